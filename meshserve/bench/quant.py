"""`meshserve bench quant`: INT8 W8A8 (and the INT8 KV cache) against float32 and bfloat16, for speed and quality.

Quality, on the trained model (meshserve/train) and its held-out text: the model is quantized with each
method (`meshserve quantize`: RTN, SmoothQuant, SmoothQuant + GPTQ) and each checkpoint's W8A8 math is
compared with the float32 model: held-out perplexity, and per position the top-1 agreement and the KL
divergence of the next-token distribution.

Speed: one engine per format (float32; bfloat16 where the CPU has native bf16; INT8 W8A8 from the
SmoothQuant + GPTQ checkpoint; the same with `--kv-cache-dtype int8`) is started once and kept alive. Each
repetition runs every batch size on every engine in turn, the order rotating between repetitions, so drift
on a shared machine hits all of them; every ratio is of two runs of the same repetition, medians reported.
Decode rates as `bench spec` measures them (held-out prompts, greedy, EOS ignored, the batch's tokens after
the first over the window between the median first and last token); prefill as prompt tokens over the
time to the first tokens of a batch of long prompts. Each format's decode roofline uses its own weight
bytes (what the engine holds, per parameter) and its own matmul rate (float32 FMA, or the INT8 kernel's).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from meshserve.bench.deployment_load import log, one_line_errors, run_bench_cli
from meshserve.bench.spec import MIN_REQUESTS, SpecBenchError, _int_list, batch_groups, measure
from meshserve.config.base import ConfigError
from meshserve.engine.core_client import EngineStartupError
from meshserve.utils import report
from meshserve.utils.cpu_features import has_native_bf16
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

PROG = "meshserve bench quant"
LOG_PREFIX = "bench quant"
DEFAULT_OUT = "bench-results/quant"
RESULT_FILE = "quant.json"
METHODS = ("rtn", "smoothquant", "smoothquant-gptq")
KV_CACHE_GB = 0.25  # per engine: room for the largest batch in float32, four engines alive at once
FP32, BF16, INT8, INT8_KV = "fp32", "bf16", "int8", "int8+kv8"
FORMAT_LABELS = {FP32: "float32", BF16: "bfloat16", INT8: "INT8 W8A8", INT8_KV: "W8A8 + INT8 KV"}


class QuantBenchError(RuntimeError):
    """The benchmark cannot run or a run came back wrong (one line for the user)."""


def add_quant_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format float model directory (default: the trained deepseek_v3 small "
                                        "model, trained and cached on first use)")
    parser.add_argument("--batch-sizes", default="1,8,32,64", help="decode batch sizes (default: 1,8,32,64)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per decode request (default: 64)")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens per request (default: 32)")
    parser.add_argument("--prefill-batch", type=int, default=8,
                        help="prompts per prefill measurement (default: 8)")
    parser.add_argument("--prefill-len", type=int, default=256, help="tokens per prefill prompt (default: 256)")
    parser.add_argument("--runs", type=int, default=3, help="repetitions, medians reported (default: 3)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"quantization methods compared for quality (default: {','.join(METHODS)})")
    parser.add_argument("--calibration-samples", type=int, default=None,
                        help="calibration sequences per method (default: `meshserve quantize`'s)")
    parser.add_argument("--eval-sequences", type=int, default=32,
                        help="held-out sequences of 256 tokens for the quality figures (default: 32)")
    parser.add_argument("--skip-quality", dest="quality", action="store_false",
                        help="speed only (the INT8 engine then rounds the float model at load)")
    parser.add_argument("--skip-bf16", dest="bf16", action="store_false", help="no bfloat16 engine")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"output directory: {RESULT_FILE}, its PNG and the quantized checkpoints "
                             f"(default: {DEFAULT_OUT})")
    parser.set_defaults(func=quant_main)


@dataclasses.dataclass(frozen=True)
class QuantBenchSettings:
    model_dir: str  # "" until resolved: the trained small model
    batch_sizes: tuple[int, ...]
    prompt_len: int
    output_len: int
    prefill_batch: int
    prefill_len: int
    runs: int
    methods: tuple[str, ...]
    calibration_samples: int | None
    eval_sequences: int
    quality: bool
    bf16: bool
    out_dir: str


def settings_from_args(args: argparse.Namespace) -> QuantBenchSettings:
    batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
    for flag, value, low in (("--prompt-len", args.prompt_len, 1), ("--output-len", args.output_len, 2),
                             ("--prefill-batch", args.prefill_batch, 1), ("--prefill-len", args.prefill_len, 1),
                             ("--runs", args.runs, 1), ("--eval-sequences", args.eval_sequences, 1)):
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise ValueError(f"--methods: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(METHODS)}")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model: directory {args.model!r} does not exist")
    return QuantBenchSettings(
        model_dir=args.model or "", batch_sizes=batch_sizes, prompt_len=args.prompt_len, output_len=args.output_len,
        prefill_batch=args.prefill_batch, prefill_len=args.prefill_len, runs=args.runs, methods=methods,
        calibration_samples=args.calibration_samples, eval_sequences=args.eval_sequences, quality=args.quality,
        bf16=args.bf16, out_dir=args.out)


_ERRORS = (QuantBenchError, SpecBenchError, ConfigError, EngineStartupError, EngineDeadError, OSError, ValueError)


def quant_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_quant_benchmark, _ERRORS, _report)


def _report(settings: QuantBenchSettings, result: dict) -> None:
    json_path = report.write_json(Path(settings.out_dir) / RESULT_FILE, result)
    png_path = plot_quant(result, report.png_path_for(json_path))
    print(result["table_text"])
    print(result["summary"])
    print(f"wrote {json_path} and {png_path}")


# ---------------------------------------------------------------- quality
def run_quality(settings: QuantBenchSettings) -> tuple[dict, dict[str, str]]:
    """Quantize with each method and measure it against the float32 model: ({method: figures}, {method: dir})."""
    # start-up: the quantizer, the corpus and torch only when the benchmark runs
    from meshserve.quant.api import quantize
    from meshserve.quant.evaluate import quality
    from meshserve.train.corpus import heldout_batches, load_corpus

    corpus = load_corpus()
    evaluation = heldout_batches(corpus, settings.eval_sequences, 256, 4)
    figures: dict[str, dict] = {}
    checkpoints: dict[str, str] = {}
    for method in settings.methods:
        out = Path(settings.out_dir) / "checkpoints" / method
        log(LOG_PREFIX, f"quantizing with {method} into {out}")
        start = time.perf_counter()
        quantize(settings.model_dir, out, method=method, calibration=corpus.train,
                 calibration_samples=settings.calibration_samples, overwrite=True)
        seconds = time.perf_counter() - start
        log(LOG_PREFIX, f"{method}: quantized in {seconds:.0f} s; measuring its quality")
        figures[method] = {**quality(settings.model_dir, out, evaluation), "quantize_seconds": seconds}
        checkpoints[method] = str(out)
        log(LOG_PREFIX, f"{method}: {_quality_text(figures[method])}")
    return figures, checkpoints


def _quality_text(f: dict) -> str:
    return (f"perplexity {f['perplexity']:.2f} vs {f['reference_perplexity']:.2f} float32 "
            f"({100 * (f['perplexity'] / f['reference_perplexity'] - 1):+.2f}%), top-1 agreement "
            f"{100 * f['top1_agreement']:.2f}%, KL {f['kl']:.5f}")


# ---------------------------------------------------------------- speed
def engine_formats(settings: QuantBenchSettings, int8_dir: str | None) -> dict[str, dict]:
    """The engines to start: name -> LLM keyword arguments."""
    largest = settings.batch_sizes[-1]
    shared = {"max_num_seqs": max(largest, settings.prefill_batch),
              "max_num_batched_tokens": max(largest * settings.prompt_len,
                                            settings.prefill_batch * settings.prefill_len),
              "enable_prefix_caching": False, "block_size": 16}
    # the same bytes for every engine's KV cache: its block count shows what each cache dtype holds
    shared["kv_cache_memory_gb"] = KV_CACHE_GB
    int8_source = {"model": int8_dir} if int8_dir else {"model": settings.model_dir, "quantization": "int8"}
    formats = {FP32: {"model": settings.model_dir, "dtype": "float32"}}
    if settings.bf16 and has_native_bf16():
        formats[BF16] = {"model": settings.model_dir, "dtype": "bfloat16"}
    formats[INT8] = {**int8_source, "dtype": "float32"}
    formats[INT8_KV] = {**int8_source, "dtype": "float32", "kv_cache_dtype": "int8"}
    return {name: {**shared, **kwargs} for name, kwargs in formats.items()}


def measure_prefill(llm, prompts: list[list[int]]) -> float:
    """Prompt tokens per second of one batch prefilled together (time from submission to the first tokens)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
    first = max(o.metrics.first_token_time for o in outs)
    arrival = min(o.metrics.arrival_time for o in outs)
    return sum(len(p) for p in prompts) / (first - arrival)


def run_speed(settings: QuantBenchSettings, formats: dict[str, dict]) -> list[dict]:
    # start-up: the corpus and the engine client only when the benchmark runs
    from meshserve.engine.llm import LLM
    from meshserve.train.corpus import heldout_prompts

    needed = max(max(batch * len(range(0, MIN_REQUESTS, batch)) for batch in settings.batch_sizes),
                 settings.batch_sizes[-1])
    prompts = heldout_prompts(needed, settings.prompt_len, seed=0)
    long_prompts = heldout_prompts(settings.prefill_batch, settings.prefill_len, seed=1)
    engines: dict = {}
    records: list[dict] = []
    try:
        for name, kwargs in formats.items():
            start = time.perf_counter()
            kwargs = dict(kwargs)
            engines[name] = LLM(kwargs.pop("model"), **kwargs)
            log(LOG_PREFIX, f"engine {name} ready in {time.perf_counter() - start:.1f} s")
            engines[name].generate(prompts[:settings.batch_sizes[-1]],
                                   SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4))
            engines[name].generate(long_prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
        names = list(engines)
        for run in range(settings.runs):
            order = names[run % len(names):] + names[:run % len(names)]
            for batch in settings.batch_sizes:
                for name in order:
                    record, _ = measure(engines[name], batch_groups(prompts, batch), settings.output_len)
                    records.append({"run": run, "phase": "decode", "batch": batch, "format": name, **record})
                    log(LOG_PREFIX, f"run {run + 1}/{settings.runs} batch {batch:>3} {name:>8}: "
                                    f"{record['decode_tokens_per_s']:8.1f} tok/s")
            for name in order:
                rate = measure_prefill(engines[name], long_prompts)
                records.append({"run": run, "phase": "prefill", "format": name, "prefill_tokens_per_s": rate})
                log(LOG_PREFIX, f"run {run + 1}/{settings.runs} prefill {name:>8}: {rate:8.1f} tok/s")
        for name, llm in engines.items():
            records.append({"phase": "kv_blocks", "format": name, "num_kv_blocks": _kv_blocks(llm)})
    finally:
        for llm in engines.values():
            llm.shutdown()
    return records


def _kv_blocks(llm) -> int | None:
    stats = llm.get_stats()
    return getattr(stats, "num_kv_blocks", None)


def _ratio_medians(records: list[dict], key: str, phase: str, batch: int | None, names: list[str]) -> dict:
    """Per format: the median of the metric and the median of its per-run ratio to fp32 (same run)."""
    rows = [r for r in records if r["phase"] == phase and (batch is None or r["batch"] == batch)]
    by_run: dict[int, dict[str, float]] = {}
    for r in rows:
        by_run.setdefault(r["run"], {})[r["format"]] = r[key]
    out = {}
    for name in names:
        values = [run[name] for run in by_run.values() if name in run]
        ratios = [run[name] / run[FP32] for run in by_run.values() if name in run and FP32 in run]
        if values:
            out[name] = {"median": statistics.median(values), "ratio_to_fp32": statistics.median(ratios),
                         "ratios": ratios}
    return out


# ---------------------------------------------------------------- weights and roofline
def weight_footprints(formats: dict[str, dict]) -> dict[str, dict]:
    """Per format: bytes of the weights the engine holds (INT8 values plus their scales), loaded in this
    process with the engine's own loader, and those bytes per parameter."""
    import torch

    from meshserve.layers import w8a8
    from meshserve.models.loader import load_model

    out = {}
    for name, kwargs in formats.items():
        if name == INT8_KV:
            out[name] = dict(out[INT8])
            continue
        model = load_model(kwargs["model"], dtype=kwargs.get("dtype", "float32"),
                           quantization=kwargs.get("quantization"))
        total_bytes = params = int8_params = 0
        for param in model.parameters():
            total_bytes += param.numel() * param.element_size()
            params += param.numel()
            scale = getattr(param, w8a8.SCALE_ATTR, None)
            if scale is not None:
                total_bytes += scale.numel() * scale.element_size()
            if param.dtype == torch.int8:
                int8_params += param.numel()
        for module in model.modules():
            for attr in ("w13_scale", "w2_scale"):
                scale = getattr(module, attr, None)
                if isinstance(scale, torch.Tensor):
                    total_bytes += scale.numel() * scale.element_size()
        out[name] = {"weight_bytes": total_bytes, "params": params, "int8_params": int8_params,
                     "bytes_per_param": total_bytes / params}
        del model
    return out


def machine_rates() -> dict:
    """This machine's memory bandwidth, float32 matmul rate and INT8 matmul rate (the INT8 kernel's)."""
    import torch

    from meshserve.bench.roofline import measure_matmul_rate, measure_memory_bandwidth
    from meshserve.layers import cpu_kernels, int8

    size, repeats = 2048, 7
    a = torch.randn(size, size)
    q, scale = int8.quantize_weight(torch.randn(size, size))
    packed = int8.pack(q) if cpu_kernels.enabled() and int8.packable(q) else None
    int8.linear(a, q, scale, packed=packed)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        int8.linear(a, q, scale, packed=packed)
        rates.append(2 * size ** 3 / (time.perf_counter() - start) / 1e9)
    return {"bandwidth_gbps": measure_memory_bandwidth(), "fp32_matmul_gflops": measure_matmul_rate(),
            "int8_matmul_gops": max(rates)}


def roofline_fractions(config: dict, footprints: dict, rates: dict, decode: dict[int, dict], context_len: int,
                       kv_bytes: dict[str, float]) -> dict:
    from meshserve.bench.roofline import decode_step_cost, footprint_from_config, roofline_bound

    footprint = footprint_from_config(config)
    out: dict[str, dict] = {}
    for name, per_format in footprints.items():
        rate = rates["int8_matmul_gops"] if name in (INT8, INT8_KV) else rates["fp32_matmul_gflops"]
        out[name] = {}
        for batch, formats in decode.items():
            if name not in formats:
                continue
            cost = decode_step_cost(footprint, batch, context_len, per_format["bytes_per_param"], kv_bytes[name])
            bound = roofline_bound(cost, rates["bandwidth_gbps"], rate)
            out[name][str(batch)] = {"bound_tokens_per_s": bound.tokens_per_s, "limited_by": bound.limited_by,
                                     "fraction": formats[name]["median"] / bound.tokens_per_s}
    return out


# ---------------------------------------------------------------- the run
def run_quant_benchmark(settings: QuantBenchSettings) -> dict:
    if not settings.model_dir:
        log(LOG_PREFIX, "no --model: the trained deepseek_v3 small model (trained on first use)")
        # start-up: the training code (and torch) only when the trained model is asked for
        from meshserve.train.cache import ensure_trained_model

        settings = dataclasses.replace(settings, model_dir=str(ensure_trained_model("deepseek_v3", "small")))
    Path(settings.out_dir).mkdir(parents=True, exist_ok=True)
    quality, checkpoints = run_quality(settings) if settings.quality else ({}, {})
    int8_dir = checkpoints.get("smoothquant-gptq") or next(iter(checkpoints.values()), None)
    formats = engine_formats(settings, int8_dir)
    log(LOG_PREFIX, "weight bytes per format")
    footprints = weight_footprints(formats)
    records = run_speed(settings, formats)
    names = list(formats)
    decode = {batch: _ratio_medians(records, "decode_tokens_per_s", "decode", batch, names)
              for batch in settings.batch_sizes}
    prefill = _ratio_medians(records, "prefill_tokens_per_s", "prefill", None, names)
    config = json.loads((Path(settings.model_dir) / "config.json").read_text())
    log(LOG_PREFIX, "measuring this machine's bandwidth and matmul rates")
    rates = machine_rates()
    kv_bytes = {FP32: 4, BF16: 2, INT8: 4, INT8_KV: _int8_kv_bytes_per_element(config)}
    context = settings.prompt_len + settings.output_len // 2
    result = {
        "machine": report.machine_info(),
        "config": {"model": settings.model_dir, **{k: v for k, v in dataclasses.asdict(settings).items()
                                                    if k != "model_dir"},
                   "int8_checkpoint": int8_dir or "float model rounded at load (--quantization int8)",
                   "formats": {name: {k: v for k, v in kw.items() if k != "model"} for name, kw in formats.items()}},
        "quality": quality,
        "weights": footprints,
        "decode": {str(b): v for b, v in decode.items()},
        "prefill": prefill,
        "kv_blocks": {r["format"]: r["num_kv_blocks"] for r in records if r["phase"] == "kv_blocks"},
        "rates": rates,
        "roofline": roofline_fractions(config, footprints, rates, decode, context, kv_bytes),
        "runs": [r for r in records if r["phase"] != "kv_blocks"],
    }
    result["table_text"] = table_text(result)
    result["summary"] = summary_line(result)
    return result


def _int8_kv_bytes_per_element(config: dict) -> float:
    """Bytes per cached element of the INT8 KV cache (MLA: the latent and rope parts), its per-token scales
    included."""
    import torch

    from meshserve.layers import kv_quant

    parts = (config["kv_lora_rank"], config["qk_rope_head_dim"])
    return kv_quant.row_width(parts, torch.int8) / sum(parts)


def table_text(result: dict) -> str:
    lines = []
    if result["quality"]:
        lines.append("quality (W8A8 vs float32 on held-out text):")
        for method, figures in result["quality"].items():
            lines.append(f"  {method:>17}: {_quality_text(figures)}")
    names = list(result["weights"])
    lines.append("format     weight MB  " + "  ".join(f"decode b{b:<3}" for b in map(int, result["decode"]))
                 + "   prefill")
    for name in names:
        cells = []
        for per_batch in result["decode"].values():
            cell = per_batch.get(name)
            cells.append(f"{cell['median']:7.1f} {cell['ratio_to_fp32']:4.2f}x" if cell else " " * 13)
        pre = result["prefill"].get(name)
        lines.append(f"{name:<9} {result['weights'][name]['weight_bytes'] / 2**20:9.1f}  " + "  ".join(cells)
                     + (f"  {pre['median']:7.0f} {pre['ratio_to_fp32']:4.2f}x" if pre else ""))
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    parts = []
    for batch, formats in result["decode"].items():
        if INT8 in formats:
            parts.append(f"batch {batch}: INT8 {formats[INT8]['ratio_to_fp32']:.2f}x fp32")
    quality = result["quality"].get("smoothquant-gptq")
    if quality:
        change = 100 * (quality["perplexity"] / quality["reference_perplexity"] - 1)
        parts.append(f"SmoothQuant+GPTQ perplexity {change:+.2f}% of float32")
    return "; ".join(parts)


def plot_quant(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    batches = [int(b) for b in result["decode"]]
    names = list(result["weights"])
    width = 0.8 / max(len(names), 1)
    ax = axes[0]
    for i, name in enumerate(names):
        values = [result["decode"][str(b)].get(name, {}).get("median", 0) for b in batches]
        ax.bar([x + i * width for x in range(len(batches))], values, width, label=FORMAT_LABELS.get(name, name))
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(batches))], [str(b) for b in batches])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("decode throughput")
    ax = axes[1]
    for name in names:
        ax.plot(batches, [result["decode"][str(b)].get(name, {}).get("ratio_to_fp32", float("nan")) for b in batches],
                marker="o", label=FORMAT_LABELS.get(name, name))
    ax.axhline(1.8, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("speed vs float32 (same run, median)")
    ax.legend(fontsize=8)
    ax.set_title("INT8 speed-up")
    ax = axes[2]
    quality = result["quality"]
    if quality:
        methods = list(quality)
        ax.bar(methods, [100 * (quality[m]["perplexity"] / quality[m]["reference_perplexity"] - 1) for m in methods],
               color="tab:orange")
        ax.set_ylabel("held-out perplexity vs float32 (%)")
        for i, m in enumerate(methods):
            ax.text(i, 0, f"top-1 {100 * quality[m]['top1_agreement']:.1f}%\nKL {quality[m]['kl']:.4f}",
                    ha="center", va="bottom", fontsize=8)
        ax.set_title("W8A8 quality by method")
    else:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
