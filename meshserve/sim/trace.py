"""The requests a simulation serves: when each arrives, its prompt length and its output length.

Synthetic (`poisson`: exponential gaps at a rate, lengths uniform in ranges, seeded) or read from a JSONL file of
`{"arrival_s": float, "prompt_len": int, "output_len": int}` lines. Negative or missing fields are refused with one
line naming the line and the field.
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

    def __post_init__(self) -> None:
        if not self.arrival_s >= 0:
            raise TraceError(f"arrival_s must be zero or more, got {self.arrival_s}")
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TraceError(f"{name} must be a positive integer, got {value!r}")


def poisson(rate: float, num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
            seed: int = 0) -> list[TraceRequest]:
    """`num_requests` arrivals at `rate` per second (exponential gaps; every request at 0 with rate 0)."""
    if rate < 0 or num_requests < 1:
        raise TraceError(f"a Poisson trace needs a rate >= 0 and at least one request, got {rate} and {num_requests}")
    for name, (low, high) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise TraceError(f"{name} range {low}:{high} must be 1 <= low <= high")
    rng = random.Random(seed)
    now, trace = 0.0, []
    for _ in range(num_requests):
        trace.append(TraceRequest(now, rng.randint(*prompt_len), rng.randint(*output_len)))
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
                trace.append(TraceRequest(float(item["arrival_s"]), item["prompt_len"], item["output_len"]))
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
            f.write(json.dumps(line) + "\n")
