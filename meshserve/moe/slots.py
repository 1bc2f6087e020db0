"""Logical expert ids -> physical slot ids after gating (xdeepserve §4.5 step 4).

A `SlotMap` is one MoE layer's replica table. Token i of a batch routed to logical expert e
goes to replica (i + offset) mod num_replicas[e]: tokens of a replicated expert rotate over
its replicas by batch position, with no communication (every rank derives the same table
from the same placement). `offset` is the DP group's rank, so that groups of one token each
(decode) do not all pick the first replica. The table is the paper's mapping table: row p
holds every expert's slot for the positions p mod the rotation period, so a batch maps with
one add and one gather.

A layer changes by swapping in a new `SlotMap` object between steps (one attribute store).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from meshserve.moe.placement import EMPTY, replica_table


class SlotMap:
    # rotation tables up to this many entries; a layer with larger replica-count periods computes the
    # replica of each token with a modulo instead
    MAX_TABLE_ENTRIES = 1 << 16

    def __init__(self, replicas: list[list[int]], device: torch.device | str | None = None) -> None:
        if not replicas or any(not slots for slots in replicas):
            raise ValueError("every logical expert needs at least one slot")
        self.replicas = [list(slots) for slots in replicas]
        self.num_logical = len(replicas)
        self.max_replicas = max(len(slots) for slots in replicas)
        # Tokens rotate with period lcm(replica counts): row p of the table holds each expert's slot for the
        # positions p mod period, so mapping a batch is one add and one gather.
        self.period = math.lcm(*(len(slots) for slots in replicas))
        if self.period * self.num_logical <= self.MAX_TABLE_ENTRIES:
            rows = [[slots[p % len(slots)] for slots in replicas] for p in range(self.period)]
        else:
            self.period = 0
            rows = [[slots[p % len(slots)] for slots in replicas] for p in range(self.max_replicas)]
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)  # [period or max replicas, E]
        self._flat = self.table.reshape(-1)
        self._first = self.table[0].contiguous()
        self.num_replicas = torch.tensor([len(slots) for slots in replicas], dtype=torch.int64, device=device)
        self._row_starts: dict[int, torch.Tensor] = {}  # offset -> flat start of each position's row

    @classmethod
    def from_slots(cls, slots: list[int], num_logical: int, disabled: Iterable[int] = (),
                   device: torch.device | str | None = None) -> SlotMap:
        """The map of a placement's slot list, leaving out the `disabled` slots."""
        off = set(disabled)
        usable = [EMPTY if slot in off else expert for slot, expert in enumerate(slots)]
        return cls(replica_table(usable, num_logical), device)

    def route(self, topk_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Slot ids [T, K] for logical ids [T, K] (int64): token i takes replica (i + offset) mod count."""
        if self.max_replicas == 1:  # nothing replicated: one gather
            return self._first[topk_ids]
        num_tokens = topk_ids.shape[0]
        if self.period:
            return self._flat[self._starts(offset, num_tokens, topk_ids.device) + topk_ids]
        choice = self._positions(offset, num_tokens, topk_ids.device) % self.num_replicas[topk_ids]
        return self._flat[choice * self.num_logical + topk_ids]

    def _positions(self, offset: int, num_tokens: int, device) -> torch.Tensor:
        return torch.arange(offset, offset + num_tokens, device=device).unsqueeze(1)

    def _starts(self, offset: int, num_tokens: int, device) -> torch.Tensor:
        """[T, 1] flat offsets of the table rows of positions offset .. offset + T - 1 (cached, grown by doubling)."""
        starts = self._row_starts.get(offset)
        if starts is None or starts.shape[0] < num_tokens:
            size = max(64, num_tokens, 2 * (0 if starts is None else starts.shape[0]))
            starts = self._positions(offset, size, device) % self.period * self.num_logical
            self._row_starts[offset] = starts
        return starts[:num_tokens]


def changed_slots(old: list[int], new: list[int]) -> list[int]:
    """Global ids of the slots whose expert differs between two slot lists."""
    return [slot for slot, (before, after) in enumerate(zip(old, new)) if before != after]
