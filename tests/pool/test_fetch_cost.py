"""The fetch-vs-recompute cost model of context caching."""
from __future__ import annotations

import math

import pytest

from meshserve.pool.fetch_cost import FetchCostModel


def test_unmeasured_prefill_fetches_every_match():
    model = FetchCostModel(block_bytes=1 << 16, block_size=16, latency_s=0.002, bandwidth_bytes_per_s=2e9)
    assert model.min_fetch_blocks() == 1
    assert math.isinf(model.compute_seconds(4))


def test_short_matches_are_computed_when_the_round_trip_dominates():
    model = FetchCostModel(block_bytes=20_480, block_size=16, latency_s=0.002, bandwidth_bytes_per_s=2e9)
    model.observe_step(num_tokens=1600, seconds=0.1)  # 16k tokens/s: a block computes in 1 ms
    n = model.min_fetch_blocks()
    assert n == 3  # 2 ms of latency over ~0.99 ms saved per block
    assert model.fetch_seconds(n) < model.compute_seconds(n)
    assert model.fetch_seconds(n - 1) >= model.compute_seconds(n - 1)


def test_a_slow_prefill_fetches_even_one_block():
    model = FetchCostModel(block_bytes=20_480, block_size=16, latency_s=0.002, bandwidth_bytes_per_s=2e9)
    model.observe_step(num_tokens=200, seconds=1.0)  # 200 tokens/s
    assert model.min_fetch_blocks() == 1


def test_a_pool_slower_than_compute_is_never_used():
    model = FetchCostModel(block_bytes=1 << 30, block_size=16, latency_s=0.0, bandwidth_bytes_per_s=1e6)
    model.observe_step(num_tokens=1000, seconds=0.01)
    assert model.min_fetch_blocks() > 1 << 20


def test_decode_steps_do_not_move_the_prefill_rate():
    model = FetchCostModel(block_bytes=1024, block_size=16, latency_s=0.001, bandwidth_bytes_per_s=1e9)
    model.observe_step(num_tokens=1000, seconds=0.1)
    model.observe_step(num_tokens=8, seconds=0.5)  # a decode step: not a prefill-rate sample
    assert model.prefill_tokens_per_s == pytest.approx(10_000)
    model.observe_step(num_tokens=1000, seconds=0.05)
    assert 10_000 < model.prefill_tokens_per_s < 20_000  # moving average


@pytest.mark.parametrize("kwargs", [dict(block_bytes=0), dict(latency_s=-1), dict(bandwidth_bytes_per_s=0)])
def test_bad_settings_are_refused(kwargs):
    args = dict(block_bytes=1024, block_size=16, latency_s=0.001, bandwidth_bytes_per_s=1e9) | kwargs
    with pytest.raises(ValueError):
        FetchCostModel(**args)
