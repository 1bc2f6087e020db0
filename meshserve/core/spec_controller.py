"""When to draft: speculative decoding pays at small batches and can cost at large ones.

A verifying step runs 1 + k tokens per sequence and the MTP layer k times: at a small
batch that is nearly free (decode reads the weights either way), at a large one the
extra tokens cost compute and more routed experts. With a fixed
`speculative_max_batch` the engine drafts up to that batch. With `-1` it measures:
per batch-size bucket (powers of two) it keeps the decode throughput (tokens the
step produced per second of step time) of steps with and without drafts, drafts
where that is higher, and now and then runs the other way to keep both figures
fresh. Each change of mind is logged with the two figures.

Where it does not draft because drafting does not pay, the MTP layer does not run at
all (its catch-up would cost a layer per step); where it does not draft only to
measure, the MTP layer still fills its cache, so later drafts read no holes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from meshserve.config import SpeculativeConfig
from meshserve.core.scheduler import Scheduler
from meshserve.wire.worker import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

MEASURE = -1  # speculative_max_batch: measure where drafting pays
_MIN_SAMPLES = 3  # steps of a mode in a bucket before its figure is trusted
_EXPLORE_EVERY = 64  # steps of a bucket between runs of the mode it is not using
_EXPLORE_STEPS = 4  # ... each run this long: a mode's first step is a transition, not a sample of it
_SMOOTHING = 0.2  # weight of the newest step in a moving average


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # drafting -> tokens per second (moving average)
    samples: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    steps: int = 0
    choice: bool | None = None


class SpeculationController:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return max(1, batch_size).bit_length()

    def decide(self, batch_size: int) -> tuple[bool, bool]:
        """Whether a step whose largest DP group runs `batch_size` sequences drafts, and whether its MTP layer
        fills its cache."""
        if self.max_batch != MEASURE:
            drafting = self.max_batch == 0 or batch_size <= self.max_batch
            return drafting, drafting
        bucket = self._buckets.setdefault(self.bucket_of(batch_size), _Bucket())
        bucket.steps += 1
        for mode in (True, False):  # measure both ways first
            if bucket.samples[mode] < _MIN_SAMPLES:
                return mode, True
        best = bucket.rate[True] >= bucket.rate[False]
        if best != bucket.choice:
            self._report(batch_size, bucket, best)
        bucket.choice = best
        if bucket.steps % _EXPLORE_EVERY < _EXPLORE_STEPS:
            return not best, True
        return best, best

    def observe(self, batch_size: int, drafting: bool, verified: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step's outcome: the tokens it produced and its step time. A step counts for a mode only
        when it drafted and verified drafts, or did neither: the first step after a switch is a transition (a
        drafting step right after a plain one has no drafts to verify yet)."""
        if self.max_batch != MEASURE or seconds <= 0 or num_tokens <= 0 or drafting != verified:
            return
        bucket = self._buckets.setdefault(self.bucket_of(batch_size), _Bucket())
        rate = num_tokens / seconds
        previous = bucket.rate.get(drafting)
        bucket.rate[drafting] = rate if previous is None else previous + _SMOOTHING * (rate - previous)
        bucket.samples[drafting] += 1

    def _report(self, batch_size: int, bucket: _Bucket, drafting: bool) -> None:
        low = 1 << (self.bucket_of(batch_size) - 1)
        logger.info("speculative decoding %s at batch %d-%d: %.1f tok/s with drafts, %.1f without",
                    "on" if drafting else "off", low, 2 * low - 1, bucket.rate[True], bucket.rate[False])

    def drafting_buckets(self) -> dict[int, bool]:
        """The lowest batch size of each measured bucket -> whether it drafts there now."""
        return {1 << (b - 1): bucket.choice for b, bucket in sorted(self._buckets.items())
                if bucket.choice is not None}


class StepSpeculation:
    """The master's use of the controller: one decision per step for all DP groups (the MTP layers' MoE
    collectives run in lockstep), fed by decode-only steps."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.controller = SpeculationController(config.speculative_max_batch)

    def decide(self, schedulers: list[Scheduler]) -> None:
        """Whether this step drafts, set on every DP group's scheduler."""
        if not self.config.enabled:
            return
        speculating, catch_up = self.controller.decide(max(s.num_running for s in schedulers))
        for scheduler in schedulers:
            scheduler.speculating, scheduler.mtp_catch_up = speculating, catch_up

    def observe(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Feed a decode-only step's throughput to the controller (prefill work would blur it)."""
        if not self.config.enabled or sched.new_reqs or not sched.num_scheduled_tokens:
            return
        if sched.total_num_scheduled_tokens > len(sched.num_scheduled_tokens) * (1 + self.config.num_draft_tokens):
            return
        self.controller.observe(len(sched.num_scheduled_tokens), sched.num_draft_tokens > 0, bool(out.num_drafts),
                                sum(len(tokens) for tokens in out.sampled.values()), out.execute_seconds)
