"""A TE recovers its ranks when one dies or hangs, and every request continues from its tokens so far
(xdeepserve §6): the same greedy tokens as without the failure, nothing repeated or lost. The API client
also starts a new engine when the master itself dies."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from meshserve import LLM, SamplingParams
from meshserve.config import EngineConfig
from meshserve.engine.async_client import AsyncEngineClient
from meshserve.utils.processes import rank_processes
from meshserve.wire.errors import EngineDeadError

PROMPTS = [[5, 6, 7], [9, 3, 1, 4], [11, 12], [2, 8, 8, 8, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
DP2_EP2 = "attn=TP1+DP2 moe=TP1+EP2"
HANG_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2}))


@pytest.fixture(scope="module")
def reference(model_dir):
    """The fault-free greedy tokens of PROMPTS (the single-rank engine: every parallel path must match it)."""
    llm = LLM(model=model_dir, kv_cache_memory_gb=0.05)
    try:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


def _worker_pids(master_pid: int, count: int) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = list(rank_processes(master_pid).values())
        if len(pids) >= count:
            return sorted(pids)
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} worker processes")


@pytest.fixture(scope="module")
def dp2_ep2(model_dir):
    """One DP2+EP2 engine for the recovery tests; faults are armed at run time through the admin command."""
    llm = LLM(model=model_dir, kv_cache_memory_gb=0.05, parallel=DP2_EP2, hang_timeout_s=HANG_TIMEOUT_S)
    yield llm
    llm.shutdown()


def test_a_killed_rank_is_recovered_and_requests_continue_with_the_same_tokens(dp2_ep2, reference):
    llm = dp2_ep2
    before = _worker_pids(llm.engine.proc.pid, 2)
    recoveries = llm.get_stats().num_recoveries
    # rank 1 is killed -9 at its 9th step from now: mid-stream
    llm.admin("fault.inject", {"fault": {"kind": "kill", "rank": 1, "after_steps": 8}})
    outs = llm.generate(PROMPTS, GREEDY)
    assert [out.outputs[0].token_ids for out in outs] == reference
    assert all(out.outputs[0].finish_reason == "length" for out in outs)
    stats = llm.get_stats()
    assert stats.healthy and stats.num_recoveries == recoveries + 1
    assert stats.num_migrated >= 1  # the running requests went on from their tokens
    assert "died" in (stats.last_failure or "")
    after = _worker_pids(llm.engine.proc.pid, 2)
    assert set(after).isdisjoint(before)  # new ranks; the master is the same process


def test_a_killed_rank_of_a_dp4_ep4_te_in_two_micro_batches_loses_nothing(model_dir, reference):
    """Killed mid-stream while the steps run split in two overlapped micro-batches (their transfers in flight
    when the peer dies): the ranks are recovered and every request ends with its fault-free tokens."""
    llm = LLM(model=model_dir, kv_cache_memory_gb=0.05, parallel="attn=TP1+DP4 moe=TP1+EP4", microbatches=2,
              microbatch_min_tokens=2, max_num_seqs=4)
    try:
        llm.admin("fault.inject", {"fault": {"kind": "kill", "rank": 2, "after_steps": 6}})
        outs = llm.generate(PROMPTS + PROMPTS, GREEDY)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert [out.outputs[0].token_ids for out in outs] == reference + reference
    assert stats.healthy and stats.num_recoveries == 1 and "died" in (stats.last_failure or "")
    assert stats.microbatched_steps > 0


def test_a_hung_rank_is_found_within_the_hang_timeout(dp2_ep2, reference):
    llm = dp2_ep2
    before = _worker_pids(llm.engine.proc.pid, 2)
    recoveries = llm.get_stats().num_recoveries
    # rank 1 stops answering (as if stuck in a kernel) at its 6th step from now, for longer than the test runs
    llm.admin("fault.inject", {"fault": {"kind": "stall", "rank": 1, "after_steps": 5, "duration_s": 120}})
    outs = llm.generate(PROMPTS, GREEDY)
    assert [out.outputs[0].token_ids for out in outs] == reference
    stats = llm.get_stats()
    assert stats.num_recoveries == recoveries + 1 and "hung" in (stats.last_failure or "")
    # found after the timeout, well before the collective timeout (a ping each second adds at most 1 s)
    assert HANG_TIMEOUT_S <= stats.last_failure_silent_s <= HANG_TIMEOUT_S + 2.5
    assert set(_worker_pids(llm.engine.proc.pid, 2)).isdisjoint(before)


def test_policy_fail_keeps_the_old_behaviour(model_dir, monkeypatch):
    monkeypatch.setenv("MESHSERVE_FAULTS", "kill:after_steps=10")
    llm = LLM(model=model_dir, kv_cache_memory_gb=0.05, on_rank_failure="fail")
    monkeypatch.delenv("MESHSERVE_FAULTS")
    try:
        with pytest.raises(EngineDeadError, match="worker 0"):
            llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("how", ["kill -9", "kill_master fault"])
def test_the_api_client_restarts_a_killed_master_and_streams_continue(model_dir, reference, how):
    """The master dies mid-stream: killed from outside, or by the `kill_master` fault (its hook is wrapped around
    the master's step sending only once the fault is armed)."""
    engine = AsyncEngineClient(EngineConfig.from_kwargs(model_dir, kv_cache_memory_gb=0.05))

    async def scenario():
        outputs: dict[str, list] = {}

        async def consume(i: int):
            async for out in engine.generate(None, PROMPTS[i], GREEDY, f"r{i}"):
                outputs.setdefault(f"r{i}", []).append(out)

        tasks = [asyncio.create_task(consume(i)) for i in range(len(PROMPTS))]
        while sum(len(v) for v in outputs.values()) < 3:  # streaming
            await asyncio.sleep(0.02)
        first_master = engine.engine.proc.pid
        if how == "kill -9":
            os.kill(first_master, signal.SIGKILL)
        else:
            # a few steps later: killed at once, the master could take the reply's frame down with it before its
            # socket sent it
            reply = await engine.admin("fault.inject", {"fault": {"kind": "kill_master", "after_steps": 3}})
            assert reply.ok, reply.error
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        assert engine.engine.proc.pid != first_master
        streamed = []
        for i in range(len(PROMPTS)):
            outs = outputs[f"r{i}"]
            deltas = [t for out in outs for t in out.outputs[0].token_ids_delta]
            streamed.append(deltas)
            assert outs[-1].outputs[0].token_ids == deltas  # the stream adds up: nothing repeated or lost
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert streamed == reference
        assert engine.healthy and engine.restarts.total == 1

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
