"""Greedy generation through the whole engine (master + worker processes) equals HF `generate`."""
from __future__ import annotations

import pytest
import torch

from meshserve import LLM, SamplingParams

OUTPUT_LEN = 24


def _prompts(vocab: int, lengths: list[int], seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = prefix or []
    return [prefix + torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding, so the reference is exact
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def model_case(request, tiny_model):
    arch = request.param
    model_dir = tiny_model(arch, seed=1)
    prompts = _prompts(32000, [5, 17, 33, 64, 9, 120, 48, 71, 2, 90])
    return arch, model_dir, prompts, _hf_greedy(model_dir, prompts, OUTPUT_LEN)


GREEDY = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "serial"])
def test_concurrent_chunked_prefill_matches_hf(model_case, async_scheduling):
    _, model_dir, prompts, expected = model_case
    with LLM(model=str(model_dir), max_num_batched_tokens=48, block_size=8, max_num_seqs=16,
             async_scheduling=async_scheduling) as llm:
        outs = llm.generate(prompts, GREEDY)
    for out, ref in zip(outs, expected):
        assert out.token_ids == ref
        assert out.finish_reason == "length"


def test_preemption_keeps_outputs_exact(model_case):
    _, model_dir, prompts, expected = model_case
    # 40 blocks of 8 tokens: far less than the ~110 blocks all ten requests need at once
    with LLM(model=str(model_dir), num_kv_blocks=40, block_size=8, max_num_batched_tokens=64,
             max_num_seqs=10) as llm:
        outs = llm.generate(prompts, GREEDY)
        stats = llm.get_stats()
    assert stats.num_preemptions > 0
    for out, ref in zip(outs, expected):
        assert out.token_ids == ref


def test_shared_prefix_hits_cache_and_output_is_unchanged(model_case, tmp_path):
    arch, model_dir, _, _ = model_case
    shared = _prompts(32000, [64], seed=7)[0]
    prompts = _prompts(32000, [6, 11], seed=8, prefix=shared)
    expected = _hf_greedy(model_dir, prompts, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(model_dir), block_size=8) as llm:
        first = llm.generate([prompts[0]], params)[0]
        second = llm.generate([prompts[1]], params)[0]
        stats = llm.get_stats()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64  # the shared 64-token prefix is 8 full blocks
    assert stats.prefix_cache_hits >= 64
    assert [first.token_ids, second.token_ids] == expected
