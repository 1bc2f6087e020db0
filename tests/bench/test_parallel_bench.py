import json
import math
import time

import pytest

from meshserve.bench import parallel as pb
from meshserve.bench.workload import WorkloadRequest
from meshserve.engine.core_client import EngineStartupError
from meshserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from meshserve.parallel.analyzer import Cluster
from meshserve.utils.rank_stats import average_ranks, spearman_rank_correlation
from meshserve.wire.errors import EngineDeadError

DP2 = "attn=TP1+DP2 moe=TP1+EP2"
TP2 = "attn=TP2+DP1 moe=TP2+EP1"
MIXED = "attn=TP1+DP2 moe=TP2+EP1"
TP2_EP2 = "attn=TP2+DP1 moe=TP1+EP2"

CLUSTER_YAML = """\
name: synthetic-1x2
nodes: 1
devices_per_node: 2
device_memory_gb: 8
tflops: 0.05
intra_bandwidth_gb_s: 2
inter_bandwidth_gb_s: 1
intra_latency_us: 50
inter_latency_us: 100
"""


# ---------------------------------------------------------------- rank statistics

def test_average_ranks_put_the_largest_first_and_share_tied_ranks():
    assert average_ranks([10.0, 30.0, 20.0]) == [3.0, 1.0, 2.0]
    assert average_ranks([3.0, 1.0, 3.0, 2.0]) == [1.5, 4.0, 1.5, 3.0]
    assert average_ranks([5.0, 5.0, 5.0]) == [2.0, 2.0, 2.0]
    assert average_ranks([]) == []


def test_spearman_on_hand_checked_cases():
    assert spearman_rank_correlation([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman_rank_correlation([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # no ties: 1 - 6*sum(d^2)/(n(n^2-1)) with d = (1, 1, 1, 1, 0): 1 - 24/120
    assert spearman_rank_correlation([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # a tie: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): 4.5 / sqrt(4.5 * 5) = sqrt(0.9)
    assert spearman_rank_correlation([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(math.sqrt(0.9))
    # monotone but not linear: ranks only
    assert spearman_rank_correlation([1, 2, 3, 4], [1, 8, 27, 1000]) == pytest.approx(1.0)


def test_spearman_is_undefined_without_two_distinct_ranks_and_rejects_unequal_lengths():
    assert spearman_rank_correlation([1.0], [2.0]) is None
    assert spearman_rank_correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None
    with pytest.raises(ValueError):
        spearman_rank_correlation([1, 2], [1, 2, 3])


# ---------------------------------------------------------------- strategies and prediction

def test_parse_strategy_list_canonicalises_and_drops_repeats():
    text = f" attn=DP2 moe=EP2 ; {TP2};;attn=TP1+DP2 moe=TP1+EP2"
    assert pb.parse_strategy_list(text, 2) == [DP2, TP2]
    with pytest.raises(pb.BenchArgumentError, match="spans 4 ranks"):
        pb.parse_strategy_list("attn=TP2+DP2 moe=TP2+EP2", 2)
    with pytest.raises(pb.BenchArgumentError, match="--strategies"):
        pb.parse_strategy_list("attn=TP2 moe=EP3", 2)
    with pytest.raises(pb.BenchArgumentError, match="no strategy"):
        pb.parse_strategy_list(" ; ", 2)
    with pytest.raises(pb.BenchArgumentError, match="bench disagg"):
        pb.parse_strategy_list("attn=DP1 moe=EP1 disagg", 2)


def test_default_strategies_are_every_strategy_of_the_world():
    options = pb.ParallelBenchOptions(model_dir="m", world_size=4, num_requests=1, input_len=(1, 1),
                                      output_len=(1, 1), json_path="x.json")
    assert len(options.strategies) == 9 and len(set(options.strategies)) == 9
    assert options.ranks_per_node == 4


def _cluster() -> Cluster:
    return Cluster(name="c", nodes=1, devices_per_node=2, device_memory_bytes=8e9, flops=5e10,
                   intra_bandwidth=2e9, inter_bandwidth=1e9, intra_latency=5e-5, inter_latency=1e-4)


def test_analyzer_workload_is_one_offline_batch_without_queueing():
    from meshserve.models.factory import preset_config
    from meshserve.parallel.analyzer import estimate, layer_latency, model_spec_from_config, service_latency_eq6
    from meshserve.parallel.strategy import parse_strategy

    workload = [WorkloadRequest([1] * n, out) for n, out in ((10, 4), (21, 6), (30, 8))]
    wl = pb.analyzer_workload(workload, max_num_seqs=2)
    assert (wl.batch, wl.input_len, wl.output_len, wl.arrival_rate) == (2, 20, 6, 0.0)

    config = preset_config("deepseek_v3", "tiny")
    predictions = pb.predict(config, _cluster(), wl, [DP2, TP2])
    model, strategy = model_spec_from_config(config), parse_strategy(DP2)
    est = estimate(model, strategy, _cluster(), wl)
    prefill = service_latency_eq6(model.num_layers, *layer_latency(model, strategy, _cluster(), 2 * 20, est.comm_model))
    decode = service_latency_eq6(model.num_layers, *layer_latency(model, strategy, _cluster(), 2, est.comm_model))
    # rate 0: no M/M/1 wait, one batch from prefill through its last decode step
    assert predictions[DP2]["throughput_tok_s"] == pytest.approx(2 * (20 + 6) / (prefill + 6 * decode))
    assert predictions[DP2]["output_tokens_per_s"] == pytest.approx(predictions[DP2]["throughput_tok_s"] * 6 / 26)
    assert predictions[DP2]["ttft_s"] == pytest.approx(prefill)


# ---------------------------------------------------------------- report assembly

def _record(strategy, rates, tokens, status="ok", error=None):
    samples = [{"output_tokens_per_s": r, "mean_ttft_s": 0.1, "mean_tpot_s": 0.01, "elapsed_s": 1.0} for r in rates]
    return {"strategy": strategy, "status": status, "error": error, "samples": samples,
            "tokens": [tokens] * len(rates),
            "median": {"output_tokens_per_s": sorted(rates)[len(rates) // 2] if rates else None,
                       "mean_ttft_s": 0.1 if rates else None, "mean_tpot_s": 0.01 if rates else None,
                       "elapsed_s": 1.0 if rates else None}}


def _prediction(throughput):
    return {"throughput_tok_s": throughput, "output_tokens_per_s": throughput / 2}


def test_assemble_results_ranks_only_layouts_that_ran_and_checks_tokens():
    base_tokens = [[1, 2, 3], [4, 5]]
    baseline = _record("single rank", [90.0, 100.0, 110.0], base_tokens)
    layouts = [
        _record(DP2, [300.0, 200.0, 250.0], base_tokens),
        _record(TP2, [150.0], [[1, 2, 3], [4, 9]]),  # second request diverges at position 1
        _record(MIXED, [400.0], base_tokens),
        _record(TP2_EP2, [], base_tokens, status="unsupported", error="heads do not split"),
    ]
    predictions = {DP2: _prediction(1000.0), TP2: _prediction(3000.0), MIXED: _prediction(2000.0),
                   TP2_EP2: _prediction(5000.0)}
    result = pb.assemble_results(baseline, layouts, predictions)

    by_name = {layout["strategy"]: layout for layout in result["layouts"]}
    assert by_name[DP2]["ratio_to_single_rank"] == pytest.approx(2.5)
    assert by_name[DP2]["tokens_match"] is True
    assert by_name[TP2]["tokens_match"] is False
    assert by_name[TP2]["greedy_check"] == {"compared_requests": 2, "mismatching_requests": 1,
                                            "first_divergence_positions": [1]}
    assert by_name[TP2_EP2]["tokens_match"] is None and "measured_rank" not in by_name[TP2_EP2]
    assert all("tokens" not in layout for layout in result["layouts"]) and "tokens" not in result["baseline"]
    assert result["baseline"]["repeats_consistent"] is True

    assert result["rankings"]["measured"] == [MIXED, DP2, TP2]
    assert result["rankings"]["predicted"] == [TP2, MIXED, DP2]
    assert [(r["measured_rank"], r["predicted_rank"]) for r in result["rankings"]["rows"]] == [
        (1.0, 2.0), (2.0, 3.0), (3.0, 1.0)]
    # d = (1, 1, 2): 1 - 6*6/(3*8)
    assert result["spearman_rho"] == pytest.approx(-0.5)
    assert result["ranked_layouts"] == 3
    assert result["all_tokens_match"] is False
    assert result["not_run"] == {TP2_EP2: {"status": "unsupported", "error": "heads do not split"}}

    lines = pb.summary_lines({**result, "repeats": 3})
    assert lines[0].startswith("single rank: 100.0 output tok/s")
    assert any(TP2 in line and "DIFFER" in line for line in lines)
    assert any(line.startswith(f"unsupported: {TP2_EP2}") for line in lines)
    assert lines[-2].endswith("-0.500")


# ---------------------------------------------------------------- the whole run with stand-in engines

class FakeEngine:
    """Greedy tokens as a function of the prompt; `corrupt` changes one token, `fail_on_call` raises."""

    def __init__(self, parallel, log, corrupt=False, fail_on_call=None):
        self.parallel, self.log, self.corrupt, self.fail_on_call = parallel, log, corrupt, fail_on_call
        self.calls = 0
        self.engine = self  # the watchdog stops `llm.engine.proc`
        self.proc = self

    def terminate(self):
        raise AssertionError("the watchdog should not fire")

    def generate(self, prompts, params):
        self.calls += 1
        if self.fail_on_call == self.calls:
            raise EngineDeadError("worker 1 died")
        now = time.time()
        outputs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            tokens = [(sum(prompt) + k) % 50 for k in range(p.max_tokens)]
            if self.corrupt and i == 0:
                tokens[-1] += 1
            metrics = RequestMetrics(arrival_time=now - 0.5, first_token_time=now - 0.4, last_token_time=now)
            outputs.append(RequestOutput(f"r{i}", None, list(prompt), [CompletionOutput(0, token_ids=tokens)],
                                         finished=True, metrics=metrics))
        return outputs

    def shutdown(self):
        self.log.append(("shutdown", self.parallel))


@pytest.fixture
def config_only_model(tmp_path):
    from meshserve.models.factory import preset_config

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(preset_config("deepseek_v3", "tiny")))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER_YAML)
    return model_dir, cluster


def _argv(model_dir, cluster, json_path, *extra):
    return ["--model", str(model_dir), "--world", "2", "--requests", "3", "--input-len", "4:8", "--output-len", "2:3",
            "--cluster", str(cluster), "--json", str(json_path), "--no-progress", *extra]


def test_rounds_record_unsupported_failed_and_mismatching_layouts(config_only_model, tmp_path, monkeypatch, capsys):
    model_dir, cluster = config_only_model
    log = []
    engines = []

    def start(model, engine_args):
        parallel = engine_args["parallel"]
        log.append(("start", parallel))
        assert engine_args["enable_prefix_caching"] is False and model == str(model_dir)
        assert engine_args["num_threads"] == 1 and engine_args["moe_comm"] == "sync"
        if parallel == TP2_EP2:
            raise EngineStartupError("worker 1 failed to start: ValueError: does not split evenly")
        # MIXED's second engine (round 2) dies on its first call, the warm-up
        fail = 1 if parallel == MIXED and sum(1 for e in engines if e.parallel == MIXED) == 1 else None
        engines.append(FakeEngine(parallel, log, corrupt=parallel == TP2, fail_on_call=fail))
        return engines[-1]

    monkeypatch.setattr(pb, "_start_engine", start)
    json_path = tmp_path / "out" / "parallel.json"
    strategies = ";".join([DP2, TP2, MIXED, TP2_EP2])
    assert pb.main(_argv(model_dir, cluster, json_path, "--repeats", "2", "--strategies", strategies,
                         "--num-threads", "1", "--moe-comm", "sync")) == 0

    starts = [p for kind, p in log if kind == "start"]
    single = pb.SINGLE_RANK
    # round 1 in order; round 2 starts one later and skips the unsupported layout
    assert starts == [single, DP2, TP2, MIXED, TP2_EP2, DP2, TP2, MIXED, single]
    assert sum(kind == "shutdown" for kind, _ in log) == len(engines) == 8

    result = json.loads(json_path.read_text())
    by_name = {layout["strategy"]: layout for layout in result["layouts"]}
    assert by_name[DP2]["status"] == "ok" and by_name[DP2]["tokens_match"] is True
    assert len(by_name[DP2]["samples"]) == 2
    assert by_name[TP2]["status"] == "ok" and by_name[TP2]["tokens_match"] is False
    assert by_name[MIXED]["status"] == "failed" and "worker 1 died" in by_name[MIXED]["error"]
    assert by_name[TP2_EP2]["status"] == "unsupported" and "does not split evenly" in by_name[TP2_EP2]["error"]
    assert set(result["rankings"]["measured"]) == set(result["rankings"]["predicted"]) == {DP2, TP2}
    assert result["ranked_layouts"] == 2 and result["spearman_rho"] in (1.0, -1.0)
    assert result["cluster"]["source"] == "file" and result["cluster"]["name"] == "synthetic-1x2"
    assert result["analyzer_workload"]["arrival_rate"] == 0.0 and result["analyzer_workload"]["batch"] == 3
    assert set(result["layouts"][0]["prediction"]) >= {"throughput_tok_s", "output_tokens_per_s", "ttft_s"}
    assert json_path.with_suffix(".png").stat().st_size > 0

    out = capsys.readouterr().out
    assert "DIFFER" in out and f"unsupported: {TP2_EP2}" in out and f"failed: {MIXED}" in out
    assert "torch threads: 1 for the single rank, 1 per rank" in out


def test_a_failing_single_rank_engine_stops_the_run_with_one_line(config_only_model, tmp_path, monkeypatch, capsys):
    model_dir, cluster = config_only_model

    def start(model, engine_args):
        raise EngineStartupError("engine not ready after 300s")

    monkeypatch.setattr(pb, "_start_engine", start)
    json_path = tmp_path / "out.json"
    assert pb.main(_argv(model_dir, cluster, json_path, "--repeats", "1", "--strategies", DP2)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "single rank" in err[0] and "not ready" in err[0]
    assert not json_path.exists()


# ---------------------------------------------------------------- argument errors

@pytest.mark.parametrize("extra, message", [
    (["--world", "3"], "power of two"),
    (["--strategies", "attn=TP2+DP2 moe=TP2+EP2"], "spans 4 ranks"),
    (["--strategies", "attn=TP2+CP1 moe=TP2"], "--strategies"),
    (["--nodes", "2", "--ranks-per-node", "2"], "is not --world 2"),
    (["--nodes", "3"], "does not divide"),
    (["--repeats", "0"], "--repeats"),
    (["--requests", "0"], "--requests"),
    (["--input-len", "9:3"], "--input-len"),
    (["--moe-comm", "async"], "moe_comm"),
    (["--num-threads", "0"], "--num-threads"),
    (["--cluster", "/nonexistent/cluster.yaml"], "not a file"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--world", "4"], "not --world 4"),  # the 1 x 2 cluster file
])
def test_argument_errors_exit_2_with_one_line_before_any_engine(config_only_model, tmp_path, monkeypatch, capsys,
                                                                 extra, message):
    model_dir, cluster = config_only_model
    monkeypatch.setattr(pb, "_start_engine", lambda *a: pytest.fail("no engine may start on bad arguments"))
    assert pb.main(_argv(model_dir, cluster, tmp_path / "o.json", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshserve bench parallel: error:") and message in err[0]


def test_a_model_the_analyzer_cannot_price_is_an_argument_error(tmp_path, monkeypatch, capsys):
    from meshserve.models.factory import preset_config

    model_dir = tmp_path / "dense"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(preset_config("qwen3", "tiny")))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER_YAML)
    monkeypatch.setattr(pb, "_start_engine", lambda *a: pytest.fail("no engine may start"))
    assert pb.main(_argv(model_dir, cluster, tmp_path / "o.json")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot price" in err[0]


# ---------------------------------------------------------------- one real run

def test_real_tiny_run_at_world_2_matches_the_single_rank(tiny_model, tmp_path, capsys):
    model_dir = tiny_model()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER_YAML)
    json_path = tmp_path / "parallel.json"
    argv = ["--model", str(model_dir), "--world", "2", "--strategies", f"{DP2};{TP2}", "--requests", "2",
            "--input-len", "4:8", "--output-len", "3:4", "--repeats", "1", "--cluster", str(cluster),
            "--json", str(json_path), "--no-progress"]
    assert pb.main(argv) == 0

    result = json.loads(json_path.read_text())
    assert [layout["strategy"] for layout in result["layouts"]] == [DP2, TP2]
    for layout in result["layouts"]:
        assert layout["status"] == "ok", layout["error"]
        assert layout["tokens_match"] is True
        assert layout["median"]["output_tokens_per_s"] > 0 and layout["ratio_to_single_rank"] > 0
        assert layout["prediction"]["throughput_tok_s"] > 0
    assert result["baseline"]["median"]["output_tokens_per_s"] > 0
    assert result["all_tokens_match"] is True and result["not_run"] == {}
    assert sorted(result["rankings"]["measured"]) == sorted(result["rankings"]["predicted"]) == sorted([DP2, TP2])
    assert result["spearman_rho"] in (1.0, -1.0, None)
    assert result["machine"]["cpu_count"] >= 1
    assert json_path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "Spearman rank correlation" in out and f"wrote {json_path}" in out
