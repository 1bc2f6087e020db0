"""`meshserve bench cache` at tiny sizes: both parts run end to end and write JSON + PNG."""
from __future__ import annotations

import json

from meshserve.bench.cache import parse_size
from meshserve.cli import main
from meshserve.models.factory import make_model


def test_cache_bench_smoke(tmp_path, capsys):
    model = make_model("qwen3_moe", "tiny", tmp_path / "model")
    out = tmp_path / "cache.json"
    assert main(["bench", "cache", "--json", str(out), "--sizes", "64K,1M", "--total-mb", "2", "--servers", "1",
                 "--repeats", "2", "--model", str(model), "--load-repeats", "1"]) == 0
    results = json.loads(out.read_text())
    rows = results["pool"]["rows"]
    assert [r["value_bytes"] for r in rows] == [64 << 10, 1 << 20]
    assert all(r["get_gbps"] > 0 and r["put_gbps"] > 0 and r["memcpy_gbps"] > 0 for r in rows)
    assert rows[0]["values"] == 32 and rows[1]["values"] == 2
    startup = results["model_startup"]
    assert startup["identical"] is True
    assert startup["pool_warm_s"] > 0 and startup["disk_warm_s"] > 0
    assert (startup["disk_cold_s"] is None) != startup["cold_measured"]
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "x memcpy" in printed and "model start-up: pool warm" in printed


def test_parse_size():
    assert parse_size("64K") == 65536 and parse_size("1M") == 1 << 20 and parse_size("100") == 100
