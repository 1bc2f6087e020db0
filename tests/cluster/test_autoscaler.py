"""The autoscaler's policy, pure: scale-up on queue, KV usage and SLO violations; hysteresis and cool-down
against an oscillating load; scale to zero when idle and back at once for a held request; clamping; P and D
pools apart; settings errors; its metrics."""
from __future__ import annotations

import logging

import pytest

from meshserve.cluster.autoscaler import Autoscaler, AutoscalerSettings, PoolSignals
from meshserve.config import ConfigError
from meshserve.router.routing import ANY_POOL, TELoad
from meshserve.wire.cluster import GroupDemand, JobExecutorReport

# short times, so a test walks through them in a few hundred ticks
FAST = AutoscalerSettings(window_s=10.0, scale_up_cooldown_s=10.0, scale_down_cooldown_s=20.0, down_stable_s=30.0,
                          idle_to_zero_s=60.0, min_slo_samples=5, max_step_up=2, max_step_down=1)


def pool(tes: int, waiting: int = 0, running: int = 0, kv: float = 0.0, waiting_tokens: int = 0,
         starting: int = 0) -> PoolSignals:
    """`tes` serving TEs sharing the totals evenly (each at KV usage `kv`)."""
    loads = [TELoad(num_running=running // tes + (i < running % tes), num_waiting=waiting // tes + (i < waiting % tes),
                    waiting_tokens=waiting_tokens // tes, kv_usage=kv) for i in range(tes)] if tes else []
    return PoolSignals(loads=loads, running=tes, starting=starting)


def demand(group: str, **fields) -> GroupDemand:
    return GroupDemand(group=group, **fields)


def only(decisions, key: str):
    return next(d for d in decisions if d.key == key)


def test_scale_up_on_queue():
    scaler = Autoscaler(FAST, {"main/colocated": (1, 8)})
    d = only(scaler.decide(0.0, {"main/colocated": pool(3, waiting=12)}), "main/colocated")
    assert (d.current, d.target, d.direction, d.kind) == (3, 5, "up", "queue")  # needs 6, +2 a step
    assert d.reason == "queue 12 > 2 per TE x 3 TEs"
    # the new TEs start (counted as current): within the cool-down nothing more, after it the rest
    d = only(scaler.decide(5.0, {"main/colocated": pool(3, waiting=12, starting=2)}), "main/colocated")
    assert (d.target, d.direction) == (5, "")
    d = only(scaler.decide(10.0, {"main/colocated": pool(3, waiting=12, starting=2)}), "main/colocated")
    assert (d.target, d.direction) == (6, "up")


def test_scale_up_on_running_requests():
    scaler = Autoscaler(FAST, {"main/colocated": (1, 8)})
    d = only(scaler.decide(0.0, {"main/colocated": pool(2, running=40)}), "main/colocated")
    assert (d.target, d.direction, d.kind) == (3, "up", "running")  # ceil(40 / 16) TEs
    assert d.reason == "40 running > 16 per TE x 2 TEs"
    d = only(Autoscaler(FAST, {"main/colocated": (1, 8)}).decide(0.0, {"main/colocated": pool(2, running=32)}),
             "main/colocated")
    assert d.direction == ""  # exactly at the target: no change


def test_scale_up_reason_shows_the_window_mean():
    # 16 then 17 running requests on one TE: the mean 16.5 is above 16 per TE, and the reason says 16.5, not 16
    scaler = Autoscaler(FAST, {"main/colocated": (1, 8)})
    assert only(scaler.decide(0.0, {"main/colocated": pool(1, running=16)}), "main/colocated").direction == ""
    d = only(scaler.decide(1.0, {"main/colocated": pool(1, running=17)}), "main/colocated")
    assert (d.target, d.direction) == (2, "up")
    assert d.reason == "16.5 running > 16 per TE x 1 TE"


def test_scale_up_on_kv_usage_and_waiting_tokens():
    scaler = Autoscaler(FAST, {"main/colocated": (1, 8), "chat/colocated": (1, 8)})
    decisions = scaler.decide(0.0, {"main/colocated": pool(2, kv=0.95),
                                    "chat/colocated": pool(2, waiting_tokens=40_000, kv=0.2)})
    kv = only(decisions, "main/colocated")
    assert (kv.target, kv.kind) == (3, "kv_usage") and kv.reason.startswith("KV usage 95% > 85%")
    tokens = only(decisions, "chat/colocated")
    assert (tokens.target, tokens.kind) == (3, "waiting_tokens")  # ceil(40000 / 16384) TEs


def test_scale_up_on_ttft_violations_and_p_and_d_pools_apart():
    scaler = Autoscaler(FAST, {"pd/prefill": (1, 4), "pd/decode": (1, 4)})
    signals = {"pd/prefill": pool(1, running=1), "pd/decode": pool(1, running=1)}
    scaler.decide(0.0, signals)
    # 12 of 40 first tokens late: the prefill pool's SLO; the decode pool's TPOT is fine
    ttft = [3.0] * 12 + [0.5] * 28
    scaler.observe(JobExecutorReport(name="je-0", http_addr="", register_addr="", pid=1, groups=[
        demand("pd/prefill", arrivals=40, ttft_s=ttft), demand("pd/decode", arrivals=40, tpot_s=[0.05] * 40)]), 1.0)
    decisions = scaler.decide(1.0, signals)
    prefill, decode = only(decisions, "pd/prefill"), only(decisions, "pd/decode")
    assert (prefill.target, prefill.kind) == (2, "ttft_slo")
    assert prefill.reason == "TTFT SLO 2 s violated by 30% of 40 requests over 10 s"
    assert (decode.target, decode.direction) == (1, "")
    # then the decode pool's TPOT: only it grows
    scaler.observe_demand("je-0", [demand("pd/decode", tpot_s=[0.3] * 10)], 2.0)
    decisions = scaler.decide(2.0, {"pd/prefill": pool(1, running=1, starting=1), "pd/decode": pool(1, running=1)})
    assert only(decisions, "pd/prefill").target == 2 and only(decisions, "pd/prefill").direction == ""
    assert (only(decisions, "pd/decode").target, only(decisions, "pd/decode").kind) == (2, "tpot_slo")


def test_too_few_slo_samples_do_not_judge():
    scaler = Autoscaler(FAST, {"main/colocated": (1, 4)})
    scaler.observe_demand("je-0", [demand("main/colocated", ttft_s=[9.0] * 4)], 0.0)  # 4 < min_slo_samples
    assert only(scaler.decide(0.0, {"main/colocated": pool(1)}), "main/colocated").target == 1


def run_oscillation(settings: AutoscalerSettings, seconds: int = 600) -> list:
    """A load that swings every 20 s between a queue of 12 and nothing, ticked each second; the changes."""
    scaler = Autoscaler(settings, {"main/colocated": (1, 8)})
    target, changes = 2, []
    for t in range(seconds):
        waiting = 12 if (t // 20) % 2 == 0 else 0
        d = only(scaler.decide(float(t), {"main/colocated": pool(target, waiting=waiting, running=4)}),
                 "main/colocated")
        if d.direction:
            changes.append((t, d.target))
        target = d.target  # the manager follows at once
    return changes


def test_hysteresis_and_cooldown_bound_changes_under_an_oscillating_load():
    changes = run_oscillation(FAST)
    assert 1 <= len(changes) <= 4, changes
    assert all(target > 2 for _, target in changes)  # it grew and never gave the TEs back within a 20 s lull
    # the same load without hysteresis, cool-down or window flaps: the bound above is the policy's doing
    naive = AutoscalerSettings(window_s=1.0, scale_up_cooldown_s=0.0, scale_down_cooldown_s=0.0,
                               down_stable_s=0.0, idle_to_zero_s=60.0)
    assert len(run_oscillation(naive)) > 20


def test_scale_down_after_the_load_stays_low():
    scaler = Autoscaler(FAST, {"main/colocated": (1, 8)})
    signals = {"main/colocated": pool(4, running=20)}  # fits 2 TEs of 16 running each
    decisions = [only(scaler.decide(float(t), signals), "main/colocated") for t in range(0, 40)]
    downs = [(t, d.target) for t, d in enumerate(decisions) if d.direction == "down"]
    assert downs == [(30, 3)]  # after down_stable_s, one step
    assert decisions[30].kind == "load" and decisions[30].reason.startswith("load fits 2 TE(s) for 30 s")
    # the next step once the load has fit fewer TEs for down_stable_s again (since t=31)
    signals = {"main/colocated": pool(3, running=20)}
    later = {t: only(scaler.decide(float(t), signals), "main/colocated") for t in range(40, 62)}
    assert [(t, d.target) for t, d in later.items() if d.direction] == [(61, 2)]
    # a burst restarts the stable period once it has left the window (t=80): the next step 30 s after that
    downs = []
    for t in range(62, 130):
        d = only(scaler.decide(float(t), {"main/colocated": pool(2, running=100 if t == 70 else 10)}),
                 "main/colocated")
        if d.direction:
            downs.append((t, d.target))
    assert downs == [(111, 1)]


def test_scale_to_zero_after_idle_and_back_on_a_held_request():
    scaler = Autoscaler(FAST, {"main/colocated": (0, 4)})
    for t in range(0, 60):
        assert only(scaler.decide(float(t), {"main/colocated": pool(1)}), "main/colocated").target == 1
    d = only(scaler.decide(60.0, {"main/colocated": pool(1)}), "main/colocated")
    assert (d.target, d.direction, d.kind, d.reason) == (0, "down", "idle", "idle 60 s: scale to zero")
    assert only(scaler.decide(61.0, {"main/colocated": pool(0)}), "main/colocated").target == 0
    # a JE holds a request: up at once, although the last change was a second ago
    scaler.observe_demand("je-0", [demand("main/colocated", held=1, held_oldest_s=0.4)], 61.5)
    d = only(scaler.decide(62.0, {"main/colocated": pool(0)}), "main/colocated")
    assert (d.target, d.direction, d.kind) == (1, "up", "held")
    assert d.reason.startswith("held request and no TE: scale from zero now")


def test_a_request_held_for_any_pool_wakes_every_pool_at_zero():
    bounds = {"main/colocated": (0, 2), "pd/prefill": (0, 2), "pd/decode": (1, 2)}
    scaler = Autoscaler(FAST, bounds)
    scaler.observe_demand("je-0", [demand(ANY_POOL, held=2, held_oldest_s=1.0)], 0.0)
    decisions = scaler.decide(0.0, {"main/colocated": pool(0), "pd/prefill": pool(0), "pd/decode": pool(1)})
    assert {d.key: d.target for d in decisions} == {"main/colocated": 1, "pd/prefill": 1, "pd/decode": 1}
    # a JE that stops reporting: its held requests stop counting
    scaler = Autoscaler(FAST, bounds)
    scaler.observe_demand("je-0", [demand("main/colocated", held=1)], 0.0)
    assert only(scaler.decide(30.0, {"main/colocated": pool(0)}), "main/colocated").target == 0


def test_targets_are_clamped_to_min_and_max():
    scaler = Autoscaler(FAST, {"a/colocated": (1, 4), "b/colocated": (3, 6), "c/colocated": (1, 2)})
    decisions = scaler.decide(0.0, {"a/colocated": pool(3, waiting=100), "b/colocated": pool(1),
                                    "c/colocated": pool(5)})
    assert only(decisions, "a/colocated").target == 4  # needs 50, max 4
    assert (only(decisions, "b/colocated").target, only(decisions, "b/colocated").kind) == (3, "min")
    assert (only(decisions, "c/colocated").target, only(decisions, "c/colocated").kind) == (2, "max")
    # idle and below nothing: never under min
    for t in range(1, 400):
        d = only(scaler.decide(float(t), {"b/colocated": pool(3)}), "b/colocated")
        assert d.target == 3


@pytest.mark.parametrize(("data", "needle"), [
    ({"window": 10}, "unknown key(s) window"),
    ({"window_s": 0}, "window_s must be a number > 0, got 0"),
    ({"kv_usage_high": 1.5}, "kv_usage_high must be a number in (0, 1], got 1.5"),
    ({"max_step_up": 1.5}, "max_step_up must be an integer >= 1, got 1.5"),
    ({"max_violation_rate": "high"}, "max_violation_rate must be a number in [0, 1]"),
    ({"idle_to_zero_s": True}, "idle_to_zero_s must be a number >= 0"),
    ([1, 2], "must be a mapping"),
])
def test_bad_settings_are_refused(data, needle):
    with pytest.raises(ConfigError) as err:
        AutoscalerSettings.from_dict(data, "deployment.yaml: autoscaler")
    assert needle in str(err.value) and str(err.value).startswith("deployment.yaml: autoscaler")


def test_settings_from_a_mapping():
    settings = AutoscalerSettings.from_dict({"window_s": 5, "max_step_up": 3}, "d")
    assert settings.window_s == 5.0 and isinstance(settings.window_s, float) and settings.max_step_up == 3
    assert AutoscalerSettings.from_dict(None, "d") == AutoscalerSettings()


def test_metrics_and_the_log(caplog):
    caplog.set_level(logging.INFO, logger="meshserve.cluster.autoscaler")
    scaler = Autoscaler(FAST, {"main/colocated": (1, 8)})
    scaler.observe_demand("je-0", [demand("main/colocated", ttft_s=[0.1] * 3 + [5.0])], 0.0)
    scaler.decide(0.0, {"main/colocated": pool(3, waiting=12, kv=0.5)})

    def value(name: str, **labels) -> float | None:
        return scaler.registry.get_sample_value(name, {"pool": "main/colocated", **labels})

    assert value("meshserve_autoscaler_decisions_total", direction="up", reason="queue") == 1.0
    assert value("meshserve_autoscaler_target_tes") == 5.0
    assert value("meshserve_autoscaler_current_tes") == 3.0
    assert value("meshserve_autoscaler_queue") == 12.0
    assert value("meshserve_autoscaler_kv_usage_ratio") == 0.5
    assert value("meshserve_autoscaler_slo_violation_ratio", slo="ttft") == 0.25
    assert value("meshserve_autoscaler_held_requests") == 0.0
    assert [r.getMessage() for r in caplog.records] == ["pool main/colocated: 3 -> 5 TEs (queue 12 > 2 per TE x 3 TEs)"]
