"""`meshserve bench tenants`: its settings and one-line argument errors, the summary and figure on made-up
results, and a --quick run end to end on the tiny model whose JSON holds every field, with consistent counts."""
from __future__ import annotations

import json

import pytest

from meshserve.bench.tenants import NOISY_FACTOR, plot_tenants, summary_lines
from meshserve.entrypoints.cli import main


def _records(ttfts_ms: list[float]) -> list[dict]:
    return [{"index": i, "ok": True, "ttft_s": t / 1000, "error": None} for i, t in enumerate(ttfts_ms)]


def _made_up_result(alone_p99: float, beside_p99: float) -> dict:
    def phase(p99: float) -> dict:
        return {"ttft_ms": {"count": 3, "p50": p99 / 2, "p90": p99 * 0.9, "p99": p99}, "statuses": {"ok": 3}}

    return {"model": "m", "settings": {"tokens_per_minute": 600, "noisy_factor": NOISY_FACTOR, "noisy_rate": 20.0},
            "polite_alone": phase(alone_p99), "polite_beside_noisy": phase(beside_p99),
            "noisy": {"sent": 10, "statuses": {"ok": 2, "HTTP 429": 8}}, "ttft_p99_ratio": beside_p99 / alone_p99,
            "requests": {"polite_alone": _records([10, 20, alone_p99]),
                         "polite_beside_noisy": _records([10, 20, beside_p99]), "noisy": []}}


@pytest.mark.parametrize(("beside", "verdict"), [(15.0, "within"), (45.0, "beyond")])
def test_the_summary_gives_the_ratio_against_the_target(beside, verdict):
    lines = summary_lines(_made_up_result(20.0, beside))
    assert f"{beside / 20.0:.2f}x ({verdict} the 2x target)" in lines[-1]
    assert "HTTP 429" in lines[3]


def test_the_figure_is_written(tmp_path):
    path = plot_tenants(_made_up_result(20.0, 30.0), tmp_path / "t.png")
    assert path.stat().st_size > 0


@pytest.mark.parametrize(("flags", "message"), [(["--requests", "0"], "--requests must be at least 1"),
                                                (["--rate", "0"], "--rate must be positive"),
                                                (["--model", "/no/such/dir"], "does not exist")])
def test_bad_arguments_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "tenants", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_quick_run_on_the_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "tenants"
    model = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    assert main(["bench", "tenants", "--quick", "--model", str(model), "--out", str(out)]) == 0
    result = json.loads((out / "tenants.json").read_text())
    assert (out / "tenants.png").stat().st_size > 0
    for phase in ("polite_alone", "polite_beside_noisy"):
        assert result[phase]["statuses"] == {"ok": 8}, result[phase]["statuses"]  # the polite tenant never refused
        assert result[phase]["ttft_ms"]["count"] == 8 and result[phase]["ttft_ms"]["p99"] > 0
    noisy = result["noisy"]
    assert noisy["sent"] == sum(noisy["statuses"].values()) > 0
    assert noisy["statuses"].get("HTTP 429", 0) > 0 and set(noisy["statuses"]) <= {"ok", "HTTP 429"}
    assert result["ttft_p99_ratio"] > 0 and result["target_ratio"] == 2.0
    assert "polite p99 TTFT beside / alone" in capsys.readouterr().out
