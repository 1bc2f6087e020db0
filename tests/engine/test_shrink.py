"""Decode vertical shrink (xdeepserve §6.2 stage 2): when an EP rank of a DP4+EP4 TE dies, the TE goes on at
once on the 3 ranks left (3 DP groups, 3 EP ranks, every expert kept by an EPLB shrink placement), its
requests continue from their tokens so far, and it grows back to 4 ranks later. Greedy outputs equal the
single-rank engine's throughout."""
from __future__ import annotations

import time

import pytest

from meshserve import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [9, 3, 1, 4], [11, 12], [2, 8, 8, 8, 3], [4, 4, 1], [13, 2, 7, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    # 8 routed experts: they split evenly over 4 ranks, not over the 3 left
    return str(tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2, "n_routed_experts": 8}))


def _experts_present(llm: LLM) -> list[set[int]]:
    """Per MoE layer, the experts some slot of the placement the ranks serve holds."""
    layers = llm.admin("eplb.status")["placement"]["layers"]
    return [{expert for expert in slots if expert >= 0} for slots in layers.values()]


def test_a_dead_ep_rank_shrinks_the_te_and_it_grows_back(model_dir, monkeypatch):
    single = LLM(model=model_dir, kv_cache_memory_gb=0.05)
    try:
        reference = [out.outputs[0].token_ids for out in single.generate(PROMPTS, GREEDY)]
    finally:
        single.shutdown()
    monkeypatch.setenv("MESHSERVE_FAULTS", "kill:rank=2:after_steps=8")
    llm = LLM(model=model_dir, kv_cache_memory_gb=0.05, parallel="attn=TP1+DP4 moe=TP1+EP4",
              eplb_redundant_experts=1, on_rank_failure="shrink", regrow_after_s=15.0)
    monkeypatch.delenv("MESHSERVE_FAULTS")
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [out.outputs[0].token_ids for out in outs] == reference
        stats = llm.get_stats()
        assert stats.num_recoveries == 1 and "died" in (stats.last_failure or "")
        assert stats.world_size == 3  # shrunk: going on without the dead rank
        assert all(present == set(range(8)) for present in _experts_present(llm))  # every expert kept a replica
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)] == reference
        deadline = time.monotonic() + 120
        while llm.get_stats().world_size != 4:  # grows back after regrow_after_s
            assert time.monotonic() < deadline, "the TE did not grow back to 4 ranks"
            time.sleep(0.5)
        assert llm.get_stats().num_recoveries == 2
        assert all(present == set(range(8)) for present in _experts_present(llm))
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)] == reference
    finally:
        llm.shutdown()
