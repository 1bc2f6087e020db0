"""HF transformers 5's fused routed experts <-> checkpoints' per-expert tensors.

HF transformers 5 keeps each MoE layer's routed experts as two fused tensors (`experts.gate_up_proj`
[E, 2I, H] with the gate rows first, `experts.down_proj` [E, H, I]); checkpoints (the factory's, real
ones) store one tensor per expert and projection (`experts.{e}.{gate,up,down}_proj.weight`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def split_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF module tensors -> checkpoint tensors: fused expert tensors become one tensor per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _FUSED_EXPERTS.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for expert in range(tensor.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{expert}.down_proj.weight"] = tensor[expert]
            else:
                gate, up = tensor[expert].chunk(2, dim=0)
                out[f"{prefix}.{expert}.gate_proj.weight"] = gate
                out[f"{prefix}.{expert}.up_proj.weight"] = up
    return out


def fuse_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> HF module tensors (the inverse of `split_experts`)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, kind = match.groups()
        experts.setdefault(prefix, {}).setdefault(int(expert), {})[kind] = tensor
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        if order != list(range(len(order))):
            raise ValueError(f"{prefix}: experts {order} are not numbered 0..{len(order) - 1}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]], dim=0) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in order])
    return out
