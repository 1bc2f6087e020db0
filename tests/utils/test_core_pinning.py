"""Each rank's slice of the cores it may run on."""
from __future__ import annotations

import os

import pytest

from meshserve.utils.core_pinning import pin_rank, rank_cores


def test_ranks_get_disjoint_slices_as_wide_as_their_threads():
    cores = range(8)
    slices = [rank_cores(rank, 2, cores) for rank in range(4)]
    assert slices == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_only_the_cores_the_process_may_use_are_handed_out_in_order():
    assert [rank_cores(rank, 1, {9, 3, 5}) for rank in range(3)] == [[3], [5], [9]]


def test_ranks_beyond_the_cores_wrap_around():
    assert [rank_cores(rank, 3, range(8)) for rank in range(4)] == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]
    # a remote host's ranks count from their own rank numbers the same way
    assert rank_cores(5, 2, range(4)) == [2, 3]


def test_more_threads_than_cores_take_them_all():
    assert rank_cores(1, 16, [0, 1]) == [0, 1]


@pytest.mark.parametrize("rank, threads, cores, message", [
    (0, 0, [0], "threads must be at least 1"), (-1, 1, [0], "rank must be at least 0"), (0, 1, [], "no cores")])
def test_bad_arguments_are_refused(rank, threads, cores, message):
    with pytest.raises(ValueError, match=message):
        rank_cores(rank, threads, cores)


def test_pinning_sets_this_threads_affinity(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: calls.append((pid, list(cores))))
    assert pin_rank(3, 2) == [2, 3]
    assert calls == [(0, [2, 3])]
