"""The OpenAI request bodies the API accepts, and the pieces of its response bodies.

Requests are validated strictly, as OpenAI does: unknown fields, wrong JSON
types and out-of-range values are rejected (the server answers 400), never
silently coerced. Integers must fit in 64 bits, numbers must be finite, and
token ids must be in the model's vocabulary (given as the validation context
`{"vocab_size": N}`). Fields with OpenAI semantics the server does not implement
(suffix, ...) are accepted only at their neutral value, so a
client never gets a different behaviour from the one it asked for.

Each request model also describes itself for the OpenAPI schema
(`openapi_request_body`), so generic tools can test the API.
"""
from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

import msgspec
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from meshserve.engine.outputs import PositionLogprobs
from meshserve.entrypoints.openai.context_caches import MAX_TTL_S
from meshserve.entrypoints.openai.structured_request import (
    ResponseFormat,
    StructuredOutputsRequest,
    structured_outputs_of,
)
from meshserve.entrypoints.openai.tool_request import NamedToolChoice, Tool, ToolCallInMessage
from meshserve.utils.faults import Fault
from meshserve.wire.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputs,
)

MAX_N = 128
MAX_TOOLS = 128  # tools one request may offer
# OpenAI's default for /v1/completions; chat generates until the context ends
DEFAULT_COMPLETION_MAX_TOKENS = 16

# bounds the schema can state exactly: its numbers are doubles, and 2**63 is one, 2**63 - 1 is not
_INT64_END = INT64_MAX + 1


def _integral(value: Any) -> Any:
    """16.0 is the integer 16 (as in JSON Schema); 16.5, true and "16" stay what they are and are refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
# constraints before the validator, so that the schema states them
Int64 = Annotated[int, Field(ge=INT64_MIN, lt=_INT64_END), BeforeValidator(_integral)]
TokenId = Annotated[int, Field(ge=0, lt=_INT64_END), BeforeValidator(_integral)]
TokenCount = Annotated[int, Field(ge=1, lt=_INT64_END), BeforeValidator(_integral)]

# what the hand-written validators below accept, for the schema
_TOKEN_IDS_SCHEMA = {"type": "array", "minItems": 1,
                     "items": {"type": "integer", "minimum": 0, "exclusiveMaximum": _INT64_END}}
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    _TOKEN_IDS_SCHEMA,
    {"type": "array", "minItems": 1, "items": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS_SCHEMA]}},
]}
_STOP_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}},
    {"type": "null"},
]}
_TEXT_PART_SCHEMA = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                     "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART_SCHEMA}]}
_LOGIT_BIAS_SCHEMA = {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^[0-9]{1,18}$"},
                                  "maxProperties": MAX_LOGIT_BIAS_TOKENS,
                                  "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                           "maximum": MAX_LOGIT_BIAS}},
                                 {"type": "null"}]}
# fields accepted only at their neutral value
_NULL_SCHEMA = {"type": "null"}


class StrictModel(BaseModel):
    # NaN and Infinity (JSON literals a careless client may send) are no numbers here
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool | None = False


class _SamplingRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: Int = Field(1, ge=1, le=MAX_N)
    stop: Annotated[Any, WithJsonSchema(_STOP_SCHEMA)] = None
    seed: Int64 | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # token id (as a string, as JSON keys are) -> a bias in [-100, 100] added to its logit
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema(_LOGIT_BIAS_SCHEMA)] = None
    # OpenAI's output format (vLLM takes it on completions too) and vLLM's structured outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM extensions
    top_k: Int | None = Field(None, ge=-1, lt=_INT64_END)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Int = Field(0, ge=0, lt=_INT64_END)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    # explicit context caching: the named cache (POST /v1/context_caches) whose prefix comes first
    context_cache_id: str | None = None
    # vLLM's prefix-cache salt: only requests of this key (or its shared group) with the same salt share cached
    # prompt blocks (docs/caching.md#tenant-isolation)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

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

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_in_vocabulary(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        check_vocabulary(value or [], info)
        return value

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_ids(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, dict):
            return value
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens may be biased, got {len(value)}")
        for key, bias in value.items():
            if not (isinstance(key, str) and key.isdigit() and len(key) <= 18):
                raise ValueError(f"keys must be token ids, got {key!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
                    -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"the bias of token {key} must be a number in [-100, 100], got {bias!r}")
        check_vocabulary([int(key) for key in value], info)
        return {key: float(bias) for key, bias in value.items()}

    def structured_outputs_spec(self) -> tuple[StructuredOutputs, str] | None:
        """The output constraint and the field that asked for it (APIError 400 when it is malformed)."""
        return structured_outputs_of(self.response_format, self.structured_outputs)

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None,
                           structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
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
            structured_outputs=structured_outputs,
            logit_bias={int(key): bias for key, bias in self.logit_bias.items()} if self.logit_bias else None,
        )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def check_vocabulary(token_ids: list[int], info: ValidationInfo) -> None:
    """Every id in [0, vocab_size) when the caller gave the model's vocabulary size as context."""
    vocab_size = (info.context or {}).get("vocab_size")
    if vocab_size is None:
        return
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


# ------------------------------------------------------------------ /v1/completions
class CompletionRequest(_SamplingRequest):
    # one prompt (text or token ids) or a batch of them; normalised to a list
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: TokenCount | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: Int | None = Field(None, ge=1, le=MAX_N)
    suffix: Annotated[str | None, WithJsonSchema(_NULL_SCHEMA)] = None

    @field_validator("suffix")
    @classmethod
    def _no_fill_in_the_middle(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("the served models have no fill-in-the-middle tokens, so a suffix cannot be honoured")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _default_max_tokens(cls, value: int | None) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if value is None else value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts_as_list(cls, value: Any, info: ValidationInfo) -> list[str | list[int]]:
        value = _integral_items(value)
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
        for prompt in prompts:
            if isinstance(prompt, list):
                check_vocabulary(prompt, info)
        return prompts

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n when given)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported")
        return self


def _integral_items(value: Any) -> Any:
    """A prompt with integral floats (1.0) read as token ids, at both list depths."""
    if not isinstance(value, list):
        return value
    return [_integral_items(v) if isinstance(v, list) else _integral(v) for v in value]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------ /v1/chat/completions
class ChatMessage(StrictModel):
    # "developer" is OpenAI's newer name for the system role; "tool" carries a tool's result
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null (an assistant's turn that only called tools) reads as empty text
    content: Annotated[Any, WithJsonSchema({"anyOf": [*_CONTENT_SCHEMA["anyOf"], {"type": "null"}]})]
    name: str | None = None
    tool_calls: list[ToolCallInMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)  # the call a tool message answers
    reasoning_content: str | None = None  # an assistant's earlier thinking, as responses carry it

    @field_validator("content", mode="before")
    @classmethod
    def _content_as_text(cls, value: Any) -> str:
        if value is None:
            return ""
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

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("only a tool message carries a tool_call_id")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries reasoning_content")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's shape: tool calls and tool results included)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


# what the server itself hands the chat template, and apply_chat_template's own parameters: a request cannot
# replace these through chat_template_kwargs
_TEMPLATE_OWN_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "tokenizer", "bos_token",
    "eos_token", "raise_exception"})


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: variables the chat template reads (Qwen3's `enable_thinking`, ...)
    chat_template_kwargs: dict[str, str | bool | int | float | None] | None = Field(None, max_length=16)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for name, setting in (value or {}).items():
            if not name.isidentifier() or name in _TEMPLATE_OWN_VARIABLES:
                raise ValueError(f"{name!r} is not a template variable a request may set")
            if isinstance(setting, str) and len(setting) > 1024:
                raise ValueError(f"{name} is longer than 1024 characters")
        return value

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ------------------------------------------------------------------ /v1/context_caches
class ContextCacheCreateRequest(StrictModel):
    """A named prefix: a prompt (text or token ids, for /v1/completions) or chat messages (for chat)."""

    model: str
    prompt: Annotated[str | list[Int] | None, WithJsonSchema(
        {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS_SCHEMA, {"type": "null"}]})] = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    ttl_seconds: float | None = Field(None, gt=0, le=MAX_TTL_S)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str | list[int] | None, info: ValidationInfo) -> str | list[int] | None:
        if value is not None and len(value) == 0:
            raise ValueError("the prompt must not be empty")
        if isinstance(value, list):
            if not all(_is_token_id(t) for t in value):
                raise ValueError("must be a string or a list of token ids")
            check_vocabulary(value, info)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ContextCacheCreateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


# ------------------------------------------------------------------ OpenAPI
def openapi_request_body(model: type[BaseModel], served_model_name: str | None = None) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body `model` validates by hand: the body's schema, refs inlined.

    With `served_model_name`, the `model` field lists the one name the server answers to (others get 404).
    """
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    if served_model_name is not None and "model" in schema.get("properties", {}):
        schema["properties"]["model"] = {"type": "string", "enum": [served_model_name], "title": "Model"}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _inline_refs(schema, definitions)}}}}


# POST /admin/eplb/rebalance: {} (rebalance from the measured load) or an explicit placement
EPLB_REBALANCE_OPENAPI = {"requestBody": {"required": False, "content": {"application/json": {"schema": {
    "type": "object", "additionalProperties": False,
    "properties": {"placement": {"type": "object", "description": "an expert placement, as `meshserve eplb` writes"}},
}}}}}


def _inline_refs(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline_refs(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:  # "#/$defs/Name": no model here refers to itself
        target = copy.deepcopy(definitions[node["$ref"].rsplit("/", 1)[-1]])
        return _inline_refs({**target, **{k: v for k, v in node.items() if k != "$ref"}}, definitions)
    return {key: _inline_refs(value, definitions) for key, value in node.items()}


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


def _fault_openapi() -> dict[str, Any]:
    """POST /admin/faults: a `Fault` (meshserve.utils.faults), plus the TE to arm it in (a deployment)."""
    schema = msgspec.json.schema(Fault)
    body = _inline_refs(schema["$defs"]["Fault"], schema["$defs"])
    body["properties"]["te"] = {"type": "string", "description": "the TE to arm it in (a deployment's JE)"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}


FAULT_OPENAPI = _fault_openapi()
