"""The EPLB algorithm of xdeepserve §4.5 step 2: choose redundant experts, then place them.

Choice: the hottest expert of each time slice is h_t = argmax_e count[e][t] (a
replicated expert counts count/copies, the share of each replica) and the layer's
load is L = sum_t count[h_t][t]. Each round simulates one more replica of every
expert that is hot in some slice, keeps the one that minimises L, and repeats
until the budget is spent.

- No early stop on a plateau: when two experts tie for the hottest of a slice,
  one more replica of either leaves L unchanged but the next round lowers it, and
  every replica also lowers its expert's share on the devices that hold it.
  Ties go to the expert with the larger share summed over slices, then the lower id.
- The choice does stop once every hot expert has a copy on every device: a second
  copy on the same device cannot take load off it.

Placement: the chosen replicas, with their load summed over the slices and split
evenly over the copies, go in descending order to the least-loaded device (the
sum of its slots' shares) that has a free slot and does not already hold that
expert (a device that does is used only when no other has a free slot).
"""
from __future__ import annotations

import numpy as np

from meshserve.moe.placement import EMPTY


def choose_replicas(counts: np.ndarray, copies: np.ndarray, budget: int, max_copies: int) -> list[int]:
    """Experts to add one replica each (in the order chosen); `copies` is updated in place."""
    slices = np.arange(counts.shape[0])
    active = counts.sum(axis=1) > 0
    chosen: list[int] = []
    for _ in range(budget):
        share = counts / copies
        hottest = share.max(axis=1)
        hot = np.unique(np.nonzero(active[:, None] & (share == hottest[:, None]) & (share > 0))[1])
        hot = hot[copies[hot] < max_copies]
        if hot.size == 0:
            break
        # L after one more replica of each candidate: a slice's max is the candidate's new share
        # or, where the candidate was the hottest, the runner-up.
        order = np.argsort(-share, axis=1, kind="stable")
        top, runner_up = share[slices, order[:, 0]], share[slices, order[:, min(1, share.shape[1] - 1)]]
        new_share = counts[:, hot] / (copies[hot] + 1)  # [slice][candidate]
        others = np.where(order[:, :1] == hot[None, :], runner_up[:, None], top[:, None])
        if share.shape[1] == 1:
            others = np.zeros_like(others)
        load = np.maximum(others, new_share)[active].sum(axis=0)
        per_copy_total = (counts[:, hot] / copies[hot]).sum(axis=0)
        best = min(range(hot.size), key=lambda i: (load[i], -per_copy_total[i], hot[i]))
        expert = int(hot[best])
        copies[expert] += 1
        chosen.append(expert)
    return chosen


def place_by_descending_load(slots: np.ndarray, free: np.ndarray, items: list[int], counts: np.ndarray,
                             num_ranks: int) -> None:
    """Put `items` (expert ids, one per copy to place) into free slots of `slots`, in place."""
    num_logical = counts.shape[1]
    per_rank = slots.size // num_ranks
    # every item counts as a copy from the start: a replica's share is its expert's load / final copies
    copies = np.bincount(np.concatenate([slots[slots != EMPTY], np.asarray(items, dtype=slots.dtype)]),
                         minlength=num_logical)
    share = counts.sum(axis=0) / np.maximum(copies, 1)
    device = np.arange(slots.size) // per_rank
    load = np.zeros(num_ranks)
    np.add.at(load, device[slots != EMPTY], share[slots[slots != EMPTY]])
    holds = np.zeros((num_ranks, num_logical), dtype=bool)
    holds[device[slots != EMPTY], slots[slots != EMPTY]] = True
    free_per_device = np.bincount(device[free], minlength=num_ranks)
    for expert in sorted(items, key=lambda e: (-share[e], e)):
        open_devices = free_per_device > 0
        if not open_devices.any():
            raise ValueError("more replicas than free slots")
        preferred = open_devices & ~holds[:, expert]
        candidates = np.flatnonzero(preferred if preferred.any() else open_devices)
        target = int(candidates[np.argmin(load[candidates])])  # argmin keeps the lowest id on ties
        slot = int(np.flatnonzero(free & (device == target))[0])
        slots[slot] = expert
        free[slot] = False
        free_per_device[target] -= 1
        holds[target, expert] = True
        load[target] += share[expert]
