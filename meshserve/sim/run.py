"""The simulation's loop on virtual time, and what it reports.

Requests arrive at their trace times; whenever the TE has work it steps, and the virtual clock moves by the step's
time (meshserve/sim/profile.py); when it has none the clock jumps to the next arrival. With the master's
pipelining (`pipeline_depth` 2, its default: step n + 1 is scheduled as step n starts) a busy TE's next step holds
only the requests that had arrived when the step before it began; an idle TE takes a request at once.

Each request's first and last token times give TTFT and TPOT as the benchmarks report them (`meshserve bench
serve`): TTFT from arrival to the first token, TPOT the mean gap between its later tokens. A line of progress is
logged every few seconds of wall time.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.sim.te import SimTE
from meshserve.sim.trace import TraceRequest
from meshserve.utils import report

PROGRESS_EVERY_S = 5.0


@dataclass
class _Served:
    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    finished: bool = False


def simulate(trace: Sequence[TraceRequest], te: SimTE, progress: bool = True) -> dict:
    """Serve `trace` on `te`; the metrics of the run (virtual seconds) and what the run itself cost (wall)."""
    started = last_log = time.perf_counter()
    now, next_index, events = 0.0, 0, 0
    served: dict[str, _Served] = {}
    step_seconds: list[float] = []
    delivery_s = 1e-3 * te.profile.delivery_ms  # every token reaches its client that much after its step
    last_start = 0.0  # when the step that just ended began: a pipelined master scheduled the next one then
    while next_index < len(trace) or te.has_work():
        horizon = last_start if te.settings.pipeline_depth == 2 and te.has_work() else now
        while next_index < len(trace) and trace[next_index].arrival_s <= horizon:
            req_id = f"sim-{next_index}"
            te.admit(req_id, trace[next_index], now)
            served[req_id] = _Served(trace[next_index].arrival_s)
            next_index += 1
            events += 1
        if not te.has_work():
            now = trace[next_index].arrival_s
            continue
        seconds, deltas = te.step()
        last_start = now
        now += seconds
        step_seconds.append(seconds)
        events += 1
        for delta in deltas:
            record = served[delta.req_id]
            if delta.new_token_ids:
                seen = now + delivery_s
                record.first_token_s = seen if record.first_token_s is None else record.first_token_s
                record.last_token_s = seen
                record.num_tokens += len(delta.new_token_ids)
            record.finished = record.finished or delta.finish_reason is not None
        if progress and time.perf_counter() - last_log > PROGRESS_EVERY_S:
            last_log = time.perf_counter()
            done = sum(r.finished for r in served.values())
            print(f"[simulate] {done}/{len(trace)} requests done, {te.num_steps} steps, virtual {now:.1f} s",
                  file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    return _metrics(list(served.values()), step_seconds, now, events, wall)


def _metrics(served: list[_Served], step_seconds: list[float], end_s: float, events: int, wall_s: float) -> dict:
    ttft = [r.first_token_s - r.arrival_s for r in served if r.first_token_s is not None]
    tpot = [(r.last_token_s - r.first_token_s) / (r.num_tokens - 1) for r in served if r.num_tokens > 1]
    tokens = sum(r.num_tokens for r in served)
    span = end_s - min(r.arrival_s for r in served) if served else 0.0
    return {
        "requests": len(served),
        "completed": sum(r.finished for r in served),
        "output_tokens": tokens,
        "virtual_s": end_s,
        "output_tokens_per_s": tokens / span if span > 0 else 0.0,
        "ttft_s": report.summarize(ttft) if ttft else None,
        "tpot_s": report.summarize(tpot) if tpot else None,
        "steps": len(step_seconds),
        "mean_step_ms": 1e3 * statistics.fmean(step_seconds) if step_seconds else 0.0,
        "ttfts": ttft,
        "tpots": tpot,
        "events": events,
        "wall_s": wall_s,
        "events_per_s": events / wall_s if wall_s > 0 else 0.0,
    }
