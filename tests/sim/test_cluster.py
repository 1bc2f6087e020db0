"""Several simulated TEs behind a job executor (meshserve/sim/cluster.py): the router's own routing policy and load
view, the P/D hand-off with the P/D connector's hold, pull and release, and routes that follow the policy."""
from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest

from meshserve.cluster.autoscaler import Autoscaler, AutoscalerSettings, ScaleDecision
from meshserve.entrypoints.cli import main
from meshserve.router import routing as served_routing
from meshserve.sim.cluster import SimCluster, TESpec, deployment_specs
from meshserve.sim.profile import ProfileError, StepProfile
from meshserve.sim.scaling import SimScaler
from meshserve.sim.te import SimTESettings
from meshserve.sim.trace import poisson

PROFILE = StepProfile(name="test", source="made up for the tests", base_ms=3.0, per_decode_row_ms=0.25,
                      per_prefill_token_ms=0.1, per_context_kilotoken_ms=0.8, per_prefill_megapair_ms=0.3,
                      delivery_ms=2.0)
SETTINGS = SimTESettings(max_num_seqs=16)
TRACE = poisson(40.0, 96, (64, 512), (8, 48), seed=7)


def _cluster(text: str, policy: str = "load") -> SimCluster:
    return SimCluster(deployment_specs(text, SETTINGS, PROFILE), policy=policy)


def test_a_pd_pair_hands_every_request_over_and_the_prefill_te_frees_every_hold():
    cluster = _cluster("1p+1d")
    result = cluster.run(TRACE, progress=False)
    assert result["completed"] == 96 and result["output_tokens"] == sum(r.output_len for r in TRACE)
    assert result["routes"] == {"disaggregated": 96}
    prefill, decode = cluster.members["p0"].te, cluster.members["d0"].te
    assert sum(c.num_pulled for s in decode.schedulers for c in s.connectors) == 96
    assert prefill.num_holds() == 0  # every decode pull sent ReleaseKV
    assert result["tes"]["p0"]["steps"] < result["tes"]["d0"]["steps"]  # a prompt and one token each


def test_the_simulation_routes_with_the_routers_policy_and_a_change_to_it_changes_the_result(monkeypatch):
    cluster = _cluster("2c")
    assert type(cluster.routing) is served_routing.RoutingPolicy
    assert type(cluster.loads) is served_routing.LoadTracker
    balanced = _cluster("2c").run(TRACE, progress=False)
    assert min(te["steps"] for te in balanced["tes"].values()) > 0

    def first_entry(self, cands, entries, policy, why):
        return self._decide(cands, entries[0], policy, "always the first")
    monkeypatch.setattr(served_routing.RoutingPolicy, "_least_load", first_entry)
    lopsided = _cluster("2c").run(TRACE, progress=False)
    assert lopsided["completed"] == 96 and lopsided["tes"]["c1"]["steps"] == 0
    assert lopsided["ttft_s"]["p90"] > balanced["ttft_s"]["p90"]


def test_pd_aware_routing_disaggregates_long_prompts_and_keeps_long_outputs_colocated():
    long_prompts = poisson(20.0, 24, (1024, 2048), (8, 16), seed=1)
    long_outputs = poisson(20.0, 24, (16, 32), (256, 512), seed=2)
    for trace, kind in ((long_prompts, "disaggregated"), (long_outputs, "colocated")):
        result = _cluster("1p+1d+1c", policy="pd_aware").run(trace, progress=False)
        assert result["routes"] == {kind: 24} and result["completed"] == 24


def test_round_robin_alternates_the_tes():
    result = _cluster("2c", policy="round_robin").run(TRACE, progress=False)
    assert result["completed"] == 96
    steps = [te["steps"] for te in result["tes"].values()]
    assert min(steps) > 0.5 * max(steps)


def test_bad_deployments_are_refused(tmp_path, capsys):
    for text, message in (("1p", "prefill TEs need decode TEs"), ("2x", "each part is a count"),
                          ("0c", "each part is a count")):
        with pytest.raises(ValueError, match=message):
            deployment_specs(text, SETTINGS, PROFILE)
    with pytest.raises(ValueError, match="role must be one of"):
        TESpec("t", "router", SETTINGS, PROFILE)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    out = tmp_path / "sim.json"
    assert main(["simulate", "run", "--profile", str(profile), "--tes", "1p+1d", "--requests", "12", "--rate", "10",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["routes"] == {"disaggregated": 12}
    assert main(["simulate", "run", "--profile", str(profile), "--tes", "1d", "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prefill TEs need decode TEs" in err[0]


def _burst(peak: float = 24.0, seed: int = 0) -> list:
    """Quiet, then `peak` requests/s for half a minute, then quiet again."""
    trace, now = [], 0.0
    for rate, until in ((4.0, 20.0), (peak, 50.0), (2.0, 120.0)):
        part = poisson(rate, int(rate * (until - now)) + 1, (64, 256), (16, 64), seed=seed + int(until))
        trace += [replace(r, arrival_s=now + r.arrival_s) for r in part if now + r.arrival_s < until]
        now = until
    return trace


SCALING = AutoscalerSettings(interval_s=2.0, window_s=10.0, scale_up_cooldown_s=4.0, scale_down_cooldown_s=20.0,
                             down_stable_s=20.0, running_per_te=8.0)


@functools.cache
def _scaled(text: str, pools: tuple, autoscaler_class=Autoscaler, peak: float = 24.0) -> dict:
    scaler = SimScaler(autoscaler_class(SCALING, dict(pools)), start_s=5.0)
    return SimCluster(deployment_specs(text, SETTINGS, PROFILE), scaler=scaler).run(_burst(peak), progress=False)


def test_the_served_autoscaler_grows_a_pool_for_a_burst_and_shrinks_it_after():
    result = _scaled("1c", (("group-0/colocated", (1, 5)),))
    serving = [tick["serving"]["group-0/colocated"] for tick in result["scaling"]]
    assert result["completed"] == result["requests"]
    assert max(serving) > 1 and serving[-1] < max(serving)  # up for the burst, down after it
    # fewer TE-seconds than holding the peak the whole run
    assert result["te_seconds"]["group-0/colocated"] < max(serving) * result["virtual_s"]
    fixed = SimCluster(deployment_specs("1c", SETTINGS, PROFILE)).run(_burst(), progress=False)
    assert result["ttft_s"]["p90"] < fixed["ttft_s"]["p90"]


def test_prefill_and_decode_pools_scale_on_their_own_and_a_drained_te_leaves_only_when_empty():
    result = _scaled("1p+1d", (("group-0/prefill", (1, 3)), ("group-0/decode", (1, 3))), peak=64.0)
    assert result["completed"] == result["requests"]
    gone = [te for te in result["tes"].values() if te["state"] == "gone"]
    assert gone and all(te["seconds"] > 0 for te in gone)
    peaks = {pool: max(tick["serving"].get(pool, 0) for tick in result["scaling"])
             for pool in ("group-0/prefill", "group-0/decode")}
    assert max(peaks.values()) > 1


def test_a_change_to_the_served_autoscaler_changes_the_simulated_deployment():
    class Frozen(Autoscaler):  # a policy that never changes a target
        def decide(self, now, signals):
            return [ScaleDecision(key, len(sig.loads) + sig.starting, len(sig.loads) + sig.starting, "frozen")
                    for key, sig in signals.items()]
    scaled = _scaled("1c", (("group-0/colocated", (1, 5)),))
    frozen = _scaled("1c", (("group-0/colocated", (1, 5)),), Frozen)
    assert {tick["serving"]["group-0/colocated"] for tick in frozen["scaling"]} == {1}
    assert frozen["ttft_s"]["p90"] > scaled["ttft_s"]["p90"]


def test_the_command_autoscales_and_refuses_a_pool_it_does_not_have(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    trace = tmp_path / "burst.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": r.arrival_s, "prompt_len": r.prompt_len,
                                         "output_len": r.output_len}) + "\n" for r in _burst()))
    out = tmp_path / "sim.json"
    flags = ["simulate", "run", "--profile", str(profile), "--trace", str(trace), "--tes", "1c", "--max-num-seqs",
             "16", "--te-start-s", "5", "--autoscaler-settings",
             json.dumps({"interval_s": 2, "window_s": 10, "scale_up_cooldown_s": 4, "running_per_te": 8}),
             "--json", str(out)]
    assert main([*flags, "--autoscale", "c=1:4"]) == 0
    result = json.loads(out.read_text())
    assert max(tick["serving"]["group-0/colocated"] for tick in result["scaling"]) > 1
    assert "TE-seconds" in capsys.readouterr().out and out.with_suffix(".png").stat().st_size > 0
    for bad, message in ((["--autoscale", "p=1:2"], "names pool(s) group-0/prefill that --tes does not have"),
                         (["--autoscale", "c=3:1"], "each pool is ROLE=MIN:MAX"),
                         (["--autoscale", "c=1:2", "--autoscaler-settings", '{"interval_s": -1}'], "interval_s"),
                         (["--autoscale", "c=1:2", "--prewarm-s", "-1"], "pre-warmed process's start time")):
        assert main([*flags, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_slo_attainment_counts_the_requests_that_met_both_objectives():
    result = _cluster("2c").run(TRACE, progress=False, slo=(0.05, None))
    assert result["slo_attainment"] == pytest.approx(sum(t <= 0.05 for t in result["ttfts"]) / 96)
    assert 0 < result["slo_attainment"] < 1
    both = _cluster("2c").run(TRACE, progress=False, slo=(0.05, 0.001))
    assert both["slo_attainment"] < result["slo_attainment"]
    assert _cluster("2c").run(TRACE, progress=False)["slo_attainment"] is None


def test_tes_on_one_hosts_cores_slow_each_other_only_while_both_step():
    """A profile fitted on a shared host: one TE alone steps at the fitted times; two TEs stepping at once each
    step beside another (1.7x), and with cores of their own (`share_cores=False`) neither slows."""
    shared = replace(PROFILE, stretch_beside_tes=(1.7, 2.2))
    alone = SimCluster(deployment_specs("1c", SETTINGS, shared)).run(TRACE, progress=False)
    assert alone["mean_step_ms"] == pytest.approx(
        SimCluster(deployment_specs("1c", SETTINGS, PROFILE)).run(TRACE, progress=False)["mean_step_ms"])
    assert "shared_cores_slowdown_mean" not in alone
    busy = poisson(200.0, 96, (64, 128), (48, 64), seed=3)  # both TEs step nearly all the time
    own = SimCluster(deployment_specs("2c", SETTINGS, shared), share_cores=False).run(busy, progress=False)
    sharing = SimCluster(deployment_specs("2c", SETTINGS, shared)).run(busy, progress=False)
    assert 1.4 < sharing["shared_cores_slowdown_mean"] <= 1.7 + 1e-9
    assert sharing["tpot_s"]["p50"] > 1.3 * own["tpot_s"]["p50"]
    assert sharing["completed"] == own["completed"] == 96


def test_a_starting_te_keeps_the_cores_as_busy_as_one_that_steps():
    shared = replace(PROFILE, stretch_beside_tes=(1.7, 2.2))
    cluster = SimCluster(deployment_specs("1c", SETTINGS, shared))
    cluster.add(TESpec("c1", "colocated", SETTINGS, shared), ready_in=60.0)  # loading the whole trace (2.4 s)
    result = cluster.run(TRACE, progress=False)
    assert result["shared_cores_slowdown_mean"] == pytest.approx(1.7)
    assert result["tes"]["c1"]["steps"] == 0
    # a start calibrated at half a stepping TE (`calibrate --scale-up`) stretches half as much
    light = replace(shared, starting_te_weight=0.5)
    cluster = SimCluster(deployment_specs("1c", SETTINGS, light))
    cluster.add(TESpec("c1", "colocated", SETTINGS, light), ready_in=60.0)
    assert cluster.run(TRACE, progress=False)["shared_cores_slowdown_mean"] == pytest.approx(1.35)


def test_the_shared_cores_factor_is_the_measured_stretch_continued_along_its_last_slope():
    shared = replace(PROFILE, stretch_beside_tes=(1.7, 2.2))
    assert [shared.shared_cores_factor(n) for n in range(4)] == pytest.approx([1.0, 1.7, 2.2, 2.7])
    assert replace(PROFILE, stretch_beside_tes=(1.5,)).shared_cores_factor(2) == pytest.approx(2.0)
    assert PROFILE.shared_cores_factor(5) == 1.0  # no shared host: devices of its own
    with pytest.raises(ProfileError, match="stretch_beside_tes"):
        replace(PROFILE, stretch_beside_tes=(0.5,))
    # written to a file and read back; a file without the field (fitted elsewhere, or before it) still loads
    assert StepProfile.from_dict(json.loads(json.dumps(shared.to_dict()))) == shared
    assert StepProfile.from_dict({k: v for k, v in shared.to_dict().items() if k != "stretch_beside_tes"}) \
        == PROFILE


def test_a_prompt_beside_a_decoding_te_takes_its_own_stretch_delivery_included():
    """P/D on a shared host (`calibrate --pd`): a prompt's step and its first token's delivery take the prompt
    table's stretch while the decode TE steps, and nothing while it idles; without a prompt table a prompt's step
    takes the steps' stretch and its delivery none."""
    from meshserve.sim.profile import GroupWork
    from meshserve.sim.trace import TraceRequest

    long_decode, beside, alone = (TraceRequest(0.0, 64, 400), TraceRequest(0.5, 256, 2),
                                  TraceRequest(3.0, 256, 2))  # the second comes while the first decodes

    def ttfts(profile: StepProfile) -> list[float]:
        result = SimCluster(deployment_specs("1p+1d", SETTINGS, profile)).run([long_decode, beside, alone],
                                                                              progress=False)
        assert result["completed"] == 3
        return result["ttfts"]
    prompt_s = PROFILE.group_seconds(GroupWork.prompt(256)) + 1e-3 * PROFILE.delivery_ms
    pd = replace(PROFILE, stretch_beside_tes=(1.3,), prompt_stretch_beside_tes=(2.0,))
    assert ttfts(pd)[1:] == pytest.approx([2.0 * prompt_s, prompt_s], rel=1e-6)
    steps_only = replace(PROFILE, stretch_beside_tes=(1.3,))
    assert ttfts(steps_only)[1:] == pytest.approx(
        [1.3 * PROFILE.group_seconds(GroupWork.prompt(256)) + 1e-3 * PROFILE.delivery_ms, prompt_s], rel=1e-6)
    assert pd.shared_cores_factor(1, prompt=True) == 2.0 and pd.shared_cores_factor(1) == 1.3
    assert StepProfile.from_dict(json.loads(json.dumps(pd.to_dict()))) == pd
    with pytest.raises(ProfileError, match="prompt_stretch_beside_tes"):
        replace(PROFILE, prompt_stretch_beside_tes=(0.9,))


def test_a_pre_warmed_replacement_keeps_the_cores_busy_after_a_scale_up():
    """The manager replaces the pre-warmed process a scale-up took once the new TE serves: on a shared host it
    stretches the TEs' steps for `prewarm_s`, and nowhere else."""
    shared = replace(PROFILE, stretch_beside_tes=(1.7,))
    pools = {"group-0/colocated": (1, 2)}

    def run(prewarm_s: float) -> tuple[dict, SimScaler]:
        scaler = SimScaler(Autoscaler(SCALING, dict(pools)), start_s=2.0, prewarm_s=prewarm_s)
        result = SimCluster(deployment_specs("1c", SETTINGS, shared), scaler=scaler).run(_burst(), progress=False)
        return result, scaler
    without, _ = run(0.0)
    with_pool, scaler = run(3.0)
    ready = scaler.warming_until[0] - 3.0  # when the new TE served
    assert scaler.warming(ready + 1.0) == 1 and scaler.warming(ready + 3.5) == 0
    assert with_pool["mean_step_ms"] > without["mean_step_ms"] and with_pool["tpot_s"]["p50"] > without["tpot_s"]["p50"]


def test_an_idle_history_delays_the_autoscalers_first_scale_up():
    """A deployment that idled before its load judges the load over a window that still holds the idle time."""
    pools = {"group-0/colocated": (1, 3)}

    def first_scale_up(idle_before_s: float) -> float:
        scaler = SimScaler(Autoscaler(SCALING, dict(pools)), start_s=1.0)
        loaded_from_the_start = poisson(30.0, 300, (64, 256), (16, 64), seed=5)
        result = SimCluster(deployment_specs("1c", SETTINGS, PROFILE), scaler=scaler).run(
            loaded_from_the_start, progress=False, idle_before_s=idle_before_s)
        return min(tick["at_s"] for tick in result["scaling"] if tick["serving"]["group-0/colocated"] > 1)
    assert first_scale_up(2 * SCALING.window_s) > first_scale_up(0.0)
