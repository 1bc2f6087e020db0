"""Live EPLB in the simulator (meshserve/sim/live_eplb.py): the served EPLB controller moves an op model's expert
placement on virtual time, the steps follow the placement's imbalance, and a change to the served controller
changes the simulated result."""
from __future__ import annotations

import json

import pytest

from meshserve.core.eplb_controller import EplbController
from meshserve.entrypoints.cli import main
from meshserve.parallel.cluster_file import MODEL_PRESETS
from meshserve.parallel.strategy import parse_strategy
from meshserve.sim.hardware import Hardware
from meshserve.sim.live_eplb import LiveEplbSettings
from meshserve.sim.op_model import OpStepModel, deployment_of
from meshserve.sim.run import simulate
from meshserve.sim.te import SimTE, SimTESettings
from meshserve.sim.trace import TraceRequest

# a decode TE of 64 dies (2 of its 64 DP groups simulated), 256 experts with one redundant slot per die
MODEL = OpStepModel(MODEL_PRESETS["deepseek-r1"], Hardware.load("ascend910c-cm384"),
                    deployment_of(parse_strategy("attn=DP64 moe=EP64"), 256, redundant=64))
TRACE = [TraceRequest(0.0, 1024, 200) for _ in range(128)]


def _run(interval_s: float, rebalance_below: float | None = None) -> dict:
    live = LiveEplbSettings(hot_ratio=30.0, interval_s=interval_s, slice_s=min(10.0, interval_s),
                            **({} if rebalance_below is None else {"rebalance_below": rebalance_below}))
    settings = SimTESettings(dp=2, max_num_seqs=64, kv_transfer="consumer", prefix_caching=False, live_eplb=live)
    return simulate(TRACE, SimTE(settings, MODEL), progress=False)


def test_a_te_moves_from_the_default_placement_to_a_balanced_one_and_its_steps_shorten():
    moved, unmoved = _run(interval_s=2.0), _run(interval_s=1000.0)
    eplb = moved["tes"]["te"]["eplb"]
    assert eplb["reconfigurations"] >= 1 and eplb["rounds"] > 1  # a move of primaries: several rounds
    start, end = eplb["imbalance"][0][1], eplb["imbalance"][-1][1]
    assert start > 5 and end < 1.1  # the default placement's hot devices, then the planner's balance
    assert unmoved["tes"]["te"]["eplb"]["reconfigurations"] == 0
    assert moved["mean_step_ms"] < 0.95 * unmoved["mean_step_ms"]
    assert moved["step_breakdown_ms"]["moe"] < unmoved["step_breakdown_ms"]["moe"]  # priced as the placement


def test_the_served_controller_decides_the_moves(monkeypatch):
    # a controller whose plan keeps the placement in use: nothing moves and the steps stay as slow
    monkeypatch.setattr(EplbController, "_planned", lambda self, record: self.placement)
    result = _run(interval_s=2.0)
    assert {x for _, x in result["tes"]["te"]["eplb"]["imbalance"]} == {result["tes"]["te"]["eplb"]["imbalance"][0][1]}
    assert result["mean_step_ms"] > 0.95 * _run(interval_s=1000.0)["mean_step_ms"]


def test_a_balanced_placement_stays_where_every_interval_would_move_it_again():
    always, below = _run(interval_s=2.0, rebalance_below=1.0), _run(interval_s=2.0, rebalance_below=0.95)
    # planned on each window's counts, every plan beats the placement on them by their noise: moved every interval,
    # each move's rounds unbalancing the TE while they run
    assert always["tes"]["te"]["eplb"]["reconfigurations"] > below["tes"]["te"]["eplb"]["reconfigurations"] == 1
    assert below["mean_step_ms"] < always["mean_step_ms"]


def test_the_command_reports_the_moves_and_refuses_what_it_cannot_move(tmp_path, capsys):
    out = tmp_path / "live.json"
    flags = ["simulate", "run", "--hardware", "ascend910c-cm384", "--parallel", "attn=DP64 moe=EP64", "--redundant",
             "64", "--dp", "2", "--decode-only", "--rate", "0", "--requests", "64", "--input-len", "1024:1024",
             "--output-len", "120:120", "--no-prefix-caching", "--json", str(out)]
    assert main([*flags, "--expert-load", "zipf:30", "--eplb-interval-s", "1"]) == 0
    assert json.loads(out.read_text())["tes"]["te"]["eplb"]["reconfigurations"] == 1
    assert "live EPLB on te: 1 move(s)" in capsys.readouterr().out
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"name": "p", "source": "test", "base_ms": 1.0, "per_decode_row_ms": 0.1,
                                   "per_prefill_token_ms": 0.01, "per_context_kilotoken_ms": 0.1,
                                   "per_prefill_megapair_ms": 0.1, "delivery_ms": 1.0}))
    for bad, message in (
            (["--eplb-interval-s", "1"], "needs --hardware and --expert-load"),
            (["--expert-load", "zipf:30", "--eplb-interval-s", "-1"], "--eplb-interval-s must be positive"),
            (["--expert-load", "zipf:30", "--eplb-interval-s", "1", "--eplb-rebalance-below", "1.5"],
             "--eplb-rebalance-below must be above 0 and at most 1"),
            (["--expert-load", "zipf:30", "--eplb-interval-s", "1", "--parallel", "attn=DP8 moe=EP8 disagg",
              "--redundant", "8"], "expert-parallel layouts (moe=EPn) without disaggregation")):
        assert main([*flags, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]
    assert main(["simulate", "run", "--profile", str(profile), "--expert-load", "zipf:30", "--eplb-interval-s", "1",
                 "--requests", "4", "--json", str(out)]) == 2
    assert "needs --hardware" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["attn=DP8 moe=TP2+EP4", "attn=DP8 moe=EP8 disagg"])
def test_layouts_live_eplb_does_not_simulate_are_refused(layout):
    model = OpStepModel(MODEL_PRESETS["deepseek-r1"], Hardware.load("ascend910c-cm384"),
                        deployment_of(parse_strategy(layout), 256, redundant=8))
    settings = SimTESettings(live_eplb=LiveEplbSettings(hot_ratio=30.0, interval_s=1.0))
    with pytest.raises(ValueError, match="live EPLB is simulated on expert-parallel layouts"):
        SimTE(settings, model)


def _record_file(tmp_path, num_experts: int = 256, hot_ratio: float = 30.0, seed: int = 0) -> str:
    from meshserve.moe.synthetic_load import synthetic_load

    record = synthetic_load(num_experts, num_layers=2, num_slices=4, tokens_per_slice=4096, hot_ratio=hot_ratio,
                            slice_seconds=1.0, seed=seed)
    path = tmp_path / f"load-{num_experts}-{hot_ratio:g}.json"
    path.write_text(json.dumps(record.to_dict()))
    return str(path)


def test_a_recorded_expert_load_prices_the_planners_placement_and_moves_live(tmp_path, capsys):
    out = tmp_path / "sim.json"
    flags = ["simulate", "run", "--hardware", "ascend910c-cm384", "--parallel", "attn=DP64 moe=EP64", "--dp", "2",
             "--decode-only", "--rate", "0", "--requests", "128", "--input-len", "1024:1024", "--output-len", "20:20",
             "--no-prefix-caching", "--json", str(out)]

    def moe_ms(load: str, redundant: str) -> float:
        assert main([*flags, "--expert-load", load, "--redundant", redundant]) == 0
        return json.loads(out.read_text())["step_breakdown_ms"]["moe"]
    hot, mild = _record_file(tmp_path), _record_file(tmp_path, hot_ratio=3.0)
    assert moe_ms(hot, "0") > moe_ms(mild, "0")  # a hotter recorded load, a busier expert die
    assert moe_ms(hot, "64") < moe_ms(hot, "0")  # replicas placed on the record's counts relieve it
    # live: the record's slices in turn, the placement moved by the served controller
    assert main([*flags, "--expert-load", hot, "--redundant", "64", "--eplb-interval-s", "1",
                 "--output-len", "300:300"]) == 0
    result = json.loads(out.read_text())
    eplb = result["tes"]["te"]["eplb"]
    assert eplb["reconfigurations"] >= 1 and eplb["imbalance"][-1][1] < eplb["imbalance"][0][1] / 2
    # the timeline changes at the start, at each round and at each 1 s slice of the record, not at every step
    assert len(eplb["imbalance"]) <= 1 + eplb["rounds"] + int(result["virtual_s"]) + 1
    capsys.readouterr()
    assert main([*flags, "--expert-load", _record_file(tmp_path, num_experts=64)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records 64 experts, the model has 256" in err[0]
    assert main([*flags, "--expert-load", str(tmp_path / "missing.json")]) == 2
    assert "must be zipf:H or an expert-load file" in capsys.readouterr().err
