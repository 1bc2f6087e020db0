"""Moving any expert while serving: a target placement as rounds that the four-phase reconfiguration applies live.

A live reconfiguration stops routing to the slots it changes while their weights are copied
(meshserve/moe/balancer.py), so during a round every expert must keep a slot that does not
change. A slot may therefore change only where it is empty or its expert has another copy
staying put. Moving primaries (two experts trading ranks, say) then takes several rounds:
a spare slot (empty, or holding a second copy) lends its place to a copy of one expert, that
expert's old slot takes the next one, and so on around the cycle; the lent slot gets its own
target last. With no spare slot at all (every slot holds the only copy of its expert) a
permutation cannot be applied live, and `move_rounds` says so.

A planned target is first renumbered to keep as many experts where they are as possible
(`align_to_current`): balancedness depends only on which experts share a device, not on the
device's number or a slot's position on it, so renumbering changes no load and moves fewer
weights.

Pure Python: the master plans the rounds; every rank checks each round with `check_every_expert_served`.
"""
from __future__ import annotations

from collections import Counter

from meshserve.moe.placement import EMPTY, ExpertPlacement, PlacementShape

# a round changes at least one slot, and a slot changes at most twice (lent, then its target) per slot whose
# expert differs: this bounds the rounds of any solvable move
_ROUNDS_PER_SLOT = 3


def check_every_expert_served(old: list[int], new: list[int], what: str = "placement") -> None:
    """Refuse a live change after which some expert of `old` would have no unchanged slot while the changing
    slots are disabled."""
    kept = {before for before, after in zip(old, new) if before == after and before != EMPTY}
    lost = sorted({expert for expert in old if expert != EMPTY} - kept)
    if lost:
        raise ValueError(f"{what}: expert {lost[0]} would have no slot while the changing slots are disabled "
                         f"({len(lost)} such experts); apply the change in rounds (meshserve/moe/live_moves.py)")


def align_to_current(shape: PlacementShape, current: list[int], target: list[int]) -> list[int]:
    """`target` with its devices renumbered and each device's slots reordered so that as many experts as possible
    stay in the slot they hold in `current` (the same device loads, fewer weights to move)."""
    per_rank = shape.slots_per_rank
    cur_devices = [current[r * per_rank:(r + 1) * per_rank] for r in range(shape.num_ranks)]
    new_devices = [target[r * per_rank:(r + 1) * per_rank] for r in range(shape.num_ranks)]
    cur_sets = [Counter(e for e in device if e != EMPTY) for device in cur_devices]
    new_sets = [Counter(e for e in device if e != EMPTY) for device in new_devices]
    # greedy matching on the experts two devices share, largest first (ties: the current numbering)
    pairs = sorted(((sum((new_sets[i] & cur_sets[j]).values()), i, j)
                    for i in range(shape.num_ranks) for j in range(shape.num_ranks)),
                   key=lambda p: (-p[0], p[1] != p[2], p[1], p[2]))
    home: dict[int, int] = {}  # target device -> current device it becomes
    taken: set[int] = set()
    for _, i, j in pairs:
        if i not in home and j not in taken:
            home[i] = j
            taken.add(j)
    aligned = [EMPTY] * len(target)
    for i, j in home.items():
        aligned[j * per_rank:(j + 1) * per_rank] = _keep_slots(cur_devices[j], new_devices[i])
    return aligned


def _keep_slots(current: list[int], wanted: list[int]) -> list[int]:
    """The experts of `wanted` (one device) in the order that keeps each one already in `current` in its slot."""
    left = Counter(wanted)
    out: list[int | None] = [None] * len(current)
    for slot, expert in enumerate(current):
        if left[expert] > 0:
            out[slot] = expert
            left[expert] -= 1
    rest = list(left.elements())
    rest.sort(key=lambda e: e == EMPTY)  # experts before empties: empties end up at the device's end
    return [expert if expert is not None else rest.pop(0) for expert in out]


def move_rounds(current: list[int], target: list[int]) -> list[list[int]]:
    """The slot lists after each round, from `current` to `target` (one layer; empty when they are equal). In
    every round each expert of the list before keeps a slot that does not change (`check_every_expert_served`)."""
    if len(current) != len(target):
        raise ValueError(f"the target has {len(target)} slots, the current placement {len(current)}")
    cur = list(current)
    lent: set[int] = set()  # slots holding a copy lent to break a cycle: they change last
    rounds: list[list[int]] = []
    limit = _ROUNDS_PER_SLOT * sum(a != b for a, b in zip(current, target)) + 1
    while cur != target:
        if len(rounds) >= limit:
            raise RuntimeError(f"no live move found from {current} to {target} in {limit} rounds")
        nxt = _one_round(cur, target, lent)
        check_every_expert_served(cur, nxt, f"round {len(rounds) + 1}")
        lent = {slot for slot in lent if nxt[slot] != target[slot]}
        rounds.append(nxt)
        cur = nxt
    return rounds


def _one_round(cur: list[int], target: list[int], lent: set[int]) -> list[int]:
    copies = Counter(e for e in cur if e != EMPTY)
    changing = [slot for slot, (a, b) in enumerate(zip(cur, target)) if a != b]
    # empty slots first (they take load off nobody), lent slots last (their copy frees the cycle's next slot)
    changing.sort(key=lambda slot: (cur[slot] != EMPTY, slot in lent, slot))
    nxt = list(cur)
    for slot in changing:
        expert = cur[slot]
        if expert == EMPTY or copies[expert] > 1:
            nxt[slot] = target[slot]
            if expert != EMPTY:
                copies[expert] -= 1
    # The slots left hold the only copy of their expert. Each spare slot (empty, or a copy this round leaves
    # spare) that does not change takes a copy of one of them, so that expert's slot changes next round: the
    # chains of moves go on in as many places as there are spares instead of dying out one by one.
    stuck = [cur[slot] for slot in changing if nxt[slot] == cur[slot]]
    spares = [slot for slot, expert in enumerate(cur)
              if nxt[slot] == expert and (expert == EMPTY or copies[expert] > 1)]
    spares.sort(key=lambda slot: (cur[slot] != EMPTY, slot))
    if stuck and not spares and nxt == cur:
        raise ValueError("every slot holds the only copy of its expert, so experts cannot change places live; "
                         "start the engine with --eplb-redundant-experts N (a spare slot per rank)")
    for spare, expert in zip(spares, stuck):
        if cur[spare] != EMPTY:
            if copies[cur[spare]] < 2:
                continue  # an earlier spare took the other copy of this one's expert
            copies[cur[spare]] -= 1
        nxt[spare] = expert
        lent.add(spare)
    return nxt


def placement_rounds(current: ExpertPlacement, target: ExpertPlacement) -> list[ExpertPlacement]:
    """Whole-model rounds from `current` to `target` (at least one: the target itself where nothing moves). Round
    i of a layer that needs fewer rounds is its target."""
    if current.shape != target.shape or set(current.layers) != set(target.layers):
        raise ValueError("the target placement has another shape or other layers than the current one")
    per_layer = {layer: move_rounds(current.layers[layer], target.layers[layer]) for layer in target.layers}
    count = max([len(rounds) for rounds in per_layer.values()] + [1])
    return [ExpertPlacement(target.shape, {layer: list(rounds[i]) if i < len(rounds) else list(target.layers[layer])
                                           for layer, rounds in per_layer.items()})
            for i in range(count)]
