"""What callers get back: offline `LLM.generate` results and the API's stream items."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    decoded: str


@dataclass
class PositionLogprobs:
    """Log-probability of the chosen token at one position, and the top alternatives."""

    chosen: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""  # cumulative
    token_ids: list[int] = field(default_factory=list)  # cumulative
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None  # cumulative, when requested
    cumulative_logprob: float | None = None
    # what is new since the previous item of a stream
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the engine failed this request
    metrics: RequestMetrics | None = None

    # the first completion's fields, for the common n=1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
