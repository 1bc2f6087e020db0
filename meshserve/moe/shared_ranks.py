"""Shared experts on dedicated EP ranks beside the routed ones (`shared=EPs`).

The seeds' decode layouts give the shared expert dies of their own: xdeepserve's EP288 is 256 routed-expert
dies plus 32 shared-expert dies, CloudMatrix-Infer's EP320 is 256 routed + 32 redundant + 32 shared. Every
token goes through the shared experts, so they take the same dispatch and combine as the routed ones
instead of running on every rank.

Slots, over the EP group: the routed ranks (the first EP - s) hold the routed slots [0, routed_slots) as
they would without shared ranks (their placement shape, EPLB and all); then shared rank i holds the slots
routed_slots + i * n + j, j < n, where n = n_shared_experts. A shared expert of intermediate n * I is n
column blocks of I (silu(x W_g) * (x W_u) W_d over concatenated columns is the sum over the blocks), so
it is n "experts" of the routed experts' shape, each weighted 1. After gating every token gets n more
columns, to the shared rank (token index + DP rank) mod s, so tokens spread evenly over the shared ranks
(the rotation of meshserve/moe/slots.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers.moe import FusedMoEWeights


@dataclass(frozen=True)
class SharedExpertSlots:
    routed_slots: int  # slots of the routed ranks, all together
    routed_ranks: int
    shared_ranks: int  # s
    blocks: int  # n: column blocks of I per shared expert (n_shared_experts)

    def __post_init__(self) -> None:
        if self.shared_ranks < 1 or self.routed_ranks < 1:
            raise ValueError(f"shared-expert slots need routed and shared ranks, got {self}")
        if self.blocks < 1:
            raise ValueError("shared=EPs places the shared experts on their own ranks, but this model has no shared "
                             "experts (n_shared_experts is 0); drop the shared block")

    @property
    def num_slots(self) -> int:
        return self.routed_slots + self.shared_ranks * self.blocks

    def first_slot(self, shared_index: int) -> int:
        """The first slot of the `shared_index`-th shared rank."""
        return self.routed_slots + shared_index * self.blocks

    def rank_of_slot(self) -> list[int]:
        """The EP rank of every slot (the dispatcher's table)."""
        per_routed_rank = self.routed_slots // self.routed_ranks
        return ([slot // per_routed_rank for slot in range(self.routed_slots)]
                + [self.routed_ranks + slot // self.blocks for slot in range(self.shared_ranks * self.blocks)])

    def append_columns(self, slot_ids: torch.Tensor, weights: torch.Tensor, offset: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, K] routed slots and weights -> [T, K + n]: each token's shared-expert blocks on the shared rank
        (token index + offset) mod s, weighted 1."""
        num_tokens, device = slot_ids.shape[0], slot_ids.device
        rank = (torch.arange(num_tokens, device=device) + offset) % self.shared_ranks
        columns = (self.routed_slots + rank * self.blocks).unsqueeze(1) + torch.arange(self.blocks, device=device)
        ones = torch.ones(num_tokens, self.blocks, dtype=weights.dtype, device=weights.device)
        return torch.cat([slot_ids, columns.to(slot_ids.dtype)], dim=1), torch.cat([weights, ones], dim=1)


def load_shared_expert(weights: FusedMoEWeights, proj: str, tensor: torch.Tensor) -> None:
    """Copy a full shared-expert tensor (`gate_proj` / `up_proj` [n * I, H], `down_proj` [H, n * I]) into the
    n slots of `weights`: column block j into slot j."""
    blocks, inter = weights.num_local_experts, weights.intermediate_size
    rows = proj != "down_proj"
    expected = (blocks * inter, weights.hidden_size) if rows else (weights.hidden_size, blocks * inter)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"shared expert {proj} has shape {tuple(tensor.shape)}, expected {expected}")
    for block in range(blocks):
        cols = slice(block * inter, (block + 1) * inter)
        weights.load_expert(block, proj, tensor[cols] if rows else tensor[:, cols])
