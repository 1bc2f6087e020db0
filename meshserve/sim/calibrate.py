"""A profile of this machine fitted from the real engine (`meshserve simulate calibrate`).

The engine is started as `LLM` would start it, for the model and layout, and measured through the engine
client's token stream, as `meshserve simulate compare` measures it:

- decode: batches of 1, 4, 16 and 64 requests submitted at once (and 4 with long prompts): the time between a
  request's tokens is one decode step of that batch (each DP group holding its share of the requests);
- prefill: lone prompts of 64 to 1024 tokens, each sent to an idle engine as a lone request finds it: the time
  to the first token is one prefill step of that prompt and the delivery (an idle engine's master and ranks wait
  in their polls, and waking them is part of it);
- mixed: a prompt arriving while a batch decodes: the longest gap between the batch's tokens is the step that
  holds both the prompt and the decodes.

Medians of `REPEATS` runs each, fitted by `meshserve.sim.profile.fit`; progress is logged per workload.
"""
from __future__ import annotations

import asyncio
import logging
import random
import statistics
import sys
import time
from pathlib import Path

from meshserve.sim.compare import stream
from meshserve.sim.profile import GroupWork, StepProfile, fit
from meshserve.sim.te import draw_prompt
from meshserve.utils import report

# (requests at once, prompt tokens, output tokens)
DECODE_POINTS = ((1, 32, 48), (4, 32, 48), (16, 32, 48), (64, 32, 48), (4, 512, 48))
PREFILL_POINTS = (64, 256, 512, 1024)
MIXED_POINTS = ((8, 128), (8, 512), (32, 256))  # (decoding requests, prompt tokens)
MIXED_OUTPUT = 64  # the decoding requests' tokens: they are still decoding when the prompt comes
IDLE_S = 0.25  # how long the engine idles before each lone prompt
REPEATS = 3


def calibrate(model: str, parallel: str, dp: int, repeats: int = REPEATS) -> StepProfile:
    from meshserve.config import EngineConfig
    from meshserve.engine.async_client import AsyncEngineClient

    config = EngineConfig.from_kwargs(model, parallel=parallel, max_num_batched_tokens=max(PREFILL_POINTS),
                                      enable_prefix_caching=False)
    rng = random.Random(0)

    async def batch(client, size: int, prompt_len: int, output_len: int) -> list[tuple]:
        return await asyncio.gather(*(stream(client, f"cal-{rng.random()}", draw_prompt(rng, prompt_len), output_len)
                                      for _ in range(size)))

    async def mixed_step(client, size: int, prompt_len: int) -> float:
        """The longest gap between a decoding batch's tokens while a prompt joins it (the mixed step)."""
        arrivals: list[list[float]] = [[] for _ in range(size)]
        decoding = [asyncio.ensure_future(stream(client, f"cal-{rng.random()}", draw_prompt(rng, 32), MIXED_OUTPUT,
                                                 arrivals=arrivals[i])) for i in range(size)]
        while min(len(a) for a in arrivals) < MIXED_OUTPUT // 4:  # the batch is decoding
            await asyncio.sleep(0.001)
        joined = time.monotonic()
        await stream(client, f"cal-{rng.random()}", draw_prompt(rng, prompt_len), 1)
        await asyncio.gather(*decoding)
        # the gap of the first request's tokens that spans the prompt's arrival and prefill
        times = arrivals[0]
        return max(b - a for a, b in zip(times, times[1:]) if b >= joined)

    async def measure() -> tuple[list, list]:
        client = AsyncEngineClient(config, log_level=logging.WARNING)
        try:
            await batch(client, 2, 32, 8)  # warm-up
            steps, first_tokens = [], []
            for size, prompt_len, output_len in DECODE_POINTS:
                gaps = [(last - first) / (n - 1) for _ in range(repeats)
                        for _, first, last, n in await batch(client, size, prompt_len, output_len)]
                per_group = max(1, size // dp)
                work = GroupWork(decode_rows=per_group, context_tokens=per_group * (prompt_len + output_len // 2))
                steps.append((work, statistics.median(gaps)))
                _log(f"decode batch {size} prompt {prompt_len}: {1e3 * steps[-1][1]:.1f} ms per step")
            for prompt_len in PREFILL_POINTS:
                ttfts = []
                for _ in range(repeats):
                    await asyncio.sleep(IDLE_S)
                    (sent, first, _, _), = await batch(client, 1, prompt_len, 1)
                    ttfts.append(first - sent)
                first_tokens.append((GroupWork.prompt(prompt_len), statistics.median(ttfts)))
                _log(f"prefill {prompt_len} tokens: {1e3 * first_tokens[-1][1]:.1f} ms to the first token")
            for size, prompt_len in MIXED_POINTS:
                gaps = [await mixed_step(client, size, prompt_len) for _ in range(repeats)]
                per_group = max(1, size // dp)
                work = GroupWork(decode_rows=per_group, context_tokens=per_group * (32 + MIXED_OUTPUT // 2),
                                 prefill_tokens=prompt_len, prefill_pairs=prompt_len * prompt_len / 2)
                steps.append((work, statistics.median(gaps)))
                _log(f"{size} decoding + a {prompt_len}-token prompt: {1e3 * steps[-1][1]:.1f} ms for that step")
            return steps, first_tokens
        finally:
            client.shutdown()
    steps, first_tokens = asyncio.run(measure())
    return fit(f"{Path(model).name} {parallel}", f"measured on this machine ({report.machine_info()['cpu_count']} "
               f"cores) through the engine client: {len(DECODE_POINTS)} decode, {len(PREFILL_POINTS)} prefill and "
               f"{len(MIXED_POINTS)} mixed workloads, medians of {repeats}", steps, first_tokens)


def _log(message: str) -> None:
    print(f"[calibrate] {message}", file=sys.stderr, flush=True)
