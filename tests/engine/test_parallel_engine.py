"""Every parallel layout of the engine against the single-rank engine (the oracle for parallel paths).

8 prompts x 32 greedy tokens through the whole engine (master + N worker processes over gloo):
the tokens must be identical and the log-probabilities of the chosen and top-5 tokens (the
log-softmax of the logits) within 1e-3.
"""
from __future__ import annotations

import os

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.engine.core_client import EngineStartupError
from meshserve.utils import envs
from meshserve.utils.core_pinning import rank_cores
from meshserve.utils.processes import rank_processes

NUM_PROMPTS = 8
OUTPUT_LEN = 32
LOGPROB_TOL = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True, logprobs=5)
# small steps so prefill is chunked and decodes mix with prefills, as in serving
ENGINE_ARGS = dict(max_num_batched_tokens=64, block_size=8, max_num_seqs=8, num_kv_blocks=128)

LAYOUTS = {
    "TP2": dict(parallel="attn=TP2+DP1 moe=TP2+EP1"),
    "DP2+EP2": dict(parallel="attn=TP1+DP2 moe=TP1+EP2"),
    "DP4+EP4": dict(parallel="attn=TP1+DP4 moe=TP1+EP4"),
    "TP2+EP2-hybrid-fused": dict(parallel="attn=TP2+DP2 moe=TP2+EP2", moe_comm="fused"),
    "TP2+EP2-hybrid-sync": dict(parallel="attn=TP2+DP2 moe=TP2+EP2", moe_comm="sync"),
}
# DeepSeek-V3 only: each step with two or more tokens in a DP group runs as two overlapped micro-batches
MICROBATCH_LAYOUTS = {
    "DP2+EP2-two-microbatches": dict(parallel="attn=TP1+DP2 moe=TP1+EP2", microbatches=2, microbatch_min_tokens=2),
    "DP4+EP4-two-microbatches": dict(parallel="attn=TP1+DP4 moe=TP1+EP4", microbatches=2, microbatch_min_tokens=2),
}

# DeepSeek-V3 only (qwen3 models have no MLA and refuse it): MLA per DP group at attention TP1, o_proj shared over
# both ranks (xDeepServe Fig. 10)
OPROJ_LAYOUTS = {
    "DP2+EP2-oproj-TP2": dict(parallel="attn=TP1+DP2 oproj=TP2 moe=TP1+EP2"),
    "DP2+EP2-oproj-TP2-two-microbatches": dict(parallel="attn=TP1+DP2 oproj=TP2 moe=TP1+EP2", microbatches=2,
                                               microbatch_min_tokens=2),
}


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 70, 17, 33, 9, 120, 48, 2]
    return [torch.randint(100, 31900, (n,), generator=g).tolist() for n in lengths[:NUM_PROMPTS]]


def _run(model_dir, prompts, params=GREEDY, **engine_args):
    with LLM(model=str(model_dir), **ENGINE_ARGS, **engine_args) as llm:
        return [out.outputs[0] for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def reference(request, tiny_model):
    model_dir = tiny_model(request.param, seed=3)
    prompts = _prompts()
    return model_dir, prompts, _run(model_dir, prompts)


def _assert_same(outs, refs):
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == "length"
        assert len(out.logprobs) == len(ref.logprobs) == OUTPUT_LEN
        for pos, ref_pos in zip(out.logprobs, ref.logprobs):
            assert pos.chosen.logprob == pytest.approx(ref_pos.chosen.logprob, abs=LOGPROB_TOL)
            ours = {t.token_id: t.logprob for t in pos.top}
            theirs = {t.token_id: t.logprob for t in ref_pos.top}
            shared = ours.keys() & theirs.keys()
            assert len(shared) >= 4  # a near-tie may swap the 5th alternative
            for token in shared:
                assert ours[token] == pytest.approx(theirs[token], abs=LOGPROB_TOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(reference, layout):
    model_dir, prompts, refs = reference
    _assert_same(_run(model_dir, prompts, **LAYOUTS[layout]), refs)


def test_dp2_with_an_idle_dp_group_matches_single_rank(reference):
    """One request at a time: one DP group always runs, the other only joins the MoE collectives."""
    model_dir, prompts, refs = reference
    with LLM(model=str(model_dir), **ENGINE_ARGS, parallel="attn=TP1+DP2 moe=TP1+EP2") as llm:
        outs = [llm.generate([p], GREEDY)[0].outputs[0] for p in prompts[:2]]
    _assert_same(outs, refs[:2])


@pytest.mark.parametrize("reference", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize("layout", list(MICROBATCH_LAYOUTS))
def test_two_microbatches_match_single_rank(reference, layout):
    model_dir, prompts, refs = reference
    with LLM(model=str(model_dir), **ENGINE_ARGS, **MICROBATCH_LAYOUTS[layout]) as llm:
        outs = [out.outputs[0] for out in llm.generate(prompts, GREEDY)]
        stats = llm.get_stats()
    _assert_same(outs, refs)
    assert stats.microbatched_steps > OUTPUT_LEN // 2  # most steps ran split


# DeepSeek-V3 only (it has shared experts): the shared experts on an EP rank of their own, dispatched like the
# routed ones; the 16 routed experts over 3 routed ranks split unevenly
SHARED_RANK_LAYOUTS = {
    "DP4+EP4-shared-EP1": dict(parallel="attn=TP1+DP4 moe=TP1+EP4 shared=EP1"),
}


@pytest.mark.parametrize("reference", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize("layout", list(SHARED_RANK_LAYOUTS))
def test_shared_expert_ranks_match_single_rank(reference, layout):
    model_dir, prompts, refs = reference
    _assert_same(_run(model_dir, prompts, **SHARED_RANK_LAYOUTS[layout]), refs)


def test_a_model_without_mla_refuses_a_shared_oproj_at_start(tiny_model):
    model_dir = tiny_model("qwen3_moe", overrides={"num_hidden_layers": 1})
    with pytest.raises(EngineStartupError, match="oproj=TP2 shares the output projection of MLA attention") as err:
        LLM(model=str(model_dir), **ENGINE_ARGS, parallel=OPROJ_LAYOUTS["DP2+EP2-oproj-TP2"]["parallel"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("reference", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize("layout", list(OPROJ_LAYOUTS))
def test_shared_oproj_layout_matches_single_rank(reference, layout):
    model_dir, prompts, refs = reference
    _assert_same(_run(model_dir, prompts, **OPROJ_LAYOUTS[layout]), refs)


@pytest.mark.parametrize("reference", ["deepseek_v3"], indirect=True)  # the settings touch no model code
def test_scheduled_gc_on_pinned_ranks_changes_no_token(reference):
    """Garbage collection every 2 steps on ranks pinned to cores of their own (xdeepserve §4.4): the same tokens,
    the steps marked, each rank on its slice of the cores."""
    model_dir, prompts, refs = reference
    with LLM(model=str(model_dir), **ENGINE_ARGS, parallel="attn=TP1+DP2 moe=TP1+EP2", gc_collect_every_steps=2,
             pin_cores=True) as llm:
        threads = llm.config.parallel_config.num_threads or envs.num_threads() or max(1, os.cpu_count() // 2)
        pinned = {rank: os.sched_getaffinity(pid) for rank, pid in rank_processes(llm.engine.proc.pid).items()}
        outs = [out.outputs[0] for out in llm.generate(prompts[:4], GREEDY)]  # both DP groups busy
        marked = llm.get_stats().gc_marked_steps
    _assert_same(outs, refs[:4])
    assert marked >= OUTPUT_LEN // 2  # at least one step per output token, every second one marked
    available = os.sched_getaffinity(0)
    assert pinned == {rank: set(rank_cores(rank, threads, available)) for rank in (0, 1)}


# ---------------------------------------------------------------- MTP speculative decoding (issue 15)
# the single-rank engine without speculation stays the oracle; the tiny model's MTP layer is random, so nearly
# every draft is rejected: each step verifies two drafts over the paged cache, rolls them back and drafts again
SPEC = dict(speculative="mtp", num_speculative_tokens=2)
SPEC_LAYOUTS = ("TP2", "DP2+EP2", "DP2+EP2-oproj-TP2")


@pytest.mark.parametrize("reference", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize("layout", SPEC_LAYOUTS)
def test_layout_with_mtp_matches_single_rank_without(reference, layout):
    model_dir, prompts, refs = reference
    _assert_same(_run(model_dir, prompts, **{**LAYOUTS, **OPROJ_LAYOUTS}[layout], **SPEC), refs)


@pytest.mark.parametrize("reference", ["deepseek_v3"], indirect=True)
def test_two_microbatches_with_mtp_match_single_rank_without(reference):
    """Verification steps split too: a request's draft rows may fall in both halves, the second half's rows
    reading the cache entries the first half's wrote earlier in the same layer."""
    model_dir, prompts, refs = reference
    with LLM(model=str(model_dir), **ENGINE_ARGS, **MICROBATCH_LAYOUTS["DP2+EP2-two-microbatches"], **SPEC) as llm:
        outs = [out.outputs[0] for out in llm.generate(prompts, GREEDY)]
        stats = llm.get_stats()
    _assert_same(outs, refs)
    assert stats.microbatched_steps > 0 and stats.spec_verify_steps > 0


@pytest.mark.parametrize("reference", ["deepseek_v3"], indirect=True)
def test_dp2_with_an_idle_dp_group_and_mtp_matches_single_rank_without(reference):
    """The idle DP group joins the MoE collectives of the main model's forward and of every MTP forward."""
    model_dir, prompts, refs = reference
    with LLM(model=str(model_dir), **ENGINE_ARGS, parallel="attn=TP1+DP2 moe=TP1+EP2", **SPEC) as llm:
        outs = [llm.generate([p], GREEDY)[0].outputs[0] for p in prompts[:2]]
        stats = llm.get_stats()
    _assert_same(outs, refs[:2])
    assert stats.spec_verify_steps > 0 and stats.spec_tokens == stats.spec_verify_steps + sum(stats.spec_accepted)
