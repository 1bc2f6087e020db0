"""The OpenAI request bodies the API accepts, and the pieces of its response bodies.

Requests are validated strictly, as OpenAI does: unknown fields, wrong JSON
types and out-of-range values are rejected (the server answers 400), never
silently coerced. Fields with OpenAI semantics the server does not implement
(tools, logit_bias, suffix, ...) are accepted only at their neutral value, so a
client never gets a different behaviour from the one it asked for.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meshserve.outputs import PositionLogprobs
from meshserve.platform.context_caches import MAX_TTL_S
from meshserve.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # SamplingParams' own bound


class _StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_StrictModel):
    include_usage: bool | None = False


class _SamplingRequest(_StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: Any = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    # explicit context caching: the named cache (POST /v1/context_caches) whose prefix comes first
    context_cache_id: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> list[str]:
        if value is None:
            return []
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError("must be a string or a list of strings")
        if any(v == "" for v in values):
            raise ValueError("stop strings must not be empty")
        return values

    @model_validator(mode="after")
    def _check_common(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Engine settings; absent fields take OpenAI's defaults. Raises SamplingParamsError on bad values."""
        return SamplingParams(
            n=self.n,
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, -1),
            min_p=_or(self.min_p, 0.0),
            seed=self.seed,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# ------------------------------------------------------------------ /v1/completions
class CompletionRequest(_SamplingRequest):
    # one prompt (text or token ids) or a batch of them; normalised to a list
    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts_as_list(cls, value: Any) -> list[str | list[int]]:
        if isinstance(value, str):
            prompts = [value]
        elif isinstance(value, list) and value and all(_is_token_id(v) for v in value):
            prompts = [value]
        elif isinstance(value, list) and value and all(
                isinstance(v, str) or (isinstance(v, list) and all(_is_token_id(t) for t in v)) for v in value):
            prompts = value
        elif value == []:
            raise ValueError("the prompt must not be empty")
        else:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("the prompt must not be empty")
        return prompts

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n when given)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported")
        return self


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------ /v1/chat/completions
class ChatMessage(_StrictModel):
    # "developer" is OpenAI's newer name for the system role
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_as_text(cls, value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, dict) for p in value):
            texts = []
            for part in value:
                if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError('only text content parts ({"type": "text", "text": "..."}) are supported')
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("must be a string or a list of text parts")

    def for_template(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ResponseFormat(_StrictModel):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ------------------------------------------------------------------ /v1/context_caches
class ContextCacheCreateRequest(_StrictModel):
    """A named prefix: a prompt (text or token ids, for /v1/completions) or chat messages (for chat)."""

    model: str
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    ttl_seconds: int | float | None = Field(None, gt=0, le=MAX_TTL_S)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str | list[int] | None) -> str | list[int] | None:
        if value is not None and len(value) == 0:
            raise ValueError("the prompt must not be empty")
        if isinstance(value, list) and not all(_is_token_id(t) for t in value):
            raise ValueError("must be a string or a list of token ids")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "ContextCacheCreateRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


# ------------------------------------------------------------------ response pieces
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(positions: list[PositionLogprobs], num_top: int, text_offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape; text offsets count from `text_offset` (the choice text already sent)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for pos in positions:
        tokens.append(pos.chosen.decoded)
        token_logprobs.append(pos.chosen.logprob)
        # OpenAI's top_logprobs always contains the sampled token
        top = {alt.decoded: alt.logprob for alt in pos.top[:num_top]}
        top.setdefault(pos.chosen.decoded, pos.chosen.logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(pos.chosen.decoded)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(positions: list[PositionLogprobs], num_top: int) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    content = [
        {**entry(pos.chosen.decoded, pos.chosen.logprob),
         "top_logprobs": [entry(alt.decoded, alt.logprob) for alt in pos.top[:num_top]]}
        for pos in positions
    ]
    return {"content": content, "refusal": None}
