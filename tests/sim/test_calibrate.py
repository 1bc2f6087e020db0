"""`meshserve simulate calibrate` and `compare` on the real engine of this machine (the tiny model): a profile
fitted from its steps, every term a cost (>= 0) and a step's base cost positive; both columns of a comparison on
one trace."""
from __future__ import annotations

import json

from meshserve.entrypoints.cli import main
from meshserve.sim.profile import GroupWork, StepProfile


def test_calibrate_fits_a_profile_of_this_machine(tiny_model, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["simulate", "calibrate", "--model", str(tiny_model("deepseek_v3")), "--out", str(out),
                 "--repeats", "1"]) == 0
    profile = StepProfile.load(out)
    assert profile.base_ms > 0 and "measured on this machine" in profile.source
    # a larger batch and a longer prompt never cost less
    assert profile.group_seconds(GroupWork(decode_rows=16)) >= profile.group_seconds(GroupWork(decode_rows=1))
    assert profile.group_seconds(GroupWork(prefill_tokens=1024)) > profile.group_seconds(GroupWork(prefill_tokens=64))
    # the waking cost after the idle times measured (>= 0: it may be none on an idle host)
    assert [idle_s for idle_s, _ in profile.wake_after_idle] == [0.1, 0.25, 0.5, 1.0, 2.0]
    assert all(extra_ms >= 0 for _, extra_ms in profile.wake_after_idle)
    assert json.loads(out.read_text())["name"].endswith("attn=TP1+DP1 moe=TP1+EP1")
    err = capsys.readouterr().err
    assert "[calibrate] decode batch 16" in err and "8 decoding + a 128-token prompt" in err
    # the arrivals workload ran: lone requests were sent beside its batch (a cost >= 0 either way; none if the
    # engine's stream delivered its tokens in fewer chunks than the workload's window)
    assert "lone requests a second beside a decoding batch: " in err and profile.per_request_ms >= 0


def test_compare_serves_one_trace_on_the_real_engine_and_the_simulation(tiny_model, tmp_path, capsys):
    """Both columns for the same 8 requests (the real engine's from its own request metrics), each error the
    simulation's against the measurement."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(StepProfile(name="rough", source="test", base_ms=3.0, per_decode_row_ms=0.2,
                                              per_prefill_token_ms=0.1).to_dict()))
    out = tmp_path / "compare.json"
    assert main(["simulate", "compare", "--model", str(tiny_model("deepseek_v3")), "--profile", str(profile),
                 "--rate", "0", "--requests", "8", "--input-len", "16:64", "--output-len", "8:16",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["metric"] for row in result["rows"]] == ["output_tokens_per_s", "ttft_s p50", "tpot_s p50"]
    assert result["measured"]["output_tokens"] == result["simulated"]["output_tokens"]  # every token, both sides
    for row in result["rows"]:
        assert row["measured"] > 0 and row["simulated"] > 0
        assert row["error"] == (row["simulated"] - row["measured"]) / row["measured"]
    assert out.with_suffix(".png").stat().st_size > 0 and "simulated" in capsys.readouterr().out
