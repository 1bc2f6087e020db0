"""The requests a simulation serves: when each arrives, its prompt length and its output length.

Synthetic (`poisson`: exponential gaps at a rate, lengths uniform in ranges, seeded, optionally each prompt after
one of N shared prefixes) or read from a JSONL file of `{"arrival_s": float, "prompt_len": int, "output_len": int}`
lines (and, for a prompt that starts with a shared prefix, `"prefix_id"` and `"prefix_len"`). Negative or missing
fields are refused with one line naming the line and the field.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A trace that cannot be served (one line for the user)."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    # the prompt's first prefix_len tokens are shared prefix number prefix_id (a system prompt, a document), the
    # same tokens in every request that names it; -1: nothing shared
    prefix_id: int = -1
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if not self.arrival_s >= 0:
            raise TraceError(f"arrival_s must be zero or more, got {self.arrival_s}")
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TraceError(f"{name} must be a positive integer, got {value!r}")
        for name in ("prefix_id", "prefix_len"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise TraceError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not 0 <= self.prefix_len <= self.prompt_len or (self.prefix_id >= 0) != (self.prefix_len > 0):
            raise TraceError(f"a shared prefix needs prefix_id >= 0 and 0 < prefix_len <= prompt_len, got "
                             f"prefix_id {self.prefix_id}, prefix_len {self.prefix_len}, prompt_len {self.prompt_len}")


def poisson(rate: float, num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
            seed: int = 0, shared_prefixes: tuple[int, int] | None = None) -> list[TraceRequest]:
    """`num_requests` arrivals at `rate` per second (exponential gaps; every request at 0 with rate 0).
    `shared_prefixes` (N, L): each prompt starts with one of N prefixes of L tokens, drawn uniformly, before the
    `prompt_len` tokens of its own."""
    if rate < 0 or num_requests < 1:
        raise TraceError(f"a Poisson trace needs a rate >= 0 and at least one request, got {rate} and {num_requests}")
    for name, (low, high) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise TraceError(f"{name} range {low}:{high} must be 1 <= low <= high")
    if shared_prefixes is not None and min(shared_prefixes) < 1:
        count, length = shared_prefixes
        raise TraceError(f"shared prefixes N:L need N and L of 1 or more, got {count}:{length}")
    rng = random.Random(seed)
    now, trace = 0.0, []
    for _ in range(num_requests):
        own, out = rng.randint(*prompt_len), rng.randint(*output_len)
        if shared_prefixes is None:
            trace.append(TraceRequest(now, own, out))
        else:
            count, length = shared_prefixes
            trace.append(TraceRequest(now, length + own, out, rng.randrange(count), length))
        if rate > 0:
            now += rng.expovariate(rate)
    return trace


def read_jsonl(path: str | Path) -> list[TraceRequest]:
    """The trace of a JSONL file, sorted by arrival."""
    trace = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                trace.append(TraceRequest(float(item["arrival_s"]), item["prompt_len"], item["output_len"],
                                          item.get("prefix_id", -1), item.get("prefix_len", 0)))
            except (ValueError, KeyError, TypeError) as exc:
                what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
                raise TraceError(f"{path}:{number}: {what}") from None
    if not trace:
        raise TraceError(f"{path} holds no request")
    return sorted(trace, key=lambda r: r.arrival_s)


def write_jsonl(trace: list[TraceRequest], path: str | Path) -> None:
    """`trace` as the JSONL `read_jsonl` reads (`meshserve bench serve --record-trace` writes the requests it sent)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in trace:
            line = {"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len}
            if r.prefix_len:
                line |= {"prefix_id": r.prefix_id, "prefix_len": r.prefix_len}
            f.write(json.dumps(line) + "\n")
