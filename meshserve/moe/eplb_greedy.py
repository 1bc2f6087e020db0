"""The `greedy-max-device` planner: choose and place replicas by the simulated busiest device.

xdeepserve's choice looks at the hottest *expert* of each slice. With the primary
slots fixed, what a step waits for is the busiest *device*: a device that holds
several warm experts can be the straggler while no single expert on it is the
hottest, and a hot expert whose device is otherwise idle needs fewer replicas.
This planner works on the device loads directly. Every slice's counts are first
scaled to sum to 1, and the objective is the sum over slices of the busiest
device's share. The per-slice balancedness averages (1/N) / that share; as a
search objective the plain sum found better plans than the sum of reciprocals.

- `add_replicas`: each round tries one more replica of every expert held by a
  slice's busiest device (only those can lower a slice's maximum; any expert when
  none of those can move), on each device with a free slot that does not hold it,
  and keeps the (expert, device) pair with the lowest objective, even when that
  is higher than before: noisy slices make plateaus a greedy step cannot see past.
  Replicas placed after the best state seen (the first of equals) are taken out
  at the end: a replica that balances nothing would only cost a weight load.
- `place_items`: puts experts (one item per copy) into free slots, heaviest first,
  each on the device that keeps the objective lowest (used when primaries move too).
- `refine_by_swaps`: swaps the contents of two movable slots on different devices
  (an empty slot included) while that lowers the objective, never putting two
  copies of an expert on one device. Copies do not change.
"""
from __future__ import annotations

import numpy as np

from meshserve.moe.placement import EMPTY

_EPS = 1e-12


def normalised(counts: np.ndarray) -> np.ndarray:
    """Each slice's counts scaled to sum to 1 (a slice without tokens stays 0)."""
    totals = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


class SlotState:
    """Slots, copies and per-slice device loads of one layer, kept in step with each change."""

    def __init__(self, slots: np.ndarray, load_share: np.ndarray, num_ranks: int,
                 copies: np.ndarray | None = None) -> None:
        """`copies` overrides the copies counted from `slots` (items about to be placed count already)."""
        self.slots = slots
        self.shares = load_share  # [slice][expert], normalised
        self.num_logical = load_share.shape[1]
        self.num_ranks = num_ranks
        self.per_rank = slots.size // num_ranks
        self.device = np.arange(slots.size) // self.per_rank
        held = slots != EMPTY
        self.copies = np.bincount(slots[held], minlength=self.num_logical) if copies is None else copies.copy()
        self.holds = np.zeros((num_ranks, self.num_logical + 1), dtype=np.int64)  # last column: empty slots
        np.add.at(self.holds, (self.device, np.where(held, slots, self.num_logical)), 1)
        self.load = np.zeros((load_share.shape[0], num_ranks))
        self._recompute_load()

    def slot_share(self) -> np.ndarray:
        """[slice][expert + empty]: one copy's share of its expert's load; the last column (empty) is 0."""
        share = np.zeros((self.shares.shape[0], self.num_logical + 1))
        share[:, :-1] = self.shares / np.maximum(self.copies, 1)
        return share

    def _recompute_load(self) -> None:
        column = np.where(self.slots == EMPTY, self.num_logical, self.slots)
        self.load = self.slot_share()[:, column].reshape(self.shares.shape[0], self.num_ranks, -1).sum(axis=2)

    def objective(self) -> float:
        return float(self.load.max(axis=1).sum())

    def put(self, slot: int, expert: int) -> None:
        """Fill an empty slot with a copy of `expert` (the shares of its other copies shrink)."""
        self.slots[slot] = expert
        self.copies[expert] += 1
        self.holds[self.device[slot], expert] += 1
        self.holds[self.device[slot], self.num_logical] -= 1
        self._recompute_load()

    def clear(self, slot: int) -> None:
        """Empty a slot (the shares of its expert's other copies grow)."""
        expert = self.slots[slot]
        self.slots[slot] = EMPTY
        self.copies[expert] -= 1
        self.holds[self.device[slot], expert] -= 1
        self.holds[self.device[slot], self.num_logical] += 1
        self._recompute_load()

    def swap(self, a: int, b: int) -> None:
        ea, eb = self.slots[a], self.slots[b]
        da, db = self.device[a], self.device[b]
        ca = self.num_logical if ea == EMPTY else ea
        cb = self.num_logical if eb == EMPTY else eb
        share = self.slot_share()
        delta = share[:, cb] - share[:, ca]
        self.load[:, da] += delta
        self.load[:, db] -= delta
        self.holds[da, ca] -= 1
        self.holds[da, cb] += 1
        self.holds[db, cb] -= 1
        self.holds[db, ca] += 1
        self.slots[a], self.slots[b] = eb, ea


def _busiest_three(load: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per slice, the three busiest devices (ids, loads), padded with idle virtual devices."""
    num_slices = load.shape[0]
    padded = np.concatenate([load, np.zeros((num_slices, 3))], axis=1)
    order = np.argsort(-padded, axis=1, kind="stable")[:, :3]
    ids = [order[:, k] for k in range(3)]
    return ids, [padded[np.arange(num_slices), i] for i in ids]


def _max_excluding(load: np.ndarray, excluded: list[np.ndarray], busiest=None) -> np.ndarray:
    """Per slice, the largest load over devices not in `excluded` (index arrays broadcast together).

    With at most two devices excluded, the answer is among each slice's three busiest.
    """
    ids, values = busiest or _busiest_three(load)
    num_slices = load.shape[0]
    shape = np.broadcast_shapes(*(np.shape(x) for x in excluded))
    column = (num_slices,) + (1,) * len(shape)
    result = np.broadcast_to(values[2].reshape(column), (num_slices, *shape))
    for k in (1, 0):  # the busiest device not excluded wins
        allowed = np.ones((num_slices, *shape), dtype=bool)
        for x in excluded:
            allowed &= ids[k].reshape(column) != np.asarray(x)[None, ...]
        result = np.where(allowed, values[k].reshape(column), result)
    return result


def _best_replica_move(state: SlotState, open_devices: np.ndarray, candidates: np.ndarray):
    """(objective, expert, device) of the best single replica among `candidates`, or None.

    Vectorised over candidates (in chunks that bound memory) and target devices.
    """
    candidates = candidates[state.copies[candidates] < state.num_ranks]
    num_slices, num_ranks = state.load.shape
    chunk = max(1, 2_000_000 // (num_slices * num_ranks))
    best = None
    for start in range(0, candidates.size, chunk):
        experts = candidates[start:start + chunk]
        holds = state.holds[:, experts].T  # [candidate][device]
        targets = open_devices[None, :] & (holds == 0)
        keep = targets.any(axis=1)
        experts, holds, targets = experts[keep], holds[keep], targets[keep]
        if experts.size == 0:
            continue
        k = state.copies[experts]
        column = state.shares[:, experts].T  # [candidate][slice]
        new_share = column / (k + 1)[:, None]
        base = state.load[None, :, :] - (column / k[:, None] - new_share)[:, :, None] * holds[:, None, :]
        order = np.argsort(-base, axis=2, kind="stable")
        top = np.take_along_axis(base, order[:, :, :1], axis=2)
        second = np.take_along_axis(base, order[:, :, 1:2], axis=2) if num_ranks > 1 else np.zeros_like(top)
        others = np.where(order[:, :, :1] == np.arange(num_ranks)[None, None, :], second, top)
        value = np.maximum(others, base + new_share[:, :, None]).sum(axis=1)  # [candidate][device]
        value = np.where(targets, value, np.inf)
        score = value + _EPS * base.sum(axis=1)  # ties: the lighter device overall
        device = np.argmin(score, axis=1)
        rows = np.arange(experts.size)
        best_value = np.round(value[rows, device], 12)
        per_copy = column.sum(axis=1) / (k + 1)
        i = np.lexsort((experts, -per_copy, best_value))[0]  # lowest value, then heavier, then lower id
        key = (float(best_value[i]), -float(per_copy[i]), int(experts[i]))
        if best is None or key < best[0]:
            best = (key, int(experts[i]), int(device[i]))
    return None if best is None else (best[0][0], best[1], best[2])


def add_replicas(state: SlotState, free: np.ndarray, budget: int) -> None:
    """Fill up to `budget` free slots with replicas chosen by the simulated busiest device (`free` updated).

    Every round takes the best move even when it raises the objective (a plateau of noisy
    slices can hide a better state a few replicas further); at the end the replicas after
    the best state seen are taken out again.
    """
    objectives, placed = [state.objective()], []
    for _ in range(budget):
        open_devices = np.bincount(state.device[free], minlength=state.num_ranks) > 0
        if not open_devices.any():
            break
        busiest = np.unique(state.load.argmax(axis=1)[state.load.max(axis=1) > 0])
        on_busiest = np.unique(state.slots[np.isin(state.device, busiest) & (state.slots != EMPTY)])
        move = _best_replica_move(state, open_devices, on_busiest)
        if move is None:  # nothing on the busiest devices can be replicated: any expert may help elsewhere
            move = _best_replica_move(state, open_devices, np.flatnonzero(state.shares.sum(axis=0) > 0))
        if move is None:
            break
        _, expert, target = move
        slot = int(np.flatnonzero(free & (state.device == target))[0])
        free[slot] = False
        state.put(slot, expert)
        placed.append(slot)
        objectives.append(state.objective())
    keep = min(range(len(objectives)), key=lambda n: (round(objectives[n], 12), n))  # ties: fewer weights to load
    for slot in reversed(placed[keep:]):
        state.clear(slot)
        free[slot] = True


def place_items(state: SlotState, free: np.ndarray, items: list[int]) -> None:
    """Place `items` (expert ids, one per copy, counted in state.copies already) into free slots."""
    share = state.slot_share()
    for expert in sorted(items, key=lambda e: (-share[:, e].sum(), e)):
        open_devices = np.bincount(state.device[free], minlength=state.num_ranks) > 0
        if not open_devices.any():
            raise ValueError("more experts than free slots")
        preferred = open_devices & (state.holds[:, expert] == 0)
        targets = np.flatnonzero(preferred if preferred.any() else open_devices)
        others = _max_excluding(state.load, [targets])
        value = np.maximum(others, state.load[:, targets] + share[:, [expert]]).sum(axis=0)
        value = value + _EPS * state.load[:, targets].sum(axis=0)  # ties: the lighter device overall
        target = int(targets[np.argmin(value)])
        slot = int(np.flatnonzero(free & (state.device == target))[0])
        free[slot] = False
        state.slots[slot] = expert
        state.holds[target, expert] += 1
        state.holds[target, state.num_logical] -= 1
        state.load[:, target] += share[:, expert]


def refine_by_swaps(state: SlotState, movable: np.ndarray, max_swaps: int) -> int:
    """Swap movable slots across devices while the objective drops; returns the number of swaps made."""
    empty = state.num_logical
    swaps = 0
    while swaps < max_swaps:
        current = state.objective()
        share = state.slot_share()
        column = np.where(state.slots == EMPTY, empty, state.slots)
        busiest = _busiest_three(state.load)
        holds = state.holds.copy()
        holds[:, empty] = 0  # any number of empty slots may share a device
        best = None
        for a in np.unique(state.load.argmax(axis=1)[state.load.max(axis=1) > 0]):
            mine = np.flatnonzero(movable & (state.device == a))
            theirs = np.flatnonzero(movable & (state.device != a))
            if mine.size == 0 or theirs.size == 0:
                continue
            ci, cj = column[mine], column[theirs]
            b = state.device[theirs]
            delta = share[:, cj][:, None, :] - share[:, ci][:, :, None]  # [slice][mine][theirs]
            load_a = state.load[:, a][:, None, None] + delta
            load_b = state.load[:, b][:, None, :] - delta
            others = _max_excluding(state.load, [np.full(theirs.size, a), b], busiest)[:, None, :]
            value = np.maximum(others, np.maximum(load_a, load_b)).sum(axis=0)
            valid = (ci[:, None] != cj[None, :])
            valid &= holds[b[None, :], ci[:, None]] == 0  # what moves to b is not on b already
            valid &= holds[a, cj][None, :] == 0  # nor what moves to a
            value = np.where(valid, value, np.inf)
            i, j = np.unravel_index(int(np.argmin(value)), value.shape)
            if best is None or value[i, j] < best[0]:
                best = (float(value[i, j]), int(mine[i]), int(theirs[j]))
        if best is None or not best[0] < current - 1e-9:
            break
        state.swap(best[1], best[2])
        swaps += 1
    return swaps
