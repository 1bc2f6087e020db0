"""One TE on virtual time, run by the code a TE's master runs (meshserve/core): the DP waiting queue with its DP
balancer (one collaborative placement per step), each DP group's scheduler and KV cache manager. Only the ranks
are not there: a step takes the profile's time (meshserve/sim/profile.py) for the work each group's scheduler
chose, and produces a made-up token for every request that reaches the end of its known tokens, as the
benchmarks' null ranks do (meshserve/worker/null_runner.py, whose code it runs).

A step is scheduled, timed and applied before the next; the master's pipelining (step n + 1 scheduled while step n
runs) shows in when a new request is first seen (meshserve/sim/run.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

from meshserve.config import EngineConfig, SchedulerConfig
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.request import Request
from meshserve.core.scheduler import Scheduler
from meshserve.core.waiting_queue import DPWaitingQueue
from meshserve.sim.profile import GroupWork, StepProfile
from meshserve.sim.trace import TraceRequest
from meshserve.wire.client import RequestDelta
from meshserve.wire.sampling_params import SamplingParams
from meshserve.worker.null_runner import NullRunner

PROMPT_VOCAB = 32_000  # the made-up prompts' token ids (distinct prompts: no prefix shared by chance)


def draw_prompt(rng: random.Random, length: int) -> list[int]:
    """A made-up prompt of `length` token ids (the simulation's, and the real run's it is compared with)."""
    return [rng.randrange(100, PROMPT_VOCAB) for _ in range(length)]


@dataclass(frozen=True)
class SimTESettings:
    dp: int = 1  # DP groups, stepping in lockstep
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    num_kv_blocks: int = 4096  # per DP group
    block_size: int = 16
    max_waiting: int = 100_000
    # 2: the master schedules step n + 1 while step n runs (its default, `async_scheduling`); 1: one at a time
    pipeline_depth: int = 2

    def __post_init__(self) -> None:
        if self.pipeline_depth not in (1, 2):
            raise ValueError(f"pipeline_depth must be 1 or 2, got {self.pipeline_depth!r}")
        for name in ("dp", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "block_size",
                     "max_waiting"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


class SimTE:
    def __init__(self, settings: SimTESettings, profile: StepProfile, seed: int = 0) -> None:
        self.settings, self.profile = settings, profile
        config = SchedulerConfig(max_num_seqs=settings.max_num_seqs,
                                 max_num_batched_tokens=settings.max_num_batched_tokens,
                                 max_model_len=settings.max_model_len, max_waiting=settings.max_waiting)
        self.schedulers = [Scheduler(config, KVCacheManager(settings.num_kv_blocks, settings.block_size))
                           for _ in range(settings.dp)]
        self.queue = DPWaitingQueue(self.schedulers, settings.max_waiting, settings.block_size)
        # the null ranks' token bookkeeping, one driver per group
        engine = EngineConfig.from_kwargs("simulated", num_kv_blocks=settings.num_kv_blocks)
        self.ranks = [NullRunner(engine, SimpleNamespace(dp_rank=group, is_driver=True))
                      for group in range(settings.dp)]
        self._rng = random.Random(seed)
        self.num_steps = 0

    def admit(self, req_id: str, request: TraceRequest, now: float) -> None:
        prompt = draw_prompt(self._rng, request.prompt_len)
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        self.queue.admit(Request(req_id, prompt, params, arrival_time=now))

    def has_work(self) -> bool:
        return bool(self.queue.pending) or any(s.has_unfinished_requests() for s in self.schedulers)

    def step(self) -> tuple[float, list[RequestDelta]]:
        """One lockstep step of every group: how long it takes, and the requests' new tokens and endings."""
        self.queue.place()
        scheduled = [scheduler.schedule() for scheduler in self.schedulers]
        seconds = self.profile.step_seconds([_work(s, out) for s, out in zip(self.schedulers, scheduled)])
        deltas: list[RequestDelta] = []
        for scheduler, ranks, out in zip(self.schedulers, self.ranks, scheduled):
            deltas += scheduler.update_from_output(out, ranks.execute_rolling_back(out))
        self.queue.on_deltas(deltas)
        self.num_steps += 1
        return seconds, deltas


def _work(scheduler: Scheduler, out) -> GroupWork:
    """What a group's step computes: a decode row per request that only adds its last known token (attending to
    what came before), the rest prompt (or recomputed) tokens."""
    decode_rows = prefill_tokens = context = 0
    pairs = 0.0
    for req_id, num_tokens in out.num_scheduled_tokens.items():
        request = scheduler.get_request(req_id)
        before = request.num_computed_tokens - num_tokens  # the scheduler booked this step's tokens already
        if num_tokens == 1 and before >= request.num_tokens - 1:
            decode_rows += 1
            context += before
        else:
            prefill_tokens += num_tokens
            pairs += num_tokens * (before + num_tokens / 2)
    return GroupWork(decode_rows, prefill_tokens, context, pairs)
