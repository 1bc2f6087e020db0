"""EPLB planner: which experts get redundant replicas, and on which devices (xdeepserve §4.5 step 2).

Two algorithms (`ALGORITHMS`):
- `xdeepserve`: the paper's - replicas chosen by the per-slice hottest expert,
  placed by descending load onto the least-loaded device (eplb_xdeepserve.py);
- `greedy-max-device` (default): replicas chosen and placed by the simulated
  busiest device of each slice (eplb_greedy.py); this plan and the paper's are
  both refined by swaps, and the best per-slice balancedness among those two and
  the paper's plan as it is wins, so it never ends below the paper's plan on the
  load it was given. It
  balances better on the synthetic and recorded loads of `meshserve bench eplb`,
  most where the primaries are fixed (docs/benchmarks.md), for more planning time.

Two modes (`MODES`):
- `redundant` (default): primary slots keep the contiguous default experts and
  only the redundant slots are planned. This is what the engine can apply live.
- `full`: every slot is planned, the primaries included (copies chosen as in
  xdeepserve, then all placed); for a fresh start, and for a shrink re-planned
  from scratch.

The redundancy budget is the number of replicas placed per layer (the papers'
"redundant experts"); it defaults to every free slot.
"""
from __future__ import annotations

import numpy as np

from meshserve.moe import eplb_greedy, eplb_xdeepserve
from meshserve.moe.balance import as_counts, balancedness
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import EMPTY, ExpertPlacement, PlacementShape

ALGORITHMS = ("greedy-max-device", "xdeepserve")
DEFAULT_ALGORITHM = "greedy-max-device"
MODES = ("redundant", "full")
DEFAULT_MODE = "redundant"


def free_slots(shape: PlacementShape, mode: str = DEFAULT_MODE) -> int:
    """Slots a plan may fill with replicas: the redundant slots, or (full) every slot beyond one per expert."""
    _check_choice(mode, MODES, "mode")
    if mode == "redundant":
        return shape.num_ranks * shape.redundant_per_rank
    return shape.num_slots - shape.num_logical


def plan_redundancy(counts_per_slice, shape: PlacementShape, *, budget: int | None = None,
                    algorithm: str = DEFAULT_ALGORITHM, mode: str = DEFAULT_MODE,
                    base_slots: list[int] | None = None) -> list[int]:
    """One layer's slots (physical slot -> logical expert, -1 empty) from its counts[slice][expert].

    In `redundant` mode the primary slots keep `base_slots`' experts (default: the contiguous
    default placement), so a running engine can apply the plan live."""
    _check_choice(algorithm, ALGORITHMS, "algorithm")
    counts = as_counts(counts_per_slice, shape.num_logical)
    budget = _check_budget(budget, free_slots(shape, mode))
    if mode == "redundant":
        if shape.uneven:
            raise ValueError("mode 'redundant' needs primary slots; plan a shrink placement with mode 'full'")
        slots = np.asarray(shape.default_slots(), dtype=np.int64)
        if base_slots is not None:
            if len(base_slots) != shape.num_slots:
                raise ValueError(f"base placement has {len(base_slots)} slots, the shape {shape.num_slots}")
            primary = np.arange(shape.num_slots) % shape.slots_per_rank < shape.primary_per_rank
            slots[primary] = np.asarray(base_slots, dtype=np.int64)[primary]
        free = slots == EMPTY
        return fill_free_slots(slots, free, counts, shape.num_ranks, budget, algorithm)
    return plan_all_slots(counts, shape.num_ranks, shape.slots_per_rank, budget, algorithm)


def plan_placement(record: ExpertLoadRecord, shape: PlacementShape, *, budget: int | None = None,
                   algorithm: str = DEFAULT_ALGORITHM, mode: str = DEFAULT_MODE,
                   base: ExpertPlacement | None = None) -> ExpertPlacement:
    """A placement for every MoE layer of a recorded load (`base`: the placement in use, whose
    primary slots a `redundant` plan keeps)."""
    if record.num_logical != shape.num_logical:
        raise ValueError(f"the load record has {record.num_logical} experts per layer, the shape "
                         f"{shape.num_logical}")
    if not record.num_slices:
        raise ValueError("the load record has no time slices")
    layers = {layer: plan_redundancy(record.layer_counts(layer), shape, budget=budget, algorithm=algorithm,
                                     mode=mode, base_slots=base.layers[layer] if base is not None else None)
              for layer in record.moe_layers}
    return ExpertPlacement(shape, layers)


def fill_free_slots(slots: np.ndarray, free: np.ndarray, counts: np.ndarray, num_ranks: int, budget: int,
                    algorithm: str = DEFAULT_ALGORITHM) -> list[int]:
    """Fill up to `budget` of the `free` slots with replicas; the other slots stay as they are."""
    if budget <= 0:
        return slots.tolist()
    paper = slots.copy()
    copies = np.maximum(np.bincount(slots[slots != EMPTY], minlength=counts.shape[1]), 1)
    chosen = eplb_xdeepserve.choose_replicas(counts, copies, budget, max_copies=num_ranks)
    eplb_xdeepserve.place_by_descending_load(paper, free.copy(), chosen, counts, num_ranks)
    if algorithm == "xdeepserve":
        return paper.tolist()
    greedy = eplb_greedy.SlotState(slots.copy(), eplb_greedy.normalised(counts), num_ranks)
    eplb_greedy.add_replicas(greedy, free.copy(), budget)
    return _refined_best([greedy.slots, paper], free, counts, num_ranks)


def plan_all_slots(counts: np.ndarray, num_ranks: int, slots_per_rank: int, budget: int,
                   algorithm: str = DEFAULT_ALGORITHM) -> list[int]:
    """Place every expert and `budget` replicas on `num_ranks` devices of `slots_per_rank` slots."""
    num_logical = counts.shape[1]
    if num_ranks * slots_per_rank < num_logical + budget:
        raise ValueError(f"{num_ranks} devices x {slots_per_rank} slots cannot hold {num_logical} experts "
                         f"and {budget} replicas")
    copies = np.ones(num_logical, dtype=np.int64)
    chosen = eplb_xdeepserve.choose_replicas(counts, copies, budget, max_copies=num_ranks)
    items = list(range(num_logical)) + chosen
    empty = np.full(num_ranks * slots_per_rank, EMPTY, dtype=np.int64)
    everywhere = np.ones(empty.size, dtype=bool)
    paper = empty.copy()
    eplb_xdeepserve.place_by_descending_load(paper, everywhere.copy(), items, counts, num_ranks)
    if algorithm == "xdeepserve":
        return paper.tolist()
    greedy = eplb_greedy.SlotState(empty.copy(), eplb_greedy.normalised(counts), num_ranks, copies=copies)
    eplb_greedy.place_items(greedy, everywhere.copy(), items)
    return _refined_best([greedy.slots, paper], everywhere, counts, num_ranks)


def _refined_best(candidates: list[np.ndarray], movable: np.ndarray, counts: np.ndarray, num_ranks: int) -> list[int]:
    """The best per-slice balancedness among the candidates refined by swaps and the last one as it is.

    The last candidate is the paper's plan, so greedy-max-device never ends below it. Ties keep the
    earlier plan.
    """
    shares = eplb_greedy.normalised(counts)
    plans = []
    for slots in candidates:
        state = eplb_greedy.SlotState(_without_duplicates(slots, movable, num_ranks), shares, num_ranks)
        eplb_greedy.refine_by_swaps(state, movable, max_swaps=_swap_limit(movable))
        plans.append(state.slots)
    plans.append(candidates[-1])
    scores = [balancedness(slots, counts, num_ranks) for slots in plans]
    best = max(range(len(plans)), key=lambda i: (round(scores[i], 12), -i))
    return plans[best].tolist()


def _without_duplicates(slots: np.ndarray, movable: np.ndarray, num_ranks: int) -> np.ndarray:
    """A second copy of an expert on the same device takes no load off it: empty such movable slots."""
    slots = slots.copy()
    per_rank = slots.size // num_ranks
    for device in range(num_ranks):
        seen: set[int] = set()
        for slot in range(device * per_rank, (device + 1) * per_rank):
            expert = int(slots[slot])
            if expert != EMPTY and expert in seen and movable[slot]:
                slots[slot] = EMPTY
            seen.add(expert)
    return slots


def _swap_limit(movable: np.ndarray) -> int:
    # each swap lowers the objective; this only bounds the loop on pathological inputs
    return 2 * int(movable.sum()) + 16


def _check_budget(budget: int | None, available: int) -> int:
    if budget is None:
        return available
    if budget < 0:
        raise ValueError(f"the redundancy budget must be >= 0, got {budget}")
    if budget > available:
        raise ValueError(f"a budget of {budget} replicas needs more than the {available} free slots")
    return budget


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose from {', '.join(choices)}")
