"""`meshserve bench microbatch --quick`: both schedules per latency, the hidden-time figures and the timeline."""
from __future__ import annotations

import json

import pytest

from meshserve.bench.microbatch import summarise
from meshserve.entrypoints.cli import main


def test_a_quick_run_writes_rows_a_timeline_and_a_png(tmp_path, capsys):
    out = tmp_path / "microbatch.json"
    assert main(["bench", "microbatch", "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["strategy"] == "attn=TP1+DP2 moe=TP1+EP2" and result["config"]["moe_layers"] >= 1
    rows = result["rows"]
    assert [r["latency_ms"] for r in rows] == [0.0, 2.0]
    for r in rows:
        assert r["one_batch_ms"] > 0 and r["two_microbatches_ms"] > 0
        assert r["ratio"] == pytest.approx(r["two_microbatches_ms"] / r["one_batch_ms"])
        assert len(r["one_batch_all_ms"]) == len(r["two_microbatches_all_ms"]) == 1
    assert rows[0]["hidden_fraction"] is None and rows[0]["exposed_one_ms"] == 0
    prefill = result["prefill_rows"]  # one step of 2 prompts x 32 tokens per DP group
    assert [r["latency_ms"] for r in prefill] == [0.0, 2.0] and all(r["two_microbatches_ms"] > 0 for r in prefill)
    stages = result["timeline"]["stages"]
    assert result["timeline"]["latency_ms"] == 2.0
    assert {index for index, *_ in stages} == {0, 1}
    # each micro-batch: a dispatch and a combine stage per MoE layer, then its finish
    per_half = [[stage for index, stage, *_ in stages if index == i] for i in (0, 1)]
    assert per_half[0] == per_half[1] and per_half[0][-1] == "finish"
    assert per_half[0].count("attention, dispatch") == result["config"]["moe_layers"]
    assert all(end >= start >= 0 for *_, start, end in stages)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| latency | one batch | two micro-batches |" in printed
    assert "decode: split cost with no latency" in printed and "prefill: split cost with no latency" in printed


def test_hidden_time_is_what_the_split_removes_of_the_exposed_latency():
    times = {"0.0": {"1": [0.100], "2": [0.110]}, "2.0": {"1": [0.140], "2": [0.125]}}
    base, two_ms = summarise(times, (0.0, 2.0))
    assert base["split_cost_ms"] == pytest.approx(10.0) and base["hidden_fraction"] is None
    assert two_ms["exposed_one_ms"] == pytest.approx(40.0) and two_ms["exposed_two_ms"] == pytest.approx(15.0)
    assert two_ms["hidden_ms"] == pytest.approx(25.0) and two_ms["hidden_fraction"] == pytest.approx(25 / 40)
    assert two_ms["net_ms"] == pytest.approx(15.0)


@pytest.mark.parametrize("extra, message", [
    (["--latencies", "1,2"], "--latencies must include 0"),
    (["--latencies", "0,x"], "comma-separated milliseconds"),
    (["--batch", "1"], "--batch must be at least 2"),
    (["--prefill-tokens", "100", "--prefill-len", "64"], "--prefill-tokens must hold at least two prompts"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "m.json"
    assert main(["bench", "microbatch", "--json", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
    assert not out.exists()
