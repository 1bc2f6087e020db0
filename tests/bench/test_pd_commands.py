"""`meshserve profile pd`, `bench pd` and `bench routing` end to end on the tiny model with tiny settings:
the files they write, what the TEs' counters say about where requests went, and one-line argument errors."""
from __future__ import annotations

import json
import math

import pytest

from meshserve.bench.mixed_workload import LONG_OUTPUT, LONG_PROMPT, Mix, make_mixed_workload
from meshserve.entrypoints.cli import main
from meshserve.router.pd_heatmap import PDHeatmap
from meshserve.router.routing import POLICIES

ENGINE = ["--num-kv-blocks", "128", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model("deepseek_v3", name="tiny"))


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _one_line_error(capsys, command: str, needle: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"meshserve {command}: error:") and needle in err[0], err


def test_profile_pd_writes_a_heatmap_the_router_can_read(model, tmp_path, capsys):
    out = tmp_path / "profile"
    assert main(["profile", "pd", "--model", model, "--out", str(out), "--prefill-lengths", "32",
                 "--ratios", "0.25,1", "--rates", "8", "--requests-per-cell", "2", *ENGINE]) == 0
    heatmap = PDHeatmap.load(out / "pd_heatmap.json")
    assert heatmap.shape == (1, 2) and list(heatmap.grids) == [8.0]
    assert all(v is not None and math.isfinite(v) and v > -1 for v in heatmap.grids[8.0][0])
    assert heatmap.value(32, 8) == heatmap.grids[8.0][0][0] and heatmap.value(32, 32) == heatmap.grids[8.0][0][1]
    assert (out / "pd_heatmap.png").stat().st_size > 0
    raw = json.loads((out / "pd_profile.json").read_text())
    assert [(c["prefill_tokens"], c["decode_tokens"]) for c in raw["cells"]] == [(32, 8), (32, 32)]
    for cell in raw["cells"]:
        for setup in ("colocated", "disaggregated"):
            assert cell[setup]["completed"] == 2 and cell[setup]["failed"] == 0
            assert len(cell[setup]["jct_s"]) == 2 and all(_positive(j) for j in cell[setup]["jct_s"])
        mean = {setup: sum(cell[setup]["jct_s"]) / 2 for setup in ("colocated", "disaggregated")}
        assert cell["value"] == pytest.approx(mean["colocated"] / mean["disaggregated"] - 1)
    printed = capsys.readouterr().out
    assert "RPS 8" in printed and "combined (sum over RPS)" in printed


def test_profile_pd_bad_arguments(model, tmp_path, capsys):
    assert main(["profile", "pd", "--model", model, "--out", str(tmp_path), "--ratios", "0,1"]) == 2
    _one_line_error(capsys, "profile pd", "--ratios")
    assert main(["profile", "pd", "--model", model, "--out", str(tmp_path), "--prefill-lengths", "4096",
                 "--ratios", "1"]) == 2
    _one_line_error(capsys, "profile pd", "no cell fits")
    assert main(["profile", "pd", "--model", model, "--out", str(tmp_path), "--colocated", "1p1d"]) == 2
    _one_line_error(capsys, "profile pd", "--colocated")
    with pytest.raises(SystemExit) as exc:
        main(["profile", "pd", "--model", model])
    assert exc.value.code == 2
    _one_line_error(capsys, "profile pd", "--out")
    assert not list(tmp_path.iterdir())


def test_bench_pd_compares_colocated_and_disaggregated(model, tmp_path, capsys):
    out = tmp_path / "pd.json"
    assert main(["bench", "pd", "--model", model, "--json", str(out), "--requests", "4", "--rate", "20",
                 "--long-prompt", "64", "--short-output", "2", "--short-prompt", "8", "--long-output", "12",
                 *ENGINE]) == 0
    result = json.loads(out.read_text())
    for setup in ("colocated", "disaggregated"):
        data = result["setups"][setup]
        summary = data["summary"]
        assert summary["completed"] == 4 and summary["failed"] == 0
        for field in ("ttft_ms", "tpot_ms"):
            assert _positive(summary[field]["p50"]) and _positive(summary[field]["p99"])
        assert _positive(summary["jct_ms"]["mean"])
        assert data["by_kind"][LONG_PROMPT]["completed"] == 2 and data["by_kind"][LONG_OUTPUT]["completed"] == 2
        assert sorted(r["output_tokens"] for r in data["requests"]) == [2, 2, 12, 12]
    pulled = {name: c["kv_pulled"] for name, c in result["setups"]["disaggregated"]["te_counters"].items()}
    assert pulled == {"pd-prefill-0": 0, "pd-decode-0": 4}  # every request's KV went prefill -> decode
    assert all(c["kv_pulled"] == 0 for c in result["setups"]["colocated"]["te_counters"].values())
    ratios = result["ratios_disaggregated_vs_colocated"]
    assert set(ratios) == {"ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "jct_mean"}
    assert all(_positive(v) for v in ratios.values())
    assert out.with_suffix(".png").stat().st_size > 0
    assert "disaggregated / colocated" in capsys.readouterr().out


def test_bench_pd_bad_arguments(model, tmp_path, capsys):
    out = tmp_path / "pd.json"
    assert main(["bench", "pd", "--model", model, "--json", str(out), "--rate", "0"]) == 2
    _one_line_error(capsys, "bench pd", "--rate")
    assert main(["bench", "pd", "--model", model, "--json", str(out), "--long-output", "9:3"]) == 2
    _one_line_error(capsys, "bench pd", "A <= B")
    assert main(["bench", "pd", "--model", str(tmp_path / "nothing"), "--json", str(out)]) == 2
    _one_line_error(capsys, "bench pd", "not a model directory")
    assert not out.exists()


def test_bench_routing_runs_every_policy_and_reads_the_heatmap(model, tmp_path, capsys):
    # disaggregation wins only where the output is at least as long as the prompt: the opposite of the
    # router's built-in rule, so pd_aware sending exactly the long-output requests to the P/D pair
    # shows it read this heatmap
    heatmap = PDHeatmap([0, 4096], [0, 1, 100], {1.0: [[-1.0, 1.0]]}).save(tmp_path / "heatmap.json")
    out = tmp_path / "routing.json"
    mix = ["--long-prompt", "64", "--short-output", "2", "--short-prompt", "8", "--long-output", "48"]
    assert main(["bench", "routing", "--model", model, "--json", str(out), "--requests", "6", "--rate", "20",
                 "--repeats", "1", "--num-prefixes", "2", "--prefix-len", "32", "--heatmap", str(heatmap),
                 *mix, *ENGINE]) == 0
    result = json.loads(out.read_text())
    assert list(result["policies"]) == list(POLICIES) and result["baseline"] == "round_robin"
    for entry in result["policies"].values():
        (run,) = entry["runs"]
        assert run["completed"] == 6 and run["failed"] == 0
        assert all(_positive(run[field]["mean"]) for field in ("jct_ms", "ttft_ms", "tpot_ms"))
        assert 0 <= run["prefix_cache_hits"] <= run["prefix_cache_queries"] and 0 <= run["hit_rate"] <= 1
        assert run["prefix_cache_queries"] >= 6 * 32  # every prompt was looked up where it was prefilled
        assert _positive(entry["jct_vs_round_robin"])
    assert result["policies"]["round_robin"]["jct_vs_round_robin"] == 1.0
    # three units (two colocated TEs, one P/D pair) in turn: 6 requests -> 2 disaggregated
    assert result["policies"]["round_robin"]["runs"][0]["disaggregated_requests"] == 2
    _, kinds = make_mixed_workload(6, Mix((64, 64), (2, 2), (8, 8), (48, 48)), 1000)
    assert result["policies"]["pd_aware"]["runs"][0]["disaggregated_requests"] == kinds.count(LONG_OUTPUT) == 3
    assert result["settings"]["predictor"].startswith("max_tokens")
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert all(policy in printed for policy in POLICIES)


def test_bench_routing_bad_arguments(model, tmp_path, capsys):
    out = tmp_path / "routing.json"
    assert main(["bench", "routing", "--model", model, "--json", str(out), "--policies", "fastest"]) == 2
    _one_line_error(capsys, "bench routing", "fastest")
    assert main(["bench", "routing", "--model", model, "--json", str(out), "--heatmap",
                 str(tmp_path / "missing.json")]) == 2
    _one_line_error(capsys, "bench routing", "does not exist")
    assert main(["bench", "routing", "--model", model, "--json", str(out), "--repeats", "0"]) == 2
    _one_line_error(capsys, "bench routing", "--repeats")
    assert not out.exists()


def test_mixed_workload_runs_share_shapes_but_no_tokens():
    mix = Mix((40, 60), (1, 4), (5, 9), (20, 30), long_prompt_fraction=0.25)
    first, kinds = make_mixed_workload(8, mix, 1000, seed=3, token_seed=1, num_prefixes=2, prefix_len=16)
    second, kinds_again = make_mixed_workload(8, mix, 1000, seed=3, token_seed=2, num_prefixes=2, prefix_len=16)
    assert kinds == kinds_again and kinds.count(LONG_PROMPT) == 2
    assert [(len(a.prompt_token_ids), a.output_len) for a in first] == \
        [(len(b.prompt_token_ids), b.output_len) for b in second]
    for request, kind in zip(first, kinds):
        own = len(request.prompt_token_ids) - 16
        low, high = (40, 60) if kind == LONG_PROMPT else (5, 9)
        assert low <= own <= high
    # two prefixes, each used by half the requests, and unrelated to the other run's
    prefixes = [tuple(r.prompt_token_ids[:16]) for r in first]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4]
    assert not set(prefixes) & {tuple(r.prompt_token_ids[:16]) for r in second}


def test_heatmap_bins_surround_the_measured_points():
    from meshserve.entrypoints.profile_pd import bin_edges

    assert bin_edges([64, 256, 1024]) == [0.0, 128.0, 512.0, 2048.0]
    assert bin_edges([0.25, 1.0]) == [0.0, 0.5, 2.0]
    assert bin_edges([8]) == [0.0, 16.0]
    edges = bin_edges([1000, 1001, 1002])  # too close to round: exact midpoints keep the bins apart
    assert all(b > a for a, b in zip(edges, edges[1:])) and len(edges) == 4
