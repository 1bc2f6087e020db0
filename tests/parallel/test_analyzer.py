import dataclasses
import json
import math

import pytest
import yaml

from meshserve.entrypoints.plan import CLUSTER_PRESETS, MODEL_PRESETS, load_cluster_file, main
from meshserve.parallel import analyzer as az
from meshserve.parallel.analyzer import AnalyzerError, Cluster, Link, ModelSpec, Workload, analyze
from meshserve.parallel.cluster_file import PlanError
from meshserve.parallel.strategy import ParallelStrategy, enumerate_strategies

# Toy numbers chosen so every expectation below is hand-computable.
INTRA = Link(bandwidth=100.0, latency=1.0)
INTER = Link(bandwidth=10.0, latency=2.0)
TOY_CLUSTER = Cluster(name="toy", nodes=2, devices_per_node=2, device_memory_bytes=1e3, flops=5.0,
                      intra_bandwidth=100.0, inter_bandwidth=10.0, intra_latency=1.0, inter_latency=2.0)


def test_link_choice_by_span():
    assert TOY_CLUSTER.link_for_span(2) == INTRA
    assert TOY_CLUSTER.link_for_span(4) == INTER


def test_reduce_scatter_and_all_gather_eq1():
    # log2(4) = 2 latencies of 1 s + (3/4 of 800 bytes) / 100 B/s = 8 s; a group of one costs nothing.
    assert az.reduce_scatter_time_eq1(800, 4, INTRA) == pytest.approx(8.0)
    assert az.all_gather_time_eq1(800, 4, INTRA) == pytest.approx(8.0)
    assert az.reduce_scatter_time_eq1(800, 1, INTRA) == 0.0
    # a rank sends (d-1)/d of the tensor whatever d is: 32 ranks send 31/32 of it, not 1/32
    assert az.reduce_scatter_time_eq1(3200, 32, Link(bandwidth=100.0, latency=0.0)) == pytest.approx(31.0)


def test_allreduce_eq2():
    # RS + AG = 8 + 8.
    assert az.allreduce_time(800, 4, INTRA) == pytest.approx(16.0)
    assert az.allreduce_time(800, 1, INTRA) == 0.0


def test_all_to_all_eq3():
    # (4-1) rounds * (1 + 200/100) = 9; over the slow link (4-1) * (2 + 200/10) = 66.
    assert az.all_to_all_time(800, 4, INTRA) == pytest.approx(9.0)
    # a kernel that writes to every peer at once pays one latency for the same bytes: 1 + 3 * 200/100 = 7
    assert az.all_to_all_time(800, 4, Link(bandwidth=100.0, latency=1.0, latency_per_peer=False)) == pytest.approx(7.0)
    concurrent = dataclasses.replace(TOY_CLUSTER, a2a_concurrent=True)
    assert not concurrent.a2a_link(4).latency_per_peer and TOY_CLUSTER.a2a_link(4).latency_per_peer
    assert concurrent.link_for_span(4).latency_per_peer  # a shared o_proj's all-to-alls stay pairwise
    assert az.all_to_all_time(800, 4, INTER) == pytest.approx(66.0)
    assert az.all_to_all_time(800, 1, INTER) == 0.0


def test_a_measured_all_to_all_prices_eps_dispatch_and_combine():
    """A calibrated cluster's all-to-all (one call of the collective library) replaces d - 1 rounds of the link's
    latency; the other collectives keep their link."""
    measured = dataclasses.replace(TOY_CLUSTER, a2a_latency=0.5, a2a_bandwidth=200.0)
    assert measured.a2a_link(4) == Link(bandwidth=200.0, latency=0.5)
    assert TOY_CLUSTER.a2a_link(4) == INTER  # no measurement: the link its span crosses
    s = ParallelStrategy(2, 2, 2, 2)
    # as test_communication_latency_eq5_dp_at_least_ep, with each A2A 1 * (0.5 + 20/200) = 0.6 instead of 4
    assert az.communication_latency_eq5(s, 8, 5, 1, measured) == pytest.approx(2.4 + 2.4 + 2 * 0.6)
    with pytest.raises(AnalyzerError, match="come together"):
        dataclasses.replace(TOY_CLUSTER, a2a_latency=0.5)


def test_compute_latency_eq4():
    # 2 FLOPs * 10 params * 3 tokens / (2-way shard * 5 FLOP/s) = 6 s.
    assert az.compute_latency_eq4(10, 3, 2, 5.0) == pytest.approx(6.0)


def test_communication_latency_eq5_dp_at_least_ep():
    # TP2+DP2 / TP2+EP2, 8 tokens, h=5, k=1, 2 bytes: each DP rank and each EP shard holds 4 tokens = 40 B.
    # attention AR (TP2, in node) 2*(1+20/100) = 2.4; MoE AR the same 2.4;
    # 2 * A2A(40 B, EP2, across nodes) = 2 * 1*(2+20/10) = 8.  Total 12.8.
    s = ParallelStrategy(2, 2, 2, 2)
    assert az.communication_latency_eq5(s, 8, 5, 1, TOY_CLUSTER) == pytest.approx(12.8)


def test_communication_latency_eq5_dp_below_ep():
    # TP4+DP1 / TP1+EP4, 8 tokens, h=5, k=2: the single DP rank holds 8*5*2 = 80 B.
    # attention AR over 4 ranks across nodes: 2 * (2 * 2 + 60/10) = 20; MoE TP1: 0; A2A among d_DP=1 ranks: 0;
    # the 4 EP replicas sum their expert outputs: AR(80 B, 4, across nodes) = 20.  Total 40.
    s = ParallelStrategy(4, 1, 1, 4)
    assert az.communication_latency_eq5(s, 8, 5, 2, TOY_CLUSTER) == pytest.approx(40.0)


def test_the_kv_term_follows_the_models_cache_and_weights_are_read_where_the_cluster_says_how_fast():
    r1, qwen = (az.model_spec_from_config(MODEL_PRESETS[name]) for name in ("deepseek-r1", "qwen3-235b-a22b"))
    assert r1.kv_width == 512 + 64  # MLA's latent and rotary key, not 2 x 7168
    assert qwen.kv_width == 2 * 4 * 128  # GQA: K and V of 4 heads
    assert az.kv_cache_bytes(r1, 2, 10) == 2 * 10 * 576 * 61 * 2
    assert az.kv_cache_bytes_eq8(2, 10, 7168, 61) == 2 * 10 * 2 * 7168 * 61 * 2  # the paper's bound, without a width
    s = ParallelStrategy(1, 16, 1, 16)
    h20 = CLUSTER_PRESETS["h20-2x8"]
    tau, lam = az.layer_latency(r1, s, h20, 16, "eq5")
    reading = dataclasses.replace(h20, memory_bandwidth=4e12)
    tau_read, lam_read = az.layer_latency(r1, s, reading, 16, "eq5")
    # a decode step of 16 tokens is bound by its weights: a layer's attention and its 1/16 of the experts, read once
    weights = (r1.psi_attn + r1.psi_moe / 16) / r1.num_layers * r1.weight_bytes
    assert tau_read == pytest.approx(weights / 4e12) and tau_read > tau and lam_read == lam
    with pytest.raises(AnalyzerError, match="memory_bandwidth must be positive"):
        dataclasses.replace(h20, memory_bandwidth=0.0)


def test_service_latency_eq6():
    # 3 layers * (2 + 1) + (2-1) * 0.5 = 9.5
    assert az.service_latency_eq6(3, 2.0, 1.0, pp=2, p2p=0.5) == pytest.approx(9.5)
    assert az.service_latency_eq6(3, 2.0, 1.0) == pytest.approx(9.0)


def test_mm1_queueing_delay_eq7():
    # λ=1, μ=2: 1 / (2 * (2-1)) = 0.5; equivalently ρ/(μ(1-ρ)) = 0.5/(2*0.5).
    assert az.mm1_queueing_delay_eq7(1.0, 2.0) == pytest.approx(0.5)
    assert az.mm1_queueing_delay_eq7(0.0, 2.0) == 0.0
    assert math.isinf(az.mm1_queueing_delay_eq7(2.0, 2.0))
    assert math.isinf(az.mm1_queueing_delay_eq7(3.0, 2.0))


def test_memory_eq8():
    # KV: 2 * b1 * s2 * h3 * l4 * 2 bytes = 96; with 2 pipeline stages, half.
    assert az.kv_cache_bytes_eq8(1, 2, 3, 4) == pytest.approx(96.0)
    assert az.kv_cache_bytes_eq8(1, 2, 3, 4, pp=2) == pytest.approx(48.0)
    # 100/TP2 + 400/(TP2*EP2) + 10 = 160, and the constraint is strict.
    s = ParallelStrategy(2, 2, 2, 2)
    assert az.memory_per_rank_eq8(100, 400, 10, s) == pytest.approx(160.0)
    assert az.fits_memory_eq8(100, 400, 10, s, 161.0)
    assert not az.fits_memory_eq8(100, 400, 10, s, 160.0)


def test_ttft_itl_throughput_eq9_to_11():
    assert az.ttft_eq9(0.5, 1.5) == pytest.approx(2.0)
    assert az.itl_eq10(0.25) == 0.25
    # (10 + 5) / (1 + 2 + 5 * 0.4) = 3 tokens/s
    assert az.throughput_eq11(10, 5, 1.0, 2.0, 0.4) == pytest.approx(3.0)
    assert az.throughput_eq11(10, 5, math.inf, 2.0, 0.4) == 0.0


def test_ep_comm_eq12():
    # AR(40 B, 2, in node) = 2*(1+20/100) = 2.4; 2 * A2A(80 B, 2 nodes) = 2 * (2+40/10) = 12.  Total 14.4.
    assert az.ep_comm_eq12(40, 2, 2, 2, TOY_CLUSTER) == pytest.approx(14.4)


def test_hybrid_comm_eq13():
    # shard = 40*2/2 = 40 B. AR 2.4 + AG of the two shards (80 B, 2, in node) 1+40/100 = 1.4
    # + 2 * A2A(40, 2 nodes) 2*(2+20/10) = 8.  Total 11.8.
    assert az.hybrid_comm_eq13(40, 2, 2, 2, TOY_CLUSTER) == pytest.approx(11.8)
    # The hybrid layout moves k/n_proc of the EP volume across nodes, so it never costs more here.
    assert az.hybrid_comm_eq13(40, 2, 2, 2, TOY_CLUSTER) < az.ep_comm_eq12(40, 2, 2, 2, TOY_CLUSTER)


def test_comm_model_choice():
    h20 = CLUSTER_PRESETS["h20-2x8"]
    assert az.comm_model_for(ParallelStrategy(8, 2, 8, 2), h20) == "eq13"
    assert az.comm_model_for(ParallelStrategy(8, 2, 1, 16), h20) == "eq12"
    assert az.comm_model_for(ParallelStrategy(16, 1, 16, 1), h20) == "eq5"


@pytest.mark.parametrize("preset, total_b, active_b", [("deepseek-r1", 671, 37), ("qwen3-235b-a22b", 235, 22)])
def test_param_counts_match_published_sizes(preset, total_b, active_b):
    # Oracle: the sizes the model cards (and MixServe §IV-A) state.
    spec = az.model_spec_from_config(MODEL_PRESETS[preset])
    assert spec.total_params / 1e9 == pytest.approx(total_b, rel=0.01)
    assert spec.active_params / 1e9 == pytest.approx(active_b, rel=0.03)
    assert spec.psi_moe > 10 * spec.psi_attn


def test_model_config_details():
    ds = az.model_spec_from_config(MODEL_PRESETS["deepseek-r1"])
    assert (ds.hidden_size, ds.num_layers, ds.num_experts, ds.top_k, ds.weight_bytes) == (7168, 61, 256, 8, 1.0)
    qw = az.model_spec_from_config(MODEL_PRESETS["qwen3-235b-a22b"])
    assert (qw.hidden_size, qw.num_layers, qw.num_experts, qw.top_k, qw.weight_bytes) == (4096, 94, 128, 8, 2.0)


def test_model_config_errors():
    with pytest.raises(AnalyzerError, match="unsupported model_type 'llama'"):
        az.model_spec_from_config({"model_type": "llama"})
    broken = dict(MODEL_PRESETS["qwen3-235b-a22b"])
    del broken["num_experts"]
    with pytest.raises(AnalyzerError, match="lacks num_experts"):
        az.model_spec_from_config(broken)


def test_workload_and_cluster_validation():
    with pytest.raises(AnalyzerError, match="batch"):
        Workload(batch=0, input_len=1, output_len=1, arrival_rate=1.0)
    with pytest.raises(AnalyzerError, match="arrival rate"):
        Workload(batch=1, input_len=1, output_len=1, arrival_rate=-1.0)
    with pytest.raises(AnalyzerError, match="device_memory_bytes"):
        Cluster(name="x", nodes=1, devices_per_node=1, device_memory_bytes=0, flops=1,
                intra_bandwidth=1, inter_bandwidth=1)


TINY_MODEL = ModelSpec(name="tiny", hidden_size=4, num_layers=2, num_experts=4, top_k=2,
                       psi_attn=100, psi_moe=800, weight_bytes=1.0)


def test_memory_filter_drops_exactly_the_strategies_over_budget():
    # Budget 400 B: weights are 100/attn_tp + 800/4 = 200..300 B, KV 2*ceil(b/dp)*s*h*l*2 B.
    cluster = Cluster(name="c", nodes=1, devices_per_node=4, device_memory_bytes=400.0, flops=1e6,
                      intra_bandwidth=1e6, inter_bandwidth=1e5, intra_latency=0.0, inter_latency=0.0)
    workload = Workload(batch=2, input_len=2, output_len=1, arrival_rate=0.0)
    kept = {e.strategy for e in analyze(TINY_MODEL, cluster, workload)}
    expected = set()
    for s in enumerate_strategies(4):
        kv = 2 * math.ceil(2 / s.attn_dp) * 3 * 4 * 2 * 2
        if 100 / s.attn_tp + 800 / 4 + kv < 400.0:
            expected.add(s)
    assert kept == expected
    assert 0 < len(kept) < 9
    everything = analyze(TINY_MODEL, cluster, workload, include_unfit=True)
    assert len(everything) == 9
    assert [e.fits_memory for e in everything] == sorted((e.fits_memory for e in everything), reverse=True)


def test_ranking_order_slo_first_then_throughput():
    cluster = CLUSTER_PRESETS["h20-2x8"]
    loose = Workload(batch=16, input_len=256, output_len=64, arrival_rate=1.0)
    ranked = analyze(MODEL_PRESETS["qwen3-235b-a22b"], cluster, loose)
    throughputs = [e.throughput_tok_s for e in ranked]
    assert throughputs == sorted(throughputs, reverse=True)
    # An ITL SLO between the best and the worst ITL splits the list: SLO-meeting strategies lead
    # even where a missing one has higher throughput.
    itls = sorted(e.itl_s for e in ranked)
    cut = (itls[0] + itls[-1]) / 2
    strict = Workload(batch=16, input_len=256, output_len=64, arrival_rate=1.0, slo_itl_s=cut)
    ranked = analyze(MODEL_PRESETS["qwen3-235b-a22b"], cluster, strict)
    flags = [e.meets_slo for e in ranked]
    assert any(flags) and not all(flags)
    assert flags == sorted(flags, reverse=True)
    assert all(e.meets_slo == (e.itl_s <= cut) for e in ranked)
    for group in (True, False):
        t = [e.throughput_tok_s for e in ranked if e.meets_slo == group]
        assert t == sorted(t, reverse=True)


def test_overload_is_unstable():
    cluster = CLUSTER_PRESETS["h20-2x8"]
    flood = Workload(batch=1, input_len=4096, output_len=1024, arrival_rate=1e6)
    ranked = analyze(MODEL_PRESETS["deepseek-r1"], cluster, flood)
    assert ranked and all(math.isinf(e.ttft_s) and not e.meets_slo and e.throughput_tok_s == 0 for e in ranked)


def test_estimate_is_eq9_to_11_of_its_parts():
    cluster = CLUSTER_PRESETS["ascend910b-4x8"]
    spec = az.model_spec_from_config(MODEL_PRESETS["qwen3-235b-a22b"])
    w = Workload(batch=8, input_len=128, output_len=32, arrival_rate=2.0)
    s = ParallelStrategy(8, 4, 8, 4)
    est = az.estimate(spec, s, cluster, w)
    prefill = spec.num_layers * sum(az.layer_latency(spec, s, cluster, 8 * 128, "eq13"))
    decode = spec.num_layers * sum(az.layer_latency(spec, s, cluster, 8, "eq13"))
    wq = az.mm1_queueing_delay_eq7(2.0, 8 / (prefill + 32 * decode))
    assert est.comm_model == "eq13"
    assert est.ttft_s == pytest.approx(wq + prefill)
    assert est.itl_s == pytest.approx(decode)
    assert est.throughput_tok_s == pytest.approx(8 * 160 / (wq + prefill + 32 * decode))


def test_to_deployment_is_yaml_serialisable():
    s = ParallelStrategy(8, 2, 8, 2)
    d = az.to_deployment(s, "/models/x")
    assert yaml.safe_load(yaml.safe_dump(d)) == d
    assert d["parallel"] == "attn=TP8+DP2 moe=TP8+EP2" and d["world_size"] == 16
    assert ParallelStrategy.parse(d["parallel"]) == s
    # What `meshserve serve --deployment` reads, with serve's defaults where the plan has no say.
    assert d["model"] == "/models/x"
    assert d["topology"] == {"nodes": 1, "ranks_per_node": 16}
    assert (d["moe_comm"], d["int8_dispatch"], d["engine"]) == ("fused", False, {})
    assert d["attention"] == {"tp": 8, "dp": 2} and d["moe"] == {"tp": 8, "ep": 2}


def test_to_deployment_carries_the_cluster_shape_and_comm_choices():
    s = ParallelStrategy(8, 2, 8, 2)
    d = az.to_deployment(s, None, cluster=CLUSTER_PRESETS["h20-2x8"], moe_comm="sync", int8_dispatch=True,
                         engine={"max_num_seqs": 8})
    assert "model" not in d
    assert d["topology"] == {"nodes": 2, "ranks_per_node": 8}
    assert (d["moe_comm"], d["int8_dispatch"], d["engine"]) == ("sync", True, {"max_num_seqs": 8})
    with pytest.raises(AnalyzerError, match="moe_comm must be one of fused, sync"):
        az.to_deployment(s, None, moe_comm="overlapped")
    with pytest.raises(AnalyzerError, match="needs 16 ranks but cluster ascend910b-4x8 has 32"):
        az.to_deployment(s, None, cluster=CLUSTER_PRESETS["ascend910b-4x8"])


@pytest.mark.parametrize("model", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("cluster", sorted(CLUSTER_PRESETS))
def test_cli_on_paper_models_and_clusters(model, cluster, tmp_path, capsys):
    out = tmp_path / "deploy.yaml"
    rc = main(["--model-preset", model, "--preset-cluster", cluster, "--batch", "16", "--input-len", "1024",
               "--output-len", "256", "--rate", "2", "--slo-ttft-ms", "2000", "--slo-itl-ms", "50",
               "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("rank"))
    for column in ("strategy", "fits", "TTFT ms", "ITL ms", "tokens/s", "meets SLO"):
        assert column in lines[header]
    world = CLUSTER_PRESETS[cluster].world_size
    rows = [line for line in lines[header + 1:] if line.split()[0].isdigit()]
    spec = az.model_spec_from_config(MODEL_PRESETS[model])
    candidates = enumerate_strategies(world, oproj=spec.oproj_params > 0)
    # a model with shared experts is also priced with them on EP ranks of their own (shared=EPs)
    variants = sum(len(az.shared_expert_variants(s)) for s in candidates) if spec.psi_shared else 0
    assert len(rows) == len(candidates) + variants
    assert any("oproj=TP" in row for row in rows) == model.startswith("deepseek")  # MLA models only
    deployment = yaml.safe_load(out.read_text())
    chosen = ParallelStrategy.parse(deployment["parallel"])
    assert chosen.world_size == world
    assert "model" not in deployment  # a preset has no model directory: serve falls back to its default
    assert deployment["estimate"]["model"] == model and deployment["estimate"]["cluster"] == cluster
    c = CLUSTER_PRESETS[cluster]
    assert deployment["topology"] == {"nodes": c.nodes, "ranks_per_node": c.devices_per_node}
    assert (deployment["moe_comm"], deployment["int8_dispatch"], deployment["engine"]) == ("fused", False, {})
    assert str(chosen) in rows[0]
    assert deployment["estimate"]["meets_slo"] is True


def test_cli_records_model_dir_and_comm_choices(tmp_path, capsys):
    out = tmp_path / "deploy.yaml"
    assert main(["--model-preset", "qwen3-235b-a22b", "--preset-cluster", "h20-2x8", "--model-dir", "/models/qwen",
                 "--moe-comm", "sync", "--int8-dispatch", "--out", str(out)]) == 0
    deployment = yaml.safe_load(out.read_text())
    assert deployment["model"] == "/models/qwen"
    assert (deployment["moe_comm"], deployment["int8_dispatch"]) == ("sync", True)
    assert f"-> {out}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--preset-cluster", "h20-2x8"], "one of --config or --model-preset is required"),
    (["--model-preset", "deepseek-r1"], "one of --cluster or --preset-cluster is required"),
])
def test_cli_missing_model_or_cluster_is_one_line_error(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cluster_file_reads_a_measured_all_to_all(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    doc = {"nodes": 1, "devices_per_node": 4, "device_memory_gb": 8, "tflops": 0.1, "intra_bandwidth_gb_s": 2,
           "inter_bandwidth_gb_s": 1, "a2a_latency_us": 600, "a2a_bandwidth_gb_s": 0.8}
    cluster.write_text(yaml.safe_dump(doc))
    c = load_cluster_file(str(cluster))
    assert (c.a2a_latency, c.a2a_bandwidth) == (pytest.approx(600e-6), pytest.approx(0.8e9))
    assert c.memory_bandwidth is None and not c.a2a_concurrent
    cluster.write_text(yaml.safe_dump({**doc, "memory_bandwidth_gb_s": 3000, "a2a_concurrent": True}))
    c = load_cluster_file(str(cluster))
    assert c.memory_bandwidth == pytest.approx(3e12) and c.a2a_concurrent
    cluster.write_text(yaml.safe_dump({**doc, "a2a_concurrent": "yes"}))
    with pytest.raises(PlanError, match="a2a_concurrent must be true or false"):
        load_cluster_file(str(cluster))


def test_cluster_file_measured_section_is_ignored(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"nodes": 1, "devices_per_node": 2, "device_memory_gb": 8, "tflops": 0.1,
                                       "intra_bandwidth_gb_s": 2, "inter_bandwidth_gb_s": 1,
                                       "measured": {"anything": [1, 2, 3]}}))
    c = load_cluster_file(str(cluster))
    assert (c.world_size, c.flops, c.intra_bandwidth) == (2, pytest.approx(0.1e12), pytest.approx(2e9))


def test_cli_with_config_and_cluster_files(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MODEL_PRESETS["qwen3-235b-a22b"]))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"name": "mine", "nodes": 1, "devices_per_node": 8, "device_memory_gb": 80,
                                       "tflops": 400, "intra_bandwidth_gb_s": 450, "inter_bandwidth_gb_s": 50}))
    assert main(["--config", str(config), "--cluster", str(cluster), "--top", "3"]) == 0
    printed = capsys.readouterr().out
    assert "cluster mine: 1x8" in printed
    assert len([line for line in printed.splitlines() if line[:1].isdigit()]) == 3


@pytest.mark.parametrize("cluster_doc, message", [
    ({"nodes": 1}, "missing keys"),
    ({"nodes": 1, "devices_per_node": 8, "device_memory_gb": 80, "tflops": 1, "intra_bandwidth_gb_s": 1,
      "inter_bandwidth_gb_s": 1, "colour": "red"}, "unknown keys colour"),
    ({"nodes": 0, "devices_per_node": 6, "device_memory_gb": 80, "tflops": 1, "intra_bandwidth_gb_s": 1,
      "inter_bandwidth_gb_s": 1}, "cluster nodes must be positive, got 0"),
    ({"nodes": 1, "devices_per_node": 2, "device_memory_gb": 1, "tflops": 1, "intra_bandwidth_gb_s": 1,
      "inter_bandwidth_gb_s": 1}, "no strategy fits"),
])
def test_cli_bad_cluster_is_one_line_error(cluster_doc, message, tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(cluster_doc))
    assert main(["--model-preset", "deepseek-r1", "--cluster", str(cluster)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_bad_model_config_is_one_line_error(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "missing.json"), "--preset-cluster", "h20-2x8"]) == 2
    assert "cannot read model config" in capsys.readouterr().err
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "llama"}))
    assert main(["--config", str(bad), "--preset-cluster", "h20-2x8"]) == 2
    assert "unsupported model_type" in capsys.readouterr().err
    assert main(["--model-preset", "deepseek-r1", "--preset-cluster", "h20-2x8", "--batch", "0"]) == 2
    assert "batch must be a positive integer" in capsys.readouterr().err


def test_plan_deployment_file_is_what_serve_reads(tmp_path):
    from meshserve.config import Deployment

    out = tmp_path / "deploy.yaml"
    assert main(["--model-preset", "qwen3-235b-a22b", "--preset-cluster", "h20-2x8", "--model-dir", "/models/qwen",
                 "--moe-comm", "sync", "--out", str(out)]) == 0
    written = yaml.safe_load(out.read_text())
    deployment = Deployment.load(str(out))
    assert deployment.model == "/models/qwen"
    assert deployment.engine["parallel"] == written["parallel"]
    assert (deployment.engine["moe_comm"], deployment.engine["int8_dispatch"]) == ("sync", False)


# ---------------------------------------------------------------- shared o_proj (oproj=TPk)

MLA_TOY = ModelSpec(name="mla", hidden_size=5, num_layers=2, num_experts=4, top_k=1, psi_attn=1000, psi_moe=800,
                    weight_bytes=1.0, oproj_params=100)  # o_proj 100 = 20 heads·v x h=5 per layer


def test_a_shared_oproj_stores_one_kth_of_o_proj_and_pays_two_all_to_alls():
    plain, shared = ParallelStrategy(1, 4, 1, 4), ParallelStrategy(1, 4, 1, 4, oproj_tp=2)
    # per rank: Ψ_attn less half of each layer's o_proj: 1000 - 2 * 100 / 2
    assert az.attention_params_per_rank(MLA_TOY, plain) == 1000
    assert az.attention_params_per_rank(MLA_TOY, shared) == 900
    # 3 tokens per DP group, o_proj group of 2 in one node: heads out 3*20*2 B = 120 B -> 1*(1 + 60/100) = 1.6;
    # partials back 2*3*5*2 B = 60 B -> 1*(1 + 30/100) = 1.3
    assert az.oproj_comm_time(MLA_TOY, shared, 3, TOY_CLUSTER) == pytest.approx(2.9)
    assert az.oproj_comm_time(MLA_TOY, plain, 3, TOY_CLUSTER) == 0.0
    # the layer: τ unchanged (the same FLOPs per rank), λ plus the two all-to-alls
    tau0, lam0 = az.layer_latency(MLA_TOY, plain, TOY_CLUSTER, 12, "eq5")
    tau1, lam1 = az.layer_latency(MLA_TOY, shared, TOY_CLUSTER, 12, "eq5")
    assert tau1 == tau0 and lam1 == pytest.approx(lam0 + 2.9)
    workload = Workload(batch=4, input_len=2, output_len=1, arrival_rate=0.0)
    roomy = dataclasses.replace(TOY_CLUSTER, device_memory_bytes=1e4)
    est0, est1 = (az.estimate(MLA_TOY, s, roomy, workload) for s in (plain, shared))
    assert est0.memory_per_rank_bytes - est1.memory_per_rank_bytes == pytest.approx(100.0)
    assert est1.itl_s == pytest.approx(est0.itl_s + MLA_TOY.num_layers * az.oproj_comm_time(MLA_TOY, shared, 1, roomy))
    # where memory is tight the shared o_proj is what fits (1320 B per rank against 1220 B)
    tight = dataclasses.replace(TOY_CLUSTER, device_memory_bytes=1250.0)
    assert [az.estimate(MLA_TOY, s, tight, workload).fits_memory for s in (plain, shared)] == [False, True]


def test_the_planner_prices_oproj_variants_of_mla_models_only():
    workload = Workload(batch=4, input_len=2, output_len=1, arrival_rate=0.0)
    mla = {str(e.strategy) for e in analyze(MLA_TOY, TOY_CLUSTER, workload, include_unfit=True)}
    assert "attn=TP1+DP4 oproj=TP4 moe=TP2+EP2" in mla and len(mla) == len(enumerate_strategies(4, oproj=True))
    gqa = analyze(TINY_MODEL, TOY_CLUSTER, workload, include_unfit=True)
    assert all(e.strategy.oproj_tp == 1 for e in gqa)
    spec = az.model_spec_from_config(MODEL_PRESETS["deepseek-r1"])
    assert spec.oproj_params == 128 * 128 * 7168
    assert az.model_spec_from_config(MODEL_PRESETS["qwen3-235b-a22b"]).oproj_params == 0
    d = az.to_deployment(ParallelStrategy(1, 4, 1, 4, oproj_tp=2))
    assert d["parallel"] == "attn=TP1+DP4 oproj=TP2 moe=TP1+EP4" and d["attention"]["oproj_tp"] == 2
