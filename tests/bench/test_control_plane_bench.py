"""`meshserve bench control-plane`: one-line argument errors, the table and ratios on a made-up result, and a
--quick --remote-ranks run end to end on the tiny model whose JSON has a row per DP degree, way of running the
groups and place of the ranks, with positive figures and each ratio against DP 1 (timings themselves are never
compared)."""
from __future__ import annotations

import json

import pytest

from meshserve.bench.control_plane import (
    LOCAL,
    LOCKSTEP,
    MODES,
    REMOTE,
    SELF_CONTAINED,
    ControlPlaneSettings,
    _result,
    medians,
    table_lines,
)
from meshserve.entrypoints.cli import main


@pytest.mark.parametrize(("flags", "message"), [(["--repeats", "0"], "--repeats must be at least 1"),
                                                (["--dp", "2", "4"], "--dp must include 1"),
                                                (["--dp", "1", "1"], "--dp takes distinct degrees"),
                                                (["--model-ms", "-1"], "--model-ms must be at least 0"),
                                                (["--model", "/no/such/dir"], "is not a model directory")])
def test_bad_arguments_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "control-plane", *flags]) in (1, 2)
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_ratios_are_against_dp1_of_the_same_way_of_running():
    settings = ControlPlaneSettings(model_dir=None, model_ms=20.0, dp=(1, 8), requests_per_group=8, output_len=64,
                                    prompt_len=8, repeats=3, json_path="x.json")
    figures = {(LOCKSTEP, 1): 0.5, (LOCKSTEP, 8): 3.0, (SELF_CONTAINED, 1): 0.6, (SELF_CONTAINED, 8): 0.66}
    rows = [{"dp": dp, "mode": mode, "ranks": LOCAL, "control_cpu_ms_per_step": figures[mode, dp],
             "control_cpu_total_ms_per_step": figures[mode, dp] * dp, "wall_ms_per_step": 20.0 + 10 * figures[mode, dp],
             "non_model_ms_per_step": 10 * figures[mode, dp], "cpu_floor_ms_per_step": 0.05 * dp,
             "rank_cpu_ms_per_step": 0.1 * (2 if dp == 8 else 1)}
            for dp in (1, 8) for mode in MODES]
    result = _result(settings, "m", rows)
    by_key = {(r["mode"], r["dp"]): r for r in result["rows"]}
    assert by_key[LOCKSTEP, 8]["control_cpu_vs_dp1"] == pytest.approx(6.0)
    assert by_key[SELF_CONTAINED, 8]["control_cpu_vs_dp1"] == pytest.approx(1.1)
    assert result["self_contained_largest_vs_dp1"] == pytest.approx(1.1) and result["largest_dp"] == 8
    lines = table_lines(result)
    assert by_key[LOCKSTEP, 8]["non_model_vs_dp1"] == pytest.approx(6.0)
    assert by_key[SELF_CONTAINED, 8]["rank_cpu_vs_dp1"] == pytest.approx(2.0)
    assert result["self_contained_largest_rank_cpu_vs_dp1"] == pytest.approx(2.0)
    assert len(lines) == 1 + len(rows) + 1 and "6.00" in lines[3] and "1.10x in control CPU" in lines[-1]
    assert "2.00x in the busiest rank's CPU" in lines[-1] and "1.10x in non-model time" in lines[-1]
    assert "0.40" in lines[4]  # DP8's floor
    assert result["self_contained_remote_vs_local"] is None and "TCP" not in "".join(lines)


def test_remote_rows_are_compared_with_the_same_engine_on_one_host():
    settings = ControlPlaneSettings(model_dir=None, model_ms=20.0, dp=(1, 4), requests_per_group=8, output_len=64,
                                    prompt_len=8, repeats=3, json_path="x.json", remote_ranks=True)
    rows = [{"dp": dp, "mode": mode, "ranks": ranks, "control_cpu_ms_per_step": 0.5,
             "control_cpu_total_ms_per_step": 0.5 * dp, "wall_ms_per_step": 21.0 + (3.0 if ranks == REMOTE else 0),
             "non_model_ms_per_step": 1.0 + (3.0 if ranks == REMOTE else 0), "cpu_floor_ms_per_step": 0.1,
             "rank_cpu_ms_per_step": 0.4 if ranks == REMOTE else 0.2}
            for dp, ranks in ((1, LOCAL), (4, LOCAL), (4, REMOTE)) for mode in MODES]
    result = _result(settings, "m", rows)
    remote = result["self_contained_remote_vs_local"]
    assert remote["wall_ms_per_step"] == pytest.approx(24.0 / 21.0) and remote["rank_cpu_ms_per_step"] == 2.0
    # the remote rows' ratios are against DP 1 on one host; the headline is the local rows'
    by_key = {(r["mode"], r["dp"], r["ranks"]): r for r in result["rows"]}
    assert by_key[SELF_CONTAINED, 4, REMOTE]["non_model_vs_dp1"] == pytest.approx(4.0)
    assert result["self_contained_largest_non_model_vs_dp1"] == pytest.approx(1.0)
    lines = table_lines(result)
    assert sum("self-contained, remote" in line for line in lines) == 1
    assert "2.00x in the busiest rank's CPU)" in lines[-1] and "over TCP" in lines[-1]


def test_medians_leave_out_what_the_real_model_has_none_of():
    runs = [{"wall_ms_per_step": w, "non_model_ms_per_step": None} for w in (30.0, 10.0, 20.0)]
    assert medians(runs) == {"wall_ms_per_step": 20.0, "non_model_ms_per_step": None}


def test_the_table_shows_dashes_for_non_model_time_with_the_real_model():
    settings = ControlPlaneSettings(model_dir=None, model_ms=None, dp=(1, 2), requests_per_group=8, output_len=64,
                                    prompt_len=8, repeats=3, json_path="x.json")
    rows = [{"dp": dp, "mode": mode, "ranks": LOCAL, "control_cpu_ms_per_step": 1.0 * dp,
             "control_cpu_total_ms_per_step": 1.0 * dp,
             "wall_ms_per_step": 30.0, "non_model_ms_per_step": None, "cpu_floor_ms_per_step": None,
             "rank_cpu_ms_per_step": 5.0}
            for dp in (1, 2) for mode in MODES]
    result = _result(settings, "m", rows)
    assert result["self_contained_largest_vs_dp1"] == pytest.approx(2.0)
    lines = table_lines(result)
    assert " - " in lines[1] and "the real model" in lines[-1] and "non-model time" not in lines[-1]


@pytest.mark.timeout(600)
def test_a_quick_run_on_the_tiny_model(tiny_model, tmp_path, capsys):
    path = tmp_path / "control_plane.json"
    assert main(["bench", "control-plane", "--quick", "--remote-ranks", "--model", str(tiny_model()),
                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    assert sorted((r["mode"], r["dp"], r["ranks"]) for r in result["rows"]) == sorted(
        [(mode, 1, LOCAL) for mode in MODES] + [(mode, 2, ranks) for mode in MODES for ranks in (LOCAL, REMOTE)])
    assert result["self_contained_remote_vs_local"]["rank_cpu_ms_per_step"] > 0
    for row in result["rows"]:
        assert row["control_cpu_ms_per_step"] > 0 and row["rank_cpu_ms_per_step"] > 0
        assert row["wall_ms_per_step"] >= result["config"]["model_ms"]  # each step sleeps that long on the ranks
        assert row["non_model_ms_per_step"] == pytest.approx(row["wall_ms_per_step"] - result["config"]["model_ms"])
        assert row["control_cpu_total_ms_per_step"] >= row["control_cpu_ms_per_step"] * 0.999
        assert 0 < row["cpu_floor_ms_per_step"] <= row["rank_cpu_ms_per_step"] * row["dp"] * 1.001
        if row["dp"] == 1:
            assert row["control_cpu_vs_dp1"] == pytest.approx(1.0)
    out = capsys.readouterr()
    assert "self-contained" in out.out and "DP2 lockstep" in out.err  # progress on stderr
