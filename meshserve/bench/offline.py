"""`bench offline`: throughput of the offline engine against HF transformers on one workload, plus the decode roofline.

Order of work, chosen so nothing competes for the cores while it is timed:
measure the machine (bandwidth, matmul rate) -> run the workload through
meshserve -> measure decode tokens/s at batch B on the same engine -> shut the
engine down -> run the same workload through HF transformers.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshserve.bench.workload import WorkloadRequest, make_offline_workload, special_token_ids
from meshserve.utils import report
from meshserve.wire.sampling_params import SamplingParams

# Warm-up and roofline prompts come from their own seeds, so they never repeat the timed workload's.
WARMUP_SEED_OFFSET = 1_000_000
ROOFLINE_SEED_OFFSET = 2_000_000


@dataclass
class OfflineOptions:
    model_dir: str
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    json_path: str
    baseline: str = "hf"  # "hf" | "none"
    hf_batch_size: int = 16
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)
    roofline: bool = True
    roofline_batch: int | None = None  # default: min(max_num_seqs, requests)
    roofline_context: int | None = None  # default: middle of the input-length range
    roofline_decode_tokens: int = 32
    roofline_repeats: int = 3
    bandwidth_bytes: int = 256 * 2**20  # copy buffer for the bandwidth measurement; keep well beyond cache
    matmul_size: int = 2048
    progress: bool = True

    def __post_init__(self) -> None:
        if self.baseline not in ("hf", "none"):
            raise ValueError(f"baseline must be 'hf' or 'none', got {self.baseline!r}")
        if self.hf_batch_size < 1:
            raise ValueError(f"hf batch size must be at least 1, got {self.hf_batch_size}")
        for name in ("roofline_batch", "roofline_context"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be at least 1, got {value}")
        if self.roofline_decode_tokens < 1 or self.roofline_repeats < 1:
            raise ValueError("roofline decode tokens and repeats must be at least 1")
        max_num_seqs = int(self.engine_args.get("max_num_seqs", 64))
        if self.roofline_batch is not None and self.roofline_batch > max_num_seqs:
            raise ValueError(f"roofline batch {self.roofline_batch} exceeds max_num_seqs {max_num_seqs}: "
                             "the batch would not decode together")
        if self.bandwidth_bytes < 2**20 or self.matmul_size < 16:
            raise ValueError("bandwidth buffer must be at least 1 MiB and matmul size at least 16")


def log(message: str) -> None:
    print(f"[bench offline] {message}", file=sys.stderr, flush=True)


def compare_greedy(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How many requests' greedy tokens differ, and where each first diverges."""
    divergence = []
    for a, b in zip(ours, theirs):
        a, b = list(a), list(b)
        if a != b:
            divergence.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {
        "compared_requests": min(len(ours), len(theirs)),
        "mismatching_requests": len(divergence),
        "first_divergence_positions": divergence[:32],
    }


def _throughput(elapsed: float, prompt_tokens: int, output_tokens: int) -> dict[str, float]:
    return {
        "output_tokens_per_s": output_tokens / elapsed if elapsed > 0 else 0.0,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed if elapsed > 0 else 0.0,
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


def run_meshserve(llm, workload: Sequence[WorkloadRequest], progress: bool) -> tuple[dict[str, Any], list[list[int]]]:
    """Greedy, EOS ignored, each request's own max_tokens; returns the throughput record and the tokens."""
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in workload]
    prompts = [r.prompt_token_ids for r in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    tokens = [list(o.token_ids) for o in outputs]
    record = _throughput(elapsed, sum(len(p) for p in prompts), sum(len(t) for t in tokens))
    record["requested_output_tokens"] = sum(r.output_len for r in workload)
    record["finish_reasons"] = _count(o.finish_reason for o in outputs)
    return record, tokens


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[str(item)] = counts.get(str(item), 0) + 1
    return counts


def _roofline_shape(options: OfflineOptions) -> tuple[int, int]:
    max_num_seqs = int(options.engine_args.get("max_num_seqs", 64))
    batch = options.roofline_batch or min(max_num_seqs, options.num_requests)
    context = options.roofline_context or (options.input_len[0] + options.input_len[1]) // 2
    return batch, context


def measure_machine(options: OfflineOptions) -> dict[str, Any]:
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.bench.roofline import measure_matmul_rate, measure_memory_bandwidth

    device = options.engine_args.get("device", "cpu")  # the roofline of the device the engine runs on
    if options.progress:
        log(f"measuring {device} memory bandwidth and fp32 matmul rate")
    return {
        "device": device,
        "memory_bandwidth_gbps": measure_memory_bandwidth(num_bytes=options.bandwidth_bytes, device=device),
        "matmul_gflops": measure_matmul_rate(size=options.matmul_size, device=device),
        "bandwidth_buffer_bytes": options.bandwidth_bytes,
        "matmul_size": options.matmul_size,
    }


def roofline_record(hf_config: dict[str, Any], dtype_name: str, batch: int, context: int,
                    machine: dict[str, Any], achieved_tokens_per_s: float,
                    measurement: dict[str, Any]) -> dict[str, Any]:
    """The bound for (batch, context) on this machine, what was achieved, and every input that went in."""
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.bench.roofline import decode_step_cost, footprint_from_config, roofline_bound
    from meshserve.models.loader import resolve_dtype

    element_bytes = resolve_dtype(dtype_name, hf_config).itemsize
    footprint = footprint_from_config(hf_config)
    cost = decode_step_cost(footprint, batch, context, weight_bytes_per_param=element_bytes,
                            kv_bytes_per_element=element_bytes)
    bound = roofline_bound(cost, machine["memory_bandwidth_gbps"], machine["matmul_gflops"])
    return {
        "batch": batch,
        "context_len": context,
        "bytes_per_param": element_bytes,
        **machine,
        "total_params": footprint.total_params,
        "active_params_per_token": footprint.active_params_per_token,
        "param_breakdown": footprint.breakdown,
        "step_cost": cost.to_dict(),
        "bound": bound.to_dict(),
        "bound_tokens_per_s": bound.tokens_per_s,
        "achieved_tokens_per_s": achieved_tokens_per_s,
        "measurement": measurement,
    }


def run_offline_benchmark(options: OfflineOptions) -> dict[str, Any]:
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.models.loader import load_hf_config

    hf_config = load_hf_config(options.model_dir)
    vocab_size = int(hf_config["vocab_size"])
    excluded = special_token_ids(options.model_dir)
    workload = make_offline_workload(options.num_requests, options.input_len, options.output_len,
                                     vocab_size, seed=options.seed, exclude_token_ids=excluded)
    machine = measure_machine(options) if options.roofline else None
    ours, our_tokens, roofline = _run_engine_phase(options, hf_config, workload, excluded, machine)
    baseline, greedy = (None, None)
    if options.baseline == "hf":
        baseline, greedy = _run_baseline(options, hf_config, workload, our_tokens)

    speedup = (ours["output_tokens_per_s"] / baseline["output_tokens_per_s"]
               if baseline and baseline["output_tokens_per_s"] > 0 else None)
    fraction = (roofline["achieved_tokens_per_s"] / roofline["bound_tokens_per_s"]) if roofline else None
    return {
        "benchmark": "offline",
        "model": {"dir": str(options.model_dir), "model_type": hf_config.get("model_type")},
        "workload": {
            "num_requests": options.num_requests,
            "input_len": list(options.input_len),
            "output_len": list(options.output_len),
            "seed": options.seed,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
            "output_tokens": sum(r.output_len for r in workload),
        },
        "engine_args": dict(options.engine_args),
        "meshserve": ours,
        "baseline": baseline,
        "speedup": speedup,
        "greedy_check": greedy,
        "decode_roofline_fraction": fraction,
        "roofline": roofline,
        "machine": report.machine_info(),
        "options": {k: v for k, v in asdict(options).items() if k not in ("engine_args", "progress")},
    }


def _run_engine_phase(options: OfflineOptions, hf_config: dict[str, Any], workload: Sequence[WorkloadRequest],
                      excluded: set[int], machine: dict[str, Any] | None):
    """Start the engine, run the workload, measure decode at batch B, and always shut the engine down."""
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.engine.llm import LLM

    vocab_size = int(hf_config["vocab_size"])
    if options.progress:
        log(f"starting meshserve on {options.model_dir} ({options.engine_args})")
    load_start = time.perf_counter()
    llm = LLM(model=options.model_dir, **options.engine_args)
    try:
        load_s = time.perf_counter() - load_start
        # Warm up on a prompt of its own, so the prefix cache holds nothing of the timed workload.
        warmup = make_offline_workload(1, options.input_len, (2, 2), vocab_size,
                                       seed=options.seed + WARMUP_SEED_OFFSET, exclude_token_ids=excluded)
        llm.generate([warmup[0].prompt_token_ids], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2))
        if options.progress:
            log(f"meshserve: {len(workload)} requests")
        ours, our_tokens = run_meshserve(llm, workload, options.progress)
        ours["load_s"] = load_s
        if options.progress:
            log(f"meshserve: {ours['output_tokens_per_s']:.1f} output tokens/s in {ours['elapsed_s']:.2f}s")
    finally:
        llm.shutdown()
    roofline = None
    if machine is not None:
        roofline = _measure_roofline(options, hf_config, excluded, machine)
    return ours, our_tokens, roofline


def _measure_roofline(options: OfflineOptions, hf_config: dict[str, Any], excluded: set[int],
                      machine: dict[str, Any]) -> dict[str, Any]:
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.bench.roofline import measure_decode_throughput
    from meshserve.engine.llm import LLM

    batch, context = _roofline_shape(options)
    if options.progress:
        log(f"decode roofline: batch {batch}, context {context}, {options.roofline_decode_tokens} decode "
            f"tokens, {options.roofline_repeats} repeats")
    # an engine of its own that prefills the whole batch in one step, so the batch then decodes in lockstep
    engine_args = dict(options.engine_args)
    engine_args["max_num_seqs"] = max(batch, engine_args.get("max_num_seqs", batch))
    engine_args["max_num_batched_tokens"] = max(batch * context, engine_args.get("max_num_batched_tokens") or 0)
    with LLM(model=options.model_dir, **engine_args) as llm:
        measured = measure_decode_throughput(llm, batch, context, options.roofline_decode_tokens,
                                             int(hf_config["vocab_size"]), repeats=options.roofline_repeats,
                                             seed=options.seed + ROOFLINE_SEED_OFFSET, exclude_token_ids=excluded)
    return roofline_record(hf_config, options.engine_args.get("dtype", "float32"), batch, context,
                           machine, measured.tokens_per_s, measured.to_dict())


def _run_baseline(options: OfflineOptions, hf_config: dict[str, Any], workload: Sequence[WorkloadRequest],
                  our_tokens: list[list[int]]):
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.bench.hf_baseline import run_hf_baseline
    from meshserve.models.loader import resolve_dtype

    progress = options.progress
    # Same precision and device as the engine (float32 on CPU by default), so the comparison is like for like.
    dtype = resolve_dtype(options.engine_args.get("dtype", "float32"), hf_config)
    device = options.engine_args.get("device", "cpu")
    if progress:
        log(f"HF transformers baseline: batches of {options.hf_batch_size}")
    bar = _progress_bar(len(workload), "hf requests") if progress else None
    try:
        result = run_hf_baseline(options.model_dir, workload, batch_size=options.hf_batch_size,
                                 dtype=dtype, on_batch_done=bar.update if bar else None, device=device)
    finally:
        if bar is not None:
            bar.close()
    if progress:
        log(f"HF: {result.output_tokens_per_s:.1f} output tokens/s in {result.elapsed_s:.2f}s")
    summary = {**result.summary(), "dtype": str(dtype).removeprefix("torch."), "device": device}
    return summary, compare_greedy(our_tokens, result.outputs)


def _progress_bar(total: int, desc: str):
    # start-up: tqdm only with a progress bar
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr)


def plot_offline(result: dict[str, Any], path: str | Path) -> Path:
    """Left: output tokens/s, meshserve vs HF, with the speedup. Right: decode tokens/s achieved vs roofline bound."""
    fig, axes = report.new_figure(ncols=2)
    ax = axes[0][0]
    names = ["meshserve"]
    values = [result["meshserve"]["output_tokens_per_s"]]
    if result.get("baseline"):
        names.append("HF transformers")
        values.append(result["baseline"]["output_tokens_per_s"])
    bars = ax.bar(names, values, color=["tab:blue", "tab:gray"][: len(names)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens/s")
    title = "offline throughput"
    if result.get("speedup"):
        title += f" (speedup {result['speedup']:.2f}x)"
    ax.set_title(title)

    ax = axes[0][1]
    roofline = result.get("roofline")
    if roofline:
        bound = roofline["bound"]
        bars = ax.bar(["achieved", f"bound ({bound['limited_by']})"],
                      [roofline["achieved_tokens_per_s"], roofline["bound_tokens_per_s"]],
                      color=["tab:blue", "tab:orange"])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"decode roofline B={roofline['batch']} L={roofline['context_len']}: "
                     f"{result['decode_roofline_fraction']:.1%}")
    else:
        ax.text(0.5, 0.5, "roofline not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    return report.save_figure(fig, path)


def summary_lines(result: dict[str, Any]) -> list[str]:
    ours = result["meshserve"]
    lines = [f"meshserve: {ours['output_tokens_per_s']:.1f} output tok/s, "
             f"{ours['total_tokens_per_s']:.1f} total tok/s, {ours['elapsed_s']:.2f}s"]
    if result.get("baseline"):
        base = result["baseline"]
        lines.append(f"HF transformers: {base['output_tokens_per_s']:.1f} output tok/s, {base['elapsed_s']:.2f}s; "
                     f"speedup {result['speedup']:.2f}x")
        greedy = result["greedy_check"]
        lines.append(f"greedy outputs: {greedy['mismatching_requests']} of {greedy['compared_requests']} "
                     f"requests differ")
    if result.get("roofline"):
        roof = result["roofline"]
        lines.append(f"decode: {roof['achieved_tokens_per_s']:.1f} tok/s of a {roof['bound_tokens_per_s']:.1f} tok/s "
                     f"{roof['bound']['limited_by']} bound ({result['decode_roofline_fraction']:.1%})")
    return lines
