"""Per-request sampling settings, in the shape vLLM users know.

`SamplingParams` checks everything it can without the model when it is built
(types, ranges, 64-bit integers, finite floats), so a bad value fails as a
`SamplingParamsError` where it enters and never reaches msgpack or a sampler;
`verify(vocab_size)` adds the checks that need the model's vocabulary.

A msgspec struct, so it crosses processes as itself (inside AddRequest and NewRequestData): decoding
runs the same checks, and `msgspec.structs.replace` makes a checked copy with some fields changed.
"""
from __future__ import annotations

import math
from typing import Any

import msgspec

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the API maps this to HTTP 400.

    `param` names the offending field (as the OpenAI error's `param`) when one does.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """The constraint a request's output must satisfy (exactly one kind), as vLLM's `structured_outputs`:
    a JSON schema (as JSON text), any JSON object, a regular expression, one of a list of strings, or a Lark
    grammar. The grammar engine (meshserve/structured_output) compiles it and masks every sampled token."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # json: skip the schema keywords the engine does not implement (OpenAI's non-strict schemas), rather than refuse
    lenient: bool = False
    # the constraint starts after these tokens in the output (a reasoning model's end of thinking); empty: at once
    starts_after: list[int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                f"structured outputs take exactly one of {', '.join(_STRUCTURED_KINDS)}; got "
                f"{', '.join(given) or 'none'}", param="structured_outputs")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise SamplingParamsError(f"structured_outputs.{name} must be a non-empty string",
                                          param=f"structured_outputs.{name}")
        if not isinstance(self.starts_after, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in self.starts_after):
            raise SamplingParamsError("structured_outputs.starts_after must be a list of token ids",
                                      param="structured_outputs.starts_after")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                      param="structured_outputs.choice")

    @property
    def kind(self) -> str:
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the chosen token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    # token id -> a bias in [-100, 100] added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # from_dict: a peer's plain mapping
            self.structured_outputs = _structured_from(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k is None:
            self.top_k = -1
        self.stop = _as_list(self.stop or [], "stop")
        self.stop_token_ids = _as_list(self.stop_token_ids or [], "stop_token_ids")
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamsError for any value no model could accept."""
        _check_types(self)
        _check_ranges(self)

    def verify(self, vocab_size: int) -> None:
        """Raise SamplingParamsError unless every token id is in the model's vocabulary [0, vocab_size)."""
        for index, token_id in enumerate(self.stop_token_ids):
            if not 0 <= token_id < vocab_size:
                raise SamplingParamsError(
                    f"stop_token_ids[{index}] = {token_id} is outside the vocabulary [0, {vocab_size}).",
                    param=f"stop_token_ids[{index}]")
        for token_id in self.logit_bias or {}:
            if not 0 <= token_id < vocab_size:
                raise SamplingParamsError(f"logit_bias: token id {token_id} is outside the vocabulary "
                                          f"[0, {vocab_size}).", param="logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: Any) -> SamplingParams:
        """The params a peer sent; anything malformed is a SamplingParamsError, never a TypeError."""
        if not isinstance(data, dict):
            raise SamplingParamsError(f"sampling params must be a mapping, got {type(data).__name__}")
        unknown = set(data) - set(cls.__struct_fields__)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameters: {', '.join(sorted(map(str, unknown)))}")
        return cls(**data)


_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
# tokens one request may bias: the sampler touches each every step, so a longer list would slow its batch mates
MAX_LOGIT_BIAS_TOKENS = 1024


def _structured_from(data: dict) -> StructuredOutputs:
    try:
        return msgspec.convert(data, StructuredOutputs)
    except msgspec.ValidationError as exc:
        raise SamplingParamsError(f"structured_outputs: {exc}", param="structured_outputs") from exc


def _check_logit_bias(bias: Any) -> None:
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias must be a mapping of token ids to numbers", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise SamplingParamsError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}",
                                  param="logit_bias")
    for token_id, value in bias.items():
        _check_int64("logit_bias", token_id)
        if token_id < 0:
            raise SamplingParamsError(f"logit_bias: token id {token_id} is negative", param="logit_bias")
        if not (_is_int(value) or isinstance(value, float)) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise SamplingParamsError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for "
                                      f"token {token_id}", param="logit_bias")


def _as_list(value: Any, name: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise SamplingParamsError(f"{name} must be a list, got {type(value).__name__}", param=name)
    return list(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int64(name: str, value: Any) -> None:
    if not _is_int(value):
        raise SamplingParamsError(f"{name} must be an integer, got {type(value).__name__}", param=name)
    if not INT64_MIN <= value <= INT64_MAX:
        raise SamplingParamsError(f"{name} must fit in a signed 64-bit integer, got {value}", param=name)


def _check_types(params: SamplingParams) -> None:
    for name in _INT_FIELDS:
        _check_int64(name, getattr(params, name))
    for name in _OPTIONAL_INT_FIELDS:
        if getattr(params, name) is not None:
            _check_int64(name, getattr(params, name))
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise SamplingParamsError(f"{name} must be a finite number, got {value!r}", param=name)
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(params, name), bool):
            raise SamplingParamsError(f"{name} must be a boolean", param=name)
    if not all(isinstance(s, str) for s in params.stop):
        raise SamplingParamsError("stop must be a list of strings", param="stop")
    if params.structured_outputs is not None and not isinstance(params.structured_outputs, StructuredOutputs):
        raise SamplingParamsError("structured_outputs must be a StructuredOutputs", param="structured_outputs")
    if params.logit_bias is not None:
        _check_logit_bias(params.logit_bias)
    for index, token_id in enumerate(params.stop_token_ids):
        _check_int64(f"stop_token_ids[{index}]", token_id)
        if token_id < 0:
            raise SamplingParamsError(f"stop_token_ids[{index}] must be non-negative, got {token_id}",
                                      param=f"stop_token_ids[{index}]")


def _check_ranges(p: SamplingParams) -> None:
    checks = [
        (p.n >= 1, "n", f"n must be at least 1, got {p.n}"),
        (p.temperature >= 0, "temperature", f"temperature must be non-negative, got {p.temperature}"),
        (0.0 < p.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {p.top_p}"),
        (p.top_k >= -1, "top_k", f"top_k must be -1 (disabled) or positive, got {p.top_k}"),
        (0.0 <= p.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {p.min_p}"),
        (-2.0 <= p.presence_penalty <= 2.0, "presence_penalty",
         f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (-2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty",
         f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (p.repetition_penalty > 0, "repetition_penalty",
         f"repetition_penalty must be positive, got {p.repetition_penalty}"),
        (p.max_tokens is None or p.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {p.max_tokens}"),
        (p.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {p.min_tokens}"),
        (p.max_tokens is None or p.min_tokens <= p.max_tokens, "min_tokens",
         f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})"),
        (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, "logprobs",
         f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}"),
        # each of the n samples draws with seed + its index (output_processor.child_params)
        (p.seed is None or p.seed + p.n - 1 <= INT64_MAX, "seed",
         f"seed + n - 1 must fit in a signed 64-bit integer, got seed {p.seed} with n {p.n}"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise SamplingParamsError(message, param=param)
