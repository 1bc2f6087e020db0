import json
from collections import Counter

import pytest

from meshserve.bench.workload import (
    WorkloadError,
    make_offline_workload,
    make_shared_prefix_workload,
    parse_range,
    special_token_ids,
)


def test_parse_range_accepts_pairs_and_single_values():
    assert parse_range("3:7") == (3, 7)
    assert parse_range(" 5 ") == (5, 5)
    assert parse_range("4:4") == (4, 4)


@pytest.mark.parametrize("text", ["", "a:b", "1:2:3", "7:3", "0:4", "-1:2", ":5", "3:"])
def test_parse_range_rejects_bad_text_with_the_name(text):
    with pytest.raises(WorkloadError, match="--input-len"):
        parse_range(text, "--input-len")


def test_offline_workload_is_deterministic_and_in_range():
    a = make_offline_workload(200, (3, 9), (2, 5), vocab_size=50, seed=7)
    b = make_offline_workload(200, (3, 9), (2, 5), vocab_size=50, seed=7)
    c = make_offline_workload(200, (3, 9), (2, 5), vocab_size=50, seed=8)
    assert a == b
    assert a != c
    assert {len(r.prompt_token_ids) for r in a} == set(range(3, 10))  # 200 draws hit every length
    assert {r.output_len for r in a} == {2, 3, 4, 5}
    assert all(0 <= t < 50 for r in a for t in r.prompt_token_ids)


def test_offline_workload_never_draws_excluded_ids():
    excluded = {0, 1, 2, 5, 9}
    workload = make_offline_workload(100, (20, 20), (1, 1), vocab_size=10, seed=0, exclude_token_ids=excluded)
    seen = Counter(t for r in workload for t in r.prompt_token_ids)
    assert set(seen) == set(range(10)) - excluded  # every allowed id appears, no excluded one


@pytest.mark.parametrize("kwargs", [
    {"num_requests": 0},
    {"input_len": (0, 3)},
    {"output_len": (4, 2)},
    {"vocab_size": 0},
    {"vocab_size": 3, "exclude_token_ids": [0, 1, 2]},
])
def test_offline_workload_rejects_bad_parameters(kwargs):
    args = {"num_requests": 2, "input_len": (1, 2), "output_len": (1, 2), "vocab_size": 10} | kwargs
    with pytest.raises(WorkloadError):
        make_offline_workload(**args)


def test_special_token_ids_reads_config_and_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 3, "eos_token_id": [4, 5], "pad_token_id": None}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 8, "content": "<x>", "special": True}, {"id": 9, "content": "word", "special": False}]}))
    assert special_token_ids(tmp_path) == {3, 4, 5, 8}


def test_shared_prefix_workload_shares_the_requested_fraction():
    workload = make_shared_prefix_workload(40, prefix_len=6, suffix_len=(2, 4), output_len=(1, 3), vocab_size=1000,
                                           shared_fraction=0.5, num_prefixes=2, seed=3)
    assert workload == make_shared_prefix_workload(40, 6, (2, 4), (1, 3), 1000, 0.5, 2, seed=3)
    prefixes = Counter(tuple(r.prompt_token_ids[:6]) for r in workload)
    common = [p for p, n in prefixes.items() if n > 1]
    assert len(common) == 2
    assert sorted(prefixes[p] for p in common) == [10, 10]  # 20 sharing requests, round-robin over 2 prefixes
    assert sum(1 for n in prefixes.values() if n == 1) == 20
    assert all(8 <= len(r.prompt_token_ids) <= 10 for r in workload)


def test_shared_prefix_workload_rejects_bad_fraction():
    with pytest.raises(WorkloadError, match="shared_fraction"):
        make_shared_prefix_workload(4, 2, (1, 1), (1, 1), 100, shared_fraction=1.5)
