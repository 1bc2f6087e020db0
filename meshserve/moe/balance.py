"""Device load of a placement, and its balancedness (mean device load / max device load).

Tokens routed to a replicated expert rotate over its replicas, so each replica
gets an even share; a device's load is the sum of its slots' shares. The load
model counts tokens only: tokens set both the dispatch/combine traffic and the
expert matmul work of a device (xdeepserve §4.5 step 1).

Two balancedness figures:
- per slice: mean/max device load within each time slice, averaged over the
  slices that saw tokens. A forward step waits for the busiest device at that
  moment, so this is the figure that tracks step time; it is what the planner
  optimises and what `meshserve bench eplb` reports first.
- total: mean/max of the device loads summed over all slices. Hot experts that
  drift between slices even out in the sum, so it is usually the higher figure.
"""
from __future__ import annotations

import numpy as np

from meshserve.moe.placement import EMPTY


def as_counts(counts, num_logical: int | None = None) -> np.ndarray:
    """counts[slice][expert] as a float array, checked."""
    array = np.asarray(counts, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] < 1:
        raise ValueError("expert counts must be a non-empty list of slices, each a list of per-expert counts")
    if num_logical is not None and array.shape[1] != num_logical:
        raise ValueError(f"expert counts have {array.shape[1]} experts per slice, expected {num_logical}")
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError("expert counts must be finite and non-negative")
    return array


def copies_of(slots: list[int] | np.ndarray, num_logical: int) -> np.ndarray:
    """How many slots hold each logical expert."""
    held = np.asarray(slots)
    return np.bincount(held[held != EMPTY], minlength=num_logical)


def slot_loads(slots: list[int] | np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[slice][slot]: each slot's share of its expert's tokens (0 for an empty slot)."""
    held = np.asarray(slots)
    num_logical = counts.shape[1]
    copies = copies_of(held, num_logical)
    share = np.zeros((counts.shape[0], num_logical + 1))  # the extra column is the empty slot's
    share[:, :num_logical] = counts / np.maximum(copies, 1)
    return share[:, np.where(held == EMPTY, num_logical, held)]


def device_loads(slots: list[int] | np.ndarray, counts, num_ranks: int) -> np.ndarray:
    """[slice][device] tokens each device processes; devices hold consecutive, equal runs of slots."""
    counts = as_counts(counts)
    if len(slots) % num_ranks:
        raise ValueError(f"{len(slots)} slots do not split evenly over {num_ranks} devices")
    return slot_loads(slots, counts).reshape(counts.shape[0], num_ranks, -1).sum(axis=2)


def _ratio(loads: np.ndarray) -> np.ndarray:
    """mean/max along the last axis; rows without load give NaN."""
    peak = loads.max(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(peak > 0, loads.mean(axis=-1) / np.where(peak > 0, peak, 1), np.nan)


def per_slice_balancedness(slots, counts, num_ranks: int) -> list[float | None]:
    """mean/max device load of each slice (None for a slice without tokens)."""
    ratios = _ratio(device_loads(slots, counts, num_ranks))
    return [None if np.isnan(r) else float(r) for r in ratios]


def balancedness(slots, counts, num_ranks: int) -> float:
    """Per-slice mean/max device load, averaged over the slices with tokens (1.0 when none has any)."""
    ratios = _ratio(device_loads(slots, counts, num_ranks))
    ratios = ratios[~np.isnan(ratios)]
    return float(ratios.mean()) if ratios.size else 1.0


def total_balancedness(slots, counts, num_ranks: int) -> float:
    """mean/max of the device loads summed over every slice (1.0 without tokens)."""
    ratio = _ratio(device_loads(slots, counts, num_ranks).sum(axis=0))
    return 1.0 if np.isnan(ratio) else float(ratio)
