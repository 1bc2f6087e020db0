"""A profile of this machine fitted from the real engine (`meshserve simulate calibrate`).

The engine is measured through a token stream, as `meshserve simulate compare` and `meshserve bench serve` measure
it: the engine client of a TE started as `LLM` would start it, for the model and layout, or (`--url`) a running
server, whatever its deployment, through its HTTP API (then the delivery term holds the frontend and the job
executor's hops too). Workloads:

- decode: batches of 1, 4, 16 and 64 requests submitted at once (and 4 with long prompts): the time between a
  request's tokens is one decode step of that batch (each DP group holding its share of the requests);
- prefill: lone prompts of 64 to 1024 tokens (PREFILL_OUTPUT tokens each), each sent to an idle engine as a lone
  request finds it: the time to the first token is one prefill step of that prompt and the delivery (an idle
  engine's master and ranks wait in their polls, and waking them is part of it);
- side by side (a TE of several DP groups): as many prompts as groups sent at once to an idle engine, one per group:
  the first of their first tokens is one prefill step in which no group idles (a lone prompt's step leaves the
  other groups nothing to do, and on a host whose cores the groups' ranks share, their idle cores take the host's
  other work: measured on 2 cores, two 64-token prompts side by side took 7 ms longer to their first token than
  one alone, through the engine client). With the decode batch of 1 (one group decoding) they fit how much shorter
  a step is for each group with nothing to do (`per_idle_group_ms`);
- mixed: a prompt arriving while a batch decodes: the batch's gap that ends with the prompt's first token is the
  step that holds both the prompt and the decodes (not on a P/D deployment, whose prompts run on another TE);
- waking: the shortest lone prompt sent as soon as the one before it ended (AWAKE_PAUSE_S after, AWAKE_REPEATS
  times: every waking figure is measured from it), and after each of
  WAKE_IDLE_TIMES_S of idling: what the time to the first token gains after IDLE_S and those is the profile's
  `wake_after_idle`, and the lone prompts' times are fitted without it (a host whose cores clock down when idle
  makes a TE's first step after a pause slower, which an engine under load never pays); on a TE of several DP
  groups it counts from the lone prompts after IDLE_S instead (`_medians`);
- arrivals: a decoding batch alone, while lone short requests keep arriving, and alone again, at each of two rates
  (ARRIVAL_RUNS): how much longer the batch's steps take, per request that arrived, beyond the requests' own
  prefill and decode, is the profile's host work per request (their frontend, routing and admission take the cores
  from the steps), `per_request_after_gap` at the two rates' gaps between requests, `per_request_ms` at the faster's.
  On a P/D deployment (`pd`) the requests' prompts run on the prefill TE: what its steps stretch the batch's (the
  stretch below, while it prefills them) is subtracted instead of their prefill;
- P/D on a shared host (`pd`): every point above is timed with the TE not measured idle, and how much longer a
  step takes while the other TE works is measured apart: a decoding batch's step while the prefill TE prefills
  prompt after prompt, over alone (`stretch_beside_tes`), and a lone prompt's time to its first token while the
  decode TE decodes a batch, over alone (`prompt_stretch_beside_tes`: its delivery through the frontend and the
  job executor is slowed as much as its step). The simulator stretches a step only while the other TE steps.

Medians of `REPEATS` runs each, taken in rounds (every workload once per round, so that a host's drift moves every
point alike), fitted by `meshserve.sim.profile.fit`; progress is logged per round.

TEs that share one host's cores slow each other: `calibrate_shared` measures by how much, on a running deployment of
several TEs on this host. Decode batches of SHARED_ROWS requests per TE, sent at once, are spread over its TEs by the
job executor's routing, so every TE steps beside the others; each step's time against what the profile of a TE
alone (fitted first, on one TE) gives the same rows is the stretch (`stretch_beside_tes`).

A scale-up costs the serving TEs too: `calibrate_scale_up` asks the cluster manager of a running deployment to add
a TE to a pool while a batch decodes on the TEs serving, and times the batch's steps alone, while the new TE starts
(a pre-warmed process loading its weights, its KV cache and warm-up), and while the manager's replacement
pre-warmed process starts. Each window's stretch over the steps alone, read on the stretch beside stepping TEs,
is what a starting TE and a starting pre-warmed process count as (`starting_te_weight`, `prewarm_weight`: in
stepping TEs), which the simulator adds to the TEs stepping beside a step.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import statistics
import sys
import time
from pathlib import Path

from meshserve.sim.compare import stream, stream_http
from meshserve.sim.profile import GroupWork, StepProfile, fit
from meshserve.sim.te import draw_prompt
from meshserve.utils import report

# (requests at once, prompt tokens, output tokens)
DECODE_POINTS = ((1, 32, 48), (4, 32, 48), (16, 32, 48), (64, 32, 48), (4, 512, 48), (16, 512, 48))
PREFILL_POINTS = (64, 256, 512, 1024)
# the lone prompts' output tokens: their TE decodes on after the first, as a served request's does (a prompt asked
# for one token leaves its TE idle, and on one TE of 2 cores its first token came 2-3 ms sooner than the same
# prompt's asked for 8, whose second token came with it: the next steps take the cores its delivery needs)
PREFILL_OUTPUT = 8
SIDE_BY_SIDE_POINTS = (64, 256)  # prompt tokens: a TE of several DP groups is sent one such prompt per group at once
MIXED_POINTS = ((8, 128), (8, 512), (32, 256))  # (decoding requests, prompt tokens)
MIXED_OUTPUT = 64  # the decoding requests' tokens: they are still decoding when the prompt comes
IDLE_S = 0.25  # how long the engine idles before each lone prompt
# ... and before one more of the shortest each, against one sent as the last one ends: the waking cost. Several: it
# is no straight line (measured at 0.25 s and 1 s alone, a 2/s run's prompts after 0.5 s idle paid 30 ms more)
WAKE_IDLE_TIMES_S = (0.1, 0.5, 1.0, 2.0)
# ... the one sent as soon as the one before ended waits this long: the engine's pipelined step after a request's last
# token (scheduled before the token was known) ends first (back to back, a DP2+EP2 TE's prompt waited its 9 ms)
AWAKE_PAUSE_S = 0.02
# ... that many times a round: with one sample a round, its noise moved every waking figure, and the delivery (the
# lone prompts less the waking after IDLE_S) with them
AWAKE_REPEATS = 3
# P/D: the decoding batch (requests, prompt tokens, output tokens) timed alone and beside the prefill TE's prompts
# of BUSY_PROMPT tokens; PD_PROMPTS lone prompts of PD_PROMPT tokens, each PD_PAUSE_S after the one before, timed
# alone and while a batch (PD_DECODING) decodes
PD_DECODE_BATCH, BUSY_PROMPT = (16, 32, 48), 256
PD_PROMPT, PD_PROMPTS, PD_PAUSE_S, PD_DECODING = 128, 3, 0.1, (8, 32, 200)
# the arrivals workload: a batch (requests, prompt tokens, output tokens) decodes while lone requests (prompt
# tokens, output tokens: a whole request, intake to end) arrive at each rate; the batch's steps between two of its
# tokens (its window) are timed. (lone requests a second, the batch, its window): the slower rate's batch decodes
# longer, for as many arrivals
ARRIVAL_REQUEST = (32, 2)
ARRIVAL_RUNS = ((40.0, (16, 32, 160), (24, 144)), (10.0, (16, 32, 480), (24, 464)))
REPEATS = 3
KEEPALIVE_S = 3.0  # how long the HTTP client keeps an idle connection (a server's keep-alive is 5 s by default)
SHARED_ROWS = (8, 16, 32)  # decode rows per TE while every TE of a shared host steps
# the batch that decodes through a scale-up: requests, prompt tokens, output tokens (still decoding when the new TE
# and the replacement pre-warmed process have started)
SCALE_UP_BATCH = (16, 32, 2000)
SCALE_UP_WAIT_S = 120.0  # the longest a scale-up's starts are followed


class EngineStreamer:
    """Requests through the engine client of a TE started for `model` and `parallel`."""

    def __init__(self, model: str, parallel: str) -> None:
        from meshserve.config import EngineConfig

        self.config = EngineConfig.from_kwargs(model, parallel=parallel, max_num_batched_tokens=max(PREFILL_POINTS),
                                               enable_prefix_caching=False)
        self.name, self.path = f"{Path(model).name} {parallel}", "the engine client"

    async def open(self) -> None:
        from meshserve.engine.async_client import AsyncEngineClient

        self.client = AsyncEngineClient(self.config, log_level=logging.WARNING)

    async def __call__(self, prompt: list[int], output_len: int, arrivals: list[float] | None = None) -> tuple:
        return await stream(self.client, f"cal-{random.random()}", prompt, output_len, arrivals=arrivals)

    async def close(self) -> None:
        self.client.shutdown()


class HTTPStreamer:
    """Requests through a running OpenAI-compatible server (`meshserve serve`, any deployment)."""

    def __init__(self, url: str, model: str, deployment: str) -> None:
        self.url, self.model = url, model
        self.name, self.path = f"{model} ({deployment} behind {url})", f"the HTTP server at {url}"

    async def open(self) -> None:
        import httpx

        # idle connections dropped well before a server closes them (uvicorn: after 5 s): a request sent on one
        # the server is closing at that moment fails
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(60.0),
                                        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))

    async def __call__(self, prompt: list[int], output_len: int, arrivals: list[float] | None = None) -> tuple:
        return await stream_http(self.client, self.model, prompt, output_len, arrivals=arrivals)

    async def close(self) -> None:
        await self.client.aclose()


class _Workloads:
    """The calibration's workloads through `streamer`, with prompts drawn from one seeded generator."""

    def __init__(self, streamer) -> None:
        self.streamer, self.rng = streamer, random.Random(0)

    async def batch(self, size: int, prompt_len: int, output_len: int) -> list[tuple]:
        return await asyncio.gather(*(self.streamer(draw_prompt(self.rng, prompt_len), output_len)
                                      for _ in range(size)))

    def decoding(self, size: int, prompt_len: int, output_len: int) -> tuple[list, list[list[float]]]:
        """A batch sent now and left decoding: its requests' futures and each one's token arrivals."""
        arrivals: list[list[float]] = [[] for _ in range(size)]
        futures = [asyncio.ensure_future(self.streamer(draw_prompt(self.rng, prompt_len), output_len,
                                                       arrivals=arrivals[i])) for i in range(size)]
        return futures, arrivals

    async def mixed_step(self, size: int, prompt_len: int) -> float | None:
        """The step that holds a decoding batch and a prompt joining it (the mixed step): each decoding request's
        gap that ends with the prompt's first token (the step that prefilled the prompt delivered both), the
        median over the batch. Not the longest gap after the prompt came: of the dozens of steps that follow, the
        longest is whichever a hiccup of the host stretched. None if the prompt's first token came after the
        batch's last ones (it did not join the batch: its last gap is no mixed step)."""
        decoding, arrivals = self.decoding(size, 32, MIXED_OUTPUT)
        await _decoding_past(decoding, arrivals, MIXED_OUTPUT // 4)
        _, first, _, _ = await self.streamer(draw_prompt(self.rng, prompt_len), 1)
        await asyncio.gather(*decoding)
        joined = [_gap_ending_at(times, first) for times in arrivals if first < times[-1]]
        return statistics.median(joined) if joined else None

    async def batch_window(self, rate: float, batch_shape: tuple[int, int, int], window: tuple[int, int],
                           arrive: bool) -> tuple[float, int] | None:
        """The arrivals workload's batch of `batch_shape`, with or without its lone requests (`rate` a second): the
        batch's time between its tokens `window` (median over the batch), and how many lone requests were sent
        within it. None if no request of the batch streamed that many chunks (a stream that delivers several tokens
        at once)."""
        decoding, arrivals = self.decoding(*batch_shape)
        lone = []
        if arrive:
            await _decoding_past(decoding, arrivals, window[0] // 2)
            start = time.monotonic()
            while not any(request.done() for request in decoding):
                prompt_len, output_len = ARRIVAL_REQUEST
                lone.append(asyncio.ensure_future(self.streamer(draw_prompt(self.rng, prompt_len), output_len)))
                await asyncio.sleep(max(0.0, start + len(lone) / rate - time.monotonic()))
        await asyncio.gather(*decoding)
        sent = [sent for sent, *_ in await asyncio.gather(*lone)]
        first, last = window
        spans = [(times[first], times[last]) for times in arrivals if len(times) > last]
        if not spans:
            return None
        begin, end = statistics.median(b for b, _ in spans), statistics.median(e for _, e in spans)
        return end - begin, sum(begin <= moment <= end for moment in sent)

    async def prompts_elsewhere(self) -> None:
        """Prompts of one token each: only a P/D deployment's prefill TE runs them."""
        while True:
            await self.streamer(draw_prompt(self.rng, BUSY_PROMPT), 1)

    async def decode_beside_prompts(self) -> float:
        """P/D: a decoding batch's step while the prefill TE prefills prompt after prompt, over its step alone."""
        steps = []
        for load in (None, self.prompts_elsewhere):
            async with _busy(load):
                steps.append(statistics.median((last - first) / (n - 1)
                                               for _, first, last, n in await self.batch(*PD_DECODE_BATCH)))
        alone, beside = steps
        return beside / alone

    async def prompt_beside_decodes(self) -> float | None:
        """P/D: a lone prompt's time to its first token while the decode TE decodes a batch, over alone (the
        medians of PD_PROMPTS each). None if no prompt's first token came while the batch decoded."""
        alone = [ttft for _, ttft in [await self._paused_prompt() for _ in range(PD_PROMPTS)]]
        decoding, arrivals = self.decoding(*PD_DECODING)
        await _decoding_past(decoding, arrivals, 8)
        beside = [await self._paused_prompt() for _ in range(PD_PROMPTS)]
        await asyncio.gather(*decoding)
        decoded_until = min(a[-1] for a in arrivals)
        kept = [ttft for first, ttft in beside if first < decoded_until]
        return statistics.median(kept) / statistics.median(alone) if kept else None

    async def _paused_prompt(self) -> tuple[float, float]:
        """A lone prompt of PD_PROMPT tokens, PD_PAUSE_S after the last: (its first token's time, its TTFT)."""
        await asyncio.sleep(PD_PAUSE_S)
        sent, first, _, _ = await self.streamer(draw_prompt(self.rng, PD_PROMPT), 1)
        return first, first - sent


def calibrate(streamer, dp: int, repeats: int = REPEATS, mixed: bool = True, pd: bool = False) -> StepProfile:
    """The profile fitted from `streamer`'s requests (an `EngineStreamer` or an `HTTPStreamer`, opened and closed
    here) to a deployment of `dp` DP groups per TE; `mixed`: a prompt joins a decoding batch on the same TE (not
    with P/D); `pd`: a P/D deployment sharing this host's cores (how much each TE's steps stretch while the other
    works is measured too)."""
    work = _Workloads(streamer)

    async def measure() -> tuple:
        """Every workload once per round, `repeats` rounds: each point's median spans the whole calibration, so
        a host that runs faster or slower for a while moves every point alike, not the points measured then (the
        terms are fitted from the points' differences)."""
        await streamer.open()
        try:
            await work.batch(2, 32, 8)  # warm-up
            decode_gaps: list[list[float]] = [[] for _ in DECODE_POINTS]
            ttfts: list[list[float]] = [[] for _ in PREFILL_POINTS]
            side_by_side: list[list[float]] = [[] for _ in SIDE_BY_SIDE_POINTS]
            mixed_gaps: list[list[float]] = [[] for _ in MIXED_POINTS]
            # idle s -> the shortest prompt's times
            woken: dict[float, list[float]] = {0.0: [], **{idle_s: [] for idle_s in WAKE_IDLE_TIMES_S}}
            # rate -> the batch's stretch over its window, per request that arrived in it
            per_arrival: dict[float, list[float]] = {rate: [] for rate, *_ in ARRIVAL_RUNS}
            stretches: tuple[list[float], list[float]] = ([], [])  # P/D: a decode step's, a prompt's
            for round_ in range(repeats):
                for i, (size, prompt_len, output_len) in enumerate(DECODE_POINTS):
                    decode_gaps[i] += [(last - first) / (n - 1)
                                       for _, first, last, n in await work.batch(size, prompt_len, output_len)]
                for i, prompt_len in enumerate(PREFILL_POINTS):
                    await asyncio.sleep(IDLE_S)
                    (sent, first, _, _), = await work.batch(1, prompt_len, PREFILL_OUTPUT)
                    ttfts[i].append(first - sent)
                for i, prompt_len in enumerate(SIDE_BY_SIDE_POINTS if dp > 1 else ()):
                    await asyncio.sleep(IDLE_S)
                    side_by_side[i].append(min(first - sent for sent, first, _, _ in
                                               await work.batch(dp, prompt_len, PREFILL_OUTPUT)))
                for idle_s, times in woken.items():  # 0: right after the last lone prompt ended
                    for _ in range(1 if idle_s else AWAKE_REPEATS):
                        await asyncio.sleep(idle_s or AWAKE_PAUSE_S)
                        (sent, first, _, _), = await work.batch(1, PREFILL_POINTS[0], PREFILL_OUTPUT)
                        times.append(first - sent)
                for i, (size, prompt_len) in enumerate(MIXED_POINTS if mixed else ()):
                    gap = await work.mixed_step(size, prompt_len)
                    mixed_gaps[i] += [] if gap is None else [gap]
                # the arrivals workload, alone before and after the run with arrivals: a drift moves both alike
                for rate, batch_shape, window in ARRIVAL_RUNS:
                    runs = [await work.batch_window(rate, batch_shape, window, arrive)
                            for arrive in (False, True, False)]
                    if None not in runs and runs[1][1]:
                        (before, _), (joined_window, joined), (after, _) = runs
                        per_arrival[rate].append((joined_window - (before + after) / 2) / joined)
                if pd:
                    stretches[0].append(await work.decode_beside_prompts())
                    prompt_stretch = await work.prompt_beside_decodes()
                    if prompt_stretch is not None:
                        stretches[1].append(prompt_stretch)
                _log(f"round {round_ + 1} of {repeats} done")
            return (*_medians(dp, decode_gaps, ttfts, side_by_side, mixed_gaps if mixed else [], woken),
                    per_arrival, stretches)
        finally:
            await streamer.close()
    steps, first_tokens, wake, per_arrival, stretches = asyncio.run(measure())
    workloads = ", ".join([f"{len(DECODE_POINTS)} decode", f"{len(PREFILL_POINTS)} prefill",
                           *([f"{len(SIDE_BY_SIDE_POINTS)} side-by-side"] if dp > 1 else []),
                           *([f"{len(MIXED_POINTS)} mixed"] if mixed else [])])
    profile = fit(streamer.name, f"measured on this machine ({report.machine_info()['cpu_count']} cores) through "
                  f"{streamer.path}: {workloads} workloads, waking and arrivals, medians of {repeats}", steps,
                  first_tokens)
    profile = dataclasses.replace(profile, wake_after_idle=wake, dp=dp)
    if pd:
        profile = _with_pd_stretches(profile, *stretches)
    by_gap = tuple((1.0 / rate, _per_request_ms(profile, rate, per_arrival[rate], mixed, pd))
                   for rate in sorted(per_arrival, reverse=True))
    return dataclasses.replace(profile, per_request_ms=by_gap[0][1], per_request_after_gap=by_gap)


def _with_pd_stretches(profile: StepProfile, decode: list[float], prompt: list[float]) -> StepProfile:
    """`profile` with the P/D stretches (each round's ratio; their medians, at least 1), each logged."""
    tables = {}
    for table, what, ratios in (("stretch_beside_tes", "a decode step beside the prefill TE's prompts", decode),
                                ("prompt_stretch_beside_tes", "a prompt beside the decode TE's batch", prompt)):
        rounds = ", ".join(f"{x:.2f}" for x in ratios)
        if not ratios:
            _log(f"{what}: no round's prompt came out while the batch decoded; not stretched")
            continue
        tables[table] = (max(1.0, statistics.median(ratios)),)
        _log(f"{what}: {tables[table][0]:.2f}x alone (rounds: {rounds})")
    return dataclasses.replace(profile, **tables, source=f"{profile.source}; beside the other TE: a decode step "
                               f"{tables.get('stretch_beside_tes', (1.0,))[0]:.2f}x, a prompt "
                               f"{tables.get('prompt_stretch_beside_tes', (1.0,))[0]:.2f}x")


def _per_request_ms(profile: StepProfile, rate: float, per_arrival: list[float], prefill_in_batch: bool, pd: bool
                    ) -> float:
    """The host work per request (ms) from the arrivals workload's stretch per request arriving `rate` a second:
    less what the profile's steps charge for the request itself (its decode rows, and its prefill where it joins the
    batch's steps), and on P/D (`pd`) what the prefill TE's step for it stretches the batch's steps beside it."""
    if not per_arrival:
        _log(f"{rate:g} lone requests a second beside a decoding batch: no round's stream came in as many chunks as "
             f"its window; no host work per request")
        return 0.0
    prompt_len, output_len = ARRIVAL_REQUEST
    own = GroupWork(decode_rows=output_len - 1, prefill_tokens=prompt_len if prefill_in_batch else 0,
                    prefill_pairs=prompt_len * prompt_len / 2 if prefill_in_batch else 0.0)
    own_ms = 1e3 * profile.group_seconds(own) - profile.base_ms  # the rows and tokens, not another step
    if pd:  # the batch's steps beside the prefill TE's step for it
        own_ms += 1e3 * profile.group_seconds(GroupWork.prompt(prompt_len)) * (profile.shared_cores_factor(1) - 1.0)
    stretch_ms = 1e3 * statistics.median(per_arrival)
    per_request_ms = max(0.0, stretch_ms - own_ms)
    rounds = ", ".join(f"{1e3 * x:.1f}" for x in per_arrival)
    _log(f"{rate:g} lone requests a second beside a decoding batch: its steps {stretch_ms:.1f} ms longer per "
         f"request (rounds: {rounds}), {per_request_ms:.1f} ms of it host work (the rest the requests' own rows)")
    return per_request_ms


def _gap_ending_at(times: list[float], moment: float) -> float:
    """The gap between consecutive `times` whose end is nearest `moment`."""
    end = min(range(1, len(times)), key=lambda i: abs(times[i] - moment))
    return times[end] - times[end - 1]


def _medians(dp: int, decode_gaps: list[list[float]], ttfts: list[list[float]], side_by_side: list[list[float]],
             mixed_gaps: list[list[float]], woken: dict[float, list[float]]) -> tuple[list, list, tuple]:
    """The fit's points from every round's samples: (group work, median step, groups idle in it) for the decode
    and mixed workloads, (prompt, median time to the first token less the waking after IDLE_S, groups idle) for
    the prefill and side-by-side ones, and the waking cost ((idle s, ms) points); each logged."""
    steps, first_tokens = [], []
    for (size, prompt_len, output_len), gaps in zip(DECODE_POINTS, decode_gaps):
        per_group = max(1, size // dp)
        work = GroupWork(decode_rows=per_group, context_tokens=per_group * (prompt_len + output_len // 2))
        steps.append((work, statistics.median(gaps), max(0, dp - size)))
        _log(f"decode batch {size} prompt {prompt_len}: {1e3 * steps[-1][1]:.1f} ms per step")
    awake = statistics.median(woken[0.0])
    after_idle = {IDLE_S: ttfts[0], **{idle_s: times for idle_s, times in woken.items() if idle_s > 0}}
    # the waking counts from a TE that has just worked; on a TE of several DP groups, from one that idled IDLE_S:
    # there a prompt right after another came out 2-8 ms sooner than after any idling from 0.1 s on (as much after
    # 0.1 s as after 2 s) in four of eight DP2+EP2 calibrations, and its requests under load did not (counted from
    # it, their simulated TTFT came out 9-17% short at 10 and 20/s; from IDLE_S, 1-10%)
    awake_from = awake if dp == 1 else statistics.median(ttfts[0])
    wake = tuple((idle_s, max(0.0, statistics.median(after_idle[idle_s]) - awake_from))
                 for idle_s in sorted(after_idle))
    idle_extra = dict(wake)
    _log(f"prefill {PREFILL_POINTS[0]} tokens: {1e3 * awake:.1f} ms to the first token right after another; "
         + ("" if dp == 1 else f"the waking counted from the one after {IDLE_S:g} s idle ({dp} DP groups): ")
         + ", ".join(f"{1e3 * extra:.1f} ms more after {idle_s:g} s idle" for idle_s, extra in wake))
    for prompt_len, times in zip(PREFILL_POINTS, ttfts):
        first_tokens.append((GroupWork.prompt(prompt_len), max(1e-4, statistics.median(times) - idle_extra[IDLE_S]),
                             dp - 1))
        _log(f"prefill {prompt_len} tokens: {1e3 * statistics.median(times):.1f} ms to the first token")
    for prompt_len, times in zip(SIDE_BY_SIDE_POINTS, side_by_side):
        if not times:
            continue
        first_tokens.append((GroupWork.prompt(prompt_len), max(1e-4, statistics.median(times) - idle_extra[IDLE_S]),
                             0))
        _log(f"prefill {prompt_len} tokens side by side, one prompt per group: {1e3 * statistics.median(times):.1f} "
             f"ms to the first of their first tokens")
    for (size, prompt_len), gaps in zip(MIXED_POINTS, mixed_gaps):
        if not gaps:
            _log(f"{size} decoding + a {prompt_len}-token prompt: the prompt never joined the batch; not fitted")
            continue
        per_group = max(1, size // dp)
        work = GroupWork(decode_rows=per_group, context_tokens=per_group * (32 + MIXED_OUTPUT // 2),
                         prefill_tokens=prompt_len, prefill_pairs=prompt_len * prompt_len / 2)
        steps.append((work, statistics.median(gaps), dp - min(dp, size + 1)))
        _log(f"{size} decoding + a {prompt_len}-token prompt: {1e3 * steps[-1][1]:.1f} ms for that step")
    return steps, first_tokens, tuple((idle_s, 1e3 * extra) for idle_s, extra in wake)


def calibrate_shared(streamer, alone: StepProfile, tes: int, repeats: int = REPEATS) -> StepProfile:
    """`alone` with the stretch of a step beside the other TEs of the deployment behind `streamer`: `tes` TEs
    sharing this host's cores (the stretch beside fewer TEs taken on the line from 1 alone)."""
    rng = random.Random(1)
    prompt_len, output_len = 32, 48

    async def measure() -> list[float]:
        await streamer.open()
        try:
            await asyncio.gather(*(streamer(draw_prompt(rng, prompt_len), 8) for _ in range(2 * tes)))  # warm-up
            ratios = []
            for rows in SHARED_ROWS:
                gaps = [(last - first) / (n - 1) for _ in range(repeats)
                        for _, first, last, n in await asyncio.gather(*(
                            streamer(draw_prompt(rng, prompt_len), output_len) for _ in range(rows * tes)))]
                work = GroupWork(decode_rows=rows, context_tokens=rows * (prompt_len + output_len // 2))
                ratios.append(statistics.median(gaps) / alone.group_seconds(work))
                _log(f"{tes} TEs decoding {rows} rows each: each step {ratios[-1]:.2f}x a TE's alone")
            return ratios
        finally:
            await streamer.close()
    stretch = max(1.0, statistics.median(asyncio.run(measure())))
    others = tes - 1
    return dataclasses.replace(alone, source=f"{alone.source}; beside {others} other TE(s) on {streamer.path}: "
                                             f"{stretch:.2f}x, medians of {repeats}",
                               stretch_beside_tes=tuple(1.0 + (stretch - 1.0) * k / others
                                                        for k in range(1, others + 1)))


def calibrate_scale_up(streamer, shared: StepProfile, ask_manager, pool: str, repeats: int = REPEATS
                       ) -> StepProfile:
    """`shared` with what a scale-up of `pool` costs its serving TEs (`starting_te_weight`, `prewarm_weight`), from
    `repeats` scale-ups through `ask_manager(op, **fields)` (the cluster manager's `ClusterStatus` answers)."""
    rng = random.Random(2)
    size, prompt_len, output_len = SCALE_UP_BATCH

    def ready(status) -> int:
        return sum(te.state == "ready" and f"{te.group}/{te.role}" == pool for te in status.tes)

    async def scale_up() -> tuple[float, float, float]:
        """One scale-up: the median step alone, while the TE starts, while the pre-warmed replacement starts."""
        status = await asyncio.to_thread(ask_manager, "status")
        serving, warm = ready(status), status.warm
        arrivals: list[list[float]] = [[] for _ in range(size)]
        decoding = [asyncio.ensure_future(streamer(draw_prompt(rng, prompt_len), output_len, arrivals=arrivals[i]))
                    for i in range(size)]
        while min(len(a) for a in arrivals) < 64:  # the batch decodes: steps alone
            await asyncio.sleep(0.005)
        scaled = time.monotonic()
        await asyncio.to_thread(ask_manager, "scale", pool=pool, target=serving + 1)
        started = warmed = None
        while warmed is None and time.monotonic() < scaled + SCALE_UP_WAIT_S:
            status = await asyncio.to_thread(ask_manager, "status")
            if started is None and ready(status) > serving:
                started = time.monotonic()
            if started is not None and status.warm >= warm:
                warmed = time.monotonic()
            await asyncio.sleep(0.05)
        ends = [a[-1] if a else 0.0 for a in arrivals]
        await asyncio.gather(*decoding)
        await asyncio.to_thread(ask_manager, "scale", pool=pool, target=serving)
        while ready(await asyncio.to_thread(ask_manager, "status")) > serving:  # the added TE drains and leaves
            await asyncio.sleep(0.2)
        if warmed is None or min(ends) < warmed:
            raise RuntimeError(f"the scale-up of {pool} took longer than the batch decodes ({SCALE_UP_WAIT_S:g} s "
                               f"at most): is a TE of the pool free to start, and its pre-warmed pool full?")
        windows = ((0.0, scaled), (scaled, started), (started, warmed))
        gaps = [[b - a for times in arrivals for a, b in zip(times, times[1:]) if low <= a and b < high]
                for low, high in windows]
        _log(f"scale-up: the TE served {started - scaled:.1f} s after it, its pre-warmed replacement was warm "
             f"{warmed - started:.1f} s later")
        return tuple(statistics.median(window) for window in gaps)

    async def measure() -> list[tuple[float, float, float]]:
        await streamer.open()
        try:
            return [await scale_up() for _ in range(repeats)]
        finally:
            await streamer.close()
    runs = asyncio.run(measure())
    per_te = shared.shared_cores_factor(1) - 1.0  # the stretch one stepping TE adds
    alone, starting, warming = (statistics.median(run[i] for run in runs) for i in range(3))
    weights = [max(0.0, (window / alone - 1.0) / per_te) for window in (starting, warming)]
    _log(f"a starting TE stretched the serving one's steps {starting / alone:.2f}x ({weights[0]:.2f} stepping TEs), "
         f"a starting pre-warmed process {warming / alone:.2f}x ({weights[1]:.2f})")
    return dataclasses.replace(shared, starting_te_weight=weights[0], prewarm_weight=weights[1],
                               source=f"{shared.source}; a scale-up of {pool}: {starting / alone:.2f}x while the "
                                      f"TE starts, {warming / alone:.2f}x while its pre-warmed replacement does, "
                                      f"medians of {repeats}")


async def _decoding_past(decoding: list, arrivals: list[list[float]], tokens: int) -> None:
    """Until every request of a batch sent now has `tokens` tokens (the batch is decoding), or one has ended."""
    while min(len(a) for a in arrivals) < tokens and not any(request.done() for request in decoding):
        await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def _busy(load):
    """Run `load()` (a coroutine function that never returns) in the background for the block; a falsy `load`:
    nothing."""
    task = asyncio.ensure_future(load()) if load else None
    try:
        await asyncio.sleep(0.05 if task else 0)  # the load reaches its TE before the measurement starts
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _log(message: str) -> None:
    print(f"[calibrate] {message}", file=sys.stderr, flush=True)
