"""RoPE / YaRN against transformers' own rope functions."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from meshserve.layers.rope import RotaryEmbedding, compute_inv_freq, standardize_rope_parameters

YARN_CONFIGS = {
    # (rotary dim, max_position_embeddings, rope parameters)
    "small_mscale_equal": (8, 512, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "deepseek_v3": (64, 163840, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 4096}),
    "kimi_k2": (64, 131072, {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096}),
    "mscale_ratio": (16, 4096, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "mscale": 0.707,
                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 512}),
    "factor_only": (32, 32768, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                "original_max_position_embeddings": 8192}),
    "untruncated": (32, 32768, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "truncate": False,
                                "original_max_position_embeddings": 8192}),
    "explicit_attention_factor": (16, 2048, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                             "attention_factor": 0.9, "original_max_position_embeddings": 1024}),
}


def hf_config(rotary_dim: int, max_positions: int, rope_parameters: dict) -> transformers.DeepseekV3Config:
    # DeepseekV3Config sets head_dim = qk_rope_head_dim, which is what the rope functions read
    return transformers.DeepseekV3Config(qk_rope_head_dim=rotary_dim, max_position_embeddings=max_positions,
                                         rope_parameters=dict(rope_parameters))


@pytest.mark.parametrize("name", list(YARN_CONFIGS))
def test_yarn_matches_transformers(name):
    dim, max_pos, params = YARN_CONFIGS[name]
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(dim, max_pos, params))
    inv_freq, factor = compute_inv_freq(dim, params, max_pos)
    assert inv_freq.shape == (dim // 2,)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)


def test_yarn_changes_low_frequencies_only():
    dim, max_pos, params = YARN_CONFIGS["deepseek_v3"]
    yarn, _ = compute_inv_freq(dim, params, max_pos)
    plain, _ = compute_inv_freq(dim, {"rope_type": "default", "rope_theta": params["rope_theta"]}, max_pos)
    assert torch.equal(yarn[:4], plain[:4])  # fast dims are extrapolated unchanged
    torch.testing.assert_close(yarn[-4:], plain[-4:] / params["factor"])  # slow dims are interpolated


def test_legacy_rope_scaling_is_standardized_like_transformers():
    legacy = {"rope_theta": 10000, "max_position_embeddings": 163840, "qk_rope_head_dim": 64,
              "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
    params = standardize_rope_parameters(legacy)
    assert params["rope_type"] == "yarn" and "type" not in params
    ref_config = transformers.DeepseekV3Config(**legacy)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](ref_config)
    inv_freq, factor = compute_inv_freq(64, params, 163840)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor)


def test_default_rope_matches_transformers():
    config = hf_config(16, 2048, {"rope_type": "default", "rope_theta": 500000.0})
    ref_inv_freq, _ = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding \
        .compute_default_rope_parameters(config)
    inv_freq, factor = compute_inv_freq(16, {"rope_type": "default", "rope_theta": 500000.0}, 2048)
    assert torch.equal(inv_freq, ref_inv_freq) and factor == 1.0


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_embedding_matches_transformers_layouts(interleaved):
    dim, max_pos, params = YARN_CONFIGS["mscale_ratio"]
    rope = RotaryEmbedding(dim, params, max_pos, interleaved=interleaved)
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 700, 4000])
    q = torch.randn(4, 3, dim, generator=g)
    k = torch.randn(4, 1, dim, generator=g)
    q_out, k_out = rope(positions, q, k)
    # HF: cos/sin are cat(freqs, freqs) * attention factor, tensors laid out [batch, heads, seq, dim]
    freqs = positions.float().unsqueeze(-1) * rope.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * rope.attention_scaling, emb.sin() * rope.attention_scaling
    apply = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    ref_q, ref_k = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(q_out, ref_q[0].transpose(0, 1))
    torch.testing.assert_close(k_out, ref_k[0].transpose(0, 1))
    assert rope.attention_scaling != 1.0


def test_bad_rope_parameters_raise():
    with pytest.raises(NotImplementedError, match="longrope"):
        compute_inv_freq(8, {"rope_type": "longrope", "rope_theta": 10000.0}, 512)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        compute_inv_freq(8, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, 512)
