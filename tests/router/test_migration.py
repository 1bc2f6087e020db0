"""Request migration with token recomputation (Dynamo-style, xdeepserve §6.2): when a TE fails, each of its
jobs continues on another TE from its prompt plus the tokens it already streamed; the caller sees one stream
with nothing repeated or missing, and greedy text as without the failure. A job no TE can take waits for one
up to a deadline, then fails with a clear error."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import zmq

from meshserve.router.deployment import MultiDeployment
from meshserve.wire.client import AbortRequests, AddRequest, EngineStats, ReleaseKV, RequestDelta
from meshserve.wire.sampling_params import SamplingParams
from tests.router.deployment_processes import running_deployment, token_ids
from tests.router.test_pd_deployment import FakeTE, fake_deployment, start_and_hand_off

ENGINE = {"num_kv_blocks": 128}


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model("deepseek_v3", seed=0, name="deepseek_v3"))


async def _register(je, tes: dict[str, FakeTE]) -> None:
    await je.start()
    for te in tes.values():
        te.beat()
    # routable, not only registered: a TE whose link handshake the JE has not seen yet takes no job, so the
    # first job would go to whichever TE's link came up first
    for _ in range(500):
        if len(je.registry.routable()) == len(tes):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the fake TEs did not register")


def _stream(je, prompt: list[int], max_tokens: int, request_id: str = "r"):
    """Start a greedy request; returns (task, list that collects its outputs)."""
    outs: list = []

    async def run():
        async for out in je.generate(None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), request_id):
            outs.append(out)
        return outs[-1]

    return asyncio.ensure_future(run()), outs


def test_a_streaming_colocated_job_continues_on_another_te_from_its_tokens(model):
    # routed by load, so the first job goes to a (KV usage 0 against 0.5), whichever TE registered first
    with fake_deployment(model, [("a", "colocated", "main", 0.0), ("b", "colocated", "main", 0.5)],
                         routing="load") as (je, tes):
        async def scenario():
            await _register(je, tes)
            work, outs = _stream(je, [5, 6, 7], max_tokens=5)
            first = await tes["a"].next_message(AddRequest)  # the least loaded TE
            tes["a"].send(RequestDelta(req_id=first.req_id, new_token_ids=[21, 22], num_prompt_tokens=3))
            for _ in range(200):
                if outs:
                    break
                await asyncio.sleep(0.01)
            tes["a"].beat(leaving=True)  # a dies (says it is leaving: the JE drops it at once)
            moved = await tes["b"].next_message(AddRequest)
            assert moved.prompt_token_ids == [5, 6, 7] and moved.output_token_ids == [21, 22]
            assert moved.kv_transfer is None and moved.req_id != first.req_id
            # a late token of the dead TE's attempt is ignored
            tes["a"].send(RequestDelta(req_id=first.req_id, new_token_ids=[99], num_prompt_tokens=3))
            tes["b"].send(RequestDelta(req_id=moved.req_id, new_token_ids=[23, 24, 25], finish_reason="length",
                                           num_prompt_tokens=3))
            return await asyncio.wait_for(work, 10)

        final = asyncio.run(scenario())
        assert final.outputs[0].token_ids == [21, 22, 23, 24, 25] and final.outputs[0].finish_reason == "length"
        assert je.migrated == 1


def test_jobs_move_off_a_te_that_recovers_its_ranks_when_another_can_take_them(model):
    # routed by load, so the first job goes to a (KV usage 0 against 0.5), whichever TE registered first
    with fake_deployment(model, [("a", "colocated", "main", 0.0), ("b", "colocated", "main", 0.5)],
                         routing="load") as (je, tes):
        async def scenario():
            await _register(je, tes)
            work, _ = _stream(je, [5, 6, 7], max_tokens=3)
            first = await tes["a"].next_message(AddRequest)
            tes["a"].send(RequestDelta(req_id=first.req_id, new_token_ids=[21], num_prompt_tokens=3))
            await asyncio.sleep(0.2)
            tes["a"].heartbeat.stats = EngineStats(recovering="worker 1 died")
            tes["a"].beat()
            moved = await tes["b"].next_message(AddRequest)
            assert moved.output_token_ids == [21]
            abort = await tes["a"].next_message(AbortRequests)  # its copy is dropped there
            assert abort.req_ids == [first.req_id]
            assert je.registry.get("a") is not None  # still registered: it takes requests again once back
            assert "a" not in {r.name for r in je.registry.routable()}
            tes["b"].send(RequestDelta(req_id=moved.req_id, new_token_ids=[22, 23], finish_reason="length",
                                           num_prompt_tokens=3))
            return await asyncio.wait_for(work, 10)

        final = asyncio.run(scenario())
        assert final.outputs[0].token_ids == [21, 22, 23]


def test_a_te_restarted_under_its_name_gets_its_jobs_back_from_their_tokens(model):
    with fake_deployment(model, [("a", "colocated", "main", 0.0)]) as (je, tes):
        async def scenario():
            await _register(je, tes)
            work, _ = _stream(je, [5, 6, 7], max_tokens=3)
            first = await tes["a"].next_message(AddRequest)
            tes["a"].send(RequestDelta(req_id=first.req_id, new_token_ids=[21], num_prompt_tokens=3))
            await asyncio.sleep(0.2)
            # the cluster manager restarted it faster than the heartbeat timeout: same name, new process
            ctx = zmq.Context()
            restarted = FakeTE(ctx, je, "a", "colocated", "main")
            try:
                restarted.beat()
                moved = await restarted.next_message(AddRequest)
                assert moved.output_token_ids == [21] and moved.req_id != first.req_id
                restarted.send(RequestDelta(req_id=moved.req_id, new_token_ids=[22, 23], finish_reason="length",
                                                num_prompt_tokens=3))
                return await asyncio.wait_for(work, 10)
            finally:
                restarted.close()
                ctx.term()

        final = asyncio.run(scenario())
        assert final.outputs[0].token_ids == [21, 22, 23]


def test_a_decode_job_with_no_decode_te_left_continues_on_a_colocated_te(model):
    spec = [("pre", "prefill", "pd", 0.0), ("dec", "decode", "pd", 0.0), ("col", "colocated", "main", 0.9)]
    with fake_deployment(model, spec) as (je, tes):
        async def scenario():
            work, _, task = await start_and_hand_off(je, tes, "pre", "dec")
            tes["dec"].send(RequestDelta(req_id=task.req_id, new_token_ids=[12], num_prompt_tokens=3))
            await asyncio.sleep(0.2)
            tes["dec"].beat(leaving=True)
            moved = await tes["col"].next_message(AddRequest)
            assert moved.output_token_ids == [11, 12] and moved.kv_transfer is None
            release = await tes["pre"].next_message(ReleaseKV)  # nobody pulls the prompt's KV now
            assert release.req_ids == [task.req_id]
            tes["col"].send(RequestDelta(req_id=moved.req_id, new_token_ids=[13], finish_reason="length",
                                             num_prompt_tokens=3))
            return await asyncio.wait_for(work, 10)

        final = asyncio.run(scenario())
        assert final.outputs[0].token_ids == [11, 12, 13]


def test_a_job_waits_for_a_restarted_te_then_fails_after_the_deadline(model):
    with fake_deployment(model, [("a", "colocated", "main", 0.0)], migrate_deadline_s=1.0) as (je, tes):

        async def scenario():
            await _register(je, tes)
            work, _ = _stream(je, [5, 6, 7], max_tokens=5, request_id="waits")
            first = await tes["a"].next_message(AddRequest)
            tes["a"].send(RequestDelta(req_id=first.req_id, new_token_ids=[21], num_prompt_tokens=3))
            await asyncio.sleep(0.2)
            tes["a"].beat(leaving=True)
            await asyncio.sleep(0.3)
            tes["a"].beat()  # back (the cluster manager restarted it) within the deadline
            moved = await tes["a"].next_message(AddRequest)
            assert moved.output_token_ids == [21]
            tes["a"].send(RequestDelta(req_id=moved.req_id, new_token_ids=[22], finish_reason="length",
                                           num_prompt_tokens=3))
            done = await asyncio.wait_for(work, 10)
            # the second time nothing comes back within the deadline: a clear error, not a hang
            work, _ = _stream(je, [5, 6, 7], max_tokens=5, request_id="fails")
            first = await tes["a"].next_message(AddRequest)
            tes["a"].send(RequestDelta(req_id=first.req_id, new_token_ids=[21], num_prompt_tokens=3))
            await asyncio.sleep(0.2)
            started = time.monotonic()
            tes["a"].beat(leaving=True)
            with pytest.raises(Exception, match="within 1 s"):
                await asyncio.wait_for(work, 10)
            return done, time.monotonic() - started

        done, waited = asyncio.run(scenario())
        assert done.outputs[0].token_ids == [21, 22]
        assert waited < 5


def test_a_killed_te_mid_stream_loses_nothing_on_a_real_deployment(model):
    """Two colocated TEs; one is killed -9 while its requests stream: every request ends with the tokens the
    fault-free run gives (the JE drops the TE at its heartbeat timeout and moves the jobs)."""
    prompts = [[3 + i, 7, 9 + i, 2] for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with running_deployment(model, MultiDeployment.preset("colocated2"), engine=ENGINE,
                            heartbeat_timeout_s=1.5) as (jes, procs):
        je = jes[0]

        async def run_all(kill: str | None):
            outs: dict[int, list] = {i: [] for i in range(len(prompts))}

            async def one(i):
                async for out in je.generate(None, prompts[i], params, f"{kill}-{i}"):
                    outs[i].append(out)

            tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
            if kill is not None:
                while sum(1 for o in outs.values() if o) < len(prompts):  # every request is streaming
                    await asyncio.sleep(0.01)
                os.kill(procs[kill].pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return outs

        reference = asyncio.run(run_all(None))
        victim = sorted(procs)[0]
        faulted = asyncio.run(run_all(victim))
        for i in range(len(prompts)):
            streamed = [t for out in faulted[i] for t in out.outputs[0].token_ids_delta]
            assert streamed == faulted[i][-1].outputs[0].token_ids  # nothing repeated or lost in the stream
            assert faulted[i][-1].outputs[0].finish_reason == "length"
        assert token_ids([o[-1] for o in faulted.values()]) == token_ids([o[-1] for o in reference.values()])
        assert je.migrated >= 1 and je.registry.get(victim) is None
