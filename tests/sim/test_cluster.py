"""Several simulated TEs behind a job executor (meshserve/sim/cluster.py): the router's own routing policy and load
view, the P/D hand-off with the P/D connector's hold, pull and release, and routes that follow the policy."""
from __future__ import annotations

import json

import pytest

from meshserve.entrypoints.cli import main
from meshserve.router import routing as served_routing
from meshserve.sim.cluster import SimCluster, TESpec, deployment_specs
from meshserve.sim.profile import StepProfile
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
