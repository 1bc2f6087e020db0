"""Shared prefixes in the simulator: prompts that share them, the engine's pool connector fetching what another TE
computed (meshserve/sim/kv_pool.py) and deciding it, and locality routing on the prompt tree the TEs' prefix-cache
events build."""
from __future__ import annotations

import json

import pytest

from meshserve.core.kv_connector.pool import PoolConnector
from meshserve.entrypoints.cli import main
from meshserve.sim.te import SimTE, SimTESettings
from meshserve.sim.trace import TraceError, TraceRequest, poisson, read_jsonl, write_jsonl
from tests.sim.test_simulate import PROFILE

FLAGS = ["simulate", "run", "--hardware", "ascend910c-cm384", "--parallel", "attn=DP16 moe=EP16", "--dp", "2",
         "--tes", "2c", "--shared-prefixes", "4:1024", "--input-len", "32:128", "--output-len", "8:16", "--rate", "20",
         "--requests", "120"]


def test_a_trace_names_shared_prefixes_and_the_prompts_share_their_tokens(tmp_path):
    trace = poisson(10, 50, (8, 16), (2, 4), seed=1, shared_prefixes=(3, 64))
    assert {r.prefix_id for r in trace} == {0, 1, 2} and all(r.prefix_len == 64 and r.prompt_len > 64 for r in trace)
    path = tmp_path / "trace.jsonl"
    write_jsonl(trace, path)
    assert read_jsonl(path) == trace
    te = SimTE(SimTESettings(), PROFILE)
    first, second = [r for r in trace if r.prefix_id == trace[0].prefix_id][:2]
    a, b = te.draw_prompt(first), te.draw_prompt(second)
    assert a[:64] == b[:64] and a[64:80] != b[64:80]  # the prefix, then tokens of their own
    for bad in ({"prefix_id": 0, "prefix_len": 0}, {"prefix_id": -1, "prefix_len": 8}, {"prefix_id": 0,
                                                                                         "prefix_len": 99}):
        with pytest.raises(TraceError, match="a shared prefix needs prefix_id >= 0 and 0 < prefix_len <= prompt_len"):
            TraceRequest(0.0, 32, 4, **bad)


def _run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "pool.json"
    assert main([*FLAGS, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_te_fetches_from_the_pool_what_another_computed(tmp_path):
    alone, pooled = _run(tmp_path), _run(tmp_path, "--kv-pool")
    assert "pool_hit_tokens" not in alone
    # each DP group's cache computed a prefix once; with the pool, the groups that come later fetch it
    assert pooled["pool_hit_tokens"] >= 1024 and all(te["pool_hit_tokens"] > 0 for te in pooled["tes"].values())
    assert pooled["ttft_s"]["p90"] < alone["ttft_s"]["p90"]


def test_the_served_pool_connector_decides_the_fetches(tmp_path, monkeypatch):
    monkeypatch.setattr(PoolConnector, "get_num_new_matched_tokens", lambda self, req, num_local_tokens: 0)
    assert _run(tmp_path, "--kv-pool")["pool_hit_tokens"] == 0


def test_bad_pool_and_prefix_settings_are_refused_in_one_line(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    out = str(tmp_path / "x.json")
    for argv, message in (
            ([*FLAGS, "--kv-pool", "--pool-latency-ms", "-1"], "--pool-latency-ms must be zero or more"),
            ([*FLAGS, "--shared-prefixes", "4"], "--shared-prefixes must be N:L"),
            ([*FLAGS, "--shared-prefixes", "0:64"], "shared prefixes N:L need N and L of 1 or more"),
            (["simulate", "run", "--profile", str(profile), "--kv-pool", "--requests", "4"],
             "the memory pool is simulated with an op model")):
        assert main([*argv, "--json", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_locality_routing_reads_the_prompt_tree_the_tes_cache_events_build():
    from collections import Counter

    from meshserve.parallel.cluster_file import MODEL_PRESETS
    from meshserve.parallel.strategy import parse_strategy
    from meshserve.sim.cluster import SimCluster, deployment_specs
    from meshserve.sim.hardware import Hardware
    from meshserve.sim.op_model import OpStepModel, deployment_of
    from meshserve.sim.te import shared_prefix

    model = OpStepModel(MODEL_PRESETS["deepseek-r1"], Hardware.load("ascend910c-cm384"),
                        deployment_of(parse_strategy("attn=DP16 moe=EP16"), 256))
    trace = poisson(20, 120, (32, 128), (8, 16), seed=2, shared_prefixes=(4, 1024))

    def on_one_te(policy: str) -> tuple[float, SimCluster]:
        """The share of each prefix's requests its most used TE took, over the prefixes."""
        cluster = SimCluster(deployment_specs("2c", SimTESettings(dp=2), model), policy=policy)
        cluster.run(trace, progress=False)
        per_prefix: dict[int, Counter] = {}
        for req_id, served in cluster.served.items():
            request = trace[int(req_id.removeprefix("sim-"))]
            per_prefix.setdefault(request.prefix_id, Counter())[served.entry_te] += 1
        return sum(c.most_common(1)[0][1] for c in per_prefix.values()) / len(trace), cluster
    by_load, _ = on_one_te("load")
    by_locality, cluster = on_one_te("locality")
    assert by_locality > 0.9 > by_load + 0.2, (by_load, by_locality)
    # the tree the executor routed by holds what the TEs cached: a prefix's blocks on the TE that took it
    cached = cluster.tree.match(shared_prefix(0, 1024) + [7] * 40)
    assert max(cached.values()) >= 1024
