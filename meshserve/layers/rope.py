"""Rotary position embedding: default RoPE and YaRN scaling.

`rope_parameters` follows the HF dict: {"rope_type": "default"|"yarn", "rope_theta": ..., ...}.
Legacy configs (`rope_theta` + `rope_scaling`) are normalised by `standardize_rope_parameters`.
"""
from __future__ import annotations

import math

import torch

from meshserve.layers import cpu_kernels


def standardize_rope_parameters(hf_config: dict) -> dict:
    """One rope dict from either `rope_parameters` or legacy `rope_theta` / `rope_scaling`."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k != "type"})
    if "type" in scaling and "rope_type" not in params:
        params["rope_type"] = scaling["type"]
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extended `scale` times (1.0 when not extended)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(rope_parameters: dict, max_position_embeddings: int) -> float:
    """The context-extension factor; DeepSeek-style configs may leave it to max/original positions."""
    factor = rope_parameters.get("factor")
    if factor is None:
        factor = max_position_embeddings / rope_parameters["original_max_position_embeddings"]
    return float(factor)


def _yarn_inv_freq(rotary_dim: int, rope_parameters: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    if "original_max_position_embeddings" not in rope_parameters:
        raise ValueError(f"yarn rope parameters need 'original_max_position_embeddings'; got {sorted(rope_parameters)}")
    base = float(rope_parameters["rope_theta"])
    factor = yarn_factor(rope_parameters, max_position_embeddings)
    original_max = rope_parameters["original_max_position_embeddings"]

    attention_factor = rope_parameters.get("attention_factor")
    mscale = rope_parameters.get("mscale")
    mscale_all_dim = rope_parameters.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rope_parameters.get("beta_fast") or 32
    beta_slow = rope_parameters.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # the rotary dimension whose wavelength completes `num_rotations` turns over the original context
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    # high-frequency dims (ramp 0) keep their original frequency, low-frequency dims are interpolated
    extrapolation_weight = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation_weight) + inv_freq_extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def compute_inv_freq(rotary_dim: int, rope_parameters: dict,
                     max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] and the cos/sin scale (YaRN's attention factor; 1.0 otherwise)."""
    base = float(rope_parameters["rope_theta"])
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        return inv_freq, 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, rope_parameters, max_position_embeddings)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: default, yarn)")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of x; cos/sin [..., rotary_dim // 2] must already broadcast against x.

    The interleaved output is laid out evens-rotated then odds-rotated, as HF's
    `apply_rotary_pos_emb_interleave` does.
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """In place: x = apply_rotary(x, cos, sin) for x [T, R] or [T, H, R] and cos/sin [T, R/2]; returns x."""
    if (x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.stride(-1) == 1
            and cos.is_contiguous() and sin.is_contiguous() and cpu_kernels.enabled()):
        return cpu_kernels.rotary_(x, cos, sin, interleaved)  # one op instead of eight small ones
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x.copy_(apply_rotary(x, cos, sin, interleaved))


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to q [T, Hq, rotary_dim] and k [T, Hk, rotary_dim] at given positions [T].

    `interleaved=False`: rotate-half layout (Llama/Qwen). `interleaved=True`: pairs (x0,x1),(x2,x3)...
    rotate together (DeepSeek's rope dims; HF `rope_interleave`); the output is laid out like HF's
    `apply_rotary_pos_emb_interleave` (evens-rotated then odds-rotated).
    """

    def __init__(self, rotary_dim: int, rope_parameters: dict, max_position_embeddings: int,
                 interleaved: bool = False) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(rotary_dim, rope_parameters, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, rotary_dim/2]
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos.unsqueeze(1), sin.unsqueeze(1), self.interleaved)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
