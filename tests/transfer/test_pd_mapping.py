"""The decode rank -> prefill rank mapping of cloudmatrix-infer §4.3.3.

The paper: ratio = prefill_tp / decode_tp, group_size = decode_dp / ratio,
group_id = decode_dp_rank // group_size, source = group_id * decode_tp + decode_tp_rank.
"""
from __future__ import annotations

from collections import Counter
from itertools import product

import pytest

from meshserve.core.pd_mapping import source_prefill_tp_rank


def sources(prefill_tp: int, decode_tp: int, decode_dp: int) -> dict[tuple[int, int], int]:
    """(decode DP rank, decode TP rank) -> the prefill TP rank it pulls from."""
    return {(dp, tp): source_prefill_tp_rank(prefill_tp, decode_tp, decode_dp, dp, tp)
            for dp in range(decode_dp) for tp in range(decode_tp)}


def test_prefill_tp4_to_decode_tp1_dp4_gives_each_decode_rank_its_own_prefill_rank():
    assert sources(4, 1, 4) == {(0, 0): 0, (1, 0): 1, (2, 0): 2, (3, 0): 3}


def test_prefill_tp4_to_decode_tp2_dp2_spreads_both_tp_ranks():
    # ratio 2, group size 1: DP rank d uses prefill ranks 2d and 2d + 1
    assert sources(4, 2, 2) == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}


def test_more_decode_dp_ranks_than_the_ratio_share_prefill_ranks_in_consecutive_groups():
    # ratio 4, group size 2: DP ranks {0,1} -> 0, {2,3} -> 1, ...
    assert [sources(4, 1, 8)[(dp, 0)] for dp in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # ratio 2, group size 4
    assert [sources(2, 1, 8)[(dp, 0)] for dp in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_equal_tp_maps_each_tp_rank_to_the_same_rank():
    # what GQA needs: a TP rank holds one slice of the KV heads, so its source must hold the same slice
    for tp, dp in [(1, 1), (2, 1), (2, 3), (4, 2)]:
        assert all(src == tp_rank for (_, tp_rank), src in sources(tp, tp, dp).items()), (tp, dp)


@pytest.mark.parametrize("prefill_tp,decode_tp,decode_dp", [
    (p, t, d) for p, t, d in product([1, 2, 4, 8], [1, 2, 4], [1, 2, 4, 8])
    if p % t == 0 and d % (p // t) == 0
])
def test_divisible_layouts_load_every_prefill_rank_equally(prefill_tp, decode_tp, decode_dp):
    """Where the paper's formula is defined exactly, every prefill rank serves the same number of decode
    ranks (no hot link) and every result is a rank of the prefill TP group."""
    load = Counter(sources(prefill_tp, decode_tp, decode_dp).values())
    assert set(load) == set(range(prefill_tp))
    assert len(set(load.values())) == 1


@pytest.mark.parametrize("prefill_tp,decode_tp,decode_dp", [
    (8, 1, 2),  # fewer decode DP ranks than the ratio: the paper's group size would be 0
    (2, 4, 1),  # decode TP larger than prefill TP (MLA: any prefill rank holds the whole latent cache)
    (4, 1, 6),  # decode DP not a multiple of the ratio
    (4, 2, 3),
])
def test_other_layouts_still_name_a_valid_prefill_rank_and_use_several(prefill_tp, decode_tp, decode_dp):
    mapping = sources(prefill_tp, decode_tp, decode_dp)
    assert all(0 <= src < prefill_tp for src in mapping.values())
    assert len(set(mapping.values())) == min(prefill_tp, len(mapping))  # spread, not one hot rank


def test_decode_tp_larger_than_prefill_tp_alternates_sources():
    assert sources(2, 4, 1) == {(0, 0): 0, (0, 1): 1, (0, 2): 0, (0, 3): 1}


@pytest.mark.parametrize("args,message", [
    ((0, 1, 1, 0, 0), "prefill_tp must be at least 1"),
    ((1, 0, 1, 0, 0), "decode_tp must be at least 1"),
    ((1, 1, 0, 0, 0), "decode_dp must be at least 1"),
    ((2, 1, 2, 2, 0), "outside DP 2 x TP 1"),
    ((2, 1, 2, -1, 0), "outside"),
    ((2, 2, 1, 0, 2), "outside DP 1 x TP 2"),
])
def test_bad_sizes_and_ranks_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        source_prefill_tp_rank(*args)
