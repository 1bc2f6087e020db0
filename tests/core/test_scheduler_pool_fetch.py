"""Populating KV blocks from the memory pool in the background (deepserve RTC populate), in the scheduler.

A fake worker (tests/core/test_scheduler.py) checks every context slot before computing; "fetching"
writes the right fingerprints into the ordered blocks as the ranks do with the pool's bytes, so a request
that starts from blocks that were not fetched fails the test.
"""
from __future__ import annotations

from concurrent.futures import Future

from meshserve.config import PoolConfig
from meshserve.core.kv_connector import PoolConnector
from meshserve.core.request import Request, RequestStatus
from meshserve.core.scheduler import Scheduler
from meshserve.pool.context_keys import block_keys, rank_key
from meshserve.pool.fetch_cost import FetchCostModel
from meshserve.wire.kv import KVConnectorReport, PoolBlock, PoolFetch, PoolFetchDone
from tests.core.test_scheduler import (
    BS,
    FakeWorker,
    collect,
    expected_outputs,
    fingerprints,
    make_request,
    make_scheduler,
    prompt_of,
    run_sync,
)

MODEL_ID, NAMESPACE = "model-v1-float32", "tenant"


class FakePool:
    """The memory pool as the scheduler half sees it: `exists` answers at once from the keys it holds."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.lookups: list[list[str]] = []

    def exists_async(self, namespace: str, keys: list[str]) -> Future:
        assert namespace == NAMESPACE
        self.lookups.append(list(keys))
        future: Future = Future()
        future.set_result([key in self.keys for key in keys])
        return future


def prompt_keys(prompt: list[int]) -> list[str]:
    """The pool keys of a prompt's full blocks (bar the last token's), as the engine keys them."""
    return block_keys(prompt[:-1], BS, MODEL_ID, NAMESPACE)


def pool_scheduler(num_blocks: int, cost: FetchCostModel | None = None, **pool_settings) -> Scheduler:
    """A scheduler with a pool connector over a `FakePool` (`sched.pool`); every pool match is fetched
    unless `cost` says otherwise."""
    pool = FakePool()
    cost = cost or FetchCostModel(block_bytes=64, block_size=BS, latency_s=0.0, bandwidth_bytes_per_s=1e9)
    connector = PoolConnector(PoolConfig(pool_namespace=NAMESPACE, **pool_settings), pool, MODEL_ID, BS, 1, cost)
    sched = make_scheduler(num_blocks=num_blocks, connectors=[connector])
    sched.pool = pool
    return sched


def pool_request(sched: Scheduler, req_id: str, prompt: list[int], num_pool_blocks: int,
                 max_tokens: int = 6) -> Request:
    """A request whose first `num_pool_blocks` prompt blocks the scheduler's pool holds."""
    sched.pool.keys.update(rank_key(k, 0, 1) for k in prompt_keys(prompt)[:num_pool_blocks])
    return make_request(req_id, prompt, max_tokens=max_tokens)


def take_fetches(sched: Scheduler) -> list[PoolFetch]:
    """The populate orders the master would send to the ranks with the next step."""
    meta = sched.build_connector_meta()
    return meta.pool_fetches if meta is not None else []


def fetched(sched: Scheduler, req_id: str, num_blocks: int) -> None:
    """The rank's report: it wrote the first `num_blocks` ordered blocks."""
    sched.update_connector_output(KVConnectorReport(rank=0, dp_rank=0,
                                                    pool_fetches=[PoolFetchDone(req_id, num_blocks)]))


def fetch(ex: FakeWorker, prompt: list[int], order: PoolFetch, num_blocks: int, first_position: int = 0) -> None:
    """What the ranks do for a populate order: write the first `num_blocks` ordered blocks' KV."""
    fps = fingerprints(prompt)
    for i, block in enumerate(order.blocks[:num_blocks]):
        for offset in range(BS):
            ex.kv[block.block_id * BS + offset] = fps[(first_position + i) * BS + offset]


def test_a_pool_hit_waits_for_its_blocks_while_other_requests_step():
    sched, ex = pool_scheduler(num_blocks=32), FakeWorker()
    decoding = make_request("decoding", prompt_of(1, 5), max_tokens=20)
    sched.add_request(decoding)
    collect(sched.update_from_output(step := sched.schedule(), ex.execute(step)), {}, {})
    prompt = prompt_of(2, 14)  # 13 tokens before the last one: 3 full blocks the pool holds
    sched.add_request(pool_request(sched, "fetching", prompt, num_pool_blocks=3))
    for _ in range(3):  # the populate runs in the background: the other request keeps decoding
        step = sched.schedule()
        assert set(step.num_scheduled_tokens) == {"decoding"}
        sched.update_from_output(step, ex.execute(step))
    (order,) = take_fetches(sched)
    req = sched.get_request("fetching")
    keys = prompt_keys(prompt)
    assert order == PoolFetch(req_id="fetching", blocks=[PoolBlock(b, keys[i]) for i, b in enumerate(req.block_ids)])
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert sched.stats().num_running == 2 and take_fetches(sched) == []

    fetch(ex, prompt, order, 3)
    fetched(sched, "fetching", 3)
    step = sched.schedule()
    (new,) = step.new_reqs
    assert new.num_computed_tokens == 3 * BS and step.num_scheduled_tokens["fetching"] == len(prompt) - 3 * BS
    outputs, finish = {}, {}
    collect(sched.update_from_output(step, ex.execute(step)), outputs, finish)
    run = run_sync(sched, ex)
    assert outputs["fetching"] + run.outputs["fetching"] == expected_outputs(prompt, 6)
    assert run.finish["fetching"].num_cached_tokens == 3 * BS
    assert sched.stats().pool_hit_tokens == 3 * BS
    # everything freed (cached blocks are evictable)
    assert sched.kv_manager.num_available_blocks == sched.kv_manager.num_blocks


def test_blocks_the_pool_lost_are_computed_from_the_first_miss():
    sched, ex = pool_scheduler(num_blocks=32), FakeWorker()
    prompt = prompt_of(3, 14)
    sched.add_request(pool_request(sched, "r", prompt, num_pool_blocks=3))
    assert sched.schedule().is_empty
    (order,) = take_fetches(sched)
    fetch(ex, prompt, order, 1)  # block 1 was evicted between the probe and the fetch
    fetched(sched, "r", 1)
    step = sched.schedule()
    (new,) = step.new_reqs
    assert new.num_computed_tokens == BS and step.num_scheduled_tokens == {"r": len(prompt) - BS}
    outputs, finish = {}, {}
    collect(sched.update_from_output(step, ex.execute(step)), outputs, finish)
    run = run_sync(sched, ex)
    assert outputs["r"] + run.outputs["r"] == expected_outputs(prompt, 6)
    assert run.finish["r"].num_cached_tokens == sched.stats().pool_hit_tokens == BS


def test_fetched_blocks_after_a_local_hit_join_the_prefix_cache():
    sched, ex = pool_scheduler(num_blocks=32), FakeWorker()
    shared = prompt_of(4, 8)
    first = make_request("first", shared + [11, 12], max_tokens=2)  # computes the first 2 blocks locally
    sched.add_request(first)
    run_sync(sched, ex)
    prompt = shared + prompt_of(5, 6)  # 2 local blocks, then a third block the pool holds
    sched.add_request(pool_request(sched, "second", prompt, num_pool_blocks=3))
    assert sched.schedule().is_empty
    (order,) = take_fetches(sched)
    assert len(order.blocks) == 1 and order.blocks[0].key == prompt_keys(prompt)[2]  # only the pool's part
    fetch(ex, prompt, order, 1, first_position=2)
    fetched(sched, "second", 1)
    run = run_sync(sched, ex)
    assert run.outputs["second"] == expected_outputs(prompt, 6)
    # a third request with the same three leading blocks finds all of them locally now
    sched.add_request(make_request("third", prompt[:12] + [7, 8], max_tokens=2))
    run = run_sync(sched, ex)
    assert run.finish["third"].num_cached_tokens == 3 * BS and take_fetches(sched) == []


def test_abort_while_fetching_frees_the_blocks_only_when_the_fetch_ends():
    sched = pool_scheduler(num_blocks=16)
    sched.add_request(pool_request(sched, "r", prompt_of(6, 14), num_pool_blocks=3))
    sched.schedule()
    assert sched.kv_manager.num_blocks - sched.kv_manager.num_available_blocks == 3
    (aborted,) = sched.abort_requests(["r"])
    assert aborted.finish_reason == "abort" and sched.get_request("r") is None
    # the ranks may still be writing the blocks: they are not reused yet
    assert sched.kv_manager.num_blocks - sched.kv_manager.num_available_blocks == 3
    fetched(sched, "r", 3)
    assert sched.kv_manager.num_available_blocks == sched.kv_manager.num_blocks
    assert not sched.has_unfinished_requests() and sched.stats().pool_hit_tokens == 0


def test_a_short_pool_match_is_computed_without_a_fetch():
    # the fetch-vs-recompute model prices a 3-block fetch above computing it: a round trip of 3.5 s against
    # 1 s of prefill per block
    cost = FetchCostModel(block_bytes=64, block_size=BS, latency_s=3.5, bandwidth_bytes_per_s=1e12,
                          prefill_tokens_per_s=BS)
    assert cost.min_fetch_blocks() == 4
    sched, ex = pool_scheduler(num_blocks=16, cost=cost), FakeWorker()
    prompt = prompt_of(7, 14)
    sched.add_request(pool_request(sched, "r", prompt, num_pool_blocks=3))
    step = sched.schedule()
    assert step.num_scheduled_tokens == {"r": len(prompt)} and take_fetches(sched) == []
    outputs, finish = {}, {}
    collect(sched.update_from_output(step, ex.execute(step)), outputs, finish)
    assert outputs["r"] + run_sync(sched, ex).outputs["r"] == expected_outputs(prompt, 6)
