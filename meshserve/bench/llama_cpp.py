"""`meshserve bench llama-cpp`: meshserve against llama.cpp on the same model, the same shapes, in one run.

llama.cpp is built from the llama-cpp-python sdist's vendored sources with native CPU flags, the model converted
to GGUF by llama.cpp's converter (float32) and quantized by llama-quantize (Q8_0); `llama-batched-bench` then
runs each batch size with `--prompt-len` prompt tokens and `--output-len` generated tokens per sequence
(llama_cpp_build.py). meshserve runs the same shapes on its engine (a TE: master and worker processes) in float32
and INT8 W8A8 (weights quantized at load), greedy, EOS ignored, prefix caching off.

Rates, as llama-batched-bench counts them: decode tokens/s is every sequence's generated tokens over the
generation window (meshserve: from the median first token to the median last one, the first token left out);
prefill tokens/s is the batch's prompt tokens over the time to the first tokens. Each round runs every side in
turn, the order rotating between rounds so drift on a shared machine reaches all; medians over rounds. The
ratios pair meshserve float32 with llama.cpp f32 and meshserve INT8 with llama.cpp Q8_0. Where llama.cpp cannot
be built here the run measures meshserve alone and says why.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from meshserve.bench import llama_cpp_build
from meshserve.bench.deployment_load import check_model_dir, log, one_line_errors, quick_or_full, run_bench_cli
from meshserve.bench.llama_cpp_build import LlamaCpp, LlamaCppUnavailable
from meshserve.config.base import ConfigError
from meshserve.engine.core_client import EngineStartupError
from meshserve.utils import envs, report
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

PROG = "meshserve bench llama-cpp"
LOG_PREFIX = "bench llama-cpp"
DEFAULT_JSON = "bench-results/llama-cpp.json"
# side -> (engine, format); ratios pair each meshserve format with the llama.cpp one of the same weight bytes
SIDES = {"llama.cpp f32": ("llama.cpp", "f32"), "llama.cpp Q8_0": ("llama.cpp", "q8_0"),
         "meshserve fp32": ("meshserve", "float32"), "meshserve INT8": ("meshserve", "int8")}
# --per-op: the same engines with decode steps layer by layer in Python ops (MESHSERVE_FUSED_DECODE=0)
PER_OP_SIDES = {"meshserve fp32 per-op": ("meshserve", "float32"), "meshserve INT8 per-op": ("meshserve", "int8")}
PAIRS = {"meshserve fp32": "llama.cpp f32", "meshserve INT8": "llama.cpp Q8_0",
         "meshserve fp32 per-op": "llama.cpp f32", "meshserve INT8 per-op": "llama.cpp Q8_0"}
FUSED_PAIRS = {"meshserve fp32": "meshserve fp32 per-op", "meshserve INT8": "meshserve INT8 per-op"}
_FULL = {"preset": "small", "batch_sizes": "1,16,64", "prompt_len": 256, "output_len": 128, "rounds": 2}
_QUICK = {"preset": "tiny", "batch_sizes": "1,2", "prompt_len": 16, "output_len": 8, "rounds": 1}
_ERRORS = (ConfigError, EngineStartupError, EngineDeadError, OSError, RuntimeError, TimeoutError)
RUN_TIMEOUT_S = 3600


def add_llama_cpp_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format DeepSeek-V3 model directory (default: the model of --preset)")
    parser.add_argument("--preset", help="preset of the default model when --model is not given: small or tiny "
                                         "(default: small; --quick: tiny)")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest run (for tests): the --quick value of every option below not given")
    parser.add_argument("--batch-sizes", help="sequences decoded together (default: 1,16,64; --quick: 1,2)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per sequence (default: 256; --quick: 16)")
    parser.add_argument("--output-len", type=int, help="generated tokens per sequence (default: 128; --quick: 8)")
    parser.add_argument("--rounds", type=int, help="rounds, medians reported (default: 2; --quick: 1)")
    parser.add_argument("--per-op", action="store_true",
                        help="also run each meshserve format with decode steps layer by layer in Python ops "
                             "(MESHSERVE_FUSED_DECODE=0), the fused layers' baseline in the same run")
    parser.add_argument("--threads", type=int, help="CPU threads of each side (default: this machine's cores)")
    parser.add_argument("--llama-cpp-source",
                        help="a llama-cpp-python sdist tarball, an extracted one, or a llama.cpp source tree (default: "
                             f"llama-cpp-python {llama_cpp_build.LLAMA_CPP_PYTHON_VERSION} fetched with pip)")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"result file; a PNG with the same name is written next to it (default: {DEFAULT_JSON})")
    parser.set_defaults(func=llama_cpp_main)


@dataclasses.dataclass(frozen=True)
class LlamaCppSettings:
    model_dir: str | None
    preset: str
    batch_sizes: tuple[int, ...]
    prompt_len: int
    output_len: int
    rounds: int
    threads: int
    llama_cpp_source: str | None
    json_path: str
    per_op: bool = False


def settings_from_args(args: argparse.Namespace) -> LlamaCppSettings:
    given = quick_or_full(args, _FULL, _QUICK)
    try:
        batch_sizes = tuple(int(size) for size in str(given.pop("batch_sizes")).split(","))
    except ValueError:
        raise ValueError(f"--batch-sizes must be integers separated by commas, got {args.batch_sizes!r}") from None
    threads = args.threads if args.threads is not None else os.cpu_count() or 1
    for key, value in {"batch_sizes": min(batch_sizes), "prompt_len": given["prompt_len"],
                       "rounds": given["rounds"], "threads": threads}.items():
        if value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    if given["output_len"] < 3:
        raise ValueError("--output-len must be at least 3: the first token is left out of the decode rate")
    if given["preset"] not in ("tiny", "small"):
        raise ValueError(f"--preset must be tiny or small, got {given['preset']!r}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"{args.model} is not a model directory (no config.json)")
    return LlamaCppSettings(model_dir=args.model, batch_sizes=tuple(sorted(set(batch_sizes))), threads=threads,
                            llama_cpp_source=args.llama_cpp_source, json_path=args.json, per_op=args.per_op,
                            **given)


def llama_cpp_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_llama_cpp_benchmark, _ERRORS, _report)


def _progress(message: str) -> None:
    log(LOG_PREFIX, message)


# ---------------------------------------------------------------- llama.cpp's side
def parse_batched_bench(output: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's JSONL (one object per shape) -> batch size -> decode and prefill tokens/s."""
    rates = {}
    for line in output.splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        rates[int(row["pl"])] = {"decode_tokens_per_s": float(row["speed_tg"]),
                                 "prefill_tokens_per_s": float(row["speed_pp"])}
    return rates


def run_batched_bench(llama: LlamaCpp, gguf: Path, settings: LlamaCppSettings) -> dict[int, dict[str, float]]:
    """Every batch size in one llama-batched-bench run (its KV cache sized for the largest)."""
    context = max(settings.batch_sizes) * (settings.prompt_len + settings.output_len) + 16
    cmd = [str(llama.tool("llama-batched-bench")), "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512",
           "-npp", str(settings.prompt_len), "-ntg", str(settings.output_len),
           "-npl", ",".join(str(b) for b in settings.batch_sizes), "-t", str(settings.threads),
           "-tb", str(settings.threads), "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    rates = parse_batched_bench(done.stdout)
    if done.returncode != 0 or set(rates) != set(settings.batch_sizes):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"llama-batched-bench on {gguf.name} failed (exit {done.returncode}): {tail[:300]}")
    return rates


# ---------------------------------------------------------------- meshserve's side
def engine_kwargs(settings: LlamaCppSettings, fmt: str) -> dict:
    largest = max(settings.batch_sizes)
    kwargs = {"dtype": "float32", "max_num_seqs": largest, "enable_prefix_caching": False,
              # a batch's prompts in one step, as llama-batched-bench prefills them
              "max_num_batched_tokens": max(largest * settings.prompt_len, 2048), "kv_cache_memory_gb": 0.5,
              "num_threads": settings.threads}
    if fmt == "int8":
        kwargs["quantization"] = "int8"
    return kwargs


def measure_meshserve(llm, prompts: list[list[int]], settings: LlamaCppSettings) -> dict[int, dict[str, float]]:
    """Per batch size: a prefill of `batch` prompts (to their first tokens), then `batch` sequences generated."""
    rates = {}
    for batch in settings.batch_sizes:
        group = prompts[:batch]
        first = llm.generate(group, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
        prefill_s = max(o.metrics.first_token_time for o in first) - min(o.metrics.arrival_time for o in first)
        outs = llm.generate(group, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=settings.output_len))
        window = (statistics.median(o.metrics.last_token_time for o in outs)
                  - statistics.median(o.metrics.first_token_time for o in outs))
        rates[batch] = {"decode_tokens_per_s": batch * (settings.output_len - 1) / window,
                        "prefill_tokens_per_s": batch * settings.prompt_len / prefill_s}
    return rates


# ---------------------------------------------------------------- the run
def run_llama_cpp_benchmark(settings: LlamaCppSettings) -> dict:
    # start-up: the engine client, the model factory and the corpus only when the benchmark runs
    from meshserve.engine.llm import LLM
    from meshserve.models.factory import ensure_default_model
    from meshserve.train.corpus import heldout_prompts

    model = settings.model_dir or str(ensure_default_model("deepseek_v3", settings.preset))
    check_model_dir(model)
    llama, ggufs, skipped = None, {}, None
    try:
        llama = llama_cpp_build.prepare(settings.llama_cpp_source, _progress)
        ggufs = llama_cpp_build.convert(llama, model, _progress)
    except LlamaCppUnavailable as exc:
        skipped = f"llama.cpp skipped: {exc}"
        _progress(skipped)
    every_side = {**SIDES, **(PER_OP_SIDES if settings.per_op else {})}
    sides = [name for name, (engine, _) in every_side.items() if engine == "meshserve" or ggufs]
    prompts = heldout_prompts(max(settings.batch_sizes), settings.prompt_len, seed=0)
    engines = {}
    rounds: list[dict[str, dict[int, dict[str, float]]]] = []
    try:
        for name in sides:
            engine, fmt = every_side[name]
            if engine == "meshserve":
                started = time.perf_counter()
                # the engine's processes take the environment
                with envs.MESHSERVE_FUSED_DECODE.set_to("0" if name in PER_OP_SIDES else "1"):
                    engines[name] = LLM(model, **engine_kwargs(settings, fmt))
                engines[name].generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # first calls
                _progress(f"{name} ready in {time.perf_counter() - started:.1f} s")
        for r in range(settings.rounds):
            shift = r % len(sides)
            measured = {}
            for name in sides[shift:] + sides[:shift]:
                engine, fmt = every_side[name]
                measured[name] = (run_batched_bench(llama, ggufs[fmt], settings) if engine == "llama.cpp"
                                  else measure_meshserve(engines[name], prompts, settings))
                _progress(f"round {r + 1}/{settings.rounds} {name}: " + ", ".join(
                    f"b{b} {v['decode_tokens_per_s']:.1f}" for b, v in measured[name].items()) + " decode tok/s")
            rounds.append(measured)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return _result(settings, model, sides, rounds, skipped)


def _result(settings: LlamaCppSettings, model: str, sides: list[str], rounds: list[dict], skipped: str | None) -> dict:
    medians = {name: {str(b): {key: statistics.median(r[name][b][key] for r in rounds)
                                for key in ("decode_tokens_per_s", "prefill_tokens_per_s")}
                      for b in settings.batch_sizes} for name in sides}
    def ratios_of(pairs: dict[str, str]) -> dict:  # per round, then the median
        return {ours: {str(b): statistics.median(r[ours][b]["decode_tokens_per_s"] / r[theirs][b]["decode_tokens_per_s"]
                                                 for r in rounds) for b in settings.batch_sizes}
                for ours, theirs in pairs.items() if ours in sides and theirs in sides}

    return {
        "config": {"model": model, "batch_sizes": list(settings.batch_sizes), "prompt_len": settings.prompt_len,
                   "output_len": settings.output_len, "rounds": settings.rounds, "threads": settings.threads,
                   "llama_cpp_python": llama_cpp_build.LLAMA_CPP_PYTHON_VERSION},
        "machine": report.machine_info(),
        "llama_cpp_skipped": skipped,
        "medians": medians,
        "decode_ratio": ratios_of(PAIRS),
        "fused_over_per_op": ratios_of(FUSED_PAIRS),
        "rounds": [{name: {str(b): v for b, v in per.items()} for name, per in r.items()} for r in rounds],
    }


# ---------------------------------------------------------------- the report
def table_lines(result: dict) -> list[str]:
    medians, ratios = result["medians"], result["decode_ratio"]
    sides = list(medians)
    lines = ["| batch | " + " | ".join(sides) + " |", "| ---: |" + " ---: |" * len(sides)]
    for b in (str(b) for b in result["config"]["batch_sizes"]):
        cells = []
        for name in sides:
            cell = f"{medians[name][b]['decode_tokens_per_s']:,.1f}"
            if name in ratios:
                cell += f" ({ratios[name][b]:.2f}x)"
            cells.append(cell)
        lines.append(f"| {b} (decode tok/s) | " + " | ".join(cells) + " |")
    prefill = [f"{min(v['prefill_tokens_per_s'] for v in medians[n].values()):,.0f}-"
               f"{max(v['prefill_tokens_per_s'] for v in medians[n].values()):,.0f}" for n in sides]
    lines.append("| prefill tok/s | " + " | ".join(prefill) + " |")
    for name, per_batch in result["fused_over_per_op"].items():
        lines.append(f"{name} fused / per-op decode: " + ", ".join(f"batch {b} {v:.2f}x" for b, v in per_batch.items()))
    config = result["config"]
    lines.append(f"({config['prompt_len']} prompt + {config['output_len']} generated tokens per sequence, "
                 f"{config['threads']} threads, medians of {config['rounds']} round(s); ratios against llama.cpp "
                 "of the same weight format, within each round)")
    if result["llama_cpp_skipped"]:
        lines.append(result["llama_cpp_skipped"])
    return lines


def plot_llama_cpp(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2)
    decode, prefill = axes[0][0], axes[0][1]
    medians = result["medians"]
    batches = [str(b) for b in result["config"]["batch_sizes"]]
    width = 0.8 / len(medians)
    for i, (name, per_batch) in enumerate(medians.items()):
        xs = [j + (i - (len(medians) - 1) / 2) * width for j in range(len(batches))]
        decode.bar(xs, [per_batch[b]["decode_tokens_per_s"] for b in batches], width, label=name)
        prefill.bar(xs, [per_batch[b]["prefill_tokens_per_s"] for b in batches], width, label=name)
    for ax, what in ((decode, "decode tokens/s"), (prefill, "prefill tokens/s")):
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    decode.set_title("decode: meshserve vs llama.cpp")
    prefill.set_title("prefill")
    return report.save_figure(fig, path)


def _report(settings: LlamaCppSettings, result: dict) -> None:
    report.publish(settings.json_path, result, plot_llama_cpp, table_lines(result))
