"""Seeded synthetic expert loads: Zipf-like popularity whose hot set drifts a little between slices.

Shaped after xdeepserve Fig. 11a (a DeepSeek-R1 layer under ShareGPT): the
hottest expert gets about 30x the mean load and about a fifth of the experts get
more than the mean. Per layer:
- popularity of the expert at rank i is proportional to 1/i^s, with s solved so
  that the hottest / mean ratio is `hot_ratio` (s = 0.88 for 256 experts and 30x);
  which expert holds which rank is a random permutation (hot experts land on any
  device);
- drift: between consecutive slices `swaps_per_slice` random pairs of adjacent
  ranks trade places, and every expert's popularity is jittered by a log-normal
  factor (sigma `jitter`) drawn afresh per slice;
- counts: `tokens_per_slice * top_k` expert choices drawn from that popularity
  (multinomial; a token's k choices are treated as independent draws).
"""
from __future__ import annotations

import numpy as np

from meshserve.moe.load_record import ExpertLoadRecord


def zipf_exponent(num_experts: int, hot_ratio: float) -> float:
    """s such that (1/1^s) / mean_i(1/i^s) = hot_ratio (bisection; the ratio grows with s)."""
    if num_experts < 2 or not 1.0 < hot_ratio < num_experts:
        raise ValueError(f"a hot ratio of {hot_ratio} is out of reach with {num_experts} experts")
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    low, high = 0.0, 20.0
    for _ in range(100):
        s = (low + high) / 2
        if 1.0 / np.mean(ranks ** -s) < hot_ratio:
            low = s
        else:
            high = s
    return (low + high) / 2


def synthetic_load(num_experts: int = 256, num_layers: int = 4, num_slices: int = 8, *,
                   tokens_per_slice: int = 131072, top_k: int = 8, hot_ratio: float = 30.0,
                   swaps_per_slice: int = 8, jitter: float = 0.1, slice_seconds: float = 60.0,
                   seed: int = 0) -> ExpertLoadRecord:
    """A load record of `num_layers` MoE layers (numbered from 0) over `num_slices` slices."""
    if min(num_layers, num_slices, tokens_per_slice, top_k) < 1 or swaps_per_slice < 0 or jitter < 0:
        raise ValueError("synthetic load sizes must be positive (swaps and jitter non-negative)")
    rng = np.random.default_rng(seed)
    popularity = np.arange(1, num_experts + 1, dtype=np.float64) ** -zipf_exponent(num_experts, hot_ratio)
    per_layer = []
    for _ in range(num_layers):
        expert_at_rank = rng.permutation(num_experts)
        slices = []
        for t in range(num_slices):
            if t:
                for i in rng.integers(0, num_experts - 1, size=swaps_per_slice):
                    expert_at_rank[[i, i + 1]] = expert_at_rank[[i + 1, i]]
            weights = np.empty(num_experts)
            weights[expert_at_rank] = popularity * rng.lognormal(0.0, jitter, size=num_experts)
            slices.append(rng.multinomial(tokens_per_slice * top_k, weights / weights.sum()))
        per_layer.append(slices)
    counts = [[per_layer[layer][t].tolist() for layer in range(num_layers)] for t in range(num_slices)]
    return ExpertLoadRecord(num_logical=num_experts, moe_layers=list(range(num_layers)),
                            slice_seconds=slice_seconds, counts=counts,
                            slice_start_times=[t * slice_seconds for t in range(num_slices)])
