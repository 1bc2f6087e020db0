"""`meshserve bench decode-step`: one decode step of a loaded model, native CPU kernels against the torch path.

The model is loaded once, in this process, by the engine's `ModelRunner` (float32 on CPU, the dtype the
native kernels serve). One prefill of `--batch` random prompts of `--context` tokens fills the paged KV
cache; each sequence's blocks are scattered over the cache as a real allocator's are. A measurement is
`--steps` decode steps (model forward + logits, one token per sequence, positions advancing), always
started from that same cache state, so every measurement sees the same context lengths. The native path
(csrc/cpu_kernels.cpp: routed experts, MLA absorbed decode attention and its absorption products, RMSNorm,
RoPE, DeepSeek-V3 routing) and the torch path (`cpu_kernels.disabled()`: oneDNN prepacked linear per expert,
the latent gathered with index_select + bmm) are measured in turn, native first, `--repeats` pairs; the median
of each is reported.

Before timing, one measurement per path (also the warm-up) checks that both give the same logits at every
step, up to float rounding. Afterwards one step per path runs under torch.profiler: its ops by self CPU
time show where each path spends a step.
Writes JSON (machine, config, logit check, per path: ms per step, tokens/s, op breakdown; the speedup),
a PNG beside it, and summary lines.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from meshserve.bench.deployment_load import one_line_errors, run_bench_cli
from meshserve.config import EngineConfig
from meshserve.layers import cpu_kernels
from meshserve.layers.metadata import AttentionMetadata
from meshserve.models.factory import ensure_default_model
from meshserve.utils import report

PROG = "meshserve bench decode-step"
NATIVE, TORCH = "native", "torch"
PATHS = (NATIVE, TORCH)
PRESETS = ("tiny", "small")
PRESET_ARCH = "deepseek_v3"  # MLA attention and routed experts: both kernels take part
LOGIT_TOLERANCE = 1e-3  # max abs logit difference between the paths; float reordering stays far below
TOP_OPS = 8
NATIVE_OP_PREFIX = "meshserve_cpu::"


class DecodeStepError(RuntimeError):
    """The benchmark cannot run or its check failed (one line for the user)."""


def add_decode_step_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="HF-format model directory")
    source.add_argument("--preset", choices=PRESETS,
                        help=f"a generated random {PRESET_ARCH} model, created once in the model cache")
    parser.add_argument("--batch", type=int, default=64, help="sequences decoded together (default: 64)")
    parser.add_argument("--context", type=int, default=288,
                        help="tokens in each sequence's cache when a measurement starts (default: 288)")
    parser.add_argument("--block-size", dest="block_size", type=int, default=16,
                        help="KV cache block size, tokens (default: 16)")
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per measurement (default: 5)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="measurements per path, taken in turn native, torch, ...; median reported (default: 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token ids and block tables (default: 0)")
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")


@dataclasses.dataclass(frozen=True)
class DecodeStepSettings:
    model_dir: str
    preset: str | None
    batch: int
    context: int
    block_size: int
    steps: int
    repeats: int
    seed: int
    json_path: str

    @property
    def blocks_per_sequence(self) -> int:
        return -(-(self.context + self.steps) // self.block_size)

    @property
    def num_kv_blocks(self) -> int:
        # room beyond what the sequences use, so their scattered blocks do not fill the cache end to end
        return self.batch * (self.context // self.block_size + self.steps // self.block_size + 2)


def settings_from_args(args: argparse.Namespace) -> DecodeStepSettings:
    """Validated settings (the preset's model is not made yet); ValueError names the bad flag."""
    for flag, value in (("--batch", args.batch), ("--context", args.context), ("--block-size", args.block_size),
                        ("--steps", args.steps), ("--repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.block_size & (args.block_size - 1):
        raise ValueError(f"--block-size must be a power of two, got {args.block_size}")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model: directory {args.model!r} does not exist")
    return DecodeStepSettings(model_dir=args.model or "", preset=args.preset, batch=args.batch, context=args.context,
                              block_size=args.block_size, steps=args.steps, repeats=args.repeats, seed=args.seed,
                              json_path=args.json)


def decode_step_main(args: argparse.Namespace) -> int:
    errors = (DecodeStepError, OSError, ValueError)  # no kernels, an unloadable model, paths that disagree
    return run_bench_cli(PROG, args, settings_from_args, run_decode_step_benchmark, errors, _report_decode_step)


def _report_decode_step(settings, result: dict) -> None:
    json_path = report.write_json(settings.json_path, result)
    png_path = plot_decode_step(result, report.png_path_for(json_path))
    for line in summary_lines(result):
        print(line)
    print(f"wrote {json_path} and {png_path}")


def _progress(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------- the model and its cache
class DecodeBench:
    """A loaded model with a filled cache; `run(steps)` decodes from the same cache state every time."""

    def __init__(self, settings: DecodeStepSettings):
        # start-up: safetensors and the engine only when a model is loaded
        from meshserve.models.loader import load_hf_config
        from meshserve.worker.model_runner import ModelRunner

        self.settings = settings
        max_len = load_hf_config(settings.model_dir).get("max_position_embeddings")
        if max_len is not None and settings.context + settings.steps > max_len:
            raise ValueError(f"--context + --steps = {settings.context + settings.steps} exceeds the model's "
                             f"max_position_embeddings {max_len}")
        config = EngineConfig.from_kwargs(
            settings.model_dir, dtype="float32", device="cpu", block_size=settings.block_size,
            num_kv_blocks=settings.num_kv_blocks, enable_prefix_caching=False, max_num_seqs=settings.batch,
            max_num_batched_tokens=settings.batch * settings.context)
        self.runner = ModelRunner(config)
        self.model = self.runner.model
        self.vocab_size = int(self.runner.hf_config["vocab_size"])
        blocks = list(range(settings.num_kv_blocks))
        random.Random(settings.seed).shuffle(blocks)  # an allocator that has run a while hands out scattered ids
        per_seq = settings.blocks_per_sequence
        self.block_tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(settings.batch)]
        tokens = torch.Generator().manual_seed(settings.seed)
        self.prompts = torch.randint(0, self.vocab_size, (settings.batch, settings.context), generator=tokens)
        # the token each sequence is fed at each decode step: the same for both paths
        self.decode_ids = torch.randint(0, self.vocab_size, (settings.steps, settings.batch), generator=tokens)
        self.decode_steps = [self._decode_inputs(step) for step in range(settings.steps)]

    def _decode_inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        s = self.settings
        position = s.context + step
        attn = AttentionMetadata.build([1] * s.batch, [position] * s.batch, self.block_tables, s.block_size)
        return self.decode_ids[step], torch.full((s.batch,), position, dtype=torch.int64), attn

    @torch.inference_mode()
    def prefill(self) -> float:
        """One forward over every prompt: fills the cache the decode steps start from; seconds taken."""
        s = self.settings
        attn = AttentionMetadata.build([s.context] * s.batch, [0] * s.batch, self.block_tables, s.block_size)
        positions = torch.arange(s.context, dtype=torch.int64).repeat(s.batch)
        start = time.perf_counter()
        self.model(self.prompts.reshape(-1), positions, attn, self.runner.kv_caches)
        return time.perf_counter() - start

    @torch.inference_mode()
    def run(self, steps: int, keep_logits: bool = False) -> list[torch.Tensor]:
        """Decode `steps` steps from the prefilled cache (each step writes the slot after the last);
        the logits of every step when asked."""
        kept = []
        for ids, positions, attn in self.decode_steps[:steps]:
            hidden = self.model(ids, positions, attn, self.runner.kv_caches)
            logits = self.model.compute_logits(hidden)
            if keep_logits:
                kept.append(logits.clone())
        return kept

    def close(self) -> None:
        self.runner.close()


def _on_path(path: str, fn: Callable[[], object]) -> object:
    if path == NATIVE:
        return fn()
    with cpu_kernels.disabled():
        return fn()


# ---------------------------------------------------------------- measurements
def check_logits(bench: DecodeBench) -> dict:
    """Both paths' logits over one measurement's steps; DecodeStepError past LOGIT_TOLERANCE."""
    native = _on_path(NATIVE, lambda: bench.run(bench.settings.steps, keep_logits=True))
    torch_path = _on_path(TORCH, lambda: bench.run(bench.settings.steps, keep_logits=True))
    per_step = [float((a - b).abs().max()) for a, b in zip(native, torch_path)]
    max_diff = max(per_step)
    record = {"max_abs_diff": max_diff, "per_step_max_abs_diff": per_step, "tolerance": LOGIT_TOLERANCE,
              "max_abs_logit": max(float(t.abs().max()) for t in native), "steps": len(per_step),
              "passed": max_diff <= LOGIT_TOLERANCE}
    if not math.isfinite(max_diff) or max_diff > LOGIT_TOLERANCE:
        raise DecodeStepError(f"native and torch logits differ by {max_diff:.3g} (tolerance {LOGIT_TOLERANCE:g})")
    return record


def time_paths(bench: DecodeBench) -> dict[str, list[float]]:
    """Seconds per step of each measurement, the paths in turn so that drift on a shared machine hits both."""
    steps, repeats = bench.settings.steps, bench.settings.repeats
    per_step: dict[str, list[float]] = {path: [] for path in PATHS}
    for r in range(repeats):
        for path in PATHS:
            start = time.perf_counter()
            _on_path(path, lambda: bench.run(steps))
            per_step[path].append((time.perf_counter() - start) / steps)
            _progress(f"{path:<6} {r + 1}/{repeats}: {per_step[path][-1] * 1e3:8.2f} ms/step")
    return per_step


def profile_step(bench: DecodeBench, path: str) -> dict:
    """One decode step under torch.profiler: every op's self CPU time in ms, most expensive first."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        _on_path(path, lambda: bench.run(1))
        wall = time.perf_counter() - start
    ops = sorted(({"name": e.key, "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                  for e in prof.key_averages()), key=lambda op: op["self_ms"], reverse=True)
    ops = [op for op in ops if op["self_ms"] > 0]
    total = sum(op["self_ms"] for op in ops)
    return {"wall_ms": wall * 1e3, "ops_self_ms": total, "top_ops": ops[:TOP_OPS],
            "other_ops_self_ms": total - sum(op["self_ms"] for op in ops[:TOP_OPS]),
            "native_ops": sorted(op["name"] for op in ops if op["name"].startswith(NATIVE_OP_PREFIX)),
            "all_ops": ops}


def run_decode_step_benchmark(settings: DecodeStepSettings) -> dict:
    if not cpu_kernels.enabled():
        raise DecodeStepError("the native CPU kernels are not available here (the build failed, "
                              "or MESHSERVE_CPU_KERNELS=0 is set): there is nothing to compare")
    if settings.preset:
        settings = dataclasses.replace(settings, model_dir=str(ensure_default_model(PRESET_ARCH, settings.preset)))
    _progress(f"loading {settings.model_dir}")
    bench = DecodeBench(settings)
    try:
        prefill_s = bench.prefill()
        _progress(f"prefilled {settings.batch} x {settings.context} tokens in {prefill_s:.2f} s")
        logit_check = check_logits(bench)
        _progress(f"logits agree: max abs diff {logit_check['max_abs_diff']:.2e}")
        per_step = time_paths(bench)
        profiles = {path: profile_step(bench, path) for path in PATHS}
    finally:
        bench.close()
    if not profiles[NATIVE]["native_ops"]:
        raise DecodeStepError("no native kernel ran in this model's decode step: the two paths are the same")
    paths = {}
    for path in PATHS:
        median_s = statistics.median(per_step[path])
        paths[path] = {"ms_per_step": median_s * 1e3, "tokens_per_s": settings.batch / median_s,
                       "min_ms_per_step": min(per_step[path]) * 1e3,  # the least disturbed, on a shared machine
                       "times_ms_per_step": [t * 1e3 for t in per_step[path]], "profile": profiles[path]}
    hf_config = bench.runner.hf_config
    return {
        "machine": report.machine_info(),
        "config": {"model": settings.model_dir, "preset": settings.preset, "model_type": hf_config.get("model_type"),
                   "num_layers": hf_config.get("num_hidden_layers"), "dtype": "float32", "batch": settings.batch,
                   "context": settings.context, "block_size": settings.block_size, "steps": settings.steps,
                   "repeats": settings.repeats, "seed": settings.seed, "num_kv_blocks": settings.num_kv_blocks,
                   "blocks_per_sequence": settings.blocks_per_sequence, "order": "alternating, native first",
                   "timed": "model forward + compute_logits per step"},
        "prefill_s": prefill_s,
        "logit_check": logit_check,
        "paths": paths,
        "speedup": paths[TORCH]["ms_per_step"] / paths[NATIVE]["ms_per_step"],
    }


# ---------------------------------------------------------------- report
def summary_lines(result: dict) -> list[str]:
    config, paths = result["config"], result["paths"]
    native, torch_path = paths[NATIVE], paths[TORCH]
    lines = [f"decode step of {config['model_type']} ({config['num_layers']} layers), batch {config['batch']}, "
             f"context {config['context']}, median of {config['repeats']} x {config['steps']} steps",
             f"native {native['ms_per_step']:.1f} ms/step ({native['tokens_per_s']:.0f} tok/s)  "
             f"torch {torch_path['ms_per_step']:.1f} ms/step ({torch_path['tokens_per_s']:.0f} tok/s)  "
             f"speedup {result['speedup']:.2f}x",
             f"fastest measurement: native {native['min_ms_per_step']:.1f} ms/step, "
             f"torch {torch_path['min_ms_per_step']:.1f} ms/step",
             f"logits: max abs diff {result['logit_check']['max_abs_diff']:.2e} "
             f"(tolerance {result['logit_check']['tolerance']:g})"]
    for path in PATHS:
        top = paths[path]["profile"]["top_ops"]
        lines.append(f"{path} step, top ops by self CPU ms: "
                     + ", ".join(f"{op['name']} {op['self_ms']:.2f}" for op in top[:5]))
    return lines


def _breakdown_ops(result: dict) -> list[str]:
    """The ops shown in the breakdown: each path's top ops, in order of their largest time."""
    largest: dict[str, float] = {}
    for path in PATHS:
        for op in result["paths"][path]["profile"]["top_ops"]:
            largest[op["name"]] = max(largest.get(op["name"], 0.0), op["self_ms"])
    return sorted(largest, key=largest.get, reverse=True)


def plot_decode_step(result: dict, path: Path) -> Path:
    config, paths = result["config"], result["paths"]
    fig, axes = report.new_figure(ncols=2, width_per_panel=6.5, height=4.5)
    import matplotlib  # after new_figure, which selects the off-screen backend

    ax = axes[0][0]
    values = [paths[p]["ms_per_step"] for p in PATHS]
    bars = ax.bar(PATHS, values, color=["tab:green", "tab:gray"])
    for bar, p in zip(bars, PATHS):
        ax.annotate(f"{paths[p]['ms_per_step']:.1f} ms\n{paths[p]['tokens_per_s']:.0f} tok/s",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize="small")
    ax.set_ylim(0, max(values) * 1.25)
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title(f"batch {config['batch']}, context {config['context']}: speedup {result['speedup']:.2f}x")
    ax.grid(True, axis="y", alpha=0.3)

    ax = axes[0][1]
    names = _breakdown_ops(result)
    bottoms = [0.0] * len(PATHS)
    colors = matplotlib.colormaps["tab20"].colors
    for i, name in enumerate(names + ["other ops"]):
        heights = []
        for p in PATHS:
            profile = paths[p]["profile"]
            if name == "other ops":
                shown = sum(op["self_ms"] for op in profile["all_ops"] if op["name"] in names)
                heights.append(profile["ops_self_ms"] - shown)
            else:
                heights.append(next((op["self_ms"] for op in profile["all_ops"] if op["name"] == name), 0.0))
        color = "lightgray" if name == "other ops" else colors[i % len(colors)]
        ax.bar(PATHS, heights, bottom=bottoms, label=name, color=color)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("self CPU ms in one profiled step")
    ax.set_title("where a step goes (torch.profiler)")
    ax.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.02, 0.5))
    return report.save_figure(fig, path)
