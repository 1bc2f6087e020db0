"""Routed-expert compute that is fast on CPU.

Tokens are grouped by expert (one stable sort of the flattened top-k ids) and
each active expert runs one matmul pair over its contiguous slice: no per-token
Python loop and no dense mask over all experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from meshserve.models.layers.linear import linear, pack_weight


def fused_experts(
    hidden_states: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int64 [T, K], global expert ids
    topk_weights: torch.Tensor,  # [T, K]
    w13: torch.Tensor,  # [E_local, 2 * I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E_local, H, I]
    first_expert: int = 0,  # global id of local expert 0 (expert parallelism keeps a slice)
    packed: tuple[list, list] | None = None,  # per-expert oneDNN weights of w13 and w2 (see linear.py)
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    out = torch.zeros_like(hidden_states)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1) - first_expert
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids.index_select(0, order)
    local = (sorted_ids >= 0) & (sorted_ids < num_local)
    if not bool(local.all()):
        order = order[local]
        sorted_ids = sorted_ids[local]
    if order.numel() == 0:
        return out
    counts = torch.bincount(sorted_ids, minlength=num_local).tolist()
    token_idx = order // top_k
    xs = hidden_states.index_select(0, token_idx)
    ys = torch.empty_like(xs)
    intermediate = w2.shape[2]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        if packed is None:
            gate_up = torch.mm(xs[start:end], w13[expert].t())
            act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            torch.mm(act, w2[expert].t(), out=ys[start:end])
        else:
            gate_up = linear(xs[start:end], w13[expert], packed=packed[0][expert])
            act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            ys[start:end] = linear(act, w2[expert], packed=packed[1][expert])
        start = end
    weights = topk_weights.reshape(-1).index_select(0, order).to(ys.dtype)
    ys.mul_(weights.unsqueeze(1))
    out.index_add_(0, token_idx, ys)
    return out


class FusedMoEWeights(torch.nn.Module):
    """Stacked expert weights with a loader that accepts HF per-expert tensors."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 first_expert: int = 0) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.intermediate_size = intermediate_size
        self.w13 = torch.nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = torch.nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False)

    def load_expert(self, expert_id: int, proj: str, tensor: torch.Tensor) -> bool:
        """Copy one HF tensor (`gate_proj`, `up_proj` or `down_proj` of a global expert id) in place.

        Returns False when the expert is not held by this rank.
        """
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_experts:
            return False
        i = self.intermediate_size
        if proj == "gate_proj":
            self.w13.data[local, :i].copy_(tensor)
        elif proj == "up_proj":
            self.w13.data[local, i:].copy_(tensor)
        elif proj == "down_proj":
            self.w2.data[local].copy_(tensor)
        else:
            raise KeyError(f"unknown expert projection {proj!r}")
        return True

    def pack_weights(self) -> int:
        """Prepack each expert's matrices for oneDNN (see linear.py); 0 where that does not apply."""
        w13 = [pack_weight(self.w13[e]) for e in range(self.num_experts)]
        if any(p is None for p in w13):
            self._packed = None
            return 0
        self._packed = (w13, [pack_weight(self.w2[e]) for e in range(self.num_experts)])
        return 2 * self.num_experts

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(hidden_states, topk_ids, topk_weights, self.w13, self.w2, self.first_expert,
                             getattr(self, "_packed", None))
