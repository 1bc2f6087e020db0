"""`meshserve bench jitter`: step-time tails of a TE with Python's automatic garbage collection, with collection
on a schedule, and with that and each rank pinned to cores of its own (xdeepserve §4.4).

Three engines of the same layout are started once: `auto_gc` (gc_collect_every_steps=0, the baseline),
`scheduled_gc` (--gc-collect-every-steps) and `scheduled_gc_pinned` (the same, pin_cores). Each round sends
every engine in turn the same steady decode load (concurrent streaming requests, greedy, EOS ignored, so all
of them decode together, one token per step), the order rotating between rounds so drift on a shared machine
reaches all three alike. A step's time is the gap between consecutive token deltas of a stream (the first
token, which waits for the prefill, is left out; a delta carrying k tokens counts as k steps of gap / k).
Per configuration and round: p50, p90, p99 and max, and the p99 ratio against `auto_gc` of the same round;
the medians over rounds are reported. Writes the JSON and a PNG (CDF of step times, each round's p99).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import statistics
import time
from pathlib import Path

from meshserve.bench.deployment_load import check_model_dir, log, one_line_errors, run_bench_cli
from meshserve.config.base import ConfigError
from meshserve.engine.core_client import EngineStartupError
from meshserve.utils import report
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

PROG = "meshserve bench jitter"
LOG_PREFIX = "bench jitter"
DEFAULT_JSON = "bench-results/jitter.json"
BASELINE, SCHEDULED, PINNED = "auto_gc", "scheduled_gc", "scheduled_gc_pinned"
CONFIGS = (BASELINE, SCHEDULED, PINNED)
PERCENTILES = ("p50", "p90", "p99", "max")
_FULL = {"requests": 8, "output_len": 128, "prompt_len": 16, "rounds": 3}
_QUICK = {"requests": 2, "output_len": 12, "prompt_len": 8, "rounds": 1}
_ERRORS = (ConfigError, EngineStartupError, EngineDeadError, OSError, RuntimeError, TimeoutError)


def add_jitter_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format model directory (default: the tiny default model)")
    parser.add_argument("--parallel", default="attn=TP1+DP2 moe=TP1+EP2",
                        help="the engines' parallel strategy (default: attn=TP1+DP2 moe=TP1+EP2)")
    parser.add_argument("--num-threads", type=int, help="torch threads per rank (default: the engine's)")
    parser.add_argument("--gc-collect-every-steps", type=int, default=200,
                        help="the scheduled configurations' collection interval, steps (default: 200)")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest run (for tests): the --quick value of every option below not given")
    parser.add_argument("--requests", type=int, help="concurrent streaming requests (default: 8; --quick: 2)")
    parser.add_argument("--output-len", type=int, help="tokens per request (default: 128; --quick: 12)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per request (default: 16; --quick: 8)")
    parser.add_argument("--rounds", type=int, help="rounds over the three engines, medians reported "
                                                   "(default: 3; --quick: 1)")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"result file; a PNG with the same name is written next to it (default: {DEFAULT_JSON})")
    parser.set_defaults(func=jitter_main)


@dataclasses.dataclass(frozen=True)
class JitterSettings:
    model_dir: str | None
    parallel: str
    num_threads: int | None
    gc_every: int
    requests: int
    output_len: int
    prompt_len: int
    rounds: int
    json_path: str

    def engine_args(self, config: str) -> dict:
        args = {"parallel": self.parallel, "max_num_seqs": max(8, self.requests), "enable_prefix_caching": False,
                "kv_cache_memory_gb": 0.1,
                "gc_collect_every_steps": 0 if config == BASELINE else self.gc_every, "pin_cores": config == PINNED}
        if self.num_threads is not None:
            args["num_threads"] = self.num_threads
        return args


def settings_from_args(args: argparse.Namespace) -> JitterSettings:
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else (_QUICK if args.quick else _FULL)[key]
             for key in _FULL}
    for key, value in sizes.items():
        if value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    if sizes["output_len"] < 3:
        raise ValueError("--output-len must be at least 3: the first token is left out, and a step is a gap")
    if args.gc_collect_every_steps < 1:
        raise ValueError(f"--gc-collect-every-steps must be at least 1, got {args.gc_collect_every_steps}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"{args.model} is not a model directory (no config.json)")
    return JitterSettings(model_dir=args.model, parallel=args.parallel, num_threads=args.num_threads,
                          gc_every=args.gc_collect_every_steps, json_path=args.json, **sizes)


def jitter_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_jitter_benchmark, _ERRORS, _report_jitter)


# ---------------------------------------------------------------- the run
def run_jitter_benchmark(settings: JitterSettings) -> dict:
    # start-up: the engine client (and the tokenizer) only when the benchmark runs
    from meshserve.config import EngineConfig
    from meshserve.engine.async_client import AsyncEngineClient

    model = check_model_dir(settings.model_dir)
    engines: dict = {}
    try:
        for config in CONFIGS:
            log(LOG_PREFIX, f"starting {config} ({settings.parallel})")
            engines[config] = AsyncEngineClient(EngineConfig.from_kwargs(model, **settings.engine_args(config)),
                                                log_level=logging.WARNING)
        rounds, samples, marked = asyncio.run(_measure(engines, settings))
    finally:
        for engine in engines.values():
            engine.shutdown()
    return _result(settings, model, rounds, samples, marked)


async def _measure(engines: dict, settings: JitterSettings) -> tuple[list[dict], dict, dict]:
    """Each round's summaries per configuration, every step time (ms) per configuration, and the steps each
    engine marked for its ranks' garbage collection while measured."""
    prompts = [[(7 + 31 * i + 13 * j) % 1000 + 100 for j in range(settings.prompt_len)]
               for i in range(settings.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=settings.output_len, ignore_eos=True)
    for name, engine in engines.items():  # first-call costs out of the measured rounds
        await _step_times(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                          f"warm-{name}")
    before = {name: (await engine.get_stats()).gc_marked_steps for name, engine in engines.items()}
    rounds, samples = [], {name: [] for name in CONFIGS}
    for index in range(settings.rounds):
        order = CONFIGS[index % len(CONFIGS):] + CONFIGS[:index % len(CONFIGS)]
        started = time.monotonic()
        times = {name: await _step_times(engines[name], prompts, params, f"r{index}-{name}") for name in order}
        summary = {name: _summary(times[name]) for name in CONFIGS}
        for name in CONFIGS:
            summary[name]["p99_ratio"] = summary[name]["p99"] / summary[BASELINE]["p99"]
            samples[name].extend(times[name])
        rounds.append(summary)
        log(LOG_PREFIX, f"round {index + 1}/{settings.rounds} ({time.monotonic() - started:.1f} s): p99 ms " +
            ", ".join(f"{name} {summary[name]['p99']:.2f}" for name in CONFIGS))
    after = {name: (await engine.get_stats()).gc_marked_steps for name, engine in engines.items()}
    return rounds, samples, {name: after[name] - before[name] for name in CONFIGS}


async def _step_times(engine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[float]:
    """The requests streamed together to the end; the gaps (ms) between each stream's token deltas."""
    gaps: list[float] = []

    async def stream(index: int) -> None:
        last = None
        async for out in engine.generate(None, prompts[index], params, f"jitter-{tag}-{index}"):
            if out.error is not None:
                raise RuntimeError(f"request {index} failed: {out.error}")
            now, new = time.perf_counter(), len(out.outputs[0].token_ids_delta)
            if not new:
                continue
            if last is not None:
                gaps.extend([(now - last) * 1e3 / new] * new)
            last = now

    await asyncio.gather(*(stream(i) for i in range(len(prompts))))
    if not gaps:
        raise RuntimeError("no step was timed: the requests produced fewer than two token deltas")
    return gaps


def _summary(times_ms: list[float]) -> dict:
    summary = report.summarize(times_ms, (50, 90, 99))
    return {"count": summary["count"], **{key: summary[key] for key in PERCENTILES}}


def _result(settings: JitterSettings, model: str, rounds: list[dict], samples: dict, marked: dict) -> dict:
    configs = {}
    for name in CONFIGS:
        configs[name] = {
            "engine_args": settings.engine_args(name),
            "step_ms": {key: statistics.median(r[name][key] for r in rounds) for key in PERCENTILES},
            "p99_ratio": statistics.median(r[name]["p99_ratio"] for r in rounds),
            "steps_timed": sum(r[name]["count"] for r in rounds),
            "gc_marked_steps": marked[name],
        }
    return {
        "config": {"model": model, "parallel": settings.parallel, "requests": settings.requests,
                   "output_len": settings.output_len, "prompt_len": settings.prompt_len, "rounds": settings.rounds,
                   "gc_collect_every_steps": settings.gc_every, "num_threads": settings.num_threads},
        "machine": report.machine_info(),
        "baseline": BASELINE,
        "configs": configs,
        "rounds": rounds,
        "step_ms_samples": {name: [round(v, 4) for v in samples[name]] for name in CONFIGS},
    }


# ---------------------------------------------------------------- the report
def table_lines(result: dict) -> list[str]:
    lines = [f"{'config':<22}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}{'p99 ratio':>11}{'gc steps':>10}"]
    for name, row in result["configs"].items():
        step = row["step_ms"]
        lines.append(f"{name:<22}{step['p50']:>9.2f}{step['p90']:>9.2f}{step['p99']:>9.2f}{step['max']:>9.2f}"
                     f"{row['p99_ratio']:>11.2f}{row['gc_marked_steps']:>10d}")
    config = result["config"]
    lines.append(f"({config['parallel']}; {config['requests']} requests x {config['output_len']} tokens; medians over "
                 f"{config['rounds']} round(s); p99 ratio against {result['baseline']} in the same round)")
    return lines


def plot_jitter(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2)
    cdf, per_round = axes[0][0], axes[0][1]
    for name in CONFIGS:
        report.plot_cdf(cdf, result["step_ms_samples"][name], name, "step time (ms)", "fraction of steps")
        p99s = [r[name]["p99"] for r in result["rounds"]]
        per_round.plot(range(1, len(p99s) + 1), p99s, marker="o", label=name)
    cdf.set_xscale("log")
    cdf.set_title("step times")
    per_round.set_xticks(range(1, len(result["rounds"]) + 1))
    per_round.set_xlabel("round")
    per_round.set_ylabel("p99 step time (ms)")
    per_round.set_title("p99 per round")
    per_round.legend()
    per_round.grid(True, alpha=0.3)
    return report.save_figure(fig, path)


def _report_jitter(settings: JitterSettings, result: dict) -> None:
    report.publish(settings.json_path, result, plot_jitter, table_lines(result))
