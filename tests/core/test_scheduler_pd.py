"""Disaggregated prefill/decode in the scheduler (xdeepserve §5.1), driven by fake workers.

A prefill scheduler and a decode scheduler each get a fake worker (tests/core/test_scheduler.py):
its KV slots hold fingerprints of the token history, and it checks every context slot before computing.
A "pull" copies the prefill worker's slots of the handed-off blocks into the decode worker's
destination blocks, as the ranks' transfer engines do, so a decode that starts from wrong or missing
KV fails the test, and the outputs must equal the single-engine oracle.
"""
from __future__ import annotations

import time

import msgspec

from meshserve.config import KVTransferConfig, SchedulerConfig
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.kv_connector import PDConnector, PDEndpoint
from meshserve.core.kv_connector.pd import accept_kv_transfer
from meshserve.core.request import Request, RequestStatus
from meshserve.core.scheduler import Scheduler
from meshserve.wire.kv import (
    KVConnectorReport,
    KVPull,
    KVPullDone,
    KVRegion,
    KVRegionLayer,
    KVTransferParams,
    KVTransferRole,
)
from tests.core.test_scheduler import (
    BS,
    FakeWorker,
    collect,
    expected_outputs,
    make_request,
    prompt_of,
    run_sync,
)

REGION = KVRegion(engine="prefill/rank0", region="kv", layers=[KVRegionLayer(shape=[32, BS, 8], dtype="float32")],
                  host_id="host")
PREFILL = PDEndpoint(engine="prefill", engine_addr="tcp://prefill:1", dp_rank=0, attn_tp=1, attn_dp=1,
                     regions=[REGION])
DECODE = PDEndpoint(engine="decode", engine_addr="tcp://decode:1", dp_rank=0, attn_tp=1, attn_dp=1,
                    regions=[REGION])


def pd_scheduler(role: str, num_blocks: int, hold_timeout_s: float = 300.0) -> Scheduler:
    """A scheduler with the P/D connector of a prefill ("producer") or decode ("consumer") TE; the ReleaseKV
    messages its connector sends are recorded in `sched.released` as (address, req_id)."""
    kv_manager = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    released: list[tuple[str, str]] = []
    connector = PDConnector(KVTransferConfig(kv_transfer=role, kv_hold_timeout_s=hold_timeout_s), kv_manager,
                            PREFILL if role == "producer" else DECODE,
                            lambda addr, req_ids: released.extend((addr, r) for r in req_ids))
    sched = Scheduler(SchedulerConfig(max_model_len=4096), kv_manager, [connector])
    sched.released = released
    return sched


def pd(sched: Scheduler) -> PDConnector:
    (connector,) = sched.connectors
    return connector


def producer(req_id: str, prompt: list[int], max_tokens: int = 6) -> Request:
    req = make_request(req_id, prompt, max_tokens=max_tokens)
    req.kv_transfer = KVTransferParams(role=KVTransferRole.PRODUCER)
    return req


def consumer(req_id: str, prompt: list[int], first_token: int, source: KVTransferParams,
             max_tokens: int = 6) -> Request:
    """The decode TE's request, as the master admits it from AddRequest(kv_transfer=the prefill TE's hand-off)."""
    req = make_request(req_id, prompt, max_tokens=max_tokens)
    accept_kv_transfer(KVTransferConfig(kv_transfer="consumer"), BS, req, source, [first_token])
    return req


def take_pulls(sched: Scheduler) -> list[KVPull]:
    """The pull orders the master would send to the decode ranks with the next step."""
    meta = sched.build_connector_meta()
    return meta.kv_pulls if meta is not None else []


def pulled(sched: Scheduler, req_id: str, error: str | None = None) -> None:
    """The decode ranks' report of a finished (or failed) pull."""
    sched.update_connector_output(KVConnectorReport(rank=0, dp_rank=0, kv_pulls=[KVPullDone(req_id, error)]))


def prefill(sched, ex, reqs: list[Request]) -> dict:
    """Run the prefill scheduler until every request handed off; req_id -> its hand-off delta."""
    for req in reqs:
        sched.add_request(req)
    hand_offs = {}
    for _ in range(50):
        if not sched.has_unfinished_requests():
            return hand_offs
        out = sched.schedule()
        for delta in sched.update_from_output(out, ex.execute(out)):
            assert delta.finish_reason is None, delta
            hand_offs[delta.req_id] = delta
    raise AssertionError("prefill did not finish")


def pull(src: FakeWorker, dst: FakeWorker, order: KVPull) -> None:
    """What the decode ranks do for a pull order: copy the source blocks' slots into the destination's."""
    assert len(order.src_block_ids) == len(order.dst_block_ids)
    for s, d in zip(order.src_block_ids, order.dst_block_ids):
        for offset in range(BS):
            slot = src.kv.get(s * BS + offset)
            if slot is not None:
                dst.kv[d * BS + offset] = slot


def hand_off_one(prompt: list[int], max_tokens: int = 6, req_id: str = "r"):
    p_sched, p_ex = pd_scheduler("producer", num_blocks=32), FakeWorker()
    delta = prefill(p_sched, p_ex, [producer(req_id, prompt, max_tokens)])[req_id]
    return p_sched, p_ex, delta


# ---------------------------------------------------------------- prefill TE (producer)
def test_hand_off_holds_exactly_the_prompt_blocks_and_describes_them():
    for n in (10, 12):  # a partly filled last block, and a prompt of whole blocks
        prompt = prompt_of(n, n)
        p_sched, p_ex, delta = hand_off_one(prompt)
        num_blocks = -(-n // BS)
        params = delta.kv_transfer_params
        assert delta.new_token_ids == expected_outputs(prompt, 1) and delta.finish_reason is None
        assert params.num_tokens == n and params.num_cached_tokens == 0
        assert len(params.block_ids) == num_blocks
        assert pd(p_sched).holds["r"].block_ids == params.block_ids
        # what a decode TE needs to reach them
        assert params.role is KVTransferRole.CONSUMER and params.regions == [REGION]
        assert (params.engine, params.engine_addr, params.dp_rank, params.attn_tp) == \
            ("prefill", "tcp://prefill:1", 0, 1)
        assert p_sched.kv_manager.num_blocks - p_sched.kv_manager.num_available_blocks == num_blocks
        # the held blocks hold the prompt's KV (the fake worker's fingerprints)
        held_slots = [b * BS + i for b in params.block_ids for i in range(BS)][:n]
        assert all(slot in p_ex.kv for slot in held_slots)
        # the request is gone from the prefill TE; its worker state is dropped with the next step
        assert p_sched.get_request("r") is None and not p_sched.has_unfinished_requests()
        assert p_sched.stats().kv_transfer_holds == 1
        p_sched.add_request(make_request("next", prompt_of(99, 3), max_tokens=1))
        assert p_sched.schedule().finished_req_ids == ["r"]


def test_a_producer_samples_the_first_token_only():
    sched, ex = pd_scheduler("producer", num_blocks=64), FakeWorker()
    sched.add_request(producer("r", prompt_of(1, 6), max_tokens=8))
    first = sched.schedule()
    out1 = ex.execute(first)
    assert sched.schedule().is_empty  # overlapped scheduling must not feed the placeholder to a decode step
    (delta,) = sched.update_from_output(first, out1)
    assert delta.kv_transfer_params is not None and ex.samples["r"] == 1


def test_a_producer_that_finishes_with_its_first_token_hands_nothing_off():
    sched, ex = pd_scheduler("producer", num_blocks=64), FakeWorker()
    sched.add_request(producer("r", prompt_of(1, 6), max_tokens=1))
    run = run_sync(sched, ex)
    assert run.finish["r"].finish_reason == "length" and run.finish["r"].kv_transfer_params is None
    assert not pd(sched).holds and sched.kv_manager.usage == 0.0


def test_a_prefix_hit_is_handed_off_with_its_cached_tokens():
    prompt = prompt_of(3, 14)
    sched, ex = pd_scheduler("producer", num_blocks=32), FakeWorker()
    first = prefill(sched, ex, [producer("a", prompt)])["a"]
    second = prefill(sched, ex, [producer("b", prompt)])["b"]
    assert second.kv_transfer_params.num_cached_tokens == 12
    # both holds share the cached full blocks: freeing one keeps the other's intact
    shared = first.kv_transfer_params.block_ids[:3]
    assert second.kv_transfer_params.block_ids[:3] == shared
    assert pd(sched).release("a")
    assert sched.kv_manager.num_blocks - sched.kv_manager.num_available_blocks == 4  # b's 4 blocks
    assert pd(sched).release("b") and sched.kv_manager.num_available_blocks == sched.kv_manager.num_blocks


def test_release_kv_frees_the_held_blocks_once():
    p_sched, _, _ = hand_off_one(prompt_of(1, 10))
    assert pd(p_sched).release("r") is True
    assert p_sched.kv_manager.num_available_blocks == p_sched.kv_manager.num_blocks and not pd(p_sched).holds
    assert pd(p_sched).release("r") is False  # a second release (a duplicate ReleaseKV) is harmless
    assert p_sched.kv_manager.num_available_blocks == p_sched.kv_manager.num_blocks


def test_holds_nobody_pulls_expire():
    sched, ex = pd_scheduler("producer", num_blocks=32, hold_timeout_s=5.0), FakeWorker()
    start = time.monotonic()
    prefill(sched, ex, [producer("r", prompt_of(1, 10))])
    assert pd(sched).expire(now=start + 1.0) == [] and "r" in pd(sched).holds
    assert pd(sched).expire(now=time.monotonic() + 5.0) == ["r"]
    assert not pd(sched).holds and sched.kv_manager.num_available_blocks == sched.kv_manager.num_blocks


def test_aborting_a_handed_off_request_frees_its_hold():
    p_sched, _, _ = hand_off_one(prompt_of(1, 10))
    assert p_sched.abort_requests(["r"]) == []  # the caller heard of it through the decode TE, not here
    assert not pd(p_sched).holds and p_sched.kv_manager.num_available_blocks == p_sched.kv_manager.num_blocks


# ---------------------------------------------------------------- decode TE (consumer)
def test_pulled_request_decodes_from_the_transferred_kv():
    prompt = prompt_of(5, 10)
    _, p_ex, delta = hand_off_one(prompt, max_tokens=6)
    d_sched, d_ex = pd_scheduler("consumer", num_blocks=16), FakeWorker()
    req = consumer("r", prompt, delta.new_token_ids[0], delta.kv_transfer_params, max_tokens=6)
    d_sched.add_request(req)
    assert d_sched.schedule().is_empty  # nothing to compute until the blocks arrive
    (order,) = take_pulls(d_sched)
    assert order.src_block_ids == delta.kv_transfer_params.block_ids
    assert set(order.dst_block_ids) <= set(req.block_ids)
    assert order.sources == [REGION]  # decode TP rank 0 reads the one prefill rank
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert d_sched.stats().num_running == 1 and d_sched.has_unfinished_requests()
    pull(p_ex, d_ex, order)
    pulled(d_sched, "r")
    assert d_sched.released == [("tcp://prefill:1", "r")]  # the prefill TE may free its blocks
    step = d_sched.schedule()
    (new,) = step.new_reqs
    assert new.num_computed_tokens == len(prompt) and new.token_ids == prompt + delta.new_token_ids
    assert step.num_scheduled_tokens == {"r": 1}
    outputs, finish = {}, {}
    collect(d_sched.update_from_output(step, d_ex.execute(step)), outputs, finish)
    run = run_sync(d_sched, d_ex)
    assert delta.new_token_ids + outputs["r"] + run.outputs["r"] == expected_outputs(prompt, 6)
    assert run.finish["r"].finish_reason == "length"
    stats = d_sched.stats()
    assert (stats.kv_pulled, stats.kv_pull_recomputed) == (1, 0)
    assert d_sched.kv_manager.usage == 0.0


def test_a_failed_pull_recomputes_the_prompt_and_first_token():
    prompt = prompt_of(6, 10)
    _, _, delta = hand_off_one(prompt, max_tokens=5)
    d_sched, d_ex = pd_scheduler("consumer", num_blocks=16), FakeWorker()
    d_sched.add_request(consumer("r", prompt, delta.new_token_ids[0], delta.kv_transfer_params, max_tokens=5))
    d_sched.schedule()
    take_pulls(d_sched)  # the pull was ordered; nothing reaches the decode worker's KV
    pulled(d_sched, "r", error="ConnectionError: refused")
    assert d_sched.released == [("tcp://prefill:1", "r")]  # after a failure too: nobody will read them
    step = d_sched.schedule()
    (new,) = step.new_reqs
    assert new.num_computed_tokens == 0 and step.num_scheduled_tokens == {"r": len(prompt) + 1}
    outputs, finish = {}, {}
    collect(d_sched.update_from_output(step, d_ex.execute(step)), outputs, finish)
    run = run_sync(d_sched, d_ex)
    assert delta.new_token_ids + outputs["r"] + run.outputs["r"] == expected_outputs(prompt, 5)
    stats = d_sched.stats()
    assert (stats.kv_pulled, stats.kv_pull_recomputed) == (1, 1)
    assert d_sched.kv_manager.usage == 0.0


def test_a_pull_waits_for_free_blocks_and_starts_when_they_free_up():
    # the decode pool fits one request at a time: 10-token prompt + 6 outputs = 4 blocks of 4
    prompts = [prompt_of(i, 10) for i in range(3)]
    p_sched, p_ex = pd_scheduler("producer", num_blocks=32), FakeWorker()
    hand_offs = prefill(p_sched, p_ex, [producer(f"r{i}", p) for i, p in enumerate(prompts)])
    assert len(pd(p_sched).holds) == 3
    d_sched, d_ex = pd_scheduler("consumer", num_blocks=4), FakeWorker()
    reqs = [consumer(f"r{i}", p, hand_offs[f"r{i}"].new_token_ids[0], hand_offs[f"r{i}"].kv_transfer_params)
            for i, p in enumerate(prompts)]
    for req in reqs:
        d_sched.add_request(req)
    outputs, finish = {}, {}
    pulled_order = []
    waited = False
    for _ in range(200):
        if not d_sched.has_unfinished_requests():
            break
        step = d_sched.schedule()
        for order in take_pulls(d_sched):  # the master sends these to the ranks
            pull(p_ex, d_ex, order)
            pulled(d_sched, order.req_id)
            assert d_sched.released[-1] == ("tcp://prefill:1", order.req_id)
            assert pd(p_sched).release(order.req_id)  # the decode master's ReleaseKV
            pulled_order.append(order.req_id)
        if d_sched.num_waiting and pulled_order:
            # backpressure: the rest stay queued (not dropped) and their KV stays held on the prefill TE
            waited = True
            assert len(pd(p_sched).holds) == 3 - len(pulled_order)
        if not step.is_empty:
            collect(d_sched.update_from_output(step, d_ex.execute(step)), outputs, finish)
    else:
        raise AssertionError("requests did not finish")
    assert waited and pulled_order == ["r0", "r1", "r2"]
    for i, prompt in enumerate(prompts):
        assert hand_offs[f"r{i}"].new_token_ids + outputs[f"r{i}"] == expected_outputs(prompt, 6)
        assert finish[f"r{i}"].finish_reason == "length"
    assert d_sched.stats().num_preemptions == 0  # waiting, not thrashing
    assert not pd(p_sched).holds and p_sched.kv_manager.usage == 0.0 and d_sched.kv_manager.usage == 0.0


def test_a_waiting_pull_does_not_preempt_running_requests():
    d_sched, d_ex = pd_scheduler("consumer", num_blocks=4), FakeWorker()
    local = make_request("local", prompt_of(1, 10), max_tokens=6)
    d_sched.add_request(local)
    step = d_sched.schedule()
    d_sched.update_from_output(step, d_ex.execute(step))
    source = KVTransferParams(role=KVTransferRole.CONSUMER, engine="prefill", engine_addr="tcp://prefill:1",
                              regions=[REGION], block_ids=[0, 1, 2], num_tokens=10, num_cached_tokens=0)
    d_sched.add_request(consumer("pulled", prompt_of(2, 10), 7, source))
    d_sched.schedule()
    assert take_pulls(d_sched) == [] and d_sched.num_waiting == 1
    assert local.status is RequestStatus.RUNNING and d_sched.stats().num_preemptions == 0


def test_abort_while_receiving_frees_the_blocks_only_when_the_pull_ends():
    prompt = prompt_of(4, 10)
    _, _, delta = hand_off_one(prompt)
    d_sched = pd_scheduler("consumer", num_blocks=16)
    d_sched.add_request(consumer("r", prompt, delta.new_token_ids[0], delta.kv_transfer_params))
    d_sched.schedule()
    used = d_sched.kv_manager.num_blocks - d_sched.kv_manager.num_available_blocks
    assert used == 3
    (aborted,) = d_sched.abort_requests(["r"])
    assert aborted.finish_reason == "abort"
    # the ranks may still be writing the blocks: they are not reused yet
    assert d_sched.kv_manager.num_blocks - d_sched.kv_manager.num_available_blocks == used
    assert d_sched.get_request("r") is None
    pulled(d_sched, "r")
    assert d_sched.kv_manager.num_available_blocks == d_sched.kv_manager.num_blocks
    assert not d_sched.has_unfinished_requests()
    assert d_sched.schedule().is_empty and d_sched.stats().kv_pulled == 0


def test_fail_all_answers_a_receiving_request_once():
    prompt = prompt_of(4, 10)
    _, _, delta = hand_off_one(prompt)
    d_sched = pd_scheduler("consumer", num_blocks=16)
    d_sched.add_request(consumer("r", prompt, delta.new_token_ids[0], delta.kv_transfer_params))
    d_sched.add_request(make_request("local", prompt_of(8, 5)))
    d_sched.schedule()
    deltas = d_sched.fail_all("worker died")
    assert sorted(d.req_id for d in deltas) == ["local", "r"]
    assert all(d.finish_reason == "error" and d.error == "worker died" for d in deltas)
    assert d_sched.fail_all("again") == []


def test_hand_off_says_until_when_the_blocks_are_held():
    before = time.time()
    _, _, delta = hand_off_one(prompt_of(1, 10))
    params = delta.kv_transfer_params
    assert params.hold_s == 300.0
    assert before + 300.0 <= params.hold_expires_at <= time.time() + 300.0


def test_a_pull_that_waited_until_the_hold_expires_recomputes_instead_of_reading_freed_blocks():
    prompt = prompt_of(7, 10)
    _, p_ex, delta = hand_off_one(prompt, max_tokens=5)
    d_sched, d_ex = pd_scheduler("consumer", num_blocks=16), FakeWorker()
    fresh = msgspec.structs.replace(delta.kv_transfer_params, hold_expires_at=time.time() + 60.0, hold_s=60.0)
    # inside the margin
    expiring = msgspec.structs.replace(delta.kv_transfer_params, hold_expires_at=time.time() + 5.0, hold_s=60.0)
    d_sched.add_request(consumer("fresh", prompt, delta.new_token_ids[0], fresh, max_tokens=5))
    d_sched.add_request(consumer("expiring", prompt, delta.new_token_ids[0], expiring, max_tokens=5))
    step = d_sched.schedule()
    (order,) = take_pulls(d_sched)
    assert order.req_id == "fresh"
    # the expiring one is computed here right away: prompt and first token
    assert step.num_scheduled_tokens == {"expiring": len(prompt) + 1}
    pull(p_ex, d_ex, order)
    pulled(d_sched, "fresh")
    outputs, finish = {}, {}
    collect(d_sched.update_from_output(step, d_ex.execute(step)), outputs, finish)
    run = run_sync(d_sched, d_ex)
    for req_id in ("fresh", "expiring"):
        assert delta.new_token_ids + outputs.get(req_id, []) + run.outputs[req_id] == expected_outputs(prompt, 5)
    stats = d_sched.stats()
    assert (stats.kv_pulled, stats.kv_pull_recomputed) == (2, 1)
