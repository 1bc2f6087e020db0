"""The P/D connector's halves: the scheduler half's admission, TP mapping and report aggregation with fake
reports; the worker half pulling real blocks between two transfer engines."""
from __future__ import annotations

import threading

import msgspec
import pytest
import torch

from meshserve.config import KVTransferConfig
from meshserve.core.kv_connector.pd import PDEndpoint, accept_kv_transfer
from meshserve.core.pd_mapping import source_prefill_tp_rank
from meshserve.core.request import RequestStatus
from meshserve.wire.kv import (
    KVConnectorMetadata,
    KVConnectorReport,
    KVPull,
    KVPullDone,
    KVRegion,
    KVTransferParams,
    KVTransferRole,
)
from meshserve.worker.kv_connector.pd import PDConnectorWorker
from tests.core.test_scheduler import BS, FakeWorker, make_request, prompt_of, run_sync
from tests.core.test_scheduler_pd import REGION, hand_off_one, pd_scheduler, pulled, take_pulls
from tests.pool.pool_processes import wait_until


def regions(n: int) -> list[KVRegion]:
    return [msgspec.structs.replace(REGION, engine=f"prefill/rank{i}") for i in range(n)]


def hand_off(num_tokens: int = 10, attn_tp: int = 1, **fields) -> KVTransferParams:
    return KVTransferParams(role=KVTransferRole.CONSUMER, engine="prefill", engine_addr="tcp://prefill:1",
                            attn_tp=attn_tp, regions=regions(attn_tp), block_ids=list(range(-(-num_tokens // BS))),
                            num_tokens=num_tokens, hold_s=300.0, **fields)


# ---------------------------------------------------------------- admission
@pytest.mark.parametrize("params, output, error", [
    (KVTransferParams(role=KVTransferRole.PRODUCER), [], "cannot take producer"),
    (msgspec.structs.replace(hand_off(), engine_addr=""), [7], "missing engine_addr"),
    (msgspec.structs.replace(hand_off(), regions=[]), [7], "missing regions"),
    (hand_off(), [], "its first token"),
    (hand_off(num_tokens=9), [7], "its first token"),
    (msgspec.structs.replace(hand_off(), attn_tp=2), [7], "regions for attention TP 2"),
    (msgspec.structs.replace(hand_off(), block_ids=[0, 1]), [7], "block size"),
])
def test_a_decode_te_refuses_what_it_cannot_pull(params, output, error):
    req = make_request("r", prompt_of(1, 10))
    with pytest.raises(ValueError, match=error):
        accept_kv_transfer(KVTransferConfig(kv_transfer="consumer"), BS, req, params, output)


def test_a_recompute_hand_off_is_computed_here():
    req = make_request("r", prompt_of(1, 10))
    accept_kv_transfer(KVTransferConfig(kv_transfer="consumer"), BS, req, hand_off(recompute=True), [7])
    assert req.kv_transfer is None and req.output_token_ids == [7]


# ---------------------------------------------------------------- scheduler half
def test_each_decode_tp_rank_reads_its_mapped_prefill_rank_and_the_group_waits_for_all():
    sched = pd_scheduler("consumer", num_blocks=16)
    (conn,) = sched.connectors
    conn.endpoint = PDEndpoint(engine="decode", engine_addr="tcp://decode:1", dp_rank=1, attn_tp=2, attn_dp=2,
                               regions=[])
    prompt = prompt_of(2, 10)
    req = make_request("r", prompt)
    accept_kv_transfer(KVTransferConfig(kv_transfer="consumer"), BS, req, hand_off(attn_tp=4), [7])
    sched.add_request(req)
    sched.schedule()
    (order,) = take_pulls(sched)
    expected = [source_prefill_tp_rank(4, 2, 2, 1, t) for t in range(2)]
    assert [s.engine for s in order.sources] == [f"prefill/rank{i}" for i in expected]
    sched.update_connector_output(KVConnectorReport(rank=2, dp_rank=1, kv_pulls=[KVPullDone("r")]))
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV and sched.released == []
    sched.update_connector_output(KVConnectorReport(rank=3, dp_rank=1, kv_pulls=[KVPullDone("r", "lost")]))
    # one rank failed: the whole group computes the prompt; the prefill TE frees its blocks once
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == 0
    assert sched.released == [("tcp://prefill:1", "r")]
    assert (sched.stats().kv_pulled, sched.stats().kv_pull_recomputed) == (1, 1)


def test_blocks_in_the_local_prefix_cache_are_not_pulled():
    prompt = prompt_of(3, 10)
    _, p_ex, delta = hand_off_one(prompt)
    d_sched, d_ex = pd_scheduler("consumer", num_blocks=16), FakeWorker()
    local = make_request("local", prompt[:8] + [1, 2], max_tokens=1)  # computes the prompt's 2 first blocks
    d_sched.add_request(local)
    run_sync(d_sched, d_ex)
    req = make_request("r", prompt)
    accept_kv_transfer(KVTransferConfig(kv_transfer="consumer"), BS, req, delta.kv_transfer_params,
                       delta.new_token_ids)
    d_sched.add_request(req)
    d_sched.schedule()
    (order,) = take_pulls(d_sched)
    assert order.src_block_ids == delta.kv_transfer_params.block_ids[2:]
    assert order.dst_block_ids == req.block_ids[2:]
    for s, d in zip(order.src_block_ids, order.dst_block_ids):
        for offset in range(BS):
            if s * BS + offset in p_ex.kv:
                d_ex.kv[d * BS + offset] = p_ex.kv[s * BS + offset]
    pulled(d_sched, "r")
    run = run_sync(d_sched, d_ex)
    assert run.finish["r"].finish_reason == "length"
    assert run.finish["r"].num_cached_tokens == delta.kv_transfer_params.num_cached_tokens


def test_a_producer_holds_only_handed_off_requests():
    sched, ex = pd_scheduler("producer", num_blocks=16), FakeWorker()
    req = make_request("plain", prompt_of(4, 10), max_tokens=2)  # no kv_transfer: an ordinary request
    sched.add_request(req)
    run = run_sync(sched, ex)
    assert run.finish["plain"].kv_transfer_params is None and not sched.connectors[0].holds


# ---------------------------------------------------------------- worker half
def make_worker(name: str, tp_rank: int = 0) -> PDConnectorWorker:
    return PDConnectorWorker(name, "127.0.0.1", "tcp", num_layers=2, num_blocks=6, block_size=BS,
                             entry_shape=(3,), dtype=torch.float32, device=torch.device("cpu"), tp_rank=tp_rank)


def finished(worker: PDConnectorWorker) -> list[KVPullDone]:
    report = KVConnectorReport(rank=0, dp_rank=0)
    wait_until(lambda: (worker.get_finished(report), bool(report.kv_pulls))[1], 15, "the pull")
    return report.kv_pulls


def test_a_decode_rank_pulls_its_blocks_from_the_prefill_rank():
    prefill, decode = make_worker("p/rank0"), make_worker("d/rank0", tp_rank=1)
    try:
        for layer, kv in enumerate(prefill.kv_caches):
            kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view(kv.shape) + 1000 * layer)
        region = prefill.region
        assert region.engine == "p/rank0" and region.tcp_address is not None
        pulled = threading.Event()
        decode.wake_with(pulled.set)  # the rank's loop is woken as the pull ends, not at its next poll
        # the second of the pull's sources is this rank's (attention-TP rank 1)
        decode.start_load_kv(KVConnectorMetadata(kv_pulls=[
            KVPull(req_id="r", src_block_ids=[1, 4], dst_block_ids=[0, 2], sources=[REGION, region])]))
        assert decode.busy
        assert pulled.wait(15), "the pull's end did not wake the rank"
        assert finished(decode) == [KVPullDone("r")] and not decode.busy
        for layer in range(2):
            assert torch.equal(decode.kv_caches[layer][0], prefill.kv_caches[layer][1])
            assert torch.equal(decode.kv_caches[layer][2], prefill.kv_caches[layer][4])
    finally:
        decode.close()
        prefill.close()


def test_a_pull_from_an_unreachable_source_fails_that_pull_only():
    decode = make_worker("d/rank0")
    try:
        gone = msgspec.structs.replace(REGION, engine="gone", tcp_address=("127.0.0.1", 1))
        decode.start_load_kv(KVConnectorMetadata(kv_pulls=[
            KVPull(req_id="r", src_block_ids=[0], dst_block_ids=[0], sources=[gone])]))
        (done,) = finished(decode)
        assert done.req_id == "r" and done.error
    finally:
        decode.close()
