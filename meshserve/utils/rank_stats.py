"""Rankings with ties and Spearman's rank correlation (for comparing predicted and measured orders)."""
from __future__ import annotations

import math
from collections.abc import Sequence


def average_ranks(values: Sequence[float]) -> list[float]:
    """Rank 1 for the largest value; tied values share the average of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: -values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman_rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation of the average ranks; None when undefined (fewer than 2 items, or all tied)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} values against {len(ys)}")
    if len(xs) < 2:
        return None
    rx, ry = average_ranks(xs), average_ranks(ys)
    mean = (len(xs) + 1) / 2  # average ranks always average to this
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    var_x = sum((a - mean) ** 2 for a in rx)
    var_y = sum((b - mean) ** 2 for b in ry)
    if var_x == 0 or var_y == 0:
        return None
    return cov / math.sqrt(var_x * var_y)
