"""Populating KV blocks from the memory pool in the background (deepserve RTC populate), in the scheduler.

A fake executor (tests/engine/test_scheduler.py) checks every context slot before computing; "fetching"
writes the right fingerprints into the ordered blocks as the ranks do with the pool's bytes, so a request
that starts from blocks that were not fetched fails the test.
"""
from __future__ import annotations

from meshserve.core.request import Request
from tests.engine.test_scheduler import (
    BS,
    FakeExecutor,
    collect,
    expected_outputs,
    fingerprints,
    make_request,
    make_scheduler,
    prompt_of,
    run_sync,
)


def pool_request(req_id: str, prompt: list[int], num_pool_blocks: int, max_tokens: int = 6) -> Request:
    """A request whose leading blocks the pool holds, as the master admits it after its `exists` probe."""
    req = make_request(req_id, prompt, max_tokens=max_tokens)
    req.pool_key_root = "root"
    req.pool_block_keys = [f"{req_id}-key{i}" for i in range((len(prompt) - 1) // BS)]
    req.num_pool_hit_blocks = req.num_pool_stored_blocks = num_pool_blocks
    return req


def fetch(ex: FakeExecutor, prompt: list[int], order: dict, num_blocks: int, first_position: int = 0) -> None:
    """What the ranks do for a populate order: write the first `num_blocks` ordered blocks' KV."""
    fps = fingerprints(prompt)
    for i, (block_id, _) in enumerate(order["blocks"][:num_blocks]):
        for offset in range(BS):
            ex.kv[block_id * BS + offset] = fps[(first_position + i) * BS + offset]


def test_a_pool_hit_waits_for_its_blocks_while_other_requests_step():
    sched, ex = make_scheduler(num_blocks=32), FakeExecutor()
    decoding = make_request("decoding", prompt_of(1, 5), max_tokens=20)
    sched.add_request(decoding)
    collect(sched.update_from_output(step := sched.schedule(), ex.execute(step)), {}, {})
    prompt = prompt_of(2, 14)  # 13 tokens before the last one: 3 full blocks the pool holds
    sched.add_request(pool_request("fetching", prompt, num_pool_blocks=3))
    for _ in range(3):  # the populate runs in the background: the other request keeps decoding
        step = sched.schedule()
        assert set(step.num_scheduled_tokens) == {"decoding"}
        sched.update_from_output(step, ex.execute(step))
    (order,) = sched.pool_fetch_queue
    sched.pool_fetch_queue.clear()
    req = sched.get_request("fetching")
    assert order == {"req_id": "fetching", "blocks": [[b, f"fetching-key{i}"] for i, b in enumerate(req.block_ids)]}
    assert sched.stats().num_running == 2 and sched.pool_fetch_queue == []

    fetch(ex, prompt, order, 3)
    sched.on_pool_fetched("fetching", 3)
    step = sched.schedule()
    (new,) = step.new_reqs
    assert new.num_computed_tokens == 3 * BS and step.num_scheduled_tokens["fetching"] == len(prompt) - 3 * BS
    outputs, finish = {}, {}
    collect(sched.update_from_output(step, ex.execute(step)), outputs, finish)
    run = run_sync(sched, ex)
    assert outputs["fetching"] + run.outputs["fetching"] == expected_outputs(prompt, 6)
    assert run.finish["fetching"].num_cached_tokens == 3 * BS
    assert sched.pool_hit_tokens == 3 * BS
    assert sched.kv_manager.num_available_blocks == sched.kv_manager.num_blocks  # everything freed (cached blocks are evictable)


def test_blocks_the_pool_lost_are_computed_from_the_first_miss():
    sched, ex = make_scheduler(num_blocks=32), FakeExecutor()
    prompt = prompt_of(3, 14)
    sched.add_request(pool_request("r", prompt, num_pool_blocks=3))
    assert sched.schedule().is_empty
    (order,) = sched.pool_fetch_queue
    fetch(ex, prompt, order, 1)  # block 1 was evicted between the probe and the fetch
    sched.on_pool_fetched("r", 1)
    step = sched.schedule()
    (new,) = step.new_reqs
    assert new.num_computed_tokens == BS and step.num_scheduled_tokens == {"r": len(prompt) - BS}
    outputs, finish = {}, {}
    collect(sched.update_from_output(step, ex.execute(step)), outputs, finish)
    run = run_sync(sched, ex)
    assert outputs["r"] + run.outputs["r"] == expected_outputs(prompt, 6)
    assert run.finish["r"].num_cached_tokens == sched.pool_hit_tokens == BS


def test_fetched_blocks_after_a_local_hit_join_the_prefix_cache():
    sched, ex = make_scheduler(num_blocks=32), FakeExecutor()
    shared = prompt_of(4, 8)
    first = make_request("first", shared + [11, 12], max_tokens=2)  # computes the first 2 blocks locally
    sched.add_request(first)
    run_sync(sched, ex)
    prompt = shared + prompt_of(5, 6)  # 2 local blocks, then a third block the pool holds
    sched.add_request(pool_request("second", prompt, num_pool_blocks=3))
    assert sched.schedule().is_empty
    (order,) = sched.pool_fetch_queue
    sched.pool_fetch_queue.clear()
    assert len(order["blocks"]) == 1 and order["blocks"][0][1] == "second-key2"  # only the pool's part
    fetch(ex, prompt, order, 1, first_position=2)
    sched.on_pool_fetched("second", 1)
    run = run_sync(sched, ex)
    assert run.outputs["second"] == expected_outputs(prompt, 6)
    # a third request with the same three leading blocks finds all of them locally now
    sched.add_request(make_request("third", prompt[:12] + [7, 8], max_tokens=2))
    run = run_sync(sched, ex)
    assert run.finish["third"].num_cached_tokens == 3 * BS and sched.pool_fetch_queue == []


def test_abort_while_fetching_frees_the_blocks_only_when_the_fetch_ends():
    sched = make_scheduler(num_blocks=16)
    sched.add_request(pool_request("r", prompt_of(6, 14), num_pool_blocks=3))
    sched.schedule()
    assert sched.kv_manager.num_blocks - sched.kv_manager.num_available_blocks == 3
    (aborted,) = sched.abort_requests(["r"])
    assert aborted.finish_reason == "abort" and sched.get_request("r") is None
    # the ranks may still be writing the blocks: they are not reused yet
    assert sched.kv_manager.num_blocks - sched.kv_manager.num_available_blocks == 3
    sched.on_pool_fetched("r", 3)
    assert sched.kv_manager.num_available_blocks == sched.kv_manager.num_blocks
    assert not sched.has_unfinished_requests() and sched.pool_hit_tokens == 0


def test_a_short_pool_match_is_computed_without_a_fetch():
    sched, ex = make_scheduler(num_blocks=16), FakeExecutor()
    sched.pool_min_fetch_blocks = 4  # the fetch-vs-recompute model priced a 3-block fetch above computing it
    prompt = prompt_of(7, 14)
    sched.add_request(pool_request("r", prompt, num_pool_blocks=3))
    step = sched.schedule()
    assert step.num_scheduled_tokens == {"r": len(prompt)} and sched.pool_fetch_queue == []
    outputs, finish = {}, {}
    collect(sched.update_from_output(step, ex.execute(step)), outputs, finish)
    assert outputs["r"] + run_sync(sched, ex).outputs["r"] == expected_outputs(prompt, 6)
