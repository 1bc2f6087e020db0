"""`meshserve bench step-profile`: where one batch-1 decode step's time goes, end to end, in the engine's own
processes.

One engine (a TE: master and worker processes) decodes one long greedy request. While it decodes, py-spy samples
the worker and the master side by side without stopping them (`--nonblocking`); every sample is one Python stack.
A stack is put in the first category whose frame it holds (`WORKER_PARTS`, `MASTER_PARTS`: the step's input
preparation, attention, MoE routing and experts, the LM head, sampling, messages, waiting), and a category's
share of the samples times the step time (from the decode rate measured over the same window) is its time per
step. Native kernels count towards the Python line that called them.

Writes JSON (the table per process, the step time, the collapsed stacks) and a PNG beside it: the worker's
flame graph (icicle: the root at the top, a frame's width its share of the samples) and the table as bars.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from meshserve.bench.deployment_load import check_model_dir, log, one_line_errors, quick_or_full, run_bench_cli
from meshserve.config.base import ConfigError
from meshserve.engine.core_client import EngineStartupError
from meshserve.utils import report
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

PROG = "meshserve bench step-profile"
LOG_PREFIX = "bench step-profile"
DEFAULT_JSON = "bench-results/step-profile.json"
_ERRORS = (ConfigError, EngineStartupError, EngineDeadError, OSError, RuntimeError, TimeoutError)
_FULL = {"preset": "small", "prompt_len": 256, "seconds": 6.0, "rate": 250}
_QUICK = {"preset": "tiny", "prompt_len": 16, "seconds": 1.5, "rate": 200}
# (category, function names): a stack goes to the first category one of whose names is a function of it (a name
# ending in "." matches every method of that class)
WORKER_PARTS = (
    ("waiting for the master", ("Poller.poll",)),
    ("step message: receive, decode", ("recv_message",)),
    ("output message: encode, send", ("encode", "Socket.send")),
    ("requests and step inputs", ("ModelRunner._apply", "ModelRunner._lay_out", "AttentionMetadata.build",
                                  "StepSnapshot.take")),
    ("decoder layers: attention (fused op)", ("_attention_half",)),
    ("decoder layers: MLP / MoE (fused op)", ("_mlp_half",)),
    ("MoE: routing", ("DeepseekV3MoE.route",)),
    ("MoE: experts", ("MoERuntime.__call__",)),
    ("MoE: shared experts, dense MLP", ("SwiGLUMLP.forward",)),
    ("attention: projections", ("MultiHeadLatentAttention.output_projection", "Linear.forward")),
    ("attention: absorbed decode", ("MultiHeadLatentAttention._decode_absorbed",)),
    ("attention: RoPE, cache write, norms", ("MultiHeadLatentAttention.forward",)),
    ("LM head", ("compute_logits",)),
    ("sampling", ("ModelRunner._sample", "Sampler.")),
    ("layer norms, residuals, embedding", ("DeepseekV3ForCausalLM.forward",)),
    ("other step work", ("ModelRunner.execute",)),
)
MASTER_PARTS = (
    ("waiting (worker outputs, requests)", ("Poller.poll", "poll", "select")),
    ("scheduling", ("Scheduler.schedule",)),
    ("worker outputs: decode, update", ("update_from_output", "recv_message")),
    ("step message: build, encode, send", ("encode", "Socket.send", "StepBatch")),
)
OTHER = "other"
FLAME_DEPTH = 16


class StepProfileError(RuntimeError):
    """The profile cannot be taken (one line: why)."""


def add_step_profile_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format model directory (default: the DeepSeek-V3 model of --preset)")
    parser.add_argument("--preset", help="preset of the default model: small or tiny (default: small; --quick: tiny)")
    parser.add_argument("--quantization", choices=("none", "int8"), default="none",
                        help="weights as stored, or INT8 W8A8 quantized at load (default: none)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's compute dtype (default: float32)")
    parser.add_argument("--quick", action="store_true", help="the smallest run (for tests)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default: 256; --quick: 16)")
    parser.add_argument("--seconds", type=float, help="sampling window (default: 6; --quick: 1.5)")
    parser.add_argument("--rate", type=int, help="py-spy samples per second (default: 250; --quick: 200)")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"result file; a PNG with the same name is written next to it (default: {DEFAULT_JSON})")
    parser.set_defaults(func=step_profile_main)


@dataclasses.dataclass(frozen=True)
class StepProfileSettings:
    model_dir: str | None
    preset: str
    quantization: str
    dtype: str
    prompt_len: int
    seconds: float
    rate: int
    json_path: str


def settings_from_args(args: argparse.Namespace) -> StepProfileSettings:
    given = quick_or_full(args, _FULL, _QUICK)
    for key in ("prompt_len", "seconds", "rate"):
        if given[key] <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {given[key]}")
    if given["preset"] not in ("tiny", "small"):
        raise ValueError(f"--preset must be tiny or small, got {given['preset']!r}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"{args.model} is not a model directory (no config.json)")
    return StepProfileSettings(model_dir=args.model, quantization=args.quantization, dtype=args.dtype,
                               json_path=args.json, **given)


def step_profile_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_step_profile, _ERRORS, _report)


# ---------------------------------------------------------------- the stacks
def parse_collapsed(text: str) -> collections.Counter:
    """py-spy's raw output ("frame;frame;... count" per line, root first) -> stack tuple -> samples; each frame
    is kept as `function (file:line)` without the file's directories."""
    stacks: collections.Counter = collections.Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stacks[tuple(_short_frame(frame) for frame in stack.split(";"))] += int(count)
    return stacks


def _short_frame(frame: str) -> str:
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def function_of(frame: str) -> str:
    return frame.partition(" (")[0]


def categorize(stacks: collections.Counter, parts: tuple) -> dict[str, int]:
    """Samples per category (`parts` in order, then OTHER)."""
    counts = dict.fromkeys([name for name, _ in parts] + [OTHER], 0)
    for stack, samples in stacks.items():
        functions = [function_of(frame) for frame in stack]
        counts[_category(functions, parts)] += samples
    return counts


def _category(functions: list[str], parts: tuple) -> str:
    for name, patterns in parts:
        for pattern in patterns:
            if any(f.startswith(pattern) if pattern.endswith(".") else f == pattern or f.endswith("." + pattern)
                   for f in functions):
                return name
    return OTHER


def breakdown(counts: dict[str, int], step_ms: float) -> list[dict]:
    total = sum(counts.values()) or 1
    return [{"part": name, "samples": n, "share": n / total, "ms_per_step": n / total * step_ms}
            for name, n in counts.items()]


# ---------------------------------------------------------------- the run
def _py_spy() -> str:
    """py-spy beside this interpreter (the virtual environment's bin, which need not be on PATH), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    path = str(beside) if beside.is_file() else shutil.which("py-spy")
    if path is None:
        raise StepProfileError("py-spy is not installed (make install pins it)")
    return path


def _engine_pids(llm) -> tuple[int, int]:
    """(master, worker rank 0) process ids of an LLM's TE."""
    from meshserve.utils.processes import rank_processes

    master = llm.engine.proc.pid
    worker = rank_processes(master).get(0)
    if worker is None:
        raise StepProfileError("the engine's worker process was not found")
    return master, worker


def _record(py_spy: str, pid: int, seconds: float, rate: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                             "--rate", str(rate), "--nonblocking", "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_step_profile(settings: StepProfileSettings) -> dict:
    # start-up: the engine client, the model factory and the corpus only when the benchmark runs
    import tempfile

    from meshserve.engine.llm import LLM
    from meshserve.models.factory import ensure_default_model
    from meshserve.train.corpus import heldout_prompts

    py_spy = _py_spy()
    model = settings.model_dir or str(ensure_default_model("deepseek_v3", settings.preset))
    check_model_dir(model)
    quantization = {} if settings.quantization == "none" else {"quantization": settings.quantization}
    log(LOG_PREFIX, f"starting the engine ({model}, {settings.dtype}, quantization {settings.quantization})")
    llm = LLM(model, dtype=settings.dtype, max_num_seqs=8, enable_prefix_caching=False, **quantization)
    try:
        prompt = heldout_prompts(1, settings.prompt_len, seed=0)
        greedy = {"temperature": 0.0, "ignore_eos": True}
        warm = llm.generate(prompt, SamplingParams(max_tokens=32, **greedy))[0].metrics
        rate = 31 / (warm.last_token_time - warm.first_token_time)
        # long enough to decode through the whole window, within the model's length
        tokens = min(int(rate * (settings.seconds + 3)) + 32, llm.max_model_len - settings.prompt_len - 1)
        master_pid, worker_pid = _engine_pids(llm)
        outputs: list = []
        decoding = threading.Thread(
            target=lambda: outputs.extend(llm.generate(prompt, SamplingParams(max_tokens=tokens, **greedy))))
        decoding.start()
        time.sleep(1.0)  # past the prefill
        with tempfile.TemporaryDirectory() as tmp:
            files = {"worker": Path(tmp) / "worker.txt", "master": Path(tmp) / "master.txt"}
            log(LOG_PREFIX, f"sampling the worker and the master for {settings.seconds:g} s")
            pids = {"worker": worker_pid, "master": master_pid, "client": os.getpid()}
            cpu_before = _cpu_seconds(pids)
            started = time.perf_counter()
            recorders = {name: _record(py_spy, pid, settings.seconds, settings.rate, files[name])
                         for name, pid in (("worker", worker_pid), ("master", master_pid))}
            for name, recorder in recorders.items():
                _, err = recorder.communicate(timeout=settings.seconds + 60)
                if recorder.returncode != 0 or not files[name].is_file():
                    tail = (err.strip().splitlines() or ["no output"])[-1]
                    raise StepProfileError(f"py-spy could not sample the {name} ({tail[:200]})")
            window = (started, time.perf_counter())
            cpu_used = {name: after - cpu_before[name] for name, after in _cpu_seconds(pids).items()}
            stacks = {name: parse_collapsed(path.read_text()) for name, path in files.items()}
        decoding.join()
    finally:
        llm.shutdown()
    step_ms = _step_ms(outputs[0], window)
    return {
        "config": {"model": model, "dtype": settings.dtype, "quantization": settings.quantization,
                   "prompt_len": settings.prompt_len,
                   "seconds": settings.seconds, "rate": settings.rate, "batch": 1},
        "machine": report.machine_info(),
        "step_ms": step_ms,
        "decode_tokens_per_s": 1e3 / step_ms,
        # CPU time each process took per step over the window (the worker's across its threads)
        "cpu_ms_per_step": {name: seconds * step_ms / (window[1] - window[0]) for name, seconds in cpu_used.items()},
        "worker": breakdown(categorize(stacks["worker"], WORKER_PARTS), step_ms),
        "master": breakdown(categorize(stacks["master"], MASTER_PARTS), step_ms),
        "stacks": {name: [[";".join(stack), n] for stack, n in per.most_common()] for name, per in stacks.items()},
    }


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User and system CPU seconds each process has used so far."""
    import psutil

    return {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in pids.items()}


def _step_ms(output, window: tuple[float, float]) -> float:
    """The mean time between tokens over the request's decode (the sampled window lies inside it)."""
    metrics = output.metrics
    steps = len(output.token_ids) - 1
    if steps < 1 or metrics.last_token_time < window[1]:
        raise StepProfileError("the request finished before the sampling window ended")
    return (metrics.last_token_time - metrics.first_token_time) / steps * 1e3


# ---------------------------------------------------------------- the report
def table_lines(result: dict) -> list[str]:
    lines = []
    for process in ("worker", "master"):
        lines.append(f"| {process} | ms per step | share |")
        lines.append("| --- | ---: | ---: |")
        for row in result[process]:
            lines.append(f"| {row['part']} | {row['ms_per_step']:.2f} | {row['share']:.1%} |")
        lines.append("")
    config = result["config"]
    lines.append(f"batch-1 decode step {result['step_ms']:.2f} ms ({result['decode_tokens_per_s']:.1f} tokens/s), "
                 f"{config.get('dtype', 'float32')}, quantization {config['quantization']}, "
                 f"{config['prompt_len']}-token prompt; "
                 f"py-spy at {config['rate']} Hz for {config['seconds']:g} s")
    cpu = result.get("cpu_ms_per_step")
    if cpu:
        lines.append("CPU per step: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in cpu.items()))
    return lines


def plot_step_profile(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2, width_per_panel=9.0, height=6.0)
    flame, bars = axes[0][0], axes[0][1]
    stacks = collections.Counter({tuple(stack.split(";")): n for stack, n in result["stacks"]["worker"]})
    _draw_icicle(flame, stacks)
    flame.set_title(f"worker, batch-1 decode ({result['step_ms']:.2f} ms per step)")
    rows = [row for row in result["worker"] if row["ms_per_step"] > 0]
    bars.barh([row["part"] for row in rows], [row["ms_per_step"] for row in rows])
    bars.invert_yaxis()
    bars.set_xlabel("ms per step")
    bars.tick_params(axis="y", labelsize=7)
    bars.set_title("worker time per step by part")
    return report.save_figure(fig, path)


def _draw_icicle(ax, stacks: collections.Counter) -> None:
    """Frames as boxes: depth downwards, width the share of the samples; children in order of their weight."""
    total = sum(stacks.values()) or 1
    # skip the frames every sample shares (process start-up), so the picture starts where stacks differ
    common = 0
    while all(len(s) > common for s in stacks) and len({s[common] for s in stacks}) == 1:
        common += 1
    common = max(0, common - 1)

    def draw(prefix_stacks: collections.Counter, depth: int, x0: float) -> None:
        if depth >= FLAME_DEPTH:
            return
        children: collections.Counter = collections.Counter()
        for stack, n in prefix_stacks.items():
            if len(stack) > common + depth:
                children[stack[common + depth]] += n
        x = x0
        for frame, n in children.most_common():
            width = n / total
            ax.add_patch(_box(x, depth, width, depth))
            if width > 0.04:
                ax.text(x + 0.003, depth + 0.5, function_of(frame)[:int(width * 120)], fontsize=6, va="center")
            sub = collections.Counter({s: c for s, c in prefix_stacks.items()
                                       if len(s) > common + depth and s[common + depth] == frame})
            draw(sub, depth + 1, x)
            x += width

    draw(stacks, 0, 0.0)
    ax.set_xlim(0, 1)
    ax.set_ylim(FLAME_DEPTH, 0)
    ax.set_xlabel("share of the samples")
    ax.set_yticks([])


def _box(x: float, y: float, width: float, depth: int):
    from matplotlib.patches import Rectangle  # start-up: matplotlib only when drawing

    shade = 0.35 + 0.6 * ((depth * 37) % 11) / 11
    return Rectangle((x, y), width, 0.95, facecolor=(1.0, shade, 0.25), edgecolor="white", linewidth=0.3)


def _report(settings: StepProfileSettings, result: dict) -> None:
    report.publish(settings.json_path, result, plot_step_profile, table_lines(result))
