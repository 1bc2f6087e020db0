"""Moving any expert while serving: the rounds a move is split into, and the renumbering of a planned target."""
from __future__ import annotations

import random

import numpy as np
import pytest

from meshserve.moe.balance import balancedness
from meshserve.moe.eplb import plan_all_slots
from meshserve.moe.live_moves import align_to_current, check_every_expert_served, move_rounds, placement_rounds
from meshserve.moe.placement import EMPTY, ExpertPlacement, PlacementShape, check_slots


def _random_slots(shape: PlacementShape, rng: random.Random) -> list[int]:
    """Every expert once, the other slots random copies or empty, shuffled over the ranks."""
    slots = list(range(shape.num_logical))
    slots += [rng.randrange(shape.num_logical) if rng.random() < 0.7 else EMPTY
              for _ in range(shape.num_slots - shape.num_logical)]
    rng.shuffle(slots)
    return slots


def _devices(shape: PlacementShape, slots: list[int]) -> list[list[int]]:
    per_rank = shape.slots_per_rank
    return sorted(sorted(slots[r * per_rank:(r + 1) * per_rank]) for r in range(shape.num_ranks))


def test_every_round_keeps_each_expert_a_copy_and_the_last_is_the_target():
    rng = random.Random(0)
    solved = 0
    for _ in range(600):
        experts = rng.choice([4, 8, 16, 32])
        shape = PlacementShape(experts, rng.choice([r for r in (1, 2, 4, 8) if experts % r == 0]),
                               rng.choice([1, 2]))
        current = shape.default_slots() if rng.random() < 0.5 else _random_slots(shape, rng)
        target = _random_slots(shape, rng)
        before = current
        for after in move_rounds(current, target):
            check_slots(shape, after)
            check_every_expert_served(before, after)
            before = after
        assert before == target
        solved += 1
    assert solved == 600


def test_no_spare_slot_means_no_live_permutation():
    shape = PlacementShape(4, 2, 0)
    with pytest.raises(ValueError, match="--eplb-redundant-experts"):
        move_rounds(shape.default_slots(), [1, 0, 2, 3])
    assert move_rounds([0, 1, 2, 3], [0, 1, 2, 3]) == []


def test_two_primaries_trading_ranks_take_a_lent_copy():
    # rank 0: [0 1 | -], rank 1: [2 3 | -]; experts 0 and 2 trade ranks
    rounds = move_rounds([0, 1, EMPTY, 2, 3, EMPTY], [2, 1, EMPTY, 0, 3, EMPTY])
    assert rounds[-1] == [2, 1, EMPTY, 0, 3, EMPTY] and len(rounds) == 3
    assert rounds[0] == [0, 1, 0, 2, 3, 2]  # the spare slots hold copies of 0 and 2: their slots can change
    assert rounds[1] == [2, 1, 0, 0, 3, 2]  # both move at once; the copies are cleared in the last round


def test_a_planned_target_is_renumbered_to_move_fewer_experts_at_the_same_balance():
    shape = PlacementShape(64, 8, 1)
    counts = np.random.default_rng(0).zipf(1.4, (4, 64)).astype(float)
    target = plan_all_slots(counts, 8, shape.slots_per_rank, shape.num_slots - 64)
    current = shape.default_slots()
    aligned = align_to_current(shape, current, target)
    assert _devices(shape, aligned) == _devices(shape, target)
    assert balancedness(aligned, counts, 8) == pytest.approx(balancedness(target, counts, 8))
    kept = sum(a == b for a, b in zip(aligned, current))
    assert kept > sum(a == b for a, b in zip(target, current))
    assert len(move_rounds(current, aligned)) <= len(move_rounds(current, target))


def test_placement_rounds_cover_every_layer():
    shape = PlacementShape(4, 2, 1)
    current = ExpertPlacement.default(shape, [1, 3])
    target = ExpertPlacement(shape, {1: [2, 1, EMPTY, 0, 3, EMPTY], 3: list(current.layers[3])})
    rounds = placement_rounds(current, target)
    assert len(rounds) == 3 and rounds[-1].layers == target.layers
    assert all(r.layers[3] == current.layers[3] for r in rounds)  # a layer with nothing to move waits at its target
    assert placement_rounds(current, current)[0].layers == current.layers
