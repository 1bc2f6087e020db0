"""The INT8 arithmetic of W8A8: symmetric per-output-channel weights, symmetric per-token activations.

Scales are absmax / 127 (a weight row's absmax times its clip ratio), values are rounded half to even
(`torch.round`) and clamped to [-127, 127]; a zero row gets scale 1 (its codes are all zero anyway).
"""
from __future__ import annotations

import torch

QMAX = 127


def weight_scale(weight: torch.Tensor, clip: torch.Tensor | float | None = None) -> torch.Tensor:
    """Per-output-channel scales [out, 1] (float32) of a 2-D weight, optionally clipped per row."""
    amax = weight.detach().abs().amax(dim=1, keepdim=True).float()
    if clip is not None:
        clip = torch.as_tensor(clip, dtype=torch.float32, device=weight.device)
        amax = amax * (clip.reshape(-1, 1) if clip.dim() else clip)
    scale = amax / QMAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_with_scale(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes of `weight` [out, in] for the per-row `scale` [out, 1]."""
    return torch.clamp(torch.round(weight.float() / scale), -QMAX, QMAX).to(torch.int8)


def quantize_weight(weight: torch.Tensor, clip: torch.Tensor | float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [out, in], float32 scales [out, 1]) of a 2-D weight."""
    scale = weight_scale(weight, clip)
    return quantize_with_scale(weight, scale), scale


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scale.float()).to(dtype)


def fake_quantize_weight(weight: torch.Tensor, clip: torch.Tensor | float | None = None) -> torch.Tensor:
    """The weight the int8 codes stand for, in the weight's dtype."""
    codes, scale = quantize_weight(weight, clip)
    return dequantize_weight(codes, scale, weight.dtype)


def fake_quantize_activation(x: torch.Tensor) -> torch.Tensor:
    """Per-token (last dimension) symmetric int8 quantize-dequantize, in x's dtype."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.clamp(torch.round(xf / scale), -QMAX, QMAX) * scale).to(x.dtype)
