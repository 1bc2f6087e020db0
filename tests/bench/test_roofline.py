import math
from types import SimpleNamespace

import pytest
import torch

from meshserve.bench.roofline import (
    DecodeStepCost,
    RooflineConfigError,
    decode_step_cost,
    expected_active_experts,
    footprint_from_config,
    measure_decode_throughput,
    measure_matmul_rate,
    measure_memory_bandwidth,
    roofline_bound,
)

# Small enough to count by hand: H=8, V=10, layer 0 dense, layer 1 MoE (4 experts, top-2, one shared).
TINY_MLA = {
    "model_type": "deepseek_v3", "hidden_size": 8, "vocab_size": 10, "num_hidden_layers": 2,
    "num_attention_heads": 2, "qk_nope_head_dim": 2, "qk_rope_head_dim": 1, "v_head_dim": 2,
    "kv_lora_rank": 3, "q_lora_rank": None, "intermediate_size": 4, "moe_intermediate_size": 2,
    "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "tie_word_embeddings": False,
}
# Dense GQA, tied embeddings: H=8, 2 query heads, 1 KV head, head_dim 4.
TINY_GQA = {
    "model_type": "qwen3", "hidden_size": 8, "vocab_size": 10, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 4,
    "tie_word_embeddings": True,
}


def test_mla_footprint_by_hand():
    fp = footprint_from_config(TINY_MLA)
    # attention per layer: q_proj 8*2*3 + kv_a 8*(3+1) + kv_a_norm 3 + kv_b 3*2*(2+2) + o 2*2*8 + two norms 2*8
    attention = 48 + 32 + 3 + 24 + 32 + 16
    dense_mlp = 3 * 8 * 4
    expert = 3 * 8 * 2
    router = 4 * 8 + 4  # gate weight + score correction bias
    shared = expert
    head = 10 * 8 + 8  # lm_head + final norm
    assert fp.per_token_params == 2 * attention + dense_mlp + router + shared + head == 578
    assert fp.active_params_per_token == 578 + 2 * expert
    assert fp.total_params == 578 + 10 * 8 + 4 * expert
    assert (fp.num_moe_layers, fp.num_experts, fp.experts_per_token, fp.params_per_expert) == (1, 4, 2, expert)
    assert fp.kv_elements_per_token_per_layer == 3 + 1  # latent + rope key
    assert fp.attention_flops_per_position_per_layer == 2 * (2 * 4 + 2 * 3)


def test_mla_decode_cost_by_hand():
    fp = footprint_from_config(TINY_MLA)
    cost = decode_step_cost(fp, batch=2, context_len=5, weight_bytes_per_param=4, kv_bytes_per_element=4)
    active = 4 * (1 - (1 - 2 / 4) ** 2)
    assert cost.expected_active_experts_per_layer == pytest.approx(active) == pytest.approx(3.0)
    weights = 578 + 2 * 8 + 1 * 3 * 48  # every-token weights + 2 embedding rows + 3 distinct experts
    assert cost.weight_bytes == pytest.approx(4 * weights)
    assert cost.kv_cache_bytes == pytest.approx(4 * 2 * 5 * 4 * 2)  # B * L * (latent+rope) * layers
    assert cost.flops == pytest.approx(2 * (2 * 674 + 5 * 2 * 28))
    assert cost.total_bytes == pytest.approx(cost.weight_bytes + cost.kv_cache_bytes)


def test_gqa_tied_cost_by_hand():
    fp = footprint_from_config(TINY_GQA)
    attention = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 4 + 4 + 2 * 8  # q, k, v, o, q_norm, k_norm, two norms
    per_token = attention + 3 * 8 * 4 + 10 * 8 + 8
    assert fp.per_token_params == per_token == 400
    assert fp.total_params == 400  # the tied embedding is the LM head
    cost = decode_step_cost(fp, batch=3, context_len=10, weight_bytes_per_param=2, kv_bytes_per_element=2)
    assert cost.weight_bytes == 2 * 400  # no separate embedding rows, no experts
    assert cost.kv_cache_bytes == 2 * 3 * 10 * (2 * 1 * 4) * 1
    assert cost.flops == 3 * (2 * 400 + 10 * 1 * (4 * 2 * 4))


def test_expected_active_experts_limits():
    assert expected_active_experts(8, 2, 1) == pytest.approx(2.0)  # one token: exactly k
    assert expected_active_experts(8, 8, 3) == pytest.approx(8.0)  # k = E: all of them
    assert expected_active_experts(256, 8, 10_000) == pytest.approx(256.0)  # saturates at E
    assert expected_active_experts(0, 0, 5) == 0.0
    with pytest.raises(RooflineConfigError):
        expected_active_experts(4, 5, 1)


def _hf_model(config_dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**config_dict)
    return AutoModelForCausalLM.from_config(config)


HF_CONFIGS = [
    dict(model_type="deepseek_v3", hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
         num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
         topk_group=1, n_shared_experts=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12,
         kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, vocab_size=50),
    dict(model_type="deepseek_v3", hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
         num_hidden_layers=2, first_k_dense_replace=0, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
         topk_group=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=8,
         qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, vocab_size=50, attention_bias=True),
    dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
         num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=8, vocab_size=50, mlp_only_layers=[0]),
    dict(model_type="qwen3", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=8, vocab_size=50, attention_bias=True, tie_word_embeddings=True),
]


@pytest.mark.parametrize("config_dict", HF_CONFIGS, ids=lambda c: c["model_type"])
def test_total_params_match_hf_transformers(config_dict):
    model = _hf_model(config_dict)
    hf_total = sum(p.numel() for p in model.parameters())
    # DeepSeek's e_score_correction_bias is a buffer in HF, a parameter in the checkpoint.
    hf_total += sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    config = model.config.to_dict()
    assert footprint_from_config(config).total_params == hf_total


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(RooflineConfigError, match="llama"):
        footprint_from_config({"model_type": "llama"})
    with pytest.raises(RooflineConfigError, match="kv_lora_rank"):
        footprint_from_config({k: v for k, v in TINY_MLA.items() if k != "kv_lora_rank"})


def test_roofline_bound_picks_the_slower_side():
    cost = DecodeStepCost(batch=4, context_len=1, weight_bytes=3e9, kv_cache_bytes=1e9, flops=2e9,
                          expected_active_experts_per_layer=0.0)
    memory_bound = roofline_bound(cost, bandwidth_gbps=2.0, matmul_gflops=100.0)  # 2 s vs 0.02 s
    assert memory_bound.limited_by == "memory"
    assert memory_bound.memory_time_s == pytest.approx(2.0)
    assert memory_bound.tokens_per_s == pytest.approx(4 / 2.0)
    compute_bound = roofline_bound(cost, bandwidth_gbps=100.0, matmul_gflops=0.5)  # 0.04 s vs 4 s
    assert compute_bound.limited_by == "compute"
    assert compute_bound.tokens_per_s == pytest.approx(4 / 4.0)


class FakeLLM:
    """generate() stamps tokens on a virtual timeline: one prefill step, then a fixed cost per decode step."""

    def __init__(self, prefill_s, decode_step_s):
        self.prefill, self.step = prefill_s, decode_step_s
        self.now = 100.0
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((prompts, params))
        first = self.now + self.prefill
        last = first + self.step * (params.max_tokens - 1)
        self.now = last + 1.0
        metrics = SimpleNamespace(first_token_time=first, last_token_time=last)
        return [SimpleNamespace(token_ids=[7] * params.max_tokens, metrics=metrics) for _ in prompts]


def test_measure_decode_throughput_isolates_decode_steps():
    llm = FakeLLM(prefill_s=3.0, decode_step_s=0.05)
    result = measure_decode_throughput(llm, batch=4, context_len=6, decode_tokens=10, vocab_size=100, repeats=3)
    # 4 sequences advance one token per 0.05 s step, whatever the prefill costs
    assert result.tokens_per_s == pytest.approx(4 / 0.05)
    assert len(result.samples) == 3
    assert result.decode_window_s == pytest.approx([0.5] * 3)
    assert [p.max_tokens for _, p in llm.calls] == [11] * 3
    for prompts, params in llm.calls:
        assert len(prompts) == 4 and all(len(p) == 6 for p in prompts)
        assert params.ignore_eos and params.greedy
    # every run uses fresh prompts, so a prefix cache cannot shorten the prefill
    all_prompts = [tuple(p) for prompts, _ in llm.calls for p in prompts]
    assert len(set(all_prompts)) == len(all_prompts)


def test_measure_decode_throughput_rejects_short_outputs():
    llm = FakeLLM(0.0, 0.01)
    llm.generate = lambda prompts, params: [SimpleNamespace(token_ids=[1])] * len(prompts)
    with pytest.raises(RuntimeError, match="expected 9 tokens"):
        measure_decode_throughput(llm, batch=2, context_len=3, decode_tokens=8, vocab_size=50, repeats=1)


def test_machine_measurements_are_positive_and_finite():
    bandwidth = measure_memory_bandwidth(num_bytes=4 * 2**20, repeats=3)
    rate = measure_matmul_rate(size=128, repeats=3)
    assert 0 < bandwidth < math.inf
    assert 0 < rate < math.inf
    assert torch.get_num_threads() >= 1
