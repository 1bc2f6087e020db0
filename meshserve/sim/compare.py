"""The simulation beside the real engine on one trace (`meshserve simulate compare`): the instrument checked on
what this machine can run.

The real TE is started as `LLM` would start it (master and ranks, same settings), warmed up, then served the
trace: each request is submitted at its arrival time (wall clock from the first), with the prompt the simulation
gives it (same seed, same order). TTFT and TPOT come from the engine's own request metrics. The simulation then
serves the same trace with the profile; the two are reported side by side, with the simulation's error relative
to the measurement.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

from meshserve.sim.profile import StepProfile
from meshserve.sim.run import simulate
from meshserve.sim.te import SimTE, SimTESettings, draw_prompt
from meshserve.sim.trace import TraceRequest
from meshserve.utils import report

COMPARED = (("output_tokens_per_s", None), ("ttft_s", "p50"), ("tpot_s", "p50"))
WARMUP_REQUESTS = 4


def prompts_of(trace: Sequence[TraceRequest], seed: int) -> list[list[int]]:
    """The prompts `SimTE` makes for `trace` (its generator, in admission order)."""
    rng = random.Random(seed)
    return [draw_prompt(rng, r.prompt_len) for r in trace]


def measure(model: str, parallel: str, settings: SimTESettings, trace: Sequence[TraceRequest], seed: int) -> dict:
    """The real engine serving `trace` in real time: the simulation's metrics, measured."""
    from meshserve.config import EngineConfig
    from meshserve.engine.async_client import AsyncEngineClient

    config = EngineConfig.from_kwargs(model, parallel=parallel, max_num_seqs=settings.max_num_seqs,
                                      max_num_batched_tokens=settings.max_num_batched_tokens,
                                      num_kv_blocks=settings.num_kv_blocks, block_size=settings.block_size)
    prompts = prompts_of(trace, seed)

    async def serve() -> dict:
        client = AsyncEngineClient(config, log_level=logging.WARNING)
        try:
            await asyncio.gather(*(stream(client, f"warm-{i}", prompts[i % len(prompts)], 8)
                                   for i in range(WARMUP_REQUESTS)))
            start = time.monotonic()
            results = await asyncio.gather(*(stream(client, f"trace-{i}", prompts[i], r.output_len,
                                                    at=start + r.arrival_s) for i, r in enumerate(trace)))
            return _summary(results, time.monotonic() - start)
        finally:
            client.shutdown()
    return asyncio.run(serve())


async def stream(client, req_id: str, prompt: list[int], output_len: int, at: float | None = None,
                 arrivals: list[float] | None = None) -> tuple[float, float | None, float | None, int]:
    """One greedy request through the engine client, sent at monotonic time `at` (None: now): when it was sent,
    when its first and last tokens arrived, how many came (`arrivals`: every token's arrival, appended)."""
    from meshserve.wire.sampling_params import SamplingParams

    if at is not None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
    sent = time.monotonic()
    first = last = None
    tokens = 0
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    async for out in client.generate(None, prompt, params, req_id):
        if out.outputs[0].token_ids_delta:
            now = time.monotonic()
            first = now if first is None else first
            last = now
            tokens += len(out.outputs[0].token_ids_delta)
            if arrivals is not None:
                arrivals.append(now)
    return sent, first, last, tokens


async def stream_http(client, model: str, prompt: list[int], output_len: int, at: float | None = None,
                      arrivals: list[float] | None = None) -> tuple[float, float | None, float | None, int]:
    """`stream`'s request through an OpenAI-compatible server (`client`: an httpx.AsyncClient on its root), as
    `meshserve bench serve` sends it: token ids, greedy, `ignore_eos`, streamed; each chunk's tokens arrive
    together, and the count is the server's `usage`. A refused request raises RuntimeError."""
    import json

    if at is not None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": True}
    sent = time.monotonic()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or data == "[DONE]":
                continue
            event = json.loads(data)
            if event.get("choices"):
                now = time.monotonic()
                first = now if first is None else first
                last = now
                if arrivals is not None:
                    arrivals.append(now)
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    return sent, first, last, tokens


def _summary(results: list[tuple], elapsed: float) -> dict:
    ttft = [first - sent for sent, first, _, _ in results if first is not None]
    tpot = [(last - first) / (n - 1) for _, first, last, n in results if n > 1]
    tokens = sum(n for *_, n in results)
    return {"output_tokens_per_s": tokens / elapsed, "ttft_s": report.summarize(ttft),
            "tpot_s": report.summarize(tpot), "ttfts": ttft, "tpots": tpot, "output_tokens": tokens}


def compare(model: str, parallel: str, settings: SimTESettings, profile: StepProfile,
            trace: Sequence[TraceRequest], seed: int) -> dict:
    measured = measure(model, parallel, settings, trace, seed)
    simulated = simulate(trace, SimTE(settings, profile, seed=seed))
    rows = []
    for metric, key in COMPARED:
        real = measured[metric] if key is None else measured[metric][key]
        sim = simulated[metric] if key is None else simulated[metric][key]
        rows.append({"metric": metric if key is None else f"{metric} {key}", "measured": real, "simulated": sim,
                     "error": (sim - real) / real if real else None})
    return {"rows": rows, "measured": measured, "simulated": simulated}
