"""`meshserve bench jitter`: one-line argument errors, the table on a made-up result, and a --quick run end to
end on the tiny model whose JSON names every configuration with ordered, positive percentiles (timings
themselves are never compared)."""
from __future__ import annotations

import json
import math

import pytest

from meshserve.bench.jitter import BASELINE, CONFIGS, PERCENTILES, table_lines
from meshserve.entrypoints.cli import main


@pytest.mark.parametrize(("flags", "message"), [(["--rounds", "0"], "--rounds must be at least 1"),
                                                (["--output-len", "2"], "--output-len must be at least 3"),
                                                (["--gc-collect-every-steps", "0"],
                                                 "--gc-collect-every-steps must be at least 1"),
                                                (["--model", "/no/such/dir"], "is not a model directory")])
def test_bad_arguments_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "jitter", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_table_has_a_row_per_configuration():
    step = {"p50": 10.0, "p90": 12.0, "p99": 20.0, "max": 30.0}
    result = {"baseline": BASELINE, "config": {"parallel": "attn=TP1+DP2 moe=TP1+EP2", "requests": 8,
                                               "output_len": 128, "rounds": 3},
              "configs": {name: {"step_ms": step, "p99_ratio": 1.0, "gc_marked_steps": 2} for name in CONFIGS}}
    lines = table_lines(result)
    assert [line.split()[0] for line in lines[1:1 + len(CONFIGS)]] == list(CONFIGS)
    assert "20.00" in lines[1] and "medians over 3 round(s)" in lines[-1]


@pytest.mark.timeout(600)
def test_a_quick_run_on_the_tiny_model(tiny_model, tmp_path, capsys):
    path = tmp_path / "jitter.json"
    assert main(["bench", "jitter", "--quick", "--model", str(tiny_model()), "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    assert result["baseline"] == BASELINE and set(result["configs"]) == set(CONFIGS)
    assert len(result["rounds"]) == result["config"]["rounds"] == 1
    for name, row in result["configs"].items():
        values = [row["step_ms"][key] for key in PERCENTILES]
        assert all(math.isfinite(v) and v > 0 for v in values), (name, values)
        assert values == sorted(values), (name, values)  # p50 <= p90 <= p99 <= max
        assert row["p99_ratio"] > 0 and row["steps_timed"] == len(result["step_ms_samples"][name]) > 0
        assert row["engine_args"]["gc_collect_every_steps"] == (0 if name == BASELINE else 200)
        assert row["engine_args"]["pin_cores"] == name.endswith("pinned")
    assert result["configs"][BASELINE]["p99_ratio"] == 1.0
    out = capsys.readouterr()
    assert all(name in out.out for name in CONFIGS)
    assert "round 1/1" in out.err  # progress on stderr
