"""Attention-expert disaggregation through the whole engine (xdeepserve §5.2): attention ranks and expert ranks
on different processes, tokens over A2E/E2A, against the single-rank engine.

16 prompts of mixed lengths x 32 greedy tokens, submitted together, must give the single rank's tokens for:
- two attention + two expert ranks;
- four attention ranks in two DP domains taking turns on two expert ranks, also with two micro-batches each,
  and with MTP drafts (the MTP layer's experts on the expert ranks);
- MoE TP on the expert ranks behind a relay (two-stage routing);
- the shared experts on an expert rank of their own (xdeepserve's 256 routed + 32 shared expert dies);
- a Qwen3-MoE model;
- redundant experts on the expert ranks after an expert-placement move, and after a kill -9 of an expert rank
  and of an attention rank mid-stream (every request completes);
and INT8 weights on both roles follow the single-rank INT8 engine.
"""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.config import EngineConfig
from meshserve.engine.async_client import AsyncEngineClient
from meshserve.engine.core_client import EngineStartupError
from meshserve.moe.placement import ExpertPlacement
from tests.engine.test_eplb_engine import wait_until_idle

NUM_PROMPTS = 16
OUTPUT_LEN = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
ENGINE_ARGS = dict(max_num_batched_tokens=64, block_size=8, max_num_seqs=8, num_kv_blocks=256)

LAYOUTS = {
    "2-attention+2-expert": "attn=DP2 moe=EP2 disagg",
    "4-attention-in-2-domains+2-expert": "attn=DP4 moe=EP2 disagg domains=2",
    "moe-TP2+EP2-through-relays": "attn=DP2 moe=TP2+EP2 disagg relay=2",
    "2-routed+1-shared-expert-ranks": "attn=DP2 moe=EP2 shared=EP1 disagg",
}


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 70, 17, 33, 9, 120, 48, 2, 64, 3, 27, 91, 12, 40, 7, 55]
    return [torch.randint(100, 31900, (n,), generator=g).tolist() for n in lengths[:NUM_PROMPTS]]


def _run(model_dir, prompts, **engine_args) -> list[list[int]]:
    with LLM(model=str(model_dir), **ENGINE_ARGS, **engine_args) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    model_dir = tiny_model("deepseek_v3", seed=3)
    prompts = _prompts()
    return model_dir, prompts, _run(model_dir, prompts)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_disaggregated_layout_gives_the_single_rank_tokens(reference, layout):
    model_dir, prompts, expected = reference
    assert _run(model_dir, prompts, parallel=LAYOUTS[layout]) == expected


def test_two_microbatches_in_each_of_two_domains_give_the_single_rank_tokens(reference):
    """Each domain's step as two micro-batches: one computes its attention while the other's rows are on the
    expert ranks; the expert ranks serve every domain's micro-batches in order."""
    model_dir, prompts, expected = reference
    with LLM(model=str(model_dir), parallel="attn=DP4 moe=EP2 disagg domains=2", microbatches=2,
             microbatch_min_tokens=2, **ENGINE_ARGS) as llm:
        assert [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)] == expected
        assert llm.get_stats().microbatched_steps > OUTPUT_LEN // 2  # most steps ran split


@pytest.mark.parametrize("microbatches", [1, 2], ids=["one-batch", "two-microbatches"])
def test_mtp_drafts_with_the_mtp_layers_experts_on_the_expert_ranks(reference, microbatches):
    """Speculative decoding: the attention ranks draft with the MTP layer, whose experts the expert ranks serve
    after each forward's decoder layers (the tiny model's MTP layer is random: drafts are verified and mostly
    rejected, and the tokens stay the single rank's without speculation). With two micro-batches the MTP forwards
    split as their step's forward does, on both roles."""
    model_dir, prompts, expected = reference
    split = {"microbatches": 2, "microbatch_min_tokens": 2} if microbatches == 2 else {}
    with LLM(model=str(model_dir), parallel="attn=DP4 moe=EP2 disagg domains=2", speculative="mtp",
             num_speculative_tokens=2, **split, **ENGINE_ARGS) as llm:
        assert [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)] == expected
        stats = llm.get_stats()
        assert stats.spec_verify_steps > 0 and (stats.microbatched_steps > 0) == (microbatches == 2)


def test_a_qwen3_moe_model_on_expert_ranks_gives_the_single_rank_tokens(tiny_model):
    model_dir = tiny_model("qwen3_moe", seed=3)
    prompts = _prompts(seed=1)[:8]
    assert _run(model_dir, prompts, parallel="attn=DP2 moe=EP2 disagg") == _run(model_dir, prompts)


def test_int8_weights_on_both_roles_follow_the_single_rank_int8_engine(reference):
    """W8A8 on the attention and the expert ranks: the expert ranks' partial sums add up in another order than
    one rank's sum over k experts, so a late near-tie may go the other way; the first half of every output must
    be the single rank's, and most outputs whole."""
    model_dir, prompts, _ = reference
    prompts = prompts[:8]
    single = _run(model_dir, prompts, quantization="int8")
    disaggregated = _run(model_dir, prompts, quantization="int8", parallel="attn=DP2 moe=EP2 disagg")
    assert all(ours[:OUTPUT_LEN // 2] == theirs[:OUTPUT_LEN // 2] for ours, theirs in zip(disaggregated, single))
    assert sum(ours == theirs for ours, theirs in zip(disaggregated, single)) >= len(prompts) - 1


async def _generate(client: AsyncEngineClient, prompts, tag: str) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in client.generate(None, prompt, GREEDY, f"{tag}-{i}"):
            tokens = out.outputs[0].token_ids
        return tokens
    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def test_expert_moves_and_killed_ranks_keep_the_single_rank_tokens(reference):
    """Redundant slots on the expert ranks, a rebalance planned from the attention ranks' load, then a kill -9 of
    an expert rank, later of an attention rank, while 16 requests stream: the ranks restart with the moved
    placement and every request ends with the single rank's tokens."""
    model_dir, prompts, expected = reference
    config = EngineConfig.from_kwargs(str(model_dir), parallel="attn=DP2 moe=EP2 disagg", eplb_redundant_experts=1,
                                      eplb_slice_s=0.5, **ENGINE_ARGS)

    async def scenario():
        client = AsyncEngineClient(config, log_level=logging.WARNING)
        try:
            assert await _generate(client, prompts, "off") == expected
            load = await client.admin("eplb.load")
            assert load.ok, load.error
            assert sum(sum(sum(row) for row in rank) for rank in load.data.counts) > 0  # the attention ranks count
            reply = await client.admin("eplb.rebalance")
            assert reply.ok, reply.error
            status = await wait_until_idle(client)
            assert status["num_reconfigurations"] == 1 and status["last_error"] is None
            placement = ExpertPlacement.from_dict(status["placement"])
            assert any(len(r) > 1 for layer in placement.layers for r in placement.replicas(layer))
            assert await _generate(client, prompts, "moved") == expected
            # rank 3 is the second expert rank (ranks 0-1 attend, 2-3 hold experts)
            inject = await client.admin("fault.inject", {"fault": {"kind": "kill", "rank": 3, "after_steps": 4}})
            assert inject.ok, inject.error
            started = time.monotonic()
            assert await _generate(client, prompts, "killed") == expected
            print(f"\n16 requests through a kill -9 of an expert rank: {time.monotonic() - started:.1f} s")
            assert (await client.admin("stats")).data.stats.num_recoveries == 1
            # and an attention rank: its DP group's requests continue from their tokens on the restarted ranks
            inject = await client.admin("fault.inject", {"fault": {"kind": "kill", "rank": 1, "after_steps": 4}})
            assert inject.ok, inject.error
            assert await _generate(client, prompts, "attention-killed") == expected
            assert (await client.admin("stats")).data.stats.num_recoveries == 2
            kept = await client.admin("eplb.status")
            assert ExpertPlacement.from_dict(kept.to_json()["placement"]).layers == placement.layers
        finally:
            client.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize(("layout", "setting"), [
    ("attn=DP2 moe=EP32 disagg", "moe=EP32"),  # the tiny model has 16 routed experts
    ("attn=DP2 moe=TP256+EP1 disagg", "moe=TP256"),  # its experts' intermediate size is 128
])
def test_a_role_layout_the_model_cannot_fill_is_refused_before_any_rank_starts(reference, layout, setting):
    model_dir, _, _ = reference
    with pytest.raises(EngineStartupError, match=setting) as err:
        LLM(model=str(model_dir), parallel=layout)
    assert "\n" not in str(err.value)
