"""The op model (meshserve/sim/op_model.py) on op-level hardware profiles (meshserve/sim/hardware.py): figures with
sources, refusals in one line, a step's time that follows the work and the layout, MTP drafts and P/D pulls run by
the served speculation controller and P/D connector, and the papers' decode points."""
from __future__ import annotations

import json

import pytest

from meshserve.core import spec_controller as served_spec
from meshserve.entrypoints.cli import main
from meshserve.parallel.cluster_file import MODEL_PRESETS
from meshserve.parallel.strategy import parse_strategy
from meshserve.sim.hardware import HARDWARE_DIR, REQUIRED_OPS, EPTable, Hardware, HardwareError
from meshserve.sim.op_model import Deployment, OpStepModel, deployment_of, expert_imbalance
from meshserve.sim.profile import GroupWork
from meshserve.sim.run import simulate
from meshserve.sim.seeds import SEED_POINTS, run_point
from meshserve.sim.te import SimTE, SimTESettings
from meshserve.sim.trace import TraceRequest

R1 = MODEL_PRESETS["deepseek-r1"]
CM384 = Hardware.load("ascend910c-cm384")
EP32 = deployment_of(parse_strategy("attn=DP32 moe=EP32"), 256)


def _model(deployment: Deployment = EP32, hardware: Hardware = CM384) -> OpStepModel:
    return OpStepModel(R1, hardware, deployment)


def _decode(batch: int, context: int, drafts: int = 0) -> GroupWork:
    return GroupWork(decode_rows=batch, context_tokens=batch * context, draft_rows=drafts * batch)


def test_every_built_in_profile_names_a_source_for_every_op():
    for path in HARDWARE_DIR.glob("*.json"):
        hardware = Hardware.load(path.stem)
        assert set(REQUIRED_OPS) <= set(hardware.ops) and hardware.devices > 0
        assert all(hardware.sources[op].strip() for op in hardware.ops)


def test_a_profile_missing_an_op_or_too_small_for_the_deployment_is_refused_in_one_line(tmp_path):
    data = json.loads((HARDWARE_DIR / "ascend910c-cm384.json").read_text())
    del data["ops"]["dispatch"]
    with pytest.raises(HardwareError, match="missing op dispatch") as err:
        Hardware.from_dict(data, "profile")
    assert "\n" not in str(err.value)
    data = json.loads((HARDWARE_DIR / "ascend910c-cm384.json").read_text())
    data["ops"]["hbm_read_gbps"] = {"value": 1346}
    with pytest.raises(HardwareError, match="hbm_read_gbps needs a figure and its source"):
        Hardware.from_dict(data, "profile")
    with pytest.raises(HardwareError, match="needs 1024 devices; hardware profile 'ascend910c-cm384' has 768"):
        _model(deployment_of(parse_strategy("attn=DP1024 moe=EP1024"), 256))
    colocated = _model()
    with pytest.raises(HardwareError, match="no figure for op 'a2e_us'"):
        _model(deployment_of(parse_strategy("attn=DP8 moe=EP8 disagg"), 256), Hardware.load("h800"))
    assert colocated.step_seconds([_decode(8, 1024)]) > 0


def test_the_ep_tables_interpolate_between_degrees_and_scale_with_the_tokens():
    table = EPTable((8, 16), (100.0, 140.0), tokens_per_rank=128)
    assert table.seconds(12, 128) == pytest.approx(120e-6)
    assert table.seconds(4, 64) == pytest.approx(50e-6) and table.seconds(64, 128) == pytest.approx(140e-6)


def test_a_step_grows_with_batch_and_context_and_drafts_cost_rows():
    model = _model()
    small, large = (model.step_seconds([_decode(b, 2048)] * 32) for b in (8, 96))
    short, long = (model.step_seconds([_decode(32, c)] * 32) for c in (512, 8192))
    assert large > small and long > short
    plain, drafting = (model.step_seconds([_decode(64, 4096, d)] * 32) for d in (0, 1))
    assert drafting > plain  # the verification rows and the MTP layer
    assert drafting < 2 * plain  # ... but far less than a second step: the weights are read once


def test_two_microbatches_overlap_a_communication_bound_layer_and_experts_wait_for_the_slowest_group():
    one, two = (deployment_of(parse_strategy("attn=DP256 moe=EP256"), 256, microbatches=m) for m in (1, 2))
    work = [_decode(96, 1024)] * 256
    h800 = Hardware.load("h800")  # its streams keep every SM: the overlap hides DeepEP's slow combine
    assert _model(two, h800).step_seconds(work) < 0.9 * _model(one, h800).step_seconds(work)
    # cloudmatrix-infer §4.2.3: the split of a die's cube cores leaves a ~10% gain at batch 96, 4K, MTP
    cm_work = [_decode(96, 4096, drafts=1)] * 256
    gain = 1 - _model(two).step_seconds(cm_work) / _model(one).step_seconds(cm_work)
    assert 0.03 < gain < 0.25
    skewed = [_decode(96, 1024)] * 255 + [_decode(96, 8192)]
    assert _model(one).step_seconds(skewed) > _model(one).step_seconds(work)
    # an imbalanced expert load makes the busiest expert device slower
    hot = deployment_of(parse_strategy("attn=DP256 moe=EP256"), 256, expert_imbalance=3.0)
    assert _model(hot).breakdown(work)["moe"] > _model(one).breakdown(work)["moe"] > 0


def test_the_planner_spreads_a_zipf_load_better_with_more_redundant_slots():
    """EPLB redundancy vs imbalance with meshserve's own planner (moe/eplb.py) on a Zipf expert load."""
    none, some, many = (expert_imbalance(256, 256, redundant, 8) for redundant in (0, 32, 256))
    assert none > some > many >= 1.0


def _decode_te(model, acceptance: float, groups: int = 2, **settings) -> SimTE:
    return SimTE(SimTESettings(dp=groups, max_num_seqs=16, num_kv_blocks=2048, num_draft_tokens=1,
                               mtp_acceptance=acceptance, kv_transfer="consumer", **settings), model)


def test_a_decode_te_pulls_each_prompt_and_mtp_drafts_shorten_the_run():
    trace = [TraceRequest(0.0, 1024, 64) for _ in range(16)]
    model = _model()
    steps = {}
    for acceptance in (0.0, 1.0):
        te = _decode_te(model, acceptance)
        result = simulate(trace, te, progress=False)
        assert result["completed"] == 16 and result["output_tokens"] == 16 * 63  # the first came from prefill
        steps[acceptance] = result["steps"]
        pulled = sum(c.num_pulled for s in te.schedulers for c in s.connectors)
        assert pulled == 16  # every prompt's KV came through the P/D connector's pull, none was computed
    assert steps[1.0] < 0.6 * steps[0.0]  # every draft accepted: two tokens a step


def test_the_simulation_drafts_as_the_served_speculation_controller_decides(monkeypatch):
    trace = [TraceRequest(0.0, 512, 48) for _ in range(8)]
    drafting = simulate(trace, _decode_te(_model(), 1.0), progress=False)

    def never(self, batch_size):
        return False, False
    monkeypatch.setattr(served_spec.SpeculationController, "decide", never)
    plain = simulate(trace, _decode_te(_model(), 1.0), progress=False)
    assert plain["steps"] > drafting["steps"]


def test_a_pull_lands_after_the_link_time_of_the_prompts_kv():
    model = _model()
    assert model.kv_pull_seconds(4096) == pytest.approx(4096 * 61 * 576 * 2 / 164e9)
    trace = [TraceRequest(0.0, 2048, 8)]
    result = simulate(trace, _decode_te(model, 0.0, groups=1), progress=False)
    assert result["ttft_s"]["p50"] > model.kv_pull_seconds(2048)


def test_a_seed_point_is_simulated_beside_the_paper():
    point = next(p for p in SEED_POINTS if p.name == "cm-tpot15")
    row = run_point(point, groups=2)
    assert row["paper_tpot_ms"] == 14.9 and row["devices"] == 320
    assert row["tpot_error"] == pytest.approx(row["tpot_ms"] / 14.9 - 1)
    assert abs(row["tpot_error"]) < 0.2 and abs(row["throughput_error"]) < 0.2
    assert set(row["step_breakdown_ms"]) == {"attention", "moe", "overlapped_layers", "dense_ffn", "mtp", "lm_head",
                                             "host"}


def test_the_command_runs_the_op_model_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    out = tmp_path / "sim.json"
    flags = ["--hardware", "ascend910c-cm384", "--parallel", "attn=DP64 moe=EP64", "--dp", "2", "--requests", "16",
             "--rate", "0", "--input-len", "512:1024", "--output-len", "8:16", "--draft-tokens", "1",
             "--mtp-acceptance", "0.7", "--decode-only", "--json", str(out)]
    assert main(["simulate", "run", *flags]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 16 and result["config"]["profile"]["deployment"]["dp"] == 64
    # 2 of the layout's 64 DP groups simulated stand for 2 of its 64 devices
    assert result["simulated_devices_per_te"] == 2
    assert result["output_tokens_per_s_per_device"] == pytest.approx(result["output_tokens_per_s"] / 2)
    out_text = capsys.readouterr().out
    assert "mean step by part (ms): attention" in out_text and "per device" in out_text
    broken = tmp_path / "broken.json"
    data = json.loads((HARDWARE_DIR / "h800.json").read_text())
    del data["ops"]["combine"]
    broken.write_text(json.dumps(data))
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0.0, "prompt_len": -5, "output_len": 4}\n')
    for bad, message in ((["--hardware", str(broken)], "missing op combine"),
                         (["--hardware", "ascend910c-cm384", "--parallel", "attn=DP1024 moe=EP1024"],
                          "needs 1024 devices"),
                         (["--hardware", "h800", "--trace", str(trace)], "prompt_len must be a positive integer"),
                         (["--hardware", "h800", "--profile", str(broken)], "give one of --profile"),
                         (["--hardware", "tpu"], "no hardware profile tpu")):
        assert main(["simulate", "run", *bad, "--json", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1


def test_tokens_per_device_count_every_te_the_deployment_holds(tmp_path):
    # the same light load on one TE and on two: as many tokens, over twice the devices
    per_device = {}
    for tes in ("1c", "2c"):
        out = tmp_path / f"{tes}.json"
        assert main(["simulate", "run", "--hardware", "h800", "--parallel", "attn=DP8 moe=EP8", "--tes", tes,
                     "--requests", "24", "--rate", "4", "--input-len", "64:128", "--output-len", "8:16",
                     "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["simulated_devices_per_te"] == 8
        per_device[tes] = result["output_tokens_per_s_per_device"]
    assert per_device["2c"] == pytest.approx(per_device["1c"] / 2, rel=0.05)
