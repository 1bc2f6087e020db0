"""`meshserve bench scale`: the scale-up breakdown end to end on the tiny model (every case answers the held
request, with its five steps and its weight source), the autoscaling load's shape, the summary and plot of a
result, and one-line argument errors."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from meshserve.bench.scale import (
    CASES,
    PHASES,
    STEPS,
    _breakdown_summary,
    add_scale_arguments,
    load_schedule,
    plot_scale,
    settings_from_args,
    summary_lines,
)
from meshserve.entrypoints.cli import main
from meshserve.wire.heartbeat import PRE_LOAD_PARTS

pytestmark = pytest.mark.timeout(400)


@pytest.mark.slow
def test_the_breakdown_on_the_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "scale"
    model = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    assert main(["bench", "scale", "--quick", "--model", str(model), "--out", str(out)]) == 0
    result = json.loads((out / "scale.json").read_text())
    assert result["settings"]["parts"] == ["breakdown"] and result["settings"]["runs"] == 1
    assert (out / "scale.png").stat().st_size > 0
    cases = result["breakdown"]["cases"]
    assert list(cases) == list(CASES)
    assert cases["cold"]["load_source"] == "disk" and cases["prewarmed"]["load_source"] == "disk"
    assert cases["prewarmed+dram"]["load_source"] == "page-cache" and cases["fork"]["load_source"] == "fork"
    for case, data in cases.items():
        [run] = data["runs"]
        assert run["process"] == ("cold" if case == "cold" else "prewarmed")
        assert all(math.isfinite(data["steps"][step]) for step in STEPS), case
        assert data["steps"]["te_load"] > 0 and data["ttft_s"] > 0
        assert data["ttft_s"] < data["steps"]["total"] + 5  # the held request was served by the new TE
    assert set(result["breakdown"]["ratios"]) >= {"ttft_cold_over_prewarmed", "te_load_disk_over_fork"}
    # the new process's TE-Pre-Load in its parts, each one a step forward, together the whole step
    parts = cases["cold"]["pre_load_parts"]
    assert list(parts) == list(PRE_LOAD_PARTS) and all(value > 0 for value in parts.values())
    assert sum(parts.values()) == pytest.approx(cases["cold"]["steps"]["te_pre_load"])
    assert all("pre_load_parts" not in data for case, data in cases.items() if case != "cold")
    assert "scale-up, first token after the decision" in capsys.readouterr().out


def test_the_autoscaling_load_rises_holds_stops_and_comes_back():
    times = load_schedule(10.0, seed=1)
    assert times == sorted(times) and times == load_schedule(10.0, seed=1)
    edges, start = {}, 0.0
    for name, length, *_ in PHASES:
        edges[name] = (start, start + length)
        start += length
    count = {name: sum(1 for t in times if lo <= t < hi) for name, (lo, hi) in edges.items()}
    assert count["zero"] == 0
    assert count["hold"] > count["ramp"] > 0 and count["back"] > 0
    first_ramp = sum(1 for t in times if t < edges["ramp"][0] + 5)
    last_ramp = sum(1 for t in times if edges["ramp"][1] - 5 <= t < edges["ramp"][1])
    assert last_ramp > first_ramp  # a ramp, not a step


def _entry(ttft: float, te_load: float, interpreter: float = 0.0) -> dict:
    steps = {"scaler_pre": 0.01, "te_pre_load": 1.0, "te_load": te_load, "te_post_load": 0.2, "scaler_post": 0.3}
    parts = ({"interpreter": interpreter, "master_imports": 0.2, "ranks_start": 0.5, "rank_setup": 0.3 - interpreter}
             if interpreter else {})
    return {"ttft_s": ttft, "load_source": "disk", "steps": {**steps, "total": sum(steps.values())},
            "pre_load_parts": parts}


def test_summary_ratios_and_plot(tmp_path):
    breakdown = _breakdown_summary({"cold": [_entry(9.0, 4.0, 0.1), _entry(11.0, 6.0, 0.2)],
                                    "prewarmed": [_entry(2.0, 1.0)],
                                    "prewarmed+dram": [_entry(1.5, 0.5)], "fork": [_entry(1.0, 0.25)]})
    assert breakdown["cases"]["cold"]["ttft_s"] == 10.0  # the median of the runs
    assert breakdown["ratios"]["ttft_cold_over_prewarmed"] == 5.0
    assert breakdown["ratios"]["te_load_disk_over_fork"] == 20.0
    # a new process's TE-Pre-Load part by part (medians); a pre-warmed TE has none
    assert breakdown["cases"]["cold"]["pre_load_parts"]["interpreter"] == pytest.approx(0.15)
    assert "pre_load_parts" not in breakdown["cases"]["prewarmed"]
    pool = [{"t": 0.5 * i, "tes": 1 + (i > 3), "serving": 1, "queue": i % 3, "running": 2} for i in range(8)]
    auto = {"rate": 12.0, "slo_ttft_s": 2.0, "modes": {mode: {
        "slo_attainment": 0.95, "te_seconds": 40.0, "ttft_p50_s": 0.3, "failed": 0, "pool_over_time": pool,
        "first_after_zero": {"ok": True, "ttft_s": 3.2, "error": None, "sent_at_s": 65.0},
        "requests_over_time": [{"t": 1.0, "ttft_s": 0.2, "ok": True}]} for mode in ("autoscaled", "fixed-max")}}
    result = {"breakdown": breakdown, "autoscale": auto}
    lines = summary_lines(result)
    assert any("ttft_cold_over_prewarmed: 5.00x" in line for line in lines)
    assert any("TE-Pre-Load: interpreter 0.15, master imports 0.20, forkserver + ranks' fork 0.50" in line
               for line in lines)
    assert any("first request after the pool scaled to zero: answered, first token after 3.20 s" in line
               for line in lines)
    path = plot_scale(result, tmp_path / "scale.png")
    assert path.stat().st_size > 0


def test_quick_measures_the_breakdown_once_unless_told_otherwise():
    parser = argparse.ArgumentParser()
    add_scale_arguments(parser)
    quick = settings_from_args(parser.parse_args(["--quick"]))
    assert (quick.parts, quick.runs) == (("breakdown",), 1)
    assert settings_from_args(parser.parse_args(["--quick", "--runs", "2"])).runs == 2
    full = settings_from_args(parser.parse_args([]))
    assert (full.parts, full.runs) == (("breakdown", "load", "fanout", "autoscale"), 3)


@pytest.mark.parametrize("args, message", [
    (["--parts", "breakdown,nonsense"], "--parts: unknown nonsense"),
    (["--runs", "0"], "--runs must be at least 1"),
    (["--model", "/no/such/model"], "does not exist"),
])
def test_bad_arguments_are_one_line(args, message, capsys):
    assert main(["bench", "scale", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
