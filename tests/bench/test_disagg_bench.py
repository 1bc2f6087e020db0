"""`meshserve bench disagg`: one-line argument errors, the layouts it compares, the table on a made-up result, and
a --quick run (4 ranks: colocated DP4/EP4 against 2 attention + 2 expert ranks in 1 and 2 DP domains) whose JSON
has every layout with its ratio to the colocated one measured in the same run, the colocated greedy tokens, and a
timeline in which the expert ranks serve both domains (timings themselves are never compared)."""
from __future__ import annotations

import argparse
import json

import pytest

from meshserve.bench.disagg import COLOCATED, settings_from_args, summary_lines
from meshserve.entrypoints.cli import main


@pytest.mark.parametrize(("flags", "message"), [
    (["--attention", "4"], "--attention must leave at least one of the 4 ranks"),
    (["--domains", "3"], "--domains 3 must divide the 2 attention ranks"),
    (["--link-ms", "-1"], "--link-ms must be zero or more"),
    (["--repeats", "0"], "--repeats must be at least 1"),
])
def test_bad_arguments_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "disagg", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_layouts_share_the_ranks_and_the_colocated_one_comes_first():
    args = argparse.Namespace(quick=False, model=None, preset=None, json="x.json", ranks=6, attention=4, domains=[1, 4],
                              link_ms=None, requests=None, output_len=None, repeats=None)
    layouts = settings_from_args(args).layouts()
    assert list(layouts) == [COLOCATED, "disagg domains=1", "disagg domains=4", "disagg domains=4 microbatches=2"]
    assert layouts == {COLOCATED: "attn=TP1+DP6 moe=TP1+EP6", "disagg domains=1": "attn=DP4 moe=EP2 disagg domains=1",
                       "disagg domains=4": "attn=DP4 moe=EP2 disagg domains=4",
                       "disagg domains=4 microbatches=2": "attn=DP4 moe=EP2 disagg domains=4"}


def test_the_table_shows_each_layout_against_the_colocated_one():
    rows = [{"layout": COLOCATED, "link_ms": 2.0, "status": "ok", "output_tokens_per_s": 100.0, "step_ms": 40.0,
             "tokens_per_s_vs_colocated": 1.0, "greedy_vs_colocated": {"mismatching_requests": 0}},
            {"layout": "disagg domains=2", "link_ms": 2.0, "status": "ok", "output_tokens_per_s": 125.0,
             "step_ms": 30.0, "tokens_per_s_vs_colocated": 1.25, "greedy_vs_colocated": {"mismatching_requests": 1}},
            {"layout": "disagg domains=1", "link_ms": 2.0, "status": "failed", "error": "timed out"}]
    lines = summary_lines({"rows": rows})
    assert "1.25x" in lines[2] and "1 differ" in lines[2] and "same" in lines[1] and "timed out" in lines[3]


@pytest.mark.timeout(600)
def test_a_quick_run_compares_every_layout_and_draws_the_domains_taking_turns(tmp_path, capsys):
    path = tmp_path / "disagg.json"
    assert main(["bench", "disagg", "--quick", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    rows = {row["layout"]: row for row in result["rows"]}
    assert list(rows) == [COLOCATED, "disagg domains=1", "disagg domains=2", "disagg domains=2 microbatches=2"]
    for row in rows.values():
        assert row["status"] == "ok" and row["output_tokens_per_s"] > 0 and row["step_ms"] > 0
        assert row["greedy_vs_colocated"]["mismatching_requests"] == 0
        assert row["tokens_per_s_vs_colocated"] == pytest.approx(
            row["output_tokens_per_s"] / rows[COLOCATED]["output_tokens_per_s"])
    timeline = result["timeline"]
    assert timeline["domains"] == 2 and timeline["attention_ranks"] == 2
    experts = [spans for rank, spans in timeline["ranks"].items() if int(rank) >= 2]
    assert len(experts) == 2
    for spans in experts:  # each expert rank serves both domains, in turn, and computes within each service
        assert {s["domain"] for s in spans} == {0, 1} and {s["kind"] for s in spans} == {"serve", "compute"}
    attention = {int(rank): spans for rank, spans in timeline["ranks"].items() if int(rank) < 2}
    assert {s["domain"] for s in attention[0]} == {0} and {s["domain"] for s in attention[1]} == {1}
    # two micro-batches per step, both away on the experts at once
    assert {s["microbatch"] for s in attention[0]} == {0, 1}
    assert any(a["start"] < b["end"] and b["start"] < a["end"] for a in attention[0] for b in attention[0]
               if a["microbatch"] != b["microbatch"])
    assert "disagg domains=2" in capsys.readouterr().out
