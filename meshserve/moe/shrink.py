"""Shrink planning: a placement on the EP ranks left after some are removed (xdeepserve §6.2 stage 2).

Decode keeps running on fewer ranks after a failure as long as every expert still
has a replica; excess replicas give way. Each surviving rank keeps its S slots, so
M ranks left hold M * S slots, and the plan fails with a clear error when that is
fewer than the experts.

Default (`replan=False`), moving few weights:
1. the surviving ranks (renumbered 0..M-1 in rank order) keep one copy of each
   expert they hold, a primary slot's first; their other copies are emptied, as
   the replicas were planned for the old layout;
2. every expert left without a copy ("orphan"), heaviest first, takes an empty
   slot on the least-loaded device (there are enough: M * S >= experts);
3. the slots still empty get replicas of hot experts (the chosen EPLB algorithm).
With `replan=True` the remaining ranks are planned from scratch (every slot),
which balances best but moves most weights.

The result breaks the rule that primaries hold the contiguous default experts:
the shape has no primary slots unless the experts split evenly over M ranks.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from meshserve.moe.balance import as_counts
from meshserve.moe.eplb import DEFAULT_ALGORITHM, fill_free_slots, plan_all_slots
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import EMPTY, ExpertPlacement, PlacementShape, check_slots


def shrunk_shape(shape: PlacementShape, removed_ranks: Iterable[int]) -> PlacementShape:
    """The shape left after removing ranks: same slots per rank, fewer ranks."""
    removed = sorted(set(removed_ranks))
    bad = [r for r in removed if not 0 <= r < shape.num_ranks]
    if bad:
        raise ValueError(f"ranks {bad} are not in the placement's {shape.num_ranks} EP ranks")
    if not removed:
        raise ValueError("a shrink needs at least one rank to remove")
    left = shape.num_ranks - len(removed)
    per_rank = shape.slots_per_rank
    if left * per_rank < shape.num_logical:
        need = -(-shape.num_logical // per_rank)
        what = f"ranks {removed}" if len(removed) <= 8 else f"{len(removed)} ranks"
        raise ValueError(f"removing {what} leaves {left} ranks x {per_rank} slots = {left * per_rank} "
                         f"slots for {shape.num_logical} experts; at least {need} ranks must remain")
    if shape.num_logical % left == 0:
        return PlacementShape(shape.num_logical, left, per_rank - shape.num_logical // left)
    return PlacementShape(shape.num_logical, left, 0, uneven_slots_per_rank=per_rank)


def shrink_slots(shape: PlacementShape, slots: list[int], counts, removed_ranks: Iterable[int], *,
                 replan: bool = False, algorithm: str = DEFAULT_ALGORITHM) -> tuple[PlacementShape, list[int]]:
    """One layer: (the shrunk shape, its slots) from the layer's slots and counts[slice][expert] (None: uniform)."""
    check_slots(shape, slots)
    removed = set(removed_ranks)
    new_shape = shrunk_shape(shape, removed)
    counts = (np.ones((1, shape.num_logical)) if counts is None else as_counts(counts, shape.num_logical))
    num_ranks, per_rank = new_shape.num_ranks, new_shape.slots_per_rank
    if replan:
        new_slots = plan_all_slots(counts, num_ranks, per_rank, num_ranks * per_rank - shape.num_logical, algorithm)
    else:
        survivors = [slot for slot in range(shape.num_slots) if shape.rank_of_slot(slot) not in removed]
        kept = _single_copies(shape, slots, survivors)
        _rehome_orphans(kept, counts, num_ranks)
        free = kept == EMPTY
        new_slots = fill_free_slots(kept, free, counts, num_ranks, int(free.sum()), algorithm)
    check_slots(new_shape, new_slots, "shrink plan")
    return new_shape, new_slots


def plan_shrink(placement: ExpertPlacement, record: ExpertLoadRecord | None, removed_ranks: Iterable[int], *,
                replan: bool = False, algorithm: str = DEFAULT_ALGORITHM) -> ExpertPlacement:
    """Every layer of `placement` shrunk onto the ranks left (loads from `record`; None: uniform load)."""
    removed = set(removed_ranks)
    if record is not None and record.num_logical != placement.shape.num_logical:
        raise ValueError(f"the load record has {record.num_logical} experts per layer, the placement "
                         f"{placement.shape.num_logical}")
    new_shape, layers = shrunk_shape(placement.shape, removed), {}
    for layer, slots in placement.layers.items():
        counts = None
        if record is not None and record.num_slices:
            if layer not in record.moe_layers:
                raise ValueError(f"the load record has no layer {layer}")
            counts = record.layer_counts(layer)
        _, layers[layer] = shrink_slots(placement.shape, slots, counts, removed, replan=replan,
                                        algorithm=algorithm)
    return ExpertPlacement(new_shape, layers)


def _single_copies(shape: PlacementShape, slots: list[int], survivors: list[int]) -> np.ndarray:
    """The surviving slots with one copy of each expert kept (a primary slot's first) and the rest emptied."""
    primary = (lambda slot: False) if shape.uneven else (lambda slot: slot % shape.slots_per_rank
                                                          < shape.primary_per_rank)
    keeper: dict[int, int] = {}
    for slot in sorted(survivors, key=lambda slot: (not primary(slot), slot)):
        if slots[slot] != EMPTY:
            keeper.setdefault(slots[slot], slot)
    kept = set(keeper.values())
    return np.asarray([slots[slot] if slot in kept else EMPTY for slot in survivors], dtype=np.int64)


def _rehome_orphans(slots: np.ndarray, counts: np.ndarray, num_ranks: int) -> None:
    """Give every expert missing from `slots` an empty slot on the least-loaded device, in place."""
    num_logical = counts.shape[1]
    device = np.arange(slots.size) // (slots.size // num_ranks)
    total = counts.sum(axis=0)
    load = np.bincount(device[slots != EMPTY], weights=total[slots[slots != EMPTY]], minlength=num_ranks)
    missing = np.setdiff1d(np.arange(num_logical), slots[slots != EMPTY])
    for orphan in sorted(missing.tolist(), key=lambda e: (-total[e], e)):
        empty = np.flatnonzero(slots == EMPTY)
        if empty.size == 0:  # unreachable while the shape has a slot per expert; kept as a guard
            raise ValueError(f"no slot left for expert {orphan}")
        slot = int(empty[np.argmin(load[device[empty]])])  # the lowest slot on the least-loaded device
        slots[slot] = orphan
        load[device[slot]] += total[orphan]
