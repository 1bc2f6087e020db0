"""`meshserve bench cache` at tiny sizes: every part runs end to end and writes JSON + PNG."""
from __future__ import annotations

import argparse
import json

from meshserve.bench.cache import add_cache_arguments, parse_size, with_sizes
from meshserve.entrypoints.cli import main


def test_cache_bench_smoke(tiny_model, tmp_path, capsys):
    model = tiny_model("qwen3_moe")
    out = tmp_path / "cache.json"
    assert main(["bench", "cache", "--quick", "--json", str(out), "--model", str(model)]) == 0
    results = json.loads(out.read_text())
    rows = results["pool"]["rows"]
    assert [r["value_bytes"] for r in rows] == [64 << 10, 1 << 20]
    assert all(r["get_gbps"] > 0 and r["put_gbps"] > 0 and r["memcpy_gbps"] > 0 for r in rows)
    assert rows[0]["values"] == 32 and rows[1]["values"] == 2
    startup = results["model_startup"]
    assert startup["identical"] is True
    assert startup["pool_warm_s"] > 0 and startup["disk_warm_s"] > 0
    assert (startup["disk_cold_s"] is None) != startup["cold_measured"]
    kv = results["kv_reuse"]
    assert [r["rate_pct"] for r in kv["rows"]] == [0, 50]
    none, half = kv["rows"]
    assert none["pool_hit_tokens"] == 0 and none["cached_tokens"] == [0, 0]
    # the fresh TE's prefixes (two blocks of 16 per request) came from the pool, nothing more
    assert half["reused_tokens"] == 32 and half["pool_hit_tokens"] == 64 and half["cached_tokens"] == [32, 32]
    assert all(r["ttft_median_s"] > 0 and r["prefill_tokens_per_s"] > 0 for r in kv["rows"])
    assert none["ttft_vs_no_reuse"] == 1.0 and half["ttft_vs_no_reuse"] > 0
    assert kv["ttft_target_holds"] is None  # no 90% rate measured
    failover = results["failover"]
    assert [p["phase"] for p in failover["phases"]] == ["both servers up", "server killed", "server restarted"]
    assert all(p["completed"] == p["requests"] == 4 for p in failover["phases"])
    up, down, back = failover["phases"]
    assert up["pool_hit_tokens"] == 4 * 32  # two full blocks of each 47-token prompt prefix
    assert down["blocks_in_pool"] < up["blocks_in_pool"] and down["pool_hit_tokens"] < up["pool_hit_tokens"]
    assert back["blocks_in_pool"] == up["blocks_in_pool"] and failover["hits_restored"]
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "x memcpy" in printed and "model start-up: pool warm" in printed
    assert "kv-reuse 50%: TTFT median" in printed


def test_quick_takes_the_smallest_sizes_for_those_not_given():
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    quick = with_sizes(parser.parse_args(["--json", "c.json", "--quick", "--servers", "2"]))
    assert (quick.sizes, quick.total_mb, quick.repeats, quick.reuse_rates) == ("64K,1M", 2.0, 2, "0,50")
    assert (quick.kv_requests, quick.failover_requests, quick.servers) == (1, 4, 2)  # a given size wins
    full = with_sizes(parser.parse_args(["--json", "c.json"]))
    assert (full.sizes, full.total_mb, full.servers, full.prompt_len) == ("64K,256K,1M,4M,16M,64M", 256.0, 2, 2048)


def test_parse_size():
    assert parse_size("64K") == 65536 and parse_size("1M") == 1 << 20 and parse_size("100") == 100


def test_kv_reuse_rejects_rates_outside_0_to_100():
    import argparse

    import pytest

    from meshserve.bench.cache import kv_reuse

    with pytest.raises(ValueError, match="reuse rates"):
        kv_reuse(argparse.Namespace(reuse_rates="0,100"))
