import json
import math

import pytest
import yaml

from meshserve.bench import calibrate as cal
from meshserve.entrypoints.plan import load_cluster_file, main
from meshserve.parallel.analyzer import Link
from meshserve.parallel.strategy import ParallelStrategy

# A tiny qwen3_moe config, so a laptop-sized calibrated cluster fits it.
TINY_MOE_CONFIG = {
    "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "vocab_size": 256, "torch_dtype": "float32",
}


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors
        return e.code


# ---------------------------------------------------------------- fitting

def test_fit_recovers_latency_and_bandwidth_exactly():
    latency, bandwidth = 50e-6, 2e9
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    fitted_latency, fitted_bandwidth = cal.fit_latency_bandwidth(sizes, [latency + x / bandwidth for x in sizes])
    assert fitted_latency == pytest.approx(latency, rel=1e-9)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-9)
    # Time that does not grow with the size has no measurable bandwidth.
    assert cal.fit_latency_bandwidth([1, 2, 3], [5.0, 5.0, 5.0]) == (5.0, math.inf)
    with pytest.raises(ValueError, match="two different"):
        cal.fit_latency_bandwidth([8, 8], [1.0, 2.0])


def test_analyzer_terms_follow_eq1_to_3():
    # (rounds, bytes per round): RS/AG log2(d) rounds sending 3/4 of the tensor in all, AR twice that, A2A d-1.
    assert cal.analyzer_terms("all_gather", 800, 4) == (2.0, 300.0)
    assert cal.analyzer_terms("reduce_scatter", 800, 4) == (2.0, 300.0)
    assert cal.analyzer_terms("all_reduce", 800, 4) == (4.0, 300.0)
    assert cal.analyzer_terms("all_to_all", 800, 4) == (3.0, 200.0)


def _synthetic_ops(ops, degree, sizes, link):
    """Raw samples exactly as the analyzer would price them on `link` (two identical repeats)."""
    return {op: {"degree": degree, "sizes_bytes": sizes,
                 "samples_s": [[cal.ANALYZER_COST[op](s, degree, link)] * 2 for s in sizes]} for op in ops}


def test_fit_link_recovers_the_analyzer_link_from_every_collective():
    link = Link(bandwidth=3e9, latency=40e-6)
    fit = cal.fit_link(_synthetic_ops(cal.INTRA_OPS, 4, [64, 8192, 65536, 1 << 20], link))
    assert fit["latency_s"] == pytest.approx(link.latency, rel=1e-9)
    assert fit["bandwidth_bytes_s"] == pytest.approx(link.bandwidth, rel=1e-9)
    assert fit["bandwidth_source"] == "fit"
    for op in cal.INTRA_OPS:
        assert fit["ops"][op]["latency_s"] == pytest.approx(link.latency, rel=1e-9)
        assert fit["ops"][op]["bandwidth_bytes_s"] == pytest.approx(link.bandwidth, rel=1e-9)
    a2a = cal.fit_link(_synthetic_ops(cal.INTER_OPS, 4, [64, 8192, 65536], Link(bandwidth=1e8, latency=1e-4)))
    assert (a2a["latency_s"], a2a["bandwidth_bytes_s"]) == (pytest.approx(1e-4), pytest.approx(1e8))


def test_fit_link_takes_the_fastest_repeat_since_noise_only_adds_time():
    link = Link(bandwidth=3e9, latency=40e-6)
    ops = _synthetic_ops(cal.INTRA_OPS, 4, [64, 8192, 65536, 1 << 20], link)
    for raw in ops.values():  # a second repeat five times slower, as when another process took the core
        raw["samples_s"] = [[t, 5 * t] for t, _ in raw["samples_s"]]
    fit = cal.fit_link(ops)
    assert fit["latency_s"] == pytest.approx(link.latency, rel=1e-9)
    assert fit["bandwidth_bytes_s"] == pytest.approx(link.bandwidth, rel=1e-9)


def test_fit_link_falls_back_to_the_largest_message_when_noise_hides_the_slope():
    raw = {"all_reduce": {"degree": 2, "sizes_bytes": [64, 1000, 2000],
                          "samples_s": [[1e-4], [3e-3, 9e-3], [2e-3]]}}
    fit = cal.fit_link(raw)
    # The larger message was faster: bandwidth = bytes per round / time per round of the largest.
    assert fit["bandwidth_source"] == "largest message"
    assert fit["bandwidth_bytes_s"] == pytest.approx(1000 / 1e-3)
    # Latency: the 64 B message's time per round less its own 32 B per round at that bandwidth.
    assert fit["latency_s"] == pytest.approx(1e-4 / 2 - 32 / 1e6)


def test_sizes_shapes_and_rounding():
    assert [cal.parse_size(s) for s in ("4096", "256K", "1MiB", "2mb", "1g")] == [4096, 262144, 1 << 20, 2 << 20,
                                                                                  1 << 30]
    assert cal.parse_matmul_shape("32x4096x1536") == (32, 4096, 1536)
    assert cal.message_bytes(100, 4) == 112 and cal.message_bytes(1, 2) == 8
    # Sizes that round onto the latency message or onto each other count once.
    assert cal.fit_sizes([8, 1000, 1001, 4096], 2) == [1000, 1008, 4096]
    for bad in ("", "12Q", "-4", "1.5M"):
        with pytest.raises(cal.CalibrationError, match="bad message size"):
            cal.parse_size(bad)
    for bad in ("8x8", "0x4x4", "axbxc"):
        with pytest.raises(cal.CalibrationError, match="bad matmul shape"):
            cal.parse_matmul_shape(bad)


# ---------------------------------------------------------------- command line

@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: --out"),
    (["--nodes", "two"], "invalid int value"),
    (["--nodes", "0"], "--nodes must be a positive integer"),
    (["--repeats", "0"], "--repeats must be a positive integer"),
    (["--nodes", "1", "--ranks-per-node", "1"], "power of two from 2"),
    (["--nodes", "3", "--ranks-per-node", "1"], "power of two from 2"),
    (["--sizes", "4K"], "at least two different message sizes"),
    (["--sizes", "4K", "lots"], "bad message size 'lots'"),
    (["--sizes", "4K", "1G"], "message sizes must be 1 B to 256 MiB"),
    (["--sizes", "8", "16"], "fewer than two sizes above"),
    (["--matmul-shapes", "8x8"], "bad matmul shape '8x8'"),
    (["--colour", "red"], "unrecognized arguments: --colour red"),
])
def test_calibrate_rejects_bad_input_with_one_line(args, message, tmp_path, capsys):
    out = [] if not args else ["--out", str(tmp_path / "c.yaml")]
    assert _exit_code(["calibrate", *args, *out]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1, captured.err
    assert not (tmp_path / "c.yaml").exists()


def test_calibrate_rejects_a_directory_as_out(tmp_path, capsys):
    assert _exit_code(["calibrate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and err.count("\n") == 1


def test_meshserve_cli_dispatches_plan_calibrate(tmp_path, capsys):
    from meshserve.entrypoints.cli import main as meshserve_main

    assert meshserve_main(["plan", "calibrate", "--repeats", "-1", "--out", str(tmp_path / "c.yaml")]) == 2
    assert "--repeats must be a positive integer" in capsys.readouterr().err


# ---------------------------------------------------------------- on a real local world

@pytest.mark.parametrize("nodes, ranks_per_node", [(1, 2), (2, 1)])
def test_calibrate_writes_a_cluster_file_that_plan_reads(nodes, ranks_per_node, tmp_path, capsys):
    out = tmp_path / "cluster.yaml"
    assert main(["calibrate", "--nodes", str(nodes), "--ranks-per-node", str(ranks_per_node),
                 "--sizes", "1K", "8K", "--repeats", "2", "--matmul-shapes", "8x32x16", "32x64x32",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "wrote" in printed.out and "bandwidth GB/s" in printed.out
    assert printed.err.count("[calibrate]") >= 5  # progress: start, collectives, matmuls

    doc = yaml.safe_load(out.read_text())
    cluster = load_cluster_file(str(out))
    assert (cluster.nodes, cluster.devices_per_node, cluster.name) == (nodes, ranks_per_node,
                                                                         f"local-{nodes}x{ranks_per_node}")
    for value in (cluster.device_memory_bytes, cluster.flops, cluster.intra_bandwidth, cluster.inter_bandwidth,
                  cluster.intra_latency, cluster.inter_latency):
        assert math.isfinite(value) and value > 0
    assert cluster.intra_bandwidth == pytest.approx(doc["intra_bandwidth_gb_s"] * 1e9)
    assert cluster.flops == pytest.approx(doc["tflops"] * 1e12)

    measured = doc["measured"]
    link, missing = ("intra_node", "inter_node") if ranks_per_node > 1 else ("inter_node", "intra_node")
    assert measured[missing]["same_as"] == link
    assert cluster.intra_bandwidth == cluster.inter_bandwidth
    ops = measured[link]["ops"]
    assert set(ops) == set(cal.LINKS[link])
    for record in ops.values():
        assert record["sizes_bytes"][0] < record["sizes_bytes"][1] < record["sizes_bytes"][2]
        assert [len(s) for s in record["samples_s"]] == [2, 2, 2]
        assert all(t > 0 for s in record["samples_s"] for t in s)
    # EP's all-to-all, timed over the whole world: the analyzer prices dispatch and combine with it
    world = measured["world_all_to_all"]
    assert world["ranks"] == 2 and set(world["ops"]) == {"all_to_all"}
    assert cluster.a2a_latency == pytest.approx(doc["a2a_latency_us"] * 1e-6)
    assert cluster.a2a_link(2) == Link(cluster.a2a_bandwidth, cluster.a2a_latency)
    assert cluster.a2a_bandwidth > 0 and cluster.a2a_latency >= 0
    compute = measured["compute"]
    assert set(compute["per_rank_by_shape"]) == {"8x32x16", "32x64x32"}
    assert compute["one_process_gflops"] > 0 and compute["one_process_threads"] >= 1
    assert measured["memory"]["per_rank_gb"] == pytest.approx(measured["memory"]["total_gb"] / 2, rel=1e-3)
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000

    # Round trip: plan a model on the calibrated cluster.
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MOE_CONFIG))
    deployment_path = tmp_path / "deployment.yaml"
    assert main(["--config", str(config), "--cluster", str(out), "--batch", "2", "--input-len", "16",
                 "--output-len", "4", "--rate", "0.1", "--out", str(deployment_path)]) == 0
    assert f"cluster local-{nodes}x{ranks_per_node}: {nodes}x{ranks_per_node} devices" in capsys.readouterr().out
    deployment = yaml.safe_load(deployment_path.read_text())
    assert deployment["topology"] == {"nodes": nodes, "ranks_per_node": ranks_per_node}
    assert ParallelStrategy.parse(deployment["parallel"]).world_size == 2
    assert deployment["estimate"]["cluster"] == f"local-{nodes}x{ranks_per_node}"
