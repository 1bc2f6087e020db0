"""Whether fetching a cached prefix from the memory pool beats computing it (context caching).

A fetch of n blocks costs a round trip plus their bytes over the pool's bandwidth; computing
them costs n * block_size tokens at the TE's prefill rate. Long matches always pay to fetch,
short ones may not (a round trip to another process can cost more than prefilling a block
or two of a small model). The prefill rate is measured from the TE's own steps; the pool's
latency and bandwidth come from the settings (`meshserve bench cache` measures them).
"""
from __future__ import annotations

import math

_EMA = 0.2  # weight of the newest prefill-rate sample
_MIN_SAMPLE_TOKENS = 64  # steps with fewer tokens are decode-dominated: no prefill-rate sample


class FetchCostModel:
    def __init__(self, block_bytes: int, block_size: int, latency_s: float, bandwidth_bytes_per_s: float,
                 prefill_tokens_per_s: float | None = None) -> None:
        if block_bytes <= 0 or block_size <= 0:
            raise ValueError("block_bytes and block_size must be positive")
        if latency_s < 0 or bandwidth_bytes_per_s <= 0:
            raise ValueError("latency must be >= 0 and bandwidth positive")
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.latency_s = latency_s
        self.bandwidth = bandwidth_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s  # None until a prefill step was seen

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """One executed step: `num_tokens` computed in `seconds` (an EMA of prefill-heavy steps)."""
        if num_tokens < _MIN_SAMPLE_TOKENS or seconds <= 0:
            return
        rate = num_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - _EMA) * old + _EMA * rate

    def fetch_seconds(self, num_blocks: int) -> float:
        return self.latency_s + num_blocks * self.block_bytes / self.bandwidth

    def compute_seconds(self, num_blocks: int) -> float:
        if self.prefill_tokens_per_s is None:
            return math.inf  # not measured yet: fetching is the safe guess
        return num_blocks * self.block_size / self.prefill_tokens_per_s

    def min_fetch_blocks(self) -> int:
        """The shortest pool match worth fetching; shorter ones are computed (a huge number: never fetch)."""
        if self.prefill_tokens_per_s is None:
            return 1
        saved_per_block = self.block_size / self.prefill_tokens_per_s - self.block_bytes / self.bandwidth
        if saved_per_block <= 0:
            return 1 << 30  # the pool is slower per block than computing it
        return max(1, math.floor(self.latency_s / saved_per_block) + 1)
