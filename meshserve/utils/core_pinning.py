"""Pinning a rank to cores of its own (xdeepserve §4.4): a rank the OS moves between cores, or that shares a core
with another rank's threads, runs its step late, and every other rank waits for it at the next collective."""
from __future__ import annotations

import os
from collections.abc import Collection


def rank_cores(rank: int, threads: int, available: Collection[int]) -> list[int]:
    """The cores of `rank`: the `rank`-th slice of `threads` cores (its torch threads) among `available` (the
    cores this process may use), in core order. Ranks beyond the cores wrap around and share slices; a rank with
    more threads than there are cores gets them all."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if rank < 0:
        raise ValueError(f"rank must be at least 0, got {rank}")
    cores = sorted(available)
    if not cores:
        raise ValueError("no cores available")
    width = min(threads, len(cores))
    index = rank % (len(cores) // width)
    return cores[index * width:(index + 1) * width]


def pin_rank(rank: int, threads: int) -> list[int]:
    """Pin this process's calling thread (and the threads it starts from now on, e.g. torch's pool) to
    `rank_cores`; the cores chosen."""
    cores = rank_cores(rank, threads, os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores)
    return cores
