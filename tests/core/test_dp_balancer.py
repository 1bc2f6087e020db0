"""DP load balancing (xdeepserve §4.3): batch limits, prefix hits, prefill cost, KV reservation."""
from __future__ import annotations

import pytest

from meshserve.config import SchedulerConfig
from meshserve.core.dp_balancer import DPGroupLoad, PendingRequest, place_batch, place_request
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.request import Request
from meshserve.core.scheduler import Scheduler
from meshserve.wire.sampling_params import SamplingParams

BS = 16


def load(requests=0, max_seqs=8, blocks=100, used=0, reserved=0, pending=0) -> DPGroupLoad:
    return DPGroupLoad(num_requests=requests, max_num_seqs=max_seqs, num_blocks=blocks, num_used_blocks=used,
                       reserved_blocks=reserved, pending_prefill_tokens=pending)


def test_groups_at_their_batch_limit_take_nothing():
    loads = [load(requests=8), load(requests=3, used=90), load(requests=8)]
    assert place_request(100, 10, BS, loads, [0, 0, 0]).group == 1
    assert place_request(100, 10, BS, [load(requests=8)] * 2, [0, 0]) is None


def test_lowest_kv_usage_counting_reserved_output_wins_when_prefill_is_even():
    # group 0 uses fewer blocks now, but its requests will still need many more for their outputs
    loads = [load(used=10, reserved=60), load(used=30, reserved=0)]
    choice = place_request(64, 64, BS, loads, [0, 0])
    assert choice.group == 1
    assert choice.kv_usage == pytest.approx((30 + 8) / 100)


def test_prefix_hit_and_pending_prefill_set_the_cost():
    loads = [load(pending=0), load(pending=0)]
    assert place_request(256, 16, BS, loads, [0, 192]).group == 1  # its prefix is cached in group 1
    loads = [load(pending=1000), load(pending=0)]
    assert place_request(256, 16, BS, loads, [192, 0]).group == 1  # group 0 still has a long prefill queued


def test_a_batch_spreads_long_prompts_over_groups():
    pending = [PendingRequest(key=i, num_prompt_tokens=n, expected_output_tokens=16)
               for i, n in enumerate([32, 2000, 40, 1800, 24, 36])]
    placed = dict((req.key, group) for req, group in place_batch(pending, BS, [load(), load()], lambda r: [0, 0]))
    assert len(placed) == 6
    assert placed[1] != placed[3]  # the two long prompts go to different groups
    per_group = [sum(pending[k].num_prompt_tokens for k, g in placed.items() if g == group) for group in (0, 1)]
    assert abs(per_group[0] - per_group[1]) < 300


def test_a_batch_takes_only_as_many_requests_as_free_slots_in_queue_order():
    pending = [PendingRequest(key=i, num_prompt_tokens=n, expected_output_tokens=16)
               for i, n in enumerate([10, 20, 3000])]
    placed = place_batch(pending, BS, [load(requests=7), load(requests=7)], lambda r: [0, 0])
    assert sorted(req.key for req, _ in placed) == [0, 1]  # the later long request waits its turn
    assert sorted(group for _, group in placed) == [0, 1]


def test_mismatched_hit_counts_are_rejected():
    with pytest.raises(ValueError, match="prefix-hit counts"):
        place_request(10, 10, BS, [load(), load()], [0])


def test_scheduler_reports_its_load():
    kv_manager = KVCacheManager(64, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=1024), kv_manager)
    scheduler.add_request(Request("a", list(range(40)), SamplingParams(max_tokens=24), arrival_time=0.0))
    scheduler.add_request(Request("b", list(range(8)), SamplingParams(max_tokens=None), arrival_time=1.0))
    before = scheduler.dp_load(default_output_tokens=100)
    assert before.num_requests == 2 and before.pending_prefill_tokens == 48
    assert before.reserved_blocks == 4 + 7  # ceil(64/16) + ceil(108/16)
    scheduler.schedule()
    after = scheduler.dp_load(default_output_tokens=100)
    assert after.pending_prefill_tokens == 0
    assert after.num_used_blocks == 3 + 1  # 40 tokens -> 3 blocks, 8 tokens -> 1 block
    assert after.reserved_blocks == before.reserved_blocks - after.num_used_blocks
