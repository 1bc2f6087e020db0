"""`meshserve bench a2e`: one-line argument errors, the table's ratios on a made-up result, and a --quick run
(2 attention + 2 expert ranks) whose JSON has a row per routing with positive latencies and each ratio against
direct routing (timings themselves are never compared)."""
from __future__ import annotations

import json

import pytest

from meshserve.bench.a2e import ROUTINGS, table_lines
from meshserve.entrypoints.cli import main


@pytest.mark.parametrize(("flags", "message"), [
    (["--attention", "0"], "--attention must be at least 1"),
    (["--tokens", "0"], "--tokens must all be at least 1"),
    (["--expert-ranks", "3"], "is not a whole number of nodes"),
    (["--expert-ranks", "4", "--experts", "6"], "do not split evenly"),
    (["--top-k", "40"], "--top-k between 1 and --experts"),
])
def test_bad_arguments_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "a2e", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_table_shows_each_routing_against_direct():
    rows = [{"expert_ranks": 2, "tokens": 8, "routing": routing, "a2e_ms": a2e, "e2a_ms": e2a,
             "a2e_vs_direct": a2e / 1.0, "e2a_vs_direct": e2a / 2.0}
            for routing, a2e, e2a in (("direct", 1.0, 2.0), ("two-stage", 1.5, 1.0))]
    config = {"attention": 2, "steps": 3, "hidden": 64, "experts": 8, "top_k": 2, "ranks_per_node": 2,
              "int8": False}
    lines = table_lines({"config": config, "rows": rows})
    assert len(lines) == 4 and "1.50" in lines[2] and "0.50" in lines[2] and "fp32 rows" in lines[-1]


@pytest.mark.timeout(300)
def test_a_quick_run_writes_rows_ratios_and_a_png(tmp_path, capsys):
    path = tmp_path / "a2e.json"
    assert main(["bench", "a2e", "--quick", "--hidden", "64", "--experts", "8", "--top-k", "2",
                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    assert [(r["expert_ranks"], r["tokens"], r["routing"]) for r in result["rows"]] == [(2, 8, r) for r in ROUTINGS]
    for row in result["rows"]:
        assert row["a2e_ms"] > 0 and row["e2a_ms"] > 0 and len(row["a2e_steps_ms"]) == 3
    direct, two_stage = result["rows"]
    assert direct["a2e_vs_direct"] == direct["e2a_vs_direct"] == 1.0
    assert two_stage["a2e_vs_direct"] == pytest.approx(two_stage["a2e_ms"] / direct["a2e_ms"])
    assert "two-stage" in capsys.readouterr().out
