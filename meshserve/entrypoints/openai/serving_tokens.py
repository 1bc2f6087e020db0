"""POST /tokenize and /detokenize (vLLM's): a prompt or a conversation as the model's token ids, and token ids
as text, with the served model's tokenizer and chat template; the API keys guard them as they guard /v1."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import Request
from pydantic import Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from meshserve.entrypoints.openai.errors import bad_request
from meshserve.entrypoints.openai.protocol import ChatMessage, StrictModel, TokenId, check_vocabulary
from meshserve.entrypoints.openai.serving_base import ServingBase
from meshserve.entrypoints.openai.tool_request import Tool


class TokenizeRequest(StrictModel):
    """A prompt, or chat messages (rendered by the chat template, as /v1/chat/completions renders them)."""

    model: str
    prompt: Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1},
                                                            {"type": "null"}]})] = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_source(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt == "":
            raise ValueError("the prompt must not be empty")
        return self


class DetokenizeRequest(StrictModel):
    model: str
    tokens: list[TokenId] = Field(min_length=1)

    @field_validator("tokens")
    @classmethod
    def _in_vocabulary(cls, value: list[int], info: ValidationInfo) -> list[int]:
        check_vocabulary(value, info)
        return value


class TokenServing(ServingBase):
    async def tokenize(self, raw: Request) -> dict[str, Any]:
        req = await self._parse(TokenizeRequest, await raw.body())
        self._check_model_and_engine(req.model)
        if req.prompt is not None:
            self._check_prompt_chars(len(req.prompt), "prompt")
            token_ids = await self._encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            messages = [m.for_template() for m in req.messages]
            tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
            self._check_message_chars(messages, tools)
            _, token_ids = await self._tokenizing(self._render_chat, messages, req.add_generation_prompt, tools)
        return {"count": len(token_ids), "max_model_len": self.engine.max_model_len, "tokens": token_ids}

    async def detokenize(self, raw: Request) -> dict[str, Any]:
        req = await self._parse(DetokenizeRequest, await raw.body())
        self._check_model_and_engine(req.model)
        if len(req.tokens) > self.engine.max_model_len:
            raise bad_request(f"At most {self.engine.max_model_len} tokens (the model's context) are detokenized "
                              "at once.", param="tokens")
        return {"prompt": await self._tokenizing(self.engine.tokenizer.decode, req.tokens)}
