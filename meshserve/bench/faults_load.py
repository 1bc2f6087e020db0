"""The steady load of `meshserve bench faults`: a bounded closed loop of streaming greedy requests over several
JEs, with the client-side retry a deployment with JE replicas expects, and each answer compared token by token
with a fault-free answer to the same prompt.

Load: `concurrency` workers, each sending one request after the other until the phase's time or request count
is spent; request i uses prompt i mod P and goes first to JE i mod J. Every request is greedy, ignores EOS and
asks for `logprobs: 0`, so each streamed token arrives with its own text (a token list, not just a string).

Client-side retry (JE replicas, deepserve §3): a request whose connection to its JE fails (refused, reset, closed
mid-stream) is sent again to the next JE, at most `max_attempts` times in all. Before any token it is a plain
resend (`retries`); after tokens it is resent with the same prompt and the tokens already received are dropped
from the new stream (`resumes`): greedy decoding gives the same tokens again, and the ones dropped are checked
against those kept (`resume_mismatches`). An HTTP error or an error event in the stream is the server's answer
and is not retried. A request still running at its deadline is cancelled and counted as hung.

Comparison (`compare_tokens`): the answer's tokens against the reference's, as a sequence diff: reference tokens
missing are `lost`, extra tokens that copy the reference tokens next to them are `repeated` (a stream that went
back and sent tokens again), other extra or replaced ones `wrong`.
Greedy decoding should give the reference again; a fault-free phase shows how often it does not (batching and
parallel layouts can change a near-tie), which is the comparison's noise.
"""
from __future__ import annotations

import asyncio
import difflib
import json
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

COMPLETED, FAILED, HUNG = "completed", "failed", "hung"
# a connection to the JE that failed: the JE (or its host) is gone, another JE can take the request
_CONNECTION_ERRORS = ("ConnectError", "ConnectTimeout", "RemoteProtocolError", "ReadError", "WriteError",
                      "PoolTimeout")


@dataclass
class RequestResult:
    index: int
    prompt_index: int
    je: int  # the JE it was sent to first
    sent_at: float  # seconds since the load's origin
    status: str = ""  # completed | failed | hung
    finished_at: float | None = None
    first_token_at: float | None = None
    tokens: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # since the origin, one per token
    retries: int = 0  # resent to another JE before any token
    resumes: int = 0  # resent after tokens, the ones received dropped from the new stream
    resume_mismatches: int = 0  # dropped tokens that differed from those kept
    error: str | None = None

    def to_dict(self, with_tokens: bool = False) -> dict[str, Any]:
        out = asdict(self)
        out.pop("token_times")
        if not with_tokens:
            out.pop("tokens")
        out["num_tokens"] = len(self.tokens)
        return out


@dataclass(frozen=True)
class LoadSettings:
    urls: Sequence[str]  # the JEs' HTTP roots
    model: str  # the served model name
    prompts: Sequence[Sequence[int]]
    max_tokens: int
    concurrency: int
    deadline_s: float  # a request running longer is hung
    max_attempts: int = 3


class _ConnectionLost(Exception):
    pass


class SteadyLoad:
    """One bounded load run on its own thread (and event loop); `results` fill in as requests end."""

    def __init__(self, settings: LoadSettings, origin: float, first_index: int = 0) -> None:
        self.settings, self.origin = settings, origin
        self.first_index = first_index
        self.results: list[RequestResult] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop_sending = threading.Event()
        self.error: BaseException | None = None

    def now(self) -> float:
        return time.perf_counter() - self.origin

    # ------------------------------------------------------------------ running
    def start(self, duration_s: float, max_requests: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(duration_s, max_requests), name="bench-faults-load",
                                        daemon=True)
        self._thread.start()

    def join(self) -> list[RequestResult]:
        """Wait until every request ended (within its deadline) and return them in sending order."""
        assert self._thread is not None
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"the load client failed: {self.error}") from self.error
        return sorted(self.results, key=lambda r: r.index)

    def stop_sending(self) -> None:
        self._stop_sending.set()

    def _run(self, duration_s: float, max_requests: int) -> None:
        try:
            asyncio.run(self._drive(duration_s, max_requests))
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    async def _drive(self, duration_s: float, max_requests: int) -> None:
        import httpx

        s = self.settings
        end = self.now() + duration_s
        counter = iter(range(self.first_index, self.first_index + max_requests))
        limits = httpx.Limits(max_connections=4 * s.concurrency, max_keepalive_connections=0)
        timeout = httpx.Timeout(s.deadline_s, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            async def worker() -> None:
                while self.now() < end and not self._stop_sending.is_set():
                    index = next(counter, None)
                    if index is None:
                        return
                    await self._one(client, index)

            await asyncio.gather(*(worker() for _ in range(s.concurrency)))

    async def _one(self, client, index: int) -> None:
        s = self.settings
        result = RequestResult(index, index % len(s.prompts), index % len(s.urls), self.now())
        with self._lock:
            self.results.append(result)
        try:
            await asyncio.wait_for(self._attempts(client, result), timeout=s.deadline_s)
        except TimeoutError:
            result.status, result.error = HUNG, f"not finished within {s.deadline_s:g} s"
        result.finished_at = self.now()

    async def _attempts(self, client, result: RequestResult) -> None:
        s = self.settings
        for attempt in range(s.max_attempts):
            url = s.urls[(result.je + attempt) % len(s.urls)]
            kept = len(result.tokens)
            try:
                await self._stream(client, url, result, skip=kept)
                return
            except _ConnectionLost as exc:
                result.error = str(exc)
                if attempt + 1 == s.max_attempts:
                    break
                if result.tokens:
                    result.resumes += 1
                else:
                    result.retries += 1
        result.status = FAILED
        result.error = f"connection lost on every attempt ({s.max_attempts}): {result.error}"

    async def _stream(self, client, url: str, result: RequestResult, skip: int) -> None:
        """One attempt; the first `skip` tokens are the ones an earlier attempt already received."""
        import httpx

        s = self.settings
        payload = {"model": s.model, "prompt": list(s.prompts[result.prompt_index]), "max_tokens": s.max_tokens,
                   "temperature": 0.0, "ignore_eos": True, "stream": True, "logprobs": 0}
        seen = 0  # tokens of this attempt
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    result.status, result.error = FAILED, f"HTTP {response.status_code}: {body[:200]}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        result.status = COMPLETED if len(result.tokens) >= s.max_tokens else FAILED
                        result.error = None if result.status == COMPLETED else \
                            f"stream ended after {len(result.tokens)} of {s.max_tokens} tokens"
                        return
                    event = json.loads(data)
                    if event.get("error"):
                        error = event["error"]
                        result.status = FAILED
                        result.error = "stream error: " + str(error.get("message", error) if isinstance(error, dict)
                                                              else error)
                        return
                    now = self.now()
                    for choice in event.get("choices") or []:
                        tokens = (choice.get("logprobs") or {}).get("tokens") or []
                        for token in tokens:
                            if seen < skip:  # received before the connection was lost: must be the same
                                result.resume_mismatches += token != result.tokens[seen]
                            else:
                                result.tokens.append(token)
                                result.token_times.append(now)
                                if result.first_token_at is None:
                                    result.first_token_at = now
                            seen += 1
            raise _ConnectionLost("the stream ended without [DONE]")
        except (httpx.HTTPError, OSError) as exc:
            if type(exc).__name__ in _CONNECTION_ERRORS or isinstance(exc, OSError):
                raise _ConnectionLost(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
            result.status, result.error = FAILED, f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- comparison with a fault-free run
def reference_tokens(results: Sequence[RequestResult]) -> tuple[dict[int, list[str]], int]:
    """Per prompt, its most common complete answer in a fault-free run; and how many complete answers differed
    from their prompt's (the noise floor: batches and layouts that change a greedy choice)."""
    answers: dict[int, Counter] = {}
    for r in results:
        if r.status == COMPLETED:
            answers.setdefault(r.prompt_index, Counter())[tuple(r.tokens)] += 1
    reference = {p: list(c.most_common(1)[0][0]) for p, c in answers.items()}
    differing = sum(n for p, c in answers.items() for tokens, n in c.items() if list(tokens) != reference[p])
    return reference, differing


def compare_tokens(reference: Sequence[str], got: Sequence[str]) -> dict[str, int]:
    """Tokens lost, repeated and wrong in `got` against `reference` (see the module docstring)."""
    lost = repeated = wrong = 0
    matcher = difflib.SequenceMatcher(a=list(reference), b=list(got), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "delete":
            lost += i2 - i1
        elif tag == "insert":
            extra, n = list(got[j1:j2]), j2 - j1
            # a copy of the reference tokens next to where it was inserted (the diff may put the copy either side)
            if extra in (list(reference[max(0, i1 - n):i1]), list(reference[i1:i1 + n])):
                repeated += n
            else:
                wrong += len(extra)
        elif tag == "replace":
            wrong += j2 - j1
            lost += max(0, (i2 - i1) - (j2 - j1))
    return {"lost": lost, "repeated": repeated, "wrong": wrong}


def throughput_series(results: Sequence[RequestResult], start: float, end: float, bin_s: float) -> list[dict]:
    """Tokens per second received, in bins of `bin_s` from `start` to `end` (seconds since the origin)."""
    bins = max(1, int((end - start) / bin_s + 0.999))
    counts = [0] * bins
    for r in results:
        for t in r.token_times:
            i = int((t - start) / bin_s)
            if 0 <= i < bins:
                counts[i] += 1
    return [{"t": start + (i + 0.5) * bin_s, "tokens_per_s": c / bin_s} for i, c in enumerate(counts)]
