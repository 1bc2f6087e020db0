"""INT8 W8A8 linear layers and routed experts: the weights, and the activations as they come, in int8.

Weights are quantized once, per output channel (symmetric: scale = absmax / 127); activations per token
at run time, the same way. A product accumulates exactly in int32 and is scaled back to float32 by
the token's scale times the channel's scale. Decode streams the weights once per step, so a quarter of
the float bytes is up to 4x the speed where memory bounds it, and AVX-512 VNNI does 4x the
multiply-adds per instruction of a float FMA where compute does.

The native kernels (csrc/int8_kernels.cpp, built with the other CPU kernels: see cpu_kernels.py) take a
weight packed once by `pack` / `pack_moe`. Without one, on other devices, or with the kernels switched
off, the torch path computes the same thing: `torch._int_mm` on CUDA where its shape rules allow, else a
float matmul of the integer values (exact while the sums stay below 2^24; beyond, up to float rounding).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels

BLOCK_COLUMNS = 16  # output channels per packed block: one vector of int32 accumulators
GROUP = 4  # k values per packed group: the byte pairs one VNNI lane multiplies and adds
MAX_K = 65536  # 255 * 127 * K must fit int32 (activations enter the kernel as q + 128)
_QMAX = 127


class PackedWeight(NamedTuple):
    """An int8 [..., N, K] weight in the native kernel's layout."""

    blocks: torch.Tensor  # int8 [..., N/16, ceil(K/4), 64]: byte 4c + i of [b, g] is w[16b + c, 4g + i]
    compensation: torch.Tensor  # int32 [..., N]: 128 * sum_k w[n, k] (activations enter as q + 128)


class PackedExperts(NamedTuple):
    """A MoE layer's expert weights in the native kernel's layout (leading dim: expert slot)."""

    w13: PackedWeight
    w2: PackedWeight


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    absmax = x.abs().amax(dim=-1)
    scale = torch.where(absmax > 0, absmax / _QMAX, torch.ones_like(absmax))
    q = torch.round(x / scale.unsqueeze(-1)).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (int8 [..., N, K], float32 scale [..., N]): per output row symmetric,
    scale = absmax / 127 (1.0 for an all-zero row), q = round-half-even(w / scale) in [-127, 127]."""
    return _quantize_rows(w)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (int8 [M, K], float32 [M]): per-token dynamic symmetric, rounded as
    `quantize_weight`; bit for bit what the native kernels compute inside."""
    return _quantize_rows(x)


def packable(q: torch.Tensor) -> bool:
    """Whether an int8 [..., N, K] weight fits the native layout (on CPU, N a multiple of 16)."""
    return (q.device.type == "cpu" and q.dtype == torch.int8 and q.dim() >= 2
            and q.shape[-2] > 0 and q.shape[-2] % BLOCK_COLUMNS == 0 and 0 < q.shape[-1] <= MAX_K)


def pack(q: torch.Tensor) -> PackedWeight:
    """int8 [..., N, K] -> the native kernel's layout (see PackedWeight); leading dims are experts."""
    if not packable(q):
        raise ValueError(f"int8 weight of shape {tuple(q.shape)} ({q.dtype}, {q.device}) is not packable: "
                         f"int8 on CPU with N a multiple of {BLOCK_COLUMNS} and 0 < K <= {MAX_K}")
    *lead, n, k = q.shape
    groups = -(-k // GROUP)
    padded = F.pad(q, (0, groups * GROUP - k)) if groups * GROUP != k else q
    blocks = padded.reshape(*lead, n // BLOCK_COLUMNS, BLOCK_COLUMNS, groups, GROUP).transpose(-3, -2)
    blocks = blocks.reshape(*lead, n // BLOCK_COLUMNS, groups, BLOCK_COLUMNS * GROUP).contiguous()
    compensation = (q.sum(dim=-1, dtype=torch.int32) * 128).contiguous()
    return PackedWeight(blocks, compensation)


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """x float32 [..., K] -> float32 [..., N] = dequant(quant(x) q^T) * scale (+ bias), for q int8 [N, K]
    and scale float32 [N]. The native kernel where `packed` is given and the kernels are on (CPU)."""
    if packed is not None and _native(x):
        if x.dim() == 2:  # decode's case, kept to a minimum of Python: a call costs a few microseconds
            return _ops().int8_linear(x if x.stride(1) == 1 else x.contiguous(), packed.blocks, packed.compensation,
                                      scale, bias)
        out = _ops().int8_linear(x.reshape(-1, x.shape[-1]).contiguous(), packed.blocks, packed.compensation,
                                 scale, bias)
        return out.view(*x.shape[:-1], out.shape[1])
    xq, xscale = quantize_activation(x.reshape(-1, x.shape[-1]))
    out = _int_matmul(xq, q).mul_(xscale.unsqueeze(1)).mul_(scale.float())
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], q.shape[0])


def _native(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype == torch.float32 and cpu_kernels.enabled()


class _Ops(NamedTuple):
    int8_linear: Callable
    int8_moe_forward: Callable


@functools.cache
def _ops() -> _Ops:
    """The native ops' overloads, looked up once (each `torch.ops` attribute lookup costs a little)."""
    namespace = torch.ops.meshserve_cpu
    return _Ops(namespace.int8_linear.default, namespace.int8_moe_forward.default)


def _int_matmul(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float32 xq q^T of int8 [M, K] and [N, K]: int32-exact through torch._int_mm on CUDA where its shape
    rules allow (M > 16, K and N multiples of 8), else a float matmul of the integer values."""
    m, k = xq.shape
    n = q.shape[0]
    if xq.is_cuda and m > 16 and k % 8 == 0 and n % 8 == 0:
        # a transposed view as mat2 gave wrong results in some releases (torchao copies it too)
        return torch._int_mm(xq.contiguous(), q.t().contiguous()).float()
    return xq.float() @ q.float().t()


def pack_moe(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts:
    """Expert weights w13 int8 [E, 2I, H] and w2 int8 [E, H, I], packed for `moe_forward`."""
    return PackedExperts(pack(w13), pack(w2))


def repack_slot(packed_moe: PackedExperts, slot: int, w13_slot: torch.Tensor, w2_slot: torch.Tensor) -> None:
    """Write one expert slot's int8 weights (w13 [2I, H], w2 [H, I]) into the packed layers in place: the
    others serve on meanwhile. Its scales live in the caller's w13_scale / w2_scale and change there."""
    new13, new2 = pack(w13_slot), pack(w2_slot)  # packed first: the slot itself changes by one copy each
    for packed, new in ((packed_moe.w13, new13), (packed_moe.w2, new2)):
        if new.blocks.shape != packed.blocks.shape[1:]:
            raise ValueError(f"slot weights pack to {tuple(new.blocks.shape)}, the layer holds "
                             f"{tuple(packed.blocks.shape[1:])} per slot")
        packed.blocks[slot].copy_(new.blocks)
        packed.compensation[slot].copy_(new.compensation)


def moe_forward(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, first_slot: int,
                w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                packed: PackedExperts | None = None) -> torch.Tensor:
    """One MoE layer's routed experts in INT8 (the semantics of moe.fused_experts).

    hidden [T, H] float32; topk_ids int64 [T, K] global slot ids (ids outside [first_slot, first_slot + E)
    are skipped: expert parallelism); topk_weights [T, K]; w13 int8 [E, 2I, H] (gate rows, then up rows)
    with w13_scale float32 [E, 2I]; w2 int8 [E, H, I] with w2_scale float32 [E, H]. Returns
    sum_k w[t, k] * expert(hidden[t]), expert(x) = W2 (silu(W_gate x) * (W_up x)), with hidden quantized
    once per token and the silu * up row once per (token, expert). One native op where `packed` is given.
    """
    if packed is not None and _native(hidden):
        return _ops().int8_moe_forward(
            hidden.contiguous(), topk_ids.long(), topk_weights.float(), first_slot, packed.w13.blocks,
            packed.w13.compensation, w13_scale, packed.w2.blocks, packed.w2.compensation, w2_scale)
    return _moe_reference(hidden, topk_ids, topk_weights, first_slot, w13, w13_scale, w2, w2_scale)


def _moe_reference(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, first_slot: int,
                   w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                   w2_scale: torch.Tensor) -> torch.Tensor:
    """The torch path: one matmul pair per active expert over its tokens' rows."""
    out = torch.zeros_like(hidden, dtype=torch.float32)
    top_k, num_local, intermediate = topk_ids.shape[1], w13.shape[0], w2.shape[2]
    flat_ids = topk_ids.reshape(-1) - first_slot
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids.index_select(0, order)
    local = (sorted_ids >= 0) & (sorted_ids < num_local)
    order, sorted_ids = order[local], sorted_ids[local]
    if order.numel() == 0:
        return out
    xq, xscale = quantize_activation(hidden)  # once per token, shared by its experts
    token_idx = order // top_k
    weights = topk_weights.reshape(-1).index_select(0, order).float()
    start = 0
    for expert, count in enumerate(torch.bincount(sorted_ids, minlength=num_local).tolist()):
        if count == 0:
            continue
        tokens = token_idx[start:start + count]
        gate_up = _int_matmul(xq[tokens], w13[expert]).mul_(xscale[tokens].unsqueeze(1)).mul_(w13_scale[expert])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        aq, ascale = quantize_activation(act)
        ys = _int_matmul(aq, w2[expert]).mul_(ascale.unsqueeze(1)).mul_(w2_scale[expert])
        out.index_add_(0, tokens, ys.mul_(weights[start:start + count].unsqueeze(1)))
        start += count
    return out
