"""The pool connector's halves: the scheduler half against a fake pool and fake rank reports, the worker
half against a real pool (an in-process controller and server)."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from meshserve.config import PoolConfig
from meshserve.core.kv_connector import PoolConnector
from meshserve.core.request import RequestStatus
from meshserve.pool.context_keys import rank_key
from meshserve.pool.controller import run_controller
from meshserve.pool.fetch_cost import FetchCostModel
from meshserve.pool.sdk import PoolClient
from meshserve.pool.server import PoolServer
from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport, PoolBlock, PoolFetch, PoolFetchDone
from meshserve.worker.kv_connector.pool import PoolConnectorWorker
from tests.core.test_scheduler import BS, FakeWorker, collect, make_request, make_scheduler, prompt_of, run_sync
from tests.core.test_scheduler_pool_fetch import MODEL_ID, NAMESPACE, prompt_keys, take_fetches
from tests.pool.pool_processes import free_address, wait_until


class SlowPool:
    """A pool whose `exists` answers only when the test says so."""

    def __init__(self) -> None:
        self.pending: list[tuple[list[str], Future]] = []
        self.keys: set[str] = set()

    def exists_async(self, namespace: str, keys: list[str]) -> Future:
        future: Future = Future()
        self.pending.append((list(keys), future))
        return future

    def answer(self) -> None:
        for keys, future in self.pending:
            future.set_result([k in self.keys for k in keys])
        self.pending = []


def connector(pool, attn_tp: int = 1, **settings) -> PoolConnector:
    cost = FetchCostModel(block_bytes=64, block_size=BS, latency_s=0.0, bandwidth_bytes_per_s=1e9)
    return PoolConnector(PoolConfig(pool_namespace=NAMESPACE, **settings), pool, MODEL_ID, BS, attn_tp, cost)


def stores(sched) -> list[PoolBlock]:
    meta = sched.build_connector_meta()
    return meta.pool_stores if meta is not None else []


# ---------------------------------------------------------------- scheduler half
def test_a_request_waits_for_its_lookup_while_the_ones_behind_it_run():
    pool = SlowPool()
    prompt = prompt_of(1, 14)
    pool.keys.update(rank_key(k, 0, 1) for k in prompt_keys(prompt))
    conn = connector(pool)
    sched = make_scheduler(num_blocks=32, connectors=[conn])
    sched.add_request(make_request("looked-up", prompt))
    sched.add_request(make_request("short", prompt_of(2, 3)))  # shorter than a block: nothing to look up
    step = sched.schedule()
    assert set(step.num_scheduled_tokens) == {"short"} and conn.busy
    assert sched.get_request("looked-up").status is RequestStatus.WAITING and take_fetches(sched) == []
    pool.answer()
    assert not conn.busy
    assert "looked-up" not in sched.schedule().num_scheduled_tokens  # its blocks load first
    (fetch,) = take_fetches(sched)
    assert [b.key for b in fetch.blocks] == prompt_keys(prompt)
    assert sched.get_request("looked-up").status is RequestStatus.WAITING_FOR_REMOTE_KV


def test_a_lookup_that_fails_costs_hits_not_the_request():
    pool = SlowPool()
    sched, ex = make_scheduler(num_blocks=32, connectors=[connector(pool)]), FakeWorker()
    sched.add_request(make_request("r", prompt_of(3, 14), max_tokens=3))
    assert sched.schedule().is_empty
    pool.pending[0][1].set_exception(ConnectionError("pool down"))
    run = run_sync(sched, ex)
    assert run.finish["r"].finish_reason == "length" and take_fetches(sched) == []


def test_computed_prompt_blocks_are_stored_once_and_pool_hits_not_again():
    pool = SlowPool()
    prompt = prompt_of(4, 14)  # 3 full blocks before the last token
    keys = prompt_keys(prompt)
    pool.keys.add(rank_key(keys[0], 0, 1))  # the pool holds block 0 only: too short a gain to fetch...
    conn = connector(pool)
    conn.cost = FetchCostModel(block_bytes=64, block_size=BS, latency_s=10.0, bandwidth_bytes_per_s=1e12,
                               prefill_tokens_per_s=BS)  # ...as the cost model prices it
    sched, ex = make_scheduler(num_blocks=32, connectors=[conn]), FakeWorker()
    sched.add_request(make_request("r", prompt, max_tokens=8))
    sched.schedule()
    pool.answer()
    run_sync(sched, ex)
    stored = [b.key for b in stores(sched)]
    assert stored == keys[1:]  # block 0 is there already; decode blocks are not stored by default
    assert stores(sched) == []


def test_decode_blocks_are_stored_when_asked():
    pool = SlowPool()
    prompt = prompt_of(5, 9)  # 2 prompt blocks; 8 outputs fill 2 more (the last token's KV is never computed)
    sched, ex = make_scheduler(num_blocks=32, connectors=[connector(pool, pool_store_decode_blocks=True)]), \
        FakeWorker()
    req = make_request("r", prompt, max_tokens=8)
    sched.add_request(req)
    sched.schedule()
    pool.answer()
    run = run_sync(sched, ex)
    tokens = prompt + run.outputs["r"]
    full = (len(tokens) - 1) // BS
    stored = stores(sched)
    assert len(stored) == full == 4
    # the generated blocks chain from the prompt's keys, as the next turn's prompt keys them
    assert [b.key for b in stored] == prompt_keys(tokens + [0])[:full]


def test_a_tp_group_runs_from_the_fewest_blocks_any_rank_wrote():
    pool = SlowPool()
    prompt = prompt_of(6, 14)
    pool.keys.update(rank_key(k, 0, 2) for k in prompt_keys(prompt))
    sched = make_scheduler(num_blocks=32, connectors=[connector(pool, attn_tp=2)])
    sched.add_request(make_request("r", prompt))
    sched.schedule()
    pool.answer()
    sched.schedule()
    (fetch,) = take_fetches(sched)
    assert len(fetch.blocks) == 3
    sched.update_connector_output(KVConnectorReport(rank=0, dp_rank=0, pool_fetches=[PoolFetchDone("r", 3)]))
    assert sched.get_request("r").status is RequestStatus.WAITING_FOR_REMOTE_KV  # rank 1 has not reported
    sched.update_connector_output(KVConnectorReport(rank=1, dp_rank=0, pool_fetches=[PoolFetchDone("r", 1)]))
    step = sched.schedule()
    (new,) = step.new_reqs
    assert new.num_computed_tokens == BS and step.num_scheduled_tokens == {"r": len(prompt) - BS}
    assert sched.stats().pool_hit_tokens == BS


def test_steps_teach_the_cost_model_the_prefill_rate():
    pool = SlowPool()
    conn = connector(pool)
    sched, ex = make_scheduler(num_blocks=64, connectors=[conn]), FakeWorker()
    sched.add_request(make_request("r", prompt_of(7, 128), max_tokens=1))
    assert sched.schedule().is_empty
    pool.answer()  # a miss: the prompt is computed
    step = sched.schedule()
    assert step.num_scheduled_tokens == {"r": 128}
    out = ex.execute(step)
    out.execute_seconds = 0.5
    collect(sched.update_from_output(step, out), {}, {})
    assert conn.cost.prefill_tokens_per_s == 256.0


# ---------------------------------------------------------------- worker half, against a real pool
@pytest.fixture(scope="module")
def pool_address():
    controller, stop = free_address(), threading.Event()
    threads = [threading.Thread(target=run_controller, args=(controller, 60.0, 16, stop), daemon=True)]
    server = PoolServer("kv", free_address(), controller, 64 << 20, heartbeat_s=0.2)
    threads.append(threading.Thread(target=server.serve, daemon=True))
    for thread in threads:
        thread.start()
    try:
        with PoolClient(controller, timeout_s=2.0) as client:
            wait_until(lambda: client.view() is not None and len(client.view().servers) == 1, 30,
                       "the pool server to join")
        yield controller
    finally:
        server.stop()
        stop.set()
        for thread in threads:
            thread.join(timeout=10)


def kv_caches(seed: int | None) -> list[torch.Tensor]:
    """Two layers of 8 blocks; random contents, or zeros."""
    g = torch.Generator().manual_seed(seed or 0)
    return [torch.randn((8, BS, 2, 3), generator=g) if seed is not None else torch.zeros((8, BS, 2, 3))
            for _ in range(2)]


def finished(worker: PoolConnectorWorker, timeout_s: float = 10.0) -> KVConnectorReport:
    report = KVConnectorReport(rank=0, dp_rank=0)
    wait_until(lambda: (worker.get_finished(report), bool(report.pool_fetches))[1], timeout_s, "the fetch")
    return report


def test_a_rank_stores_blocks_another_rank_populates_from_them(pool_address):
    with PoolClient(pool_address, timeout_s=2.0) as a, PoolClient(pool_address, timeout_s=2.0) as b:
        source = PoolConnectorWorker(a, "ns", 1, 2, kv_caches(seed=3))
        source.start_load_kv(KVConnectorMetadata(pool_stores=[PoolBlock(2, "k0"), PoolBlock(5, "k1")]))
        wait_until(lambda: all(b.exists("ns", [rank_key("k0", 1, 2), rank_key("k1", 1, 2)])), 10, "the stores")
        assert not any(b.exists("ns", [rank_key("k0", 0, 2)]))  # each TP rank stores its own part

        dest = PoolConnectorWorker(b, "ns", 1, 2, kv_caches(seed=None))
        answered = threading.Event()
        dest.wake_with(answered.set)  # the rank's loop is woken as the pool answers, not at its next poll
        dest.start_load_kv(KVConnectorMetadata(pool_fetches=[
            PoolFetch(req_id="r", blocks=[PoolBlock(0, "k0"), PoolBlock(1, "k1"), PoolBlock(4, "lost")]),
        ]))
        assert dest.busy
        assert answered.wait(10), "the fetch's answer did not wake the rank"
        report = finished(dest)
        assert report.pool_fetches == [PoolFetchDone("r", 2)] and not dest.busy  # up to the first miss
        for layer in range(2):
            assert torch.equal(dest.kv_caches[layer][0], source.kv_caches[layer][2])
            assert torch.equal(dest.kv_caches[layer][1], source.kv_caches[layer][5])
            assert not dest.kv_caches[layer][4].any()


def test_without_a_pool_every_fetch_is_a_miss():
    worker = PoolConnectorWorker(None, "ns", 0, 1, kv_caches(seed=None))
    worker.start_load_kv(KVConnectorMetadata(pool_stores=[PoolBlock(0, "k")],
                                             pool_fetches=[PoolFetch(req_id="r", blocks=[PoolBlock(0, "k")])]))
    assert finished(worker).pool_fetches == [PoolFetchDone("r", 0)]
