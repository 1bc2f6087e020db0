"""Self-contained DP groups (xdeepserve §4.2): each DP group a master process of its own, its ranks agreeing
with the other groups' on every step, the TE shell only placing requests. The single-rank engine is the oracle:
16 prompts of mixed lengths x 32 greedy tokens, all submitted at once, must come out token for token the same,
also when a rank is killed mid-stream."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.config import ConfigError, EngineConfig
from meshserve.engine.async_client import AsyncEngineClient
from meshserve.moe.placement import ExpertPlacement
from meshserve.utils import faults
from meshserve.utils.processes import process_tree

NUM_PROMPTS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# small steps: prefills are chunked and decodes mix with prefills, as in serving
ENGINE_ARGS = dict(max_num_batched_tokens=64, block_size=8, max_num_seqs=8, num_kv_blocks=128)
DP4_EP4 = "attn=TP1+DP4 moe=TP1+EP4"


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [5, 70, 17, 33, 9, 120, 48, 2, 64, 3, 27, 90, 11, 40, 6, 21]
    return [torch.randint(100, 31900, (n,), generator=g).tolist() for n in lengths[:NUM_PROMPTS]]


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY)
    assert all(out.outputs[0].finish_reason == "length" for out in outs)
    return [out.outputs[0].token_ids for out in outs]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("deepseek_v3", seed=5, overrides={"num_hidden_layers": 2}))


@pytest.fixture(scope="module")
def reference(model_dir):
    prompts = _prompts()
    with LLM(model=model_dir, **ENGINE_ARGS) as llm:
        return prompts, _tokens(llm, prompts)


@pytest.fixture(scope="module")
def dp4_ep4(model_dir):
    llm = LLM(model=model_dir, parallel=DP4_EP4, dp_groups="self-contained", **ENGINE_ARGS)
    yield llm
    llm.shutdown()


def _processes_running(llm: LLM, entry: str) -> list[psutil.Process]:
    return [p for p in process_tree(llm.engine.proc.pid) if entry in " ".join(p.cmdline())]


def test_dp4_ep4_self_contained_groups_match_one_rank(dp4_ep4, reference):
    prompts, expected = reference
    assert _tokens(dp4_ep4, prompts) == expected
    stats = dp4_ep4.get_stats()
    assert stats.healthy and stats.world_size == 4
    # one master process per DP group below the shell, and the four ranks they started
    assert len(_processes_running(dp4_ep4, "run_group_master")) == 4
    assert len(_processes_running(dp4_ep4, "run_worker")) == 4


def test_a_killed_rank_restarts_every_group_and_loses_nothing(dp4_ep4, reference):
    """Rank 2 (DP group 2) is killed -9 mid-stream: every group's ranks restart into a new world and every request
    continues from its tokens so far, ending with the fault-free tokens."""
    prompts, expected = reference
    recoveries = dp4_ep4.get_stats().num_recoveries
    dp4_ep4.admin("fault.inject", {"fault": {"kind": "kill", "rank": 2, "after_steps": 6}})
    assert _tokens(dp4_ep4, prompts) == expected
    stats = dp4_ep4.get_stats()
    assert stats.healthy and stats.num_recoveries == recoveries + 1
    assert stats.num_migrated >= 1  # requests went on from their tokens
    assert stats.world_size == 4


def _experts_present(llm: LLM) -> list[set[int]]:
    """Per MoE layer, the experts some slot of the placement the ranks serve holds."""
    layers = llm.admin("eplb.status")["placement"]["layers"]
    return [{expert for expert in slots if expert >= 0} for slots in layers.values()]


def test_a_killed_rank_shrinks_the_groups_and_they_grow_back(model_dir, reference):
    """With `on_rank_failure shrink`, rank 2 killed -9 mid-stream takes its DP group out of the layout: the
    three groups left restart on DP3+EP3 (every expert kept by a shrink placement), group 2's master hands its
    requests over and leaves, and every request ends with the fault-free tokens. After `regrow_after_s` group
    2's master starts again and the TE is DP4+EP4 once more, with the same tokens."""
    prompts, expected = reference
    every_expert = set(range(json.loads((Path(model_dir) / "config.json").read_text())["n_routed_experts"]))
    with LLM(model=model_dir, parallel=DP4_EP4, dp_groups="self-contained", on_rank_failure="shrink",
             regrow_after_s=8.0, eplb_redundant_experts=2, **ENGINE_ARGS) as llm:
        llm.admin("fault.inject", {"fault": {"kind": "kill", "rank": 2, "after_steps": 6}})
        assert _tokens(llm, prompts) == expected
        stats = llm.get_stats()
        assert stats.healthy and stats.world_size == 3 and stats.num_recoveries == 1, stats
        assert len(_processes_running(llm, "run_group_master")) == 3  # group 2's master left
        assert len(_processes_running(llm, "run_worker")) == 3
        assert all(present == every_expert for present in _experts_present(llm))
        assert _tokens(llm, prompts) == expected  # on the 3 groups left
        deadline = time.monotonic() + 120
        while llm.get_stats().world_size != 4:
            assert time.monotonic() < deadline, "the TE did not grow back to 4 groups"
            time.sleep(0.5)
        assert _tokens(llm, prompts) == expected
        assert len(_processes_running(llm, "run_group_master")) == 4
        assert len(_processes_running(llm, "run_worker")) == 4
        assert llm.get_stats().num_recoveries == 2


def _wait_for_idle_reports(llm: LLM) -> None:
    """Until the shell's view of every group (their load reports) has no request left: placement then weighs
    the prefixes alone, not a finished request a report has not yet counted out."""
    deadline = time.monotonic() + 30
    while (stats := llm.get_stats()).num_running or stats.num_waiting:
        assert time.monotonic() < deadline, "the groups' reports still count requests that finished"
        time.sleep(0.05)


def test_a_request_goes_to_the_group_that_caches_its_prefix(model_dir):
    """Two long prompts are cached one in each group; follow-ups sharing one of them, sent one at a time to idle
    groups, each reuse that prompt's blocks: the shell sees each group's prefix-cache events and places by
    them (placed by load alone, every follow-up would go to the same group and half would miss)."""
    g = torch.Generator().manual_seed(11)
    prefixes = [torch.randint(100, 31900, (64,), generator=g).tolist() for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with LLM(model=model_dir, parallel="attn=TP1+DP2 moe=TP1+EP2", dp_groups="self-contained",
             **ENGINE_ARGS) as llm:
        llm.generate(prefixes, params)  # together: one in each group
        for i in range(6):
            _wait_for_idle_reports(llm)
            out = llm.generate([[*prefixes[i % 2], 50 + i, 60 + i]], params)[0]
            assert out.num_cached_tokens == 64, (i, out.num_cached_tokens)  # all 8 blocks of its prefix


def test_a_hung_rank_restarts_every_group_and_loses_nothing(model_dir, reference):
    """Rank 1 stops answering mid-stream (as if stuck in a kernel): its group's master finds it hung, the ranks of
    both groups restart into a new world, and every request ends with its fault-free tokens."""
    prompts, expected = reference
    with LLM(model=model_dir, parallel="attn=TP1+DP2 moe=TP1+EP2", dp_groups="self-contained", hang_timeout_s=3.0,
             **ENGINE_ARGS) as llm:
        llm.admin("fault.inject", {"fault": {"kind": "stall", "rank": 1, "after_steps": 5, "duration_s": 120}})
        assert _tokens(llm, prompts[:8]) == expected[:8]
        stats = llm.get_stats()
    assert stats.healthy and stats.num_recoveries == 1 and "hung" in (stats.last_failure or "")


def test_a_collective_error_rolls_one_step_back_on_every_group(model_dir, reference, monkeypatch):
    """A transient error in a step's MoE dispatch on every rank: the ranks agree on the forward they failed (the
    groups number their steps each on their own) and run it again, with no restart."""
    prompts, expected = reference
    monkeypatch.setenv(faults.ENV, "collective_error:after_steps=6")
    with LLM(model=model_dir, parallel="attn=TP1+DP2 moe=TP1+EP2", dp_groups="self-contained",
             **ENGINE_ARGS) as llm:
        monkeypatch.delenv(faults.ENV)
        assert _tokens(llm, prompts[:8]) == expected[:8]
        stats = llm.get_stats()
    assert stats.healthy and stats.num_rollbacks == 1 and stats.num_recoveries == 0


def test_a_killed_group_master_fails_the_te_and_the_api_client_moves_every_stream_on(model_dir, reference):
    """A group's master dies with -9 mid-stream: the shell fails the TE (the group's requests and its ranks are
    gone), and the engine client starts a new TE and continues every request from its tokens so far."""
    prompts, expected = reference
    engine = AsyncEngineClient(EngineConfig.from_kwargs(model_dir, parallel="attn=TP1+DP2 moe=TP1+EP2",
                                                        dp_groups="self-contained", **ENGINE_ARGS))

    async def scenario():
        outputs: dict[int, list] = {}

        async def consume(i: int):
            async for out in engine.generate(None, prompts[i], GREEDY, f"r{i}"):
                outputs.setdefault(i, []).append(out)

        tasks = [asyncio.create_task(consume(i)) for i in range(8)]
        while sum(len(v) for v in outputs.values()) < 8:  # streaming
            await asyncio.sleep(0.02)
        shell = engine.engine.proc.pid
        group_master = next(p for p in psutil.Process(shell).children() if "run_group_master" in " ".join(p.cmdline()))
        group_master.kill()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
        assert engine.engine.proc.pid != shell and engine.restarts.total == 1
        for i in range(8):
            deltas = [t for out in outputs[i] for t in out.outputs[0].token_ids_delta]
            assert deltas == outputs[i][-1].outputs[0].token_ids == expected[i]  # nothing repeated or lost

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_a_live_move_of_every_expert_keeps_the_tokens(model_dir, reference):
    """The shell records the groups' expert load and moves the placement planned from it (primaries too, in
    rounds) while all 16 requests stream: every phase reaches every rank through its group's master and is
    applied at one agreed forward, so no token changes. A restart after the move keeps the moved placement."""
    prompts, expected = reference
    engine = AsyncEngineClient(EngineConfig.from_kwargs(model_dir, parallel=DP4_EP4, dp_groups="self-contained",
                                                        eplb_redundant_experts=1, eplb_slice_s=0.5, **ENGINE_ARGS))

    async def scenario():
        async def generate(tag: str) -> list[list[int]]:
            async def one(i: int) -> list[int]:
                tokens = []
                async for out in engine.generate(None, prompts[i], GREEDY, f"{tag}-{i}"):
                    tokens = out.outputs[0].token_ids
                return tokens
            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

        assert await generate("before") == expected
        load = await engine.admin("eplb.load")
        # the groups' load reached the shell
        assert load.ok and sum(count for slice_ in load.data.counts for layer in slice_ for count in layer) > 0
        moving = asyncio.create_task(generate("during"))
        await asyncio.sleep(0.2)
        reply = await engine.admin("eplb.rebalance")
        assert reply.ok, reply.error
        assert await moving == expected
        for again in range(20):  # a move of primaries takes rounds: generate while they run
            status = (await engine.admin("eplb.status")).data
            if status.phase == "idle":
                break
            assert await generate(f"again-{again}") == expected
        assert status.phase == "idle" and status.num_reconfigurations == 1 and status.last_error is None
        placement = ExpertPlacement.from_dict(msgspec.to_builtins(status.placement))
        shape, default = placement.shape, ExpertPlacement.default(placement.shape, list(placement.layers))
        assert any(slots[slot] != default.layers[layer][slot] for layer, slots in placement.layers.items()
                   for slot in range(len(slots)) if slot % shape.slots_per_rank < shape.primary_per_rank)
        assert await generate("after") == expected
        # a rank lost now: every group's ranks restart with the rebalanced placement, not the configured one
        assert (await engine.admin("fault.inject", {"fault": {"kind": "kill", "rank": 1, "after_steps": 3}})).ok
        assert await generate("restarted") == expected
        status = (await engine.admin("eplb.status")).data
        assert ExpertPlacement.from_dict(msgspec.to_builtins(status.placement)).layers == placement.layers

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_a_bad_request_fails_alone_in_its_group(model_dir, reference):
    """A prompt with a token outside the vocabulary, placed on a group among good ones: its group's master refuses
    it with the request's own error; every other request, on both groups, ends with its tokens."""
    from meshserve.wire.errors import InvalidRequestError

    prompts, expected = reference
    engine = AsyncEngineClient(EngineConfig.from_kwargs(model_dir, parallel="attn=TP1+DP2 moe=TP1+EP2",
                                                        dp_groups="self-contained", **ENGINE_ARGS))

    async def scenario():
        async def one(tag: str, prompt: list[int]) -> list[int]:
            tokens = []
            async for out in engine.generate(None, prompt, GREEDY, tag):
                tokens = out.outputs[0].token_ids
            return tokens

        good = [asyncio.create_task(one(f"good-{i}", prompts[i])) for i in range(4)]
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await one("bad", [5, 6, 10**7])
        assert await asyncio.gather(*good) == expected[:4]
        assert (await engine.get_stats()).healthy

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("layout", [
    dict(parallel="attn=TP1+DP2 moe=TP1+EP2", microbatches=2, microbatch_min_tokens=2),
    dict(parallel="attn=TP2+DP2 moe=TP2+EP2"),
    dict(parallel="attn=TP1+DP2 moe=TP1+EP2", speculative="mtp", num_speculative_tokens=2),
    dict(parallel="attn=TP1+DP2 oproj=TP2 moe=TP1+EP2"),
    dict(parallel="attn=TP1+DP4 moe=TP1+EP4 shared=EP1"),
], ids=["DP2+EP2-two-microbatches", "TP2+DP2-hybrid", "DP2+EP2-mtp", "DP2-oproj-TP2", "DP4-shared-EP1"])
def test_other_layouts_with_self_contained_groups_match_one_rank(model_dir, reference, layout):
    """Micro-batches: the ranks agree on splitting from the gathered step sizes. Attention TP2: a group runs a
    step only once both its ranks hold it. MTP (the single rank without it is the oracle): every rank runs as many
    MTP forwards as the group that drafts most, a group that only catches up or idles with empty ones. The seeds'
    decode layouts: o_proj shared over two groups' ranks, the shared expert on a rank of its own."""
    prompts, expected = reference
    with LLM(model=model_dir, dp_groups="self-contained", **layout, **ENGINE_ARGS) as llm:
        assert _tokens(llm, prompts[:8]) == expected[:8]


def test_int8_weights_and_dispatch_give_the_lockstep_engines_tokens(model_dir, reference):
    """W8A8 weights and INT8 dispatch change the numbers, the same way whichever way the groups run: the lockstep
    engine of the same layout is the oracle."""
    prompts, _ = reference
    int8 = dict(parallel="attn=TP1+DP2 moe=TP1+EP2", quantization="int8", int8_dispatch=True, **ENGINE_ARGS)
    with LLM(model=model_dir, **int8) as llm:
        expected = _tokens(llm, prompts[:8])
    with LLM(model=model_dir, dp_groups="self-contained", **int8) as llm:
        assert _tokens(llm, prompts[:8]) == expected


@pytest.mark.parametrize("settings, named", [
    (dict(dp_groups="self-contained", local_ranks=2, on_rank_failure="shrink", parallel=DP4_EP4), "local_ranks"),
    (dict(dp_groups="together"), "dp_groups"),
])
def test_what_self_contained_groups_do_not_run_is_refused_naming_the_setting(settings, named):
    with pytest.raises(ConfigError, match=named):
        EngineConfig.from_kwargs("m", **settings)
