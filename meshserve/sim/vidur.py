"""One scenario on meshserve's simulator and on Vidur (Agrawal et al., MLSys 2024; PyPI `vidur`): the same dense
model shape, the same op-level hardware profile, the same trace.

Vidur times a batch from per-op tables of a profiled GPU (`mlp.csv`: the linear and elementwise ops by tokens;
`attention.csv`: prefill attention by (KV tokens, chunk), decode attention by (batch, KV tokens); `all_reduce.csv`
by message size), fits a random forest per op, and sums the ops of the batch's layers. Its published tables are
measured on H100s and fetched from Hugging Face when it starts. Here they are written from the dense op model
(`meshserve/sim/dense_op_model.py`) of the same hardware profile meshserve simulates with, on the grids Vidur
predicts at, into a Hugging Face dataset cache that Vidur reads offline. What then differs between the two
results is the simulators themselves: their schedulers, how Vidur's fitted tables round and interpolate, and the
terms one times and the other does not (meshserve's LM head and host gap between steps).

Vidur runs in its own virtual environment (`make vidur`: its dependencies, such as streamlit and wandb, are not
meshserve's), as its command line is started by a user.
"""
from __future__ import annotations

import csv
import hashlib
import json
import lzma
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshserve.sim.dense_op_model import DenseOps
from meshserve.sim.te import SimTESettings
from meshserve.sim.trace import TraceRequest
from meshserve.utils import report

VIDUR_VERSION = "0.0.26"
VIDUR_PYTHON = Path(".venv-vidur/bin/python")
KV_GRANULARITY = 256  # Vidur's step in KV tokens when it predicts attention, rounding up (its default)
TRACE_DATE = "2024-01-01"  # Vidur's trace replay keeps the rows of one date
# Vidur's names for the model and the device whose tables it reads (the H800 is an H100 with a narrower NVLink:
# the same SKU to Vidur, whose own figures for it are only the memory size)
VIDUR_MODELS = {(32, 32, 8, 4096, 14336, 128256): "meta-llama/Llama-3-8B"}
VIDUR_DEVICE, VIDUR_NETWORK = "h100", "h100_dgx"
# meshserve's routing policy -> Vidur's global scheduler: the same rotation; the least loaded TE (`load`: queued
# and running work) as the replica with the fewest outstanding requests (`lor`)
VIDUR_ROUTING = {"round_robin": "round_robin", "load": "lor"}
COMPUTE_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "mlp_act", "input_layernorm",
               "post_attention_layernorm", "attn_rope", "add")


class VidurError(RuntimeError):
    """Vidur cannot run the scenario (one line for the user)."""


def vidur_model_name(ops: DenseOps) -> str:
    s = ops.shape
    key = (s.layers, s.heads, s.kv_heads, s.hidden, s.inter, s.vocab)
    if key not in VIDUR_MODELS:
        raise VidurError(f"Vidur {VIDUR_VERSION} has no model of this shape (it knows "
                         f"{', '.join(VIDUR_MODELS.values())})")
    return VIDUR_MODELS[key]


def token_grid(max_tokens: int) -> list[int]:
    """Every token count to 128, then every multiple of 8: Vidur times a batch at its token count rounded up to a
    multiple of 8."""
    grid = set(range(1, min(128, max_tokens) + 1)) | set(range(128, max_tokens + 1, 8))
    return sorted(grid | {max_tokens})


def compute_rows(ops: DenseOps, max_tokens: int) -> list[dict]:
    """`mlp.csv`: each linear and elementwise op (milliseconds) by tokens in the batch."""
    s, tp = ops.shape, ops.deployment.tp
    timed = {"attn_pre_proj": ops.attn_pre_proj, "attn_post_proj": ops.attn_post_proj,
             "mlp_up_proj": ops.mlp_up_proj, "mlp_down_proj": ops.mlp_down_proj, "mlp_act": ops.mlp_act,
             "input_layernorm": ops.norm, "post_attention_layernorm": ops.norm, "attn_rope": ops.attn_rope,
             "add": ops.add}
    rows = []
    for tokens in token_grid(max_tokens):
        row = {"num_tensor_parallel_workers": tp, "n_head": s.heads, "n_kv_head": s.kv_heads, "n_embd": s.hidden,
               "n_expanded_embd": s.inter, "use_gated_mlp": True, "vocab_size": s.vocab, "num_tokens": tokens}
        row.update({f"time_stats.{op}.median": 1e3 * timed[op](tokens) for op in COMPUTE_OPS})
        rows.append(row)
    return rows


def attention_rows(ops: DenseOps, max_tokens: int, max_batch: int, max_chunk: int, block_size: int,
                   granularity: int) -> list[dict]:
    """`attention.csv`: decode attention by (batch, KV tokens per request), prefill attention by (KV tokens, chunk),
    the KV cache write by tokens (milliseconds), on the grids Vidur predicts at."""
    s, tp = ops.shape, ops.deployment.tp
    common = {"n_embd": s.hidden, "n_q_head": s.heads, "n_kv_head": s.kv_heads, "block_size": block_size,
              "num_tensor_parallel_workers": tp}
    rows = []
    for kv in range(0, max_tokens + 1, granularity):
        for batch in range(1, max_batch + 1):
            rows.append({**common, "batch_size": batch, "prefill_chunk_size": 0, "kv_cache_size": kv,
                         "time_stats.attn_decode.median": 1e3 * ops.attn_decode(batch, kv),
                         "time_stats.attn_prefill.median": 0.0,
                         "time_stats.attn_kv_cache_save.median": 1e3 * ops.kv_cache_save(batch)})
        for chunk in range(32, max_chunk + 1, 32):
            rows.append({**common, "batch_size": 1, "prefill_chunk_size": chunk, "kv_cache_size": kv,
                         "time_stats.attn_decode.median": 0.0,
                         "time_stats.attn_prefill.median": 1e3 * ops.attn_prefill(kv, chunk),
                         "time_stats.attn_kv_cache_save.median": 1e3 * ops.kv_cache_save(chunk)})
    return rows


def all_reduce_rows(ops: DenseOps, max_tokens: int) -> list[dict]:
    """`all_reduce.csv`: the TP all-reduce of a batch's hidden states (milliseconds) by bytes."""
    tp, hidden = ops.deployment.tp, ops.shape.hidden
    return [{"num_workers": tp, "devices_per_node": tp, "collective": "all_reduce", "size": 2 * hidden * tokens,
             "time_stats.all_reduce.median": 1e3 * ops.all_reduce(tokens)}
            for tokens in token_grid(max_tokens)] if tp > 1 else []


def _write_xz_csv(path: Path, rows: list[dict], header: Sequence[str]) -> None:
    with lzma.open(path, "wt", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(header))
        writer.writeheader()
        writer.writerows(rows)


def write_dataset(cache_dir: Path, name: str, files: dict[str, tuple[list[dict], Sequence[str]]],
                  config: dict) -> str:
    """A dataset in the Hugging Face hub's cache layout (`datasets--ORG--NAME/refs/main` naming a snapshot), which
    `huggingface_hub.snapshot_download` returns offline; its id, `meshserve/NAME-DIGEST`. Vidur caches the
    forests it fits by dataset id, so the id carries a digest of the tables: other tables, another id."""
    digest = hashlib.sha1(json.dumps(config, sort_keys=True).encode())
    for file_name, (rows, header) in sorted(files.items()):
        digest.update(json.dumps([file_name, list(header), rows], sort_keys=True).encode())
    revision = digest.hexdigest()
    repo_id = f"meshserve/{name}-{revision[:12]}"
    root = cache_dir / f"datasets--{repo_id.replace('/', '--')}"
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for file_name, (rows, header) in files.items():
        _write_xz_csv(snapshot / file_name, rows, header)
    (snapshot / "config.json").write_text(json.dumps(config) + "\n")
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    return repo_id


ALL_REDUCE_HEADER = ("num_workers", "devices_per_node", "collective", "size", "time_stats.all_reduce.median")
SEND_RECV_HEADER = ("devices_per_node", "collective", "size", "time_stats.send_recv.median")


def vidur_cache(meshserve_cache: Path, full_search: bool) -> Path:
    """Where Vidur's tables and fitted forests live: by forest search, which Vidur's cache key leaves out."""
    return meshserve_cache / "vidur" / ("full-search" if full_search else "one-setting")


def write_profiles(ops: DenseOps, settings: SimTESettings, cache_dir: Path,
                   granularity: int = KV_GRANULARITY) -> tuple[str, str]:
    """Vidur's compute and network tables of `ops` for a TE's `settings` under `cache_dir` (its execution-time
    predictor's cache), attention every `granularity` KV tokens; the two dataset ids to pass it."""
    model = vidur_model_name(ops)
    max_tokens = settings.max_model_len
    compute = compute_rows(ops, max_tokens)
    attention = attention_rows(ops, max_tokens, settings.max_num_seqs, settings.max_num_batched_tokens,
                               settings.block_size, granularity)
    tag = f"{ops.hw.name}-tp{ops.deployment.tp}-{ops.deployment.weight_format}-kv{granularity}"
    source = f"meshserve dense op model, hardware profile {ops.hw.name}"
    compute_repo = write_dataset(
        cache_dir / "profiling_data" / "compute", f"op-model-{tag}",
        {"mlp.csv.xz": (compute, list(compute[0])), "attention.csv.xz": (attention, list(attention[0]))},
        {"model": model, "device_sku": VIDUR_DEVICE, "source": source})
    network_repo = write_dataset(
        cache_dir / "profiling_data" / "network", f"op-model-network-{tag}",
        {"all_reduce.csv.xz": (all_reduce_rows(ops, max_tokens), ALL_REDUCE_HEADER),
         "send_recv.csv.xz": ([], SEND_RECV_HEADER)},
        {"sku": VIDUR_NETWORK, "source": source})
    return compute_repo, network_repo


def write_trace(trace: Sequence[TraceRequest], path: Path) -> None:
    """The trace as Vidur's trace replay reads it (one date, arrival seconds, prompt and output tokens)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for r in trace:
            writer.writerow([TRACE_DATE, f"{r.arrival_s:.6f}", r.prompt_len, r.output_len])


@dataclass(frozen=True)
class VidurRun:
    """How Vidur serves the scenario: `replicas` replicas behind its global scheduler for meshserve's `routing`
    policy, attention predicted every `granularity` KV tokens, each op's random forest fitted by Vidur's own grid
    search (`full_search`: 27 settings in 10 folds) or with the one setting it picks on these tables for most ops,
    in 2 folds."""

    replicas: int = 1
    routing: str = "round_robin"
    granularity: int = KV_GRANULARITY
    full_search: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.granularity < 1:
            raise VidurError(f"Vidur needs a replica and a KV step of a token or more, got {self.replicas} and "
                             f"{self.granularity}")
        if self.routing not in VIDUR_ROUTING:
            raise VidurError(f"Vidur has no global scheduler for routing {self.routing!r} (it has one for "
                             f"{', '.join(VIDUR_ROUTING)})")


def vidur_arguments(ops: DenseOps, settings: SimTESettings, run: VidurRun, *, trace_file: Path,
                    datasets: tuple[str, str], cache_dir: Path, out_dir: Path) -> list[str]:
    """Vidur's command line for `run.replicas` replicas of `ops`, each with the TE's `settings`, serving the trace
    with Sarathi's chunked prefill (a token budget per step that decodes and prompt chunks share: meshserve's
    scheduler's policy)."""
    flags = {
        "seed": run.seed, "replica_config_model_name": vidur_model_name(ops), "replica_config_device": VIDUR_DEVICE,
        "replica_config_network_device": VIDUR_NETWORK, "replica_config_tensor_parallel_size": ops.deployment.tp,
        "replica_config_num_pipeline_stages": 1, "cluster_config_num_replicas": run.replicas,
        "global_scheduler_config_type": VIDUR_ROUTING[run.routing],
        "cache_config_block_size": settings.block_size, "cache_config_num_blocks": settings.num_kv_blocks,
        "replica_scheduler_config_type": "sarathi", "sarathi_scheduler_config_batch_size_cap": settings.max_num_seqs,
        "sarathi_scheduler_config_chunk_size": settings.max_num_batched_tokens,
        "request_generator_config_type": "trace_replay", "trace_request_generator_config_trace_file": trace_file,
        "trace_request_generator_config_date": TRACE_DATE, "trace_request_generator_config_prefill_scale_factor": 1,
        "trace_request_generator_config_decode_scale_factor": 1, "trace_request_generator_config_time_scale_factor": 1,
        "trace_request_generator_config_max_tokens": settings.max_model_len,
        "execution_time_predictor_config_type": "random_forrest", "metrics_config_output_dir": out_dir,
    }
    predictor = {
        "model_profiling_dataset": datasets[0], "network_profiling_dataset": datasets[1], "cache_dir": cache_dir,
        "prediction_max_tokens_per_request": settings.max_model_len,
        "prediction_max_batch_size": settings.max_num_seqs,
        "prediction_max_prefill_chunk_size": settings.max_num_batched_tokens,
        "kv_cache_prediction_granularity": run.granularity,
    }
    if not run.full_search:
        predictor.update(num_estimators=250, max_depth=32, min_samples_split=2, k_fold_cv_splits=2)
    flags.update({f"random_forrest_execution_time_predictor_config_{key}": value for key, value in predictor.items()})
    return [part for flag, value in flags.items() for part in (f"--{flag}", str(value))] + [
        "--no-metrics_config_store_plots"]


def vidur_python(argument: str | None) -> Path:
    """The interpreter with Vidur installed: `argument`, else the one `make vidur` makes."""
    python = Path(argument) if argument else VIDUR_PYTHON
    if not python.exists():
        raise VidurError(f"no Vidur interpreter at {python}: `make vidur` installs vidur=={VIDUR_VERSION} in "
                         f"{VIDUR_PYTHON.parent.parent}")
    return python


def run_vidur(python: Path, arguments: list[str], log_path: Path, timeout_s: float) -> Path:
    """Vidur's simulator in its own interpreter (`vidur_python`), offline (its tables are in the cache); its run
    directory."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    out_dir = Path(arguments[arguments.index("--metrics_config_output_dir") + 1])
    with open(log_path, "w") as log:
        try:
            done = subprocess.run([str(python), "-m", "vidur.main", *arguments], stdout=log, stderr=subprocess.STDOUT,
                                  env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise VidurError(f"Vidur ran past {timeout_s:.0f} s (its log: {log_path})") from None
    runs = sorted(p for p in out_dir.iterdir() if (p / "request_metrics.csv").exists()) if out_dir.exists() else []
    if done.returncode != 0 or not runs:
        raise VidurError(f"Vidur failed with exit {done.returncode} (its log: {log_path})")
    return runs[-1]


def read_vidur_metrics(run_dir: Path, trace: Sequence[TraceRequest]) -> dict:
    """meshserve's metrics of a Vidur run, from its per-request table (request ids are the trace's rows in order):
    output tokens/s over the run's span, TTFT (arrival to the first token, which the prefill makes) and TPOT (the
    time from the first token to the last over the tokens after the first); the median batch time from its CDF."""
    with open(run_dir / "request_metrics.csv") as f:
        requests = list(csv.DictReader(f))
    if len(requests) != len(trace):
        raise VidurError(f"Vidur served {len(requests)} of the trace's {len(trace)} requests ({run_dir})")
    ttft, tpot, ends, tokens = [], [], [], 0
    for row in requests:
        arrival = trace[int(row["Request Id"])].arrival_s
        e2e, first = float(row["request_e2e_time"]), float(row["prefill_e2e_time"])
        outputs = int(float(row["request_num_decode_tokens"]))
        ttft.append(first)
        if outputs > 1:
            tpot.append((e2e - first) / (outputs - 1))
        ends.append(arrival + e2e)
        tokens += outputs
    span = max(ends) - min(r.arrival_s for r in trace)
    with open(run_dir / "plots" / "batch_execution_time.csv") as f:
        cdf = [(float(row["cdf"]), float(row["batch_execution_time"])) for row in csv.DictReader(f)]
    median_batch_s = next(seconds for share, seconds in cdf if share >= 0.5)
    return {"requests": len(requests), "output_tokens": tokens, "output_tokens_per_s": tokens / span,
            "virtual_s": max(ends), "ttft_s": report.summarize(ttft), "tpot_s": report.summarize(tpot),
            "median_step_ms": 1e3 * median_batch_s, "ttfts": ttft, "tpots": tpot}
