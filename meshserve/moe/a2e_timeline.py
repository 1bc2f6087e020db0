"""Benchmarks only (`MESHSERVE_A2E_TIMELINE=<prefix>`, `meshserve bench disagg`): when each rank of a disaggregated
layout talks to the other role, for a timeline like xdeepserve Fig. 19.

An attention rank records each MoE layer from the A2E send to the summed E2A result ("moe": the time its DP
domain waits on the experts and the links); the time between two of them is its own attention. An expert rank
records each DP domain's rows of each layer it serves ("serve": from waiting for the rows to sending the partial
outputs back) and, within it, the experts' compute ("compute"). Spans are (start, end) on the host's monotonic
clock, which every rank of the host shares, with the layer and the DP domain. The first `SKIP` spans (the first
prefill steps) are dropped, the next `KEEP` kept, and the file `<prefix>-rank<N>.json` rewritten every `FLUSH`
spans kept (a rank's end is a shutdown or a kill, not a place to write from); nothing is recorded after.

`install` wraps `MoERuntime.__call__`, `MoERuntime.finish` (two micro-batches: each span from the stage that
sent the rows), `MoERuntime.serve_domain` and `A2EComm._compute` in this process only when the variable is set:
a rank without it runs unwrapped code.
"""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

SKIP = 30
KEEP = 600
FLUSH = 50


class _Recorder:
    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank = path, rank
        self.seen = 0
        self.spans: list[dict] = []

    def add(self, kind: str, start: float, layer: int, domain: int, microbatch: int = 0) -> None:
        self.seen += 1
        if self.seen <= SKIP or len(self.spans) >= KEEP:
            return
        self.spans.append({"kind": kind, "start": start, "end": time.monotonic(), "layer": layer, "domain": domain,
                           "microbatch": microbatch})
        if len(self.spans) % FLUSH == 0 or len(self.spans) == KEEP:
            self.path.write_text(json.dumps({"rank": self.rank, "spans": self.spans}))


def install(prefix: str, rank: int) -> None:
    """Record this rank's spans for `<prefix>-rank<rank>.json`."""
    from meshserve.moe.a2e import A2EComm  # torch: a rank imports it anyway
    from meshserve.moe.runtime import MoERuntime

    recorder = _Recorder(Path(f"{prefix}-rank{rank}.json"), rank)
    call, start, finish, serve_domain = MoERuntime.__call__, MoERuntime.start, MoERuntime.finish, \
        MoERuntime.serve_domain
    compute = A2EComm._compute

    @functools.wraps(call)
    def recorded_call(runtime, *args, **kwargs):
        start = time.monotonic()
        out = call(runtime, *args, **kwargs)
        if runtime.a2e_comms:
            recorder.add("moe", start, runtime.layer, runtime.ctx.domain)
        return out

    @functools.wraps(serve_domain)
    def recorded_serve(runtime, domain, *args, **kwargs):
        start = time.monotonic()
        rows = serve_domain(runtime, domain, *args, **kwargs)
        recorder.add("serve", start, runtime.layer, domain)
        return rows

    @functools.wraps(start)
    def recorded_start(runtime, hidden, topk_ids, topk_weights, experts, buffer_index):
        begun = time.monotonic()  # a micro-batch's span begins as its rows leave
        pending = start(runtime, hidden, topk_ids, topk_weights, experts, buffer_index)
        pending.started_at, pending.microbatch = begun, buffer_index
        return pending

    @functools.wraps(finish)
    def recorded_finish(runtime, pending):
        out = finish(runtime, pending)
        if runtime.a2e_comms:
            recorder.add("moe", pending.started_at, runtime.layer, runtime.ctx.domain, pending.microbatch)
        return out

    @functools.wraps(compute)
    def recorded_compute(comm, *args, **kwargs):
        begun = time.monotonic()
        out = compute(comm, *args, **kwargs)
        recorder.add("compute", begun, -1, comm.domain)
        return out

    MoERuntime.__call__ = recorded_call
    MoERuntime.start, MoERuntime.finish = recorded_start, recorded_finish
    MoERuntime.serve_domain = recorded_serve
    A2EComm._compute = recorded_compute
