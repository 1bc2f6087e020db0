"""Tokens routed to each logical expert of each MoE layer, counted on the device as the model runs.

xdeepserve §4.5 step 1: right after gating, each MoE layer adds the per-expert counts of its
batch (its logical top-k ids, before the mapping to physical slots) into its row of one
preallocated int64 tensor [num MoE layers, E]. One `index_add_` per layer, no host sync (a
bincount would size its output from the ids' max, which syncs on CUDA), so it stays on.

The ranks of an attention TP group hold the same tokens and all count them; a reader takes
one rank's counts per group (the engine reads the driver's).
"""
from __future__ import annotations

import torch


def add_counts(row: torch.Tensor, topk_ids: torch.Tensor, one: torch.Tensor) -> None:
    """row[e] += number of entries of topk_ids equal to e; `one` is an int64 tensor [1] on row's device."""
    flat = topk_ids.reshape(-1)
    row.index_add_(0, flat, one.expand(flat.numel()))


class ExpertLoadCounter:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str | None = None) -> None:
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.one = torch.ones(1, dtype=torch.int64, device=device)

    def row(self, position: int) -> torch.Tensor:
        """The view that MoE layer `position` adds into."""
        return self.counts[position]

    def take(self) -> list[list[int]]:
        """Counts since the last take, [layer position][expert]; resets them."""
        out = self.counts.tolist()
        self.counts.zero_()
        return out
