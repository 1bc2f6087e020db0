"""`simulate run --sensitivity` (meshserve/sim/sensitivity.py): the same trace served with every step a little
shorter and longer; a deployment near its capacity moves more per percent of step time than one far below it."""
from __future__ import annotations

import json

import pytest

from meshserve.entrypoints.cli import main
from meshserve.sim.profile import GroupWork, StepProfile
from meshserve.sim.run import simulate
from meshserve.sim.sensitivity import ScaledSteps, sensitivity
from meshserve.sim.te import SimTE, SimTESettings
from meshserve.sim.trace import poisson

PROFILE = StepProfile(name="test", source="made up for the tests", base_ms=3.0, per_decode_row_ms=0.25,
                      per_prefill_token_ms=0.1, per_context_kilotoken_ms=0.8, per_prefill_megapair_ms=0.3,
                      delivery_ms=2.0, wake_after_idle=((0.1, 1.0), (1.0, 4.0)))


def test_scaled_steps_change_the_step_time_and_nothing_else():
    longer = ScaledSteps(PROFILE, 1.1)
    work = [GroupWork(decode_rows=4, context_tokens=1000)]
    assert longer.step_seconds(work) == pytest.approx(1.1 * PROFILE.step_seconds(work))
    assert longer.delivery_ms == PROFILE.delivery_ms and longer.wake_seconds(0.5) == PROFILE.wake_seconds(0.5)


def _elasticity(rate: float) -> dict:
    trace = poisson(rate, 100, (32, 128), (16, 64), seed=3)

    def serve(timer) -> dict:
        return simulate(trace, SimTE(SimTESettings(max_num_seqs=32), timer), progress=False)
    return sensitivity(lambda factor: serve(ScaledSteps(PROFILE, factor)), serve(PROFILE), 0.05)


def test_near_its_capacity_a_deployment_moves_more_per_percent_of_step_time():
    below, near = _elasticity(5.0), _elasticity(40.0)  # this profile and trace saturate near 45/s
    for result in (below, near):  # longer steps: longer times between tokens, never shorter
        tpot = [result["figures"][key]["tpot_p50_s"] for key in ("shorter", "as fitted", "longer")]
        assert tpot[0] < tpot[1] < tpot[2]
    assert 0.5 < below["elasticity"]["tpot_p50_s"] < 1.5  # far below: about the step time's own change
    assert near["elasticity"]["tpot_p50_s"] > 2 * below["elasticity"]["tpot_p50_s"]
    assert near["elasticity"]["ttft_p50_s"] > 2 * below["elasticity"]["ttft_p50_s"]
    assert abs(below["elasticity"]["output_tokens_per_s"]) < 0.05  # below capacity the arrivals set the tokens/s


def test_the_command_reports_the_sensitivity_and_refuses_a_bad_percent(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    out = tmp_path / "sim.json"
    flags = ["simulate", "run", "--profile", str(profile), "--rate", "8", "--requests", "20", "--input-len", "16:64",
             "--output-len", "4:16", "--json", str(out)]
    assert main([*flags, "--sensitivity", "5"]) == 0
    result = json.loads(out.read_text())
    assert result["sensitivity"]["step_fraction"] == 0.05
    assert set(result["sensitivity"]["figures"]) == {"shorter", "as fitted", "longer"}
    assert result["sensitivity"]["figures"]["as fitted"]["tpot_p50_s"] == result["tpot_s"]["p50"]
    assert "5% shorter / as fitted / 5% longer" in capsys.readouterr().out
    for bad in ("0", "100", "-3"):
        assert main([*flags, "--sensitivity", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--sensitivity must be a percent between 0 and 100" in err[0]


def test_scaled_steps_keep_their_scale_when_live_eplb_changes_the_imbalance():
    from meshserve.parallel.cluster_file import MODEL_PRESETS
    from meshserve.parallel.strategy import parse_strategy
    from meshserve.sim.hardware import Hardware
    from meshserve.sim.op_model import OpStepModel, deployment_of

    model = OpStepModel(MODEL_PRESETS["deepseek-r1"], Hardware.load("ascend910c-cm384"),
                        deployment_of(parse_strategy("attn=DP64 moe=EP64"), 256, redundant=64))
    work = [GroupWork(decode_rows=64, context_tokens=64 * 1024)] * 2
    skewed = model.with_expert_imbalance(3.0)
    assert skewed.step_seconds(work) > model.step_seconds(work)
    assert ScaledSteps(model, 1.1).with_expert_imbalance(3.0).step_seconds(work) == pytest.approx(
        1.1 * skewed.step_seconds(work))
