"""GPTQ (Frantar et al., 2023) for per-channel symmetric INT8 weights, with a clipping search first.

For a linear with calibration inputs X the layer-wise objective is ||W X^T - Q X^T||^2; its Hessian in W is
H = 2 X^T X / n. `search_clip` picks each output channel's clip ratio c (scale = c * absmax / 127) from a
grid by that objective for plain rounding, trace((W - Q_c) H (W - Q_c)^T) row by row. `gptq` then
quantizes column after column with those fixed scales and spreads each column's rounding error over the
columns not yet quantized, through the upper Cholesky factor of H^-1 (dampened by 1% of its mean diagonal),
in blocks of 128 columns with lazy batch updates of the rest. Everything is batched over a leading
dimension, so a layer's routed experts run as one batch.
"""
from __future__ import annotations

import torch

from meshserve.quant.int8 import QMAX

CLIP_GRID = tuple(round(1.0 - 0.02 * i, 2) for i in range(8))  # 1.00, 0.98, ..., 0.86 (smaller clips: < 0.2% of rows)
DAMP = 0.01
BLOCK = 128


def hessian(x: torch.Tensor) -> torch.Tensor:
    """2 X^T X / n of inputs x [n, in] (float64 accumulation, float32 result)."""
    x = x.reshape(-1, x.shape[-1]).double()
    return (2.0 / max(x.shape[0], 1) * (x.T @ x)).float()


def _scales(weight: torch.Tensor, clip: torch.Tensor | float) -> torch.Tensor:
    amax = weight.abs().amax(dim=-1, keepdim=True)
    if isinstance(clip, torch.Tensor):
        amax = amax * clip.unsqueeze(-1)
    else:
        amax = amax * clip
    scale = amax / QMAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _fake(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(weight / scale), -QMAX, QMAX) * scale


def search_clip(weight: torch.Tensor, h: torch.Tensor, grid: tuple[float, ...] = CLIP_GRID) -> torch.Tensor:
    """Per-row clip ratios [B, out] of weights [B, out, in] minimizing diag(D H D^T), D = W - Q_c(W)."""
    weight = weight.float()
    best = torch.ones(weight.shape[:2])
    best_err = torch.full(weight.shape[:2], float("inf"))
    for c in grid:
        d = weight - _fake(weight, _scales(weight, c))
        err = ((d @ h) * d).sum(dim=-1)
        better = err < best_err
        best = torch.where(better, torch.full_like(best, c), best)
        best_err = torch.where(better, err, best_err)
    return best


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1 per batch item, dampening more if needed."""
    h = h.clone()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    diag[diag <= 0] = 1.0  # inputs never seen: any error there costs nothing on the calibration set
    eye = torch.eye(h.shape[-1], dtype=h.dtype)
    for attempt in range(5):
        lam = damp * (10 ** attempt) * diag.mean(dim=-1)
        chol, info = torch.linalg.cholesky_ex(h + lam[:, None, None] * eye)
        if bool((info == 0).all()):
            # H^-1 = L^-T L^-1 (torch.cholesky_inverse is far slower on batches)
            l_inv = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
            inverse = l_inv.transpose(-1, -2) @ l_inv
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if bool((info == 0).all()):
                return upper
    raise torch.linalg.LinAlgError("the Hessian stays singular even with 10^4 times the dampening")


def gptq(weight: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, block: int = BLOCK, damp: float = DAMP
         ) -> torch.Tensor:
    """int8 codes [B, out, in] of weights [B, out, in] with Hessians h [B, in, in] and fixed per-row scales
    [B, out, 1]."""
    w = weight.float().clone()
    u = _inverse_cholesky(h.float(), damp)
    batch, rows, cols = w.shape
    codes = torch.empty(batch, rows, cols, dtype=torch.int8)
    s = scale.float().squeeze(-1)  # [B, out]
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, :, i]
            q = torch.clamp(torch.round(col / s), -QMAX, QMAX)
            codes[:, :, i1 + i] = q.to(torch.int8)
            err = (col - q * s) / u1[:, i, i].unsqueeze(-1)
            # the rest of the block absorbs this column's error (a batched rank-1 update, in place)
            w1[:, :, i + 1:].baddbmm_(err.unsqueeze(-1), u1[:, i:i + 1, i + 1:], alpha=-1)
            err1[:, :, i] = err
        if i2 < cols:
            w[:, :, i2:].baddbmm_(err1, u[:, i1:i2, i2:], alpha=-1)
    return codes


def quantize_gptq(weight: torch.Tensor, h: torch.Tensor, clip_grid: tuple[float, ...] = CLIP_GRID
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int8 [B, out, in], scales float32 [B, out, 1], clip ratios [B, out]): clip search, then GPTQ."""
    clip = search_clip(weight, h, clip_grid)
    scale = _scales(weight.float(), clip).float()
    return gptq(weight, h, scale), scale, clip
