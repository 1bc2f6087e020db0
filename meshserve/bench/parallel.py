"""`bench parallel`: measured vs predicted ranking of parallel strategies on this machine.

Every strategy of one world size (or the ones asked for) runs the same seeded
workload through `LLM.generate` (greedy, EOS ignored), and so does the
single-rank engine, in the same run: output tokens/s, mean TTFT and mean TPOT per
repeat, the median of the repeats reported, each layout's throughput as a ratio
to the single rank, and its greedy tokens checked against the single rank's.
The analyzer (`meshserve plan`'s cost model) prices the same strategies for the
checkpoint's config.json, the same workload and a cluster file (given, or
calibrated here with the same nodes x ranks shape); both rankings are reported
side by side with Spearman's rank correlation.

Order of work, so nothing of ours competes for the cores while it is timed:
calibration (if any), then rounds of one fresh engine at a time (the single rank
and every layout once per round). Engine start-up and a warm-up pass are not
timed; the prefix cache is off, so every repeat does the same work.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshserve.bench.offline import WARMUP_SEED_OFFSET, compare_greedy
from meshserve.bench.workload import WorkloadRequest, make_offline_workload, parse_range, special_token_ids
from meshserve.config import EngineConfig
from meshserve.models.factory import ensure_default_model
from meshserve.parallel.analyzer import AnalyzerError, Workload, estimate, model_spec_from_config
from meshserve.parallel.strategy import ParallelStrategy, StrategyError, enumerate_strategies, is_power_of_two
from meshserve.utils import report
from meshserve.utils.rank_stats import average_ranks, spearman_rank_correlation
from meshserve.wire.sampling_params import SamplingParams

SINGLE_RANK = "attn=TP1+DP1 moe=TP1+EP1"
SINGLE_RANK_LABEL = "single rank"
# Message sizes and repeats of the quick calibration when no --cluster is given.
QUICK_CALIBRATION_SIZES = (64 * 2**10, 256 * 2**10, 2**20)
QUICK_CALIBRATION_REPEATS = 2
DEFAULT_LAYOUT_TIMEOUT_S = 900.0


class BenchArgumentError(ValueError):
    """A bad `bench parallel` argument, reported as one line."""


class BaselineError(RuntimeError):
    """The single-rank engine itself failed: there is nothing to compare against."""


# ---------------------------------------------------------------- options

@dataclass
class ParallelBenchOptions:
    model_dir: str
    world_size: int
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    json_path: str
    strategies: list[str] | None = None  # canonical strings; None: every strategy of world_size
    nodes: int = 1
    ranks_per_node: int | None = None  # default: world_size // nodes
    repeats: int = 3
    seed: int = 0
    cluster_path: str | None = None  # None: a quick calibration of this machine
    engine_args: dict[str, Any] = field(default_factory=dict)
    layout_timeout_s: float = DEFAULT_LAYOUT_TIMEOUT_S
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not is_power_of_two(self.world_size) or self.world_size < 2:
            raise BenchArgumentError(f"--world must be a power of two of at least 2, got {self.world_size}")
        if self.num_requests < 1:
            raise BenchArgumentError(f"--requests must be at least 1, got {self.num_requests}")
        if self.repeats < 1:
            raise BenchArgumentError(f"--repeats must be at least 1, got {self.repeats}")
        if not self.layout_timeout_s > 0:
            raise BenchArgumentError(f"--layout-timeout must be positive, got {self.layout_timeout_s}")
        if self.nodes < 1 or self.world_size % self.nodes:
            raise BenchArgumentError(f"--nodes {self.nodes} does not divide --world {self.world_size}")
        if self.ranks_per_node is None:
            self.ranks_per_node = self.world_size // self.nodes
        if self.nodes * self.ranks_per_node != self.world_size:
            raise BenchArgumentError(f"--nodes {self.nodes} x --ranks-per-node {self.ranks_per_node} "
                                     f"is not --world {self.world_size}")
        if self.strategies is None:
            self.strategies = [str(s) for s in enumerate_strategies(self.world_size)]
        if not self.strategies:
            raise BenchArgumentError("--strategies names no strategy")


def parse_strategy_list(text: str, world_size: int) -> list[str]:
    """'attn=...;attn=...' -> canonical strategy strings of `world_size` ranks, in order, without repeats."""
    strategies: list[str] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        try:
            strategy = ParallelStrategy.parse(part)
        except StrategyError as exc:
            raise BenchArgumentError(f"--strategies: {exc}") from None
        if strategy.disagg:
            raise BenchArgumentError(f"--strategies: {strategy} is disaggregated; `meshserve bench disagg` measures "
                                     "such layouts and `meshserve plan --disagg` prices them")
        if strategy.world_size != world_size:
            raise BenchArgumentError(f"--strategies: {strategy} spans {strategy.world_size} ranks, "
                                     f"not --world {world_size}")
        if str(strategy) not in strategies:
            strategies.append(str(strategy))
    if not strategies:
        raise BenchArgumentError(f"--strategies names no strategy: {text!r}")
    return strategies


def log(message: str) -> None:
    print(f"[bench parallel] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- measuring

def _start_engine(model_dir: str, engine_args: dict[str, Any]):
    """The engine of one layout (a seam for tests)."""
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.engine.llm import LLM

    return LLM(model=model_dir, **engine_args)


def run_workload_once(llm, workload: Sequence[WorkloadRequest]) -> tuple[dict[str, Any], list[list[int]]]:
    """One timed pass of the workload: output tokens/s, mean TTFT and mean TPOT, and the greedy tokens."""
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in workload]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in workload], params)
    elapsed = time.perf_counter() - start
    tokens = [list(o.token_ids) for o in outputs]
    ttfts, tpots = [], []
    for out, ids in zip(outputs, tokens):
        m = out.metrics
        if m is None or m.first_token_time is None:
            continue
        ttfts.append(m.first_token_time - m.arrival_time)
        if len(ids) >= 2 and m.last_token_time is not None:
            tpots.append((m.last_token_time - m.first_token_time) / (len(ids) - 1))
    output_tokens = sum(len(t) for t in tokens)
    sample = {
        "output_tokens_per_s": output_tokens / elapsed if elapsed > 0 else 0.0,
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
        "mean_tpot_s": statistics.fmean(tpots) if tpots else None,
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        # the machine is shared: what else ran during the pass is part of the result
        "load_average_1m": os.getloadavg()[0],
    }
    return sample, tokens


def measure_pass(model_dir: str, engine_args: dict[str, Any], workload: Sequence[WorkloadRequest],
                 warmup: Sequence[WorkloadRequest], timeout_s: float) -> dict[str, Any]:
    """Start one engine, warm it up, time one pass of the workload, shut it down.

    An engine that does not start (a model that does not shard that way) is
    "unsupported"; one that fails or overruns `timeout_s` afterwards is "failed".
    """
    # start-up: zmq only when engines run
    from meshserve.engine.core_client import EngineStartupError

    load_start = time.perf_counter()
    try:
        llm = _start_engine(model_dir, engine_args)
    except EngineStartupError as exc:
        return {"status": "unsupported", "error": _one_line(exc)}
    load_s = time.perf_counter() - load_start
    # A hung collective would hang the whole run: past the deadline the master is stopped and generate fails.
    timed_out = threading.Event()

    def stop_engine() -> None:
        timed_out.set()
        llm.engine.proc.terminate()

    watchdog = threading.Timer(timeout_s, stop_engine)
    watchdog.daemon = True
    watchdog.start()
    try:
        run_workload_once(llm, warmup)
        sample, tokens = run_workload_once(llm, workload)
    except Exception as exc:  # an engine failure mid-run is a result to report, not a reason to stop
        return {"status": "failed", "error": f"timed out after {timeout_s:.0f}s" if timed_out.is_set()
                else _one_line(exc)}
    finally:
        watchdog.cancel()
        llm.shutdown()
    return {"status": "ok", "error": None, "load_s": load_s, "sample": sample, "tokens": tokens}


def _median_of(samples: list[dict[str, Any]], key: str) -> float | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(values) if values else None


def measure_layouts(layouts: dict[str, dict[str, Any]], model_dir: str, workload: Sequence[WorkloadRequest],
                    warmup: Sequence[WorkloadRequest], repeats: int, timeout_s: float,
                    progress: bool) -> dict[str, dict[str, Any]]:
    """Time every layout (label -> engine args) `repeats` times, in rounds.

    Each round runs every layout once, each in a fresh engine, starting one layout
    later than the round before: a slow spell of a shared machine then lands on
    several layouts instead of on all repeats of one. The first layout is the
    baseline; if it fails, nothing can be compared and BaselineError is raised.
    A layout that does not start or fails is recorded and left out of later rounds.
    """
    records = {label: {"strategy": label, "engine_args": dict(args), "status": "ok", "error": None,
                       "samples": [], "tokens": [], "load_s": []} for label, args in layouts.items()}
    labels = list(layouts)
    baseline = labels[0]
    for round_index in range(repeats):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            record = records[label]
            if record["status"] != "ok":
                continue
            if progress:
                log(f"round {round_index + 1}/{repeats}: {label}")
            result = measure_pass(model_dir, layouts[label], workload, warmup, timeout_s)
            if result["status"] != "ok":
                record.update(status=result["status"], error=result["error"])
                if label == baseline:
                    raise BaselineError(f"the {label} engine is {result['status']}: {result['error']}")
                if progress:
                    log(f"{label}: {result['status']}: {result['error']}")
                continue
            record["samples"].append(result["sample"])
            record["tokens"].append(result["tokens"])
            record["load_s"].append(result["load_s"])
            if progress:
                sample = result["sample"]
                log(f"{label}: {sample['output_tokens_per_s']:.1f} output tok/s in {sample['elapsed_s']:.2f}s "
                    f"(load average {sample['load_average_1m']:.1f})")
    for record in records.values():
        record["median"] = {key: _median_of(record["samples"], key)
                            for key in ("output_tokens_per_s", "mean_ttft_s", "mean_tpot_s", "elapsed_s")}
    return records


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


# ---------------------------------------------------------------- prediction

def analyzer_workload(workload: Sequence[WorkloadRequest], max_num_seqs: int):
    """The analyzer's view of an offline batch: every request in flight at once, no queue.

    b = the requests the engine holds at once; L_in, L_out = the workload's means.
    Rate 0 makes Eq. 7's queueing delay zero, so Eq. 11 prices exactly one batch's
    service (prefill, then L_out decode steps); any positive rate would add an
    M/M/1 wait that an offline batch does not have.
    """
    return Workload(batch=min(len(workload), max_num_seqs),
                    input_len=max(1, round(statistics.fmean(len(r.prompt_token_ids) for r in workload))),
                    output_len=max(1, round(statistics.fmean(r.output_len for r in workload))),
                    arrival_rate=0.0)


def predict(hf_config: dict[str, Any], cluster, analyzer_wl, strategies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The analyzer's estimate of each strategy; output tokens/s is its throughput's output share."""
    model = model_spec_from_config(hf_config)
    output_share = analyzer_wl.output_len / (analyzer_wl.input_len + analyzer_wl.output_len)
    predictions = {}
    for name in strategies:
        est = estimate(model, ParallelStrategy.parse(name), cluster, analyzer_wl)
        predictions[name] = {
            "throughput_tok_s": est.throughput_tok_s,
            "output_tokens_per_s": est.throughput_tok_s * output_share,
            "ttft_s": est.ttft_s if math.isfinite(est.ttft_s) else None,
            "itl_s": est.itl_s if math.isfinite(est.itl_s) else None,
            "fits_memory": est.fits_memory,
            "memory_per_rank_gb": est.memory_per_rank_bytes / 1e9,
            "comm_model": est.comm_model,
        }
    return predictions


def load_or_calibrate_cluster(options: ParallelBenchOptions, hf_config: dict[str, Any], batch: int, input_len: int):
    """(Cluster, record of where it came from): the --cluster file, or a quick calibration written beside the JSON."""
    # start-up: yaml only when a cluster file is read
    from meshserve.parallel.cluster_file import load_cluster_file

    if options.cluster_path:
        return load_cluster_file(options.cluster_path), {"source": "file", "path": options.cluster_path}
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.bench import calibrate as cal

    # Matmul shapes of this model's routed experts: a decode step and a prefill chunk of the workload.
    hidden, expert = int(hf_config["hidden_size"]), 2 * int(hf_config["moe_intermediate_size"])
    prefill_tokens = min(batch * input_len, int(options.engine_args.get("max_num_batched_tokens", 2048)))
    config = cal.CalibrationConfig(nodes=options.nodes, ranks_per_node=options.ranks_per_node,
                                   sizes=QUICK_CALIBRATION_SIZES, repeats=QUICK_CALIBRATION_REPEATS,
                                   matmul_shapes=((batch, hidden, expert), (prefill_tokens, hidden, expert)))
    path = Path(options.json_path).with_suffix(".cluster.yaml")
    if options.progress:
        log(f"calibrating this machine as {options.nodes} x {options.ranks_per_node} ranks -> {path}")
    cal.calibrate(config, path, log=log if options.progress else (lambda _message: None))
    return load_cluster_file(str(path)), {"source": "calibrated", "path": str(path)}


def cluster_record(cluster) -> dict[str, Any]:
    return {"name": cluster.name, "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node,
            "device_memory_gb": cluster.device_memory_bytes / 1e9, "tflops": cluster.flops / 1e12,
            "intra_bandwidth_gb_s": cluster.intra_bandwidth / 1e9,
            "inter_bandwidth_gb_s": cluster.inter_bandwidth / 1e9,
            "intra_latency_us": cluster.intra_latency * 1e6, "inter_latency_us": cluster.inter_latency * 1e6,
            **({"a2a_latency_us": cluster.a2a_latency * 1e6, "a2a_bandwidth_gb_s": cluster.a2a_bandwidth / 1e9}
               if cluster.a2a_bandwidth is not None else {})}


# ---------------------------------------------------------------- assembling the report

def assemble_results(baseline: dict[str, Any], layouts: list[dict[str, Any]],
                     predictions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios to the single rank, token checks, both rankings and their correlation.

    Only layouts that ran are ranked, so both rankings order the same set.
    `layouts` are `measure_layouts` records; their `tokens` are replaced by the check.
    """
    base_runs = baseline["tokens"]
    base_tokens = base_runs[0]
    base_rate = baseline["median"]["output_tokens_per_s"]
    baseline = {k: v for k, v in baseline.items() if k != "tokens"}
    baseline["repeats_consistent"] = all(run == base_tokens for run in base_runs)
    out_layouts = []
    for layout in layouts:
        layout = dict(layout)
        runs = layout.pop("tokens", None)
        layout["prediction"] = predictions.get(layout["strategy"])
        if layout["status"] == "ok":
            mismatches = [compare_greedy(run, base_tokens) for run in runs]
            worst = max(mismatches, key=lambda m: m["mismatching_requests"])
            layout["tokens_match"] = worst["mismatching_requests"] == 0
            layout["greedy_check"] = worst
            rate = layout["median"]["output_tokens_per_s"]
            layout["ratio_to_single_rank"] = rate / base_rate if base_rate else None
        else:
            layout["tokens_match"] = None
            layout["ratio_to_single_rank"] = None
        out_layouts.append(layout)

    ranked = [layout for layout in out_layouts if layout["status"] == "ok" and layout["prediction"] is not None]
    measured = [layout["median"]["output_tokens_per_s"] for layout in ranked]
    predicted = [layout["prediction"]["throughput_tok_s"] for layout in ranked]
    for layout, m_rank, p_rank in zip(ranked, average_ranks(measured), average_ranks(predicted)):
        layout["measured_rank"], layout["predicted_rank"] = m_rank, p_rank
    rows = [{"strategy": layout["strategy"], "measured_rank": layout["measured_rank"],
             "predicted_rank": layout["predicted_rank"],
             "measured_output_tokens_per_s": layout["median"]["output_tokens_per_s"],
             "predicted_output_tokens_per_s": layout["prediction"]["output_tokens_per_s"],
             "ratio_to_single_rank": layout["ratio_to_single_rank"], "tokens_match": layout["tokens_match"]}
            for layout in sorted(ranked, key=lambda layout: (layout["measured_rank"], layout["strategy"]))]
    by_predicted = sorted(ranked, key=lambda layout: (layout["predicted_rank"], layout["strategy"]))
    return {
        "baseline": baseline,
        "layouts": out_layouts,
        "rankings": {
            "measured": [r["strategy"] for r in rows],
            "predicted": [layout["strategy"] for layout in by_predicted],
            "rows": rows,
        },
        "spearman_rho": spearman_rank_correlation(measured, predicted),
        "ranked_layouts": len(ranked),
        "all_tokens_match": all(layout["tokens_match"] for layout in out_layouts if layout["status"] == "ok"),
        "not_run": {layout["strategy"]: {"status": layout["status"], "error": layout["error"]}
                    for layout in out_layouts if layout["status"] != "ok"},
    }


# ---------------------------------------------------------------- the whole run

def run_parallel_benchmark(options: ParallelBenchOptions) -> dict[str, Any]:
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.models.loader import load_hf_config

    hf_config = load_hf_config(options.model_dir)
    try:
        model_spec_from_config(hf_config)  # an architecture the analyzer cannot price fails before any work
    except AnalyzerError as exc:
        raise BenchArgumentError(f"the analyzer cannot price {options.model_dir}: {exc}") from None
    vocab_size = int(hf_config["vocab_size"])
    excluded = special_token_ids(options.model_dir)
    workload = make_offline_workload(options.num_requests, options.input_len, options.output_len, vocab_size,
                                     seed=options.seed, exclude_token_ids=excluded)
    # The same number and lengths of prompts, its own seed, few output tokens: the pass meets warm kernels.
    warmup = make_offline_workload(options.num_requests, options.input_len, (2, 4), vocab_size,
                                   seed=options.seed + WARMUP_SEED_OFFSET, exclude_token_ids=excluded)
    engine_args = {"max_num_seqs": 64, "dtype": "float32", **options.engine_args, "enable_prefix_caching": False}
    analyzer_wl = analyzer_workload(workload, int(engine_args["max_num_seqs"]))

    cluster, cluster_source = load_or_calibrate_cluster(options, hf_config, analyzer_wl.batch, analyzer_wl.input_len)
    if cluster.world_size != options.world_size:
        raise BenchArgumentError(f"cluster {cluster.name} has {cluster.world_size} devices, not --world "
                                 f"{options.world_size}")
    predictions = predict(hf_config, cluster, analyzer_wl, options.strategies)

    engines = {SINGLE_RANK_LABEL: {**engine_args, "parallel": SINGLE_RANK}}
    engines.update({name: {**engine_args, "parallel": name} for name in options.strategies})
    records = measure_layouts(engines, options.model_dir, workload, warmup, options.repeats,
                              options.layout_timeout_s, options.progress)
    baseline = records.pop(SINGLE_RANK_LABEL)
    assembled = assemble_results(baseline, list(records.values()), predictions)

    cores = os.cpu_count() or 1
    return {
        "benchmark": "parallel",
        "model": {"dir": str(options.model_dir), "model_type": hf_config.get("model_type")},
        "world_size": options.world_size,
        "workload": {
            "num_requests": options.num_requests, "input_len": list(options.input_len),
            "output_len": list(options.output_len), "seed": options.seed,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
            "output_tokens": sum(r.output_len for r in workload),
        },
        "engine_args": engine_args,
        "threads_per_rank": {"single rank": engine_args.get("num_threads") or cores,
                             "layouts": engine_args.get("num_threads") or max(1, cores // options.world_size)},
        "repeats": options.repeats,
        "analyzer_workload": {"batch": analyzer_wl.batch, "input_len": analyzer_wl.input_len,
                              "output_len": analyzer_wl.output_len, "arrival_rate": analyzer_wl.arrival_rate},
        "cluster": {**cluster_source, **cluster_record(cluster)},
        **assembled,
        "machine": report.machine_info(),
        "options": {k: v for k, v in asdict(options).items() if k not in ("engine_args", "progress")},
    }


# ---------------------------------------------------------------- output

def _short(strategy: str) -> str:
    return strategy.replace("attn=", "").replace(" moe=", "\n")


def plot_parallel(result: dict[str, Any], path: str | Path) -> Path:
    """Left: each layout's measured throughput over the single rank, with its predicted rank.
    Right: measured against predicted output tokens/s."""
    fig, axes = report.new_figure(ncols=2, width_per_panel=6.5, height=4.5)
    rows = result["rankings"]["rows"]
    ax = axes[0][0]
    if rows:
        bars = ax.bar(range(len(rows)), [r["ratio_to_single_rank"] for r in rows],
                      color=["tab:blue" if r["tokens_match"] else "tab:red" for r in rows])
        for bar, row in zip(bars, rows):
            ax.annotate(f"{row['ratio_to_single_rank']:.2f}x\npred #{row['predicted_rank']:g}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), [_short(r["strategy"]) for r in rows], fontsize=7)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.margins(y=0.2)
        if not all(r["tokens_match"] for r in rows):
            ax.text(0.99, 0.99, "red: greedy tokens differ from the single rank", transform=ax.transAxes,
                    ha="right", va="top", fontsize=7, color="tab:red")
    ax.set_ylabel("output tok/s / single rank (median)")
    rho = result["spearman_rho"]
    ax.set_title(f"world {result['world_size']}: measured order, predicted rank annotated"
                 + (f"\nSpearman rho {rho:.2f}" if rho is not None else ""), fontsize=9)

    ax = axes[0][1]
    for i, row in enumerate(rows):
        ax.scatter(row["predicted_output_tokens_per_s"], row["measured_output_tokens_per_s"], color=f"C{i % 10}",
                   label=row["strategy"])
    ax.set_xlabel("predicted output tok/s (analyzer)")
    ax.set_ylabel("measured output tok/s (median)")
    ax.set_title(f"cluster {result['cluster']['name']} ({result['cluster']['source']})", fontsize=9)
    ax.grid(True, alpha=0.3)
    if rows:
        ax.legend(fontsize=6)
    not_run = result["not_run"]
    if not_run:
        fig.text(0.01, 0.01, "not run: " + "; ".join(f"{s} ({v['status']})" for s, v in not_run.items()), fontsize=6)
    return report.save_figure(fig, path)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def summary_lines(result: dict[str, Any]) -> list[str]:
    base = result["baseline"]["median"]
    threads = result.get("threads_per_rank")
    lines = [f"single rank: {base['output_tokens_per_s']:.1f} output tok/s, TTFT {_ms(base['mean_ttft_s'])} ms, "
             f"TPOT {_ms(base['mean_tpot_s'])} ms (median of {result['repeats']})"
             + (f"; torch threads: {threads['single rank']} for the single rank, {threads['layouts']} per rank "
                f"of a layout" if threads else "")]
    table = [("measured", "predicted", "strategy", "tok/s", "x single", "TTFT ms", "TPOT ms", "pred tok/s", "tokens")]
    by_name = {layout["strategy"]: layout for layout in result["layouts"]}
    for row in result["rankings"]["rows"]:
        layout = by_name[row["strategy"]]
        table.append((f"{row['measured_rank']:g}", f"{row['predicted_rank']:g}", row["strategy"],
                      f"{row['measured_output_tokens_per_s']:.1f}", f"{row['ratio_to_single_rank']:.2f}",
                      _ms(layout["median"]["mean_ttft_s"]), _ms(layout["median"]["mean_tpot_s"]),
                      f"{row['predicted_output_tokens_per_s']:.3g}", "match" if row["tokens_match"] else "DIFFER"))
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    for name, why in result["not_run"].items():
        lines.append(f"{why['status']}: {name}: {why['error']}")
    rho = result["spearman_rho"]
    lines.append(f"Spearman rank correlation, predicted vs measured over {result['ranked_layouts']} layouts: "
                 + ("undefined" if rho is None else f"{rho:.3f}"))
    if not result["all_tokens_match"]:
        lines.append("greedy tokens DIFFER from the single rank for: "
                     + ", ".join(layout["strategy"] for layout in result["layouts"] if layout["tokens_match"] is False))
    return lines


# ---------------------------------------------------------------- command line

def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="HF-format model directory")
    source.add_argument("--preset", help="a generated random model preset (tiny, small)")
    parser.add_argument("--arch", default="deepseek_v3", help="architecture of --preset (default: deepseek_v3)")
    parser.add_argument("--world", type=int, required=True, help="ranks of every strategy (2, 4, ...)")
    parser.add_argument("--strategies", help="';'-separated strategies (default: every strategy of --world)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the analyzer's cluster (default: 1)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: world / nodes)")
    parser.add_argument("--requests", type=int, required=True, help="number of requests")
    parser.add_argument("--input-len", required=True, help="prompt length range A:B (tokens, inclusive)")
    parser.add_argument("--output-len", required=True, help="output length range A:B (tokens, inclusive)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per layout, median reported (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--cluster", help="cluster YAML (`meshserve plan calibrate`); default: calibrate quickly")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences per DP group (default: 64)")
    parser.add_argument("--moe-comm", default="fused", help="hybrid TP-EP collectives: fused | sync (default: fused)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads of every rank, the single rank's too (default: the engine's, "
                             "the cores divided among the ranks)")
    parser.add_argument("--layout-timeout", type=float, default=DEFAULT_LAYOUT_TIMEOUT_S,
                        help="seconds one layout may run after start-up before it counts as failed (default: 900)")
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress lines")


def _fail(message: str, code: int = 2) -> int:
    print(f"meshserve bench parallel: error: {message}", file=sys.stderr)
    return code


def _options_from_args(args: argparse.Namespace) -> ParallelBenchOptions:
    if args.cluster and not Path(args.cluster).is_file():
        raise BenchArgumentError(f"--cluster {args.cluster} is not a file")
    if args.model and not Path(args.model).is_dir():
        raise BenchArgumentError(f"model directory {args.model!r} does not exist")
    engine_args = {"max_num_seqs": args.max_num_seqs, "moe_comm": args.moe_comm}
    if args.num_threads is not None:
        if args.num_threads < 1:
            raise BenchArgumentError(f"--num-threads must be at least 1, got {args.num_threads}")
        engine_args["num_threads"] = args.num_threads
    EngineConfig.from_kwargs("", **engine_args)  # bad engine settings fail before anything starts
    strategies = parse_strategy_list(args.strategies, args.world) if args.strategies else None
    options = ParallelBenchOptions(
        model_dir="", world_size=args.world, num_requests=args.requests,
        input_len=parse_range(args.input_len, "--input-len"), output_len=parse_range(args.output_len, "--output-len"),
        json_path=args.json, strategies=strategies, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
        repeats=args.repeats, seed=args.seed, cluster_path=args.cluster, engine_args=engine_args,
        layout_timeout_s=args.layout_timeout, progress=args.progress)
    if args.cluster:
        # start-up: yaml only when a cluster file is read
        from meshserve.parallel.cluster_file import load_cluster_file

        cluster = load_cluster_file(args.cluster)
        if cluster.world_size != args.world:
            raise BenchArgumentError(f"--cluster {args.cluster} has {cluster.nodes} x {cluster.devices_per_node} "
                                     f"devices, not --world {args.world}")
    return options


def parallel_main(args: argparse.Namespace) -> int:
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    try:
        options = _options_from_args(args)
        # after validation: a preset may be written on first use
        options.model_dir = args.model or str(ensure_default_model(args.arch, args.preset))
        result = run_parallel_benchmark(options)
    except BaselineError as exc:
        return _fail(str(exc), code=1)
    except (TimeoutError, ProcessExitedException, ProcessRaisedException) as exc:  # the calibration world
        return _fail(f"calibration failed: {_one_line(exc)}", code=1)
    except (ValueError, OSError) as exc:  # bad arguments, cluster file, model or preset
        return _fail(_one_line(exc))
    json_path = report.write_json(args.json, result)
    png_path = plot_parallel(result, report.png_path_for(json_path))
    for line in summary_lines(result):
        print(line)
    print(f"wrote {json_path} and {png_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench parallel", description=__doc__.splitlines()[0])
    add_parallel_arguments(parser)
    return parallel_main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
