"""Client side of the engine: turn engine RequestDeltas into RequestOutputs.

The engine streams token ids; this module owns everything textual: incremental
detokenization, stop strings (truncate, finish with "stop", ask the engine to
abort), logprob token text, the n > 1 fan-out into child requests and the
aggregation of their completions, and request metrics.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from meshserve.engine.detokenizer import IncrementalDetokenizer, as_decoder
from meshserve.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput, TokenLogprob
from meshserve.wire.client import NO_TENANCY, RequestDelta, Tenancy
from meshserve.wire.sampling_params import SamplingParams
from meshserve.wire.worker import SampleLogprobs


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def child_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Per-child engine params; seeds are offset so the completions differ but stay reproducible."""
    if n == 1:
        return [params]
    return [
        msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(n)
    ]


@dataclass
class _Completion:
    """One child request's text state."""

    index: int
    engine_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    text: str = ""  # final text so far (stop-string truncation applied); may run ahead of what is shown
    stop_searched_len: int = 0  # text before this offset holds no stop string
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # what the last returned RequestOutput showed
    shown_text_len: int = 0
    shown_tokens: int = 0
    shown_logprobs: int = 0
    shown_finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    tenancy: Tenancy = NO_TENANCY  # its children's sender and prefix-cache namespace (kept for a resend)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decoder = as_decoder(tokenizer)
        self._requests: dict[str, _Request] = {}
        self._by_engine_id: dict[str, tuple[_Request, _Completion]] = {}
        self._token_text: dict[int, str] = {}  # decoded single tokens, for logprobs

    # ------------------------------------------------------------ lifecycle

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        tenancy: Tenancy = NO_TENANCY,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; return the engine-level (request_id, params) pairs to submit."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        params.validate()
        engine_ids = [request_id] if params.n == 1 else [child_request_id(request_id, i) for i in range(params.n)]
        taken = [e for e in engine_ids if e in self._by_engine_id]
        if taken:
            raise ValueError(f"engine request id {taken[0]!r} of request {request_id!r} is already in use")

        completions = [
            _Completion(
                index=i,
                engine_id=engine_id,
                detokenizer=IncrementalDetokenizer(self._tokenizer, prompt_token_ids, params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i, engine_id in enumerate(engine_ids)
        ]
        request = _Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            completions=completions,
            metrics=RequestMetrics(arrival_time=arrival_time),
            tenancy=tenancy,
        )
        self._requests[request_id] = request
        for completion in completions:
            self._by_engine_id[completion.engine_id] = (request, completion)
        return list(zip(engine_ids, child_params(params, params.n)))

    def process(self, delta: RequestDelta, now: float) -> tuple[RequestOutput | None, list[str]]:
        """Apply one engine delta; return the parent's output (None if nothing visible changed) and ids to abort."""
        entry = self._by_engine_id.get(delta.req_id)
        if entry is None:
            return None, []  # finished or aborted here already; the engine's late deltas are moot
        request, completion = entry
        if completion.finished:
            return None, []  # stopped by a stop string; the engine has not seen the abort yet

        to_abort: list[str] = []
        request.num_cached_tokens = max(request.num_cached_tokens, delta.num_cached_tokens)
        if delta.new_token_ids:
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            self._add_tokens(request, completion, delta)
        if completion.finished:  # a stop string matched
            if delta.finish_reason is None:
                to_abort.append(completion.engine_id)
        elif delta.error is not None or delta.finish_reason is not None:
            self._finish(request, completion, delta.finish_reason or "error", delta.stop_reason, delta.error)

        if request.finished:
            request.metrics.finished_time = now
            self._forget(request)
        return self._make_output(request), to_abort

    def abort(self, request_id: str, now: float | None = None) -> list[str]:
        """Finish a request with "abort"; return the engine ids still running that must be aborted."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        running = [c.engine_id for c in request.completions if not c.finished]
        for completion in request.completions:
            if not completion.finished:
                self._finish(request, completion, "abort", None, None)
        request.metrics.finished_time = time.time() if now is None else now
        self._forget(request)
        return running

    def fail_all(self, message: str, now: float | None = None) -> list[RequestOutput]:
        """The engine died: finish every live request with "error" and return their final outputs."""
        finished_time = time.time() if now is None else now
        outputs = []
        for request in list(self._requests.values()):
            for completion in request.completions:
                if not completion.finished:
                    self._finish(request, completion, "error", None, message)
            request.metrics.finished_time = finished_time
            self._forget(request)
            outputs.append(self._make_output(request, force=True))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def unfinished_children(self) -> list[tuple[str, SamplingParams, list[int], list[int], float, Tenancy]]:
        """Each running child as (engine id, its params, prompt token ids, tokens so far, arrival time, tenancy):
        what an engine that took over needs to continue it from its tokens so far, in its own cache namespace."""
        children = []
        for request in self._requests.values():
            params = child_params(request.params, request.params.n)
            for completion in request.completions:
                if not completion.finished:
                    children.append((completion.engine_id, params[completion.index], request.prompt_token_ids,
                                     list(completion.token_ids), request.metrics.arrival_time, request.tenancy))
        return children

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------ internals

    def _add_tokens(self, request: _Request, completion: _Completion, delta: RequestDelta) -> None:
        new_ids = list(delta.new_token_ids)
        if not request.params.stop or len(new_ids) < 2:
            self._append(request, completion, delta, new_ids, delta.new_logprobs)
            return
        # several tokens (speculative decoding): one at a time, so a stop string ends the output at the token
        # that completes it and the tokens after it are dropped, as when they come one per step
        for i, token_id in enumerate(new_ids):
            self._append(request, completion, delta, [token_id],
                         delta.new_logprobs[i:i + 1] if delta.new_logprobs else None, last=i == len(new_ids) - 1)
            if completion.finished:
                return

    def _append(self, request: _Request, completion: _Completion, delta: RequestDelta, new_ids: list[int],
                new_logprobs: list[SampleLogprobs] | None, last: bool = True) -> None:
        params = request.params
        completion.token_ids.extend(new_ids)
        if completion.logprobs is not None and new_logprobs:
            for token_id, entry in zip(new_ids, new_logprobs):
                position = self._position_logprobs(token_id, entry)
                completion.logprobs.append(position)
                completion.cumulative_logprob += position.chosen.logprob

        # a stop token (or eos) that ended the request is not part of the text unless asked for
        text_ids = new_ids
        if last and delta.finish_reason == "stop" and not params.include_stop_str_in_output:
            text_ids = new_ids[:-1]
        completion.text += completion.detokenizer.append(text_ids)
        if params.stop and len(completion.token_ids) > params.min_tokens:
            self._check_stop_strings(params, completion)
        completion.stop_searched_len = len(completion.text)

    def _check_stop_strings(self, params: SamplingParams, completion: _Completion) -> None:
        longest = max(len(s) for s in params.stop)
        # a match could begin in the already-searched tail
        start = max(0, completion.stop_searched_len - longest + 1)
        found: tuple[int, str] | None = None
        for stop in params.stop:
            at = completion.text.find(stop, start)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return
        at, stop = found
        end = at + len(stop) if params.include_stop_str_in_output else at
        completion.text = completion.text[:end]
        completion.finish_reason = "stop"
        completion.stop_reason = stop

    def _finish(
        self, request: _Request, completion: _Completion, reason: str, stop_reason: int | None, error: str | None
    ) -> None:
        completion.text += completion.detokenizer.flush()
        if request.params.stop and len(completion.token_ids) > request.params.min_tokens:
            self._check_stop_strings(request.params, completion)
        if completion.finished:
            return  # the flushed text completed a stop string
        completion.finish_reason = reason
        completion.stop_reason = stop_reason
        if error is not None:
            request.error = error

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        for completion in request.completions:
            self._by_engine_id.pop(completion.engine_id, None)

    def _position_logprobs(self, token_id: int, entry: SampleLogprobs) -> PositionLogprobs:
        return PositionLogprobs(
            chosen=TokenLogprob(token_id, entry.logprob, self._token_str(token_id)),
            top=[TokenLogprob(t, lp, self._token_str(t)) for t, lp in entry.top],
        )

    def _token_str(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._decoder.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def _visible_len(self, params: SamplingParams, completion: _Completion) -> int:
        """How much text can be shown: hold back a tail that may be the start of a stop string."""
        text = completion.text
        if completion.finished or not params.stop or params.include_stop_str_in_output:
            return len(text)
        longest = max(len(s) for s in params.stop)
        for held in range(min(longest - 1, len(text)), 0, -1):
            tail = text[-held:]
            if any(stop.startswith(tail) for stop in params.stop):
                return len(text) - held
        return len(text)

    def _make_output(self, request: _Request, force: bool = False) -> RequestOutput | None:
        changed = False
        outputs = []
        for completion in request.completions:
            visible = max(self._visible_len(request.params, completion), completion.shown_text_len)
            text_delta = completion.text[completion.shown_text_len:visible]
            token_ids_delta = completion.token_ids[completion.shown_tokens:]
            logprobs_delta = None
            if completion.logprobs is not None:
                logprobs_delta = completion.logprobs[completion.shown_logprobs:]
            if text_delta or token_ids_delta or completion.finish_reason != completion.shown_finish_reason:
                changed = True
            outputs.append(
                CompletionOutput(
                    index=completion.index,
                    text=completion.text[:visible],
                    token_ids=list(completion.token_ids),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    logprobs=list(completion.logprobs) if completion.logprobs is not None else None,
                    cumulative_logprob=completion.cumulative_logprob,
                    text_delta=text_delta,
                    token_ids_delta=token_ids_delta,
                    logprobs_delta=logprobs_delta,
                )
            )
            completion.shown_text_len = visible
            completion.shown_tokens = len(completion.token_ids)
            completion.shown_logprobs = len(completion.logprobs) if completion.logprobs is not None else 0
            completion.shown_finish_reason = completion.finish_reason
        if not (changed or force):
            return None
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
            metrics=dataclasses.replace(request.metrics),
        )
