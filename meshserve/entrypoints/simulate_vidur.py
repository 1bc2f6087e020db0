"""`meshserve simulate vidur`: one scenario (a dense model's shape, a hardware profile, a trace) on meshserve's
simulator and on Vidur, side by side (meshserve/sim/vidur.py says how Vidur is given the same hardware)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
import time
from pathlib import Path

DEFAULT_JSON = "bench-results/simulate-vidur.json"
VIDUR_TERMS = ("lm_head", "host")  # the step's parts meshserve times and Vidur does not
# meshserve's simulation as it serves, then without each thing Vidur does not model, one at a time: the terms of a
# step it does not time, and the master's pipelining (a request arriving during step n waits for step n + 2)
VARIANTS = (("meshserve", "meshserve", (), 2),
            ("meshserve_vidur_terms", "meshserve, Vidur's terms", VIDUR_TERMS, 2),
            ("meshserve_unpipelined", "meshserve, Vidur's terms, unpipelined", VIDUR_TERMS, 1))
METRICS = (("output tokens/s", "output_tokens_per_s", None), ("TTFT p50 ms", "ttft_s", "p50"),
           ("TTFT p90 ms", "ttft_s", "p90"), ("TPOT p50 ms", "tpot_s", "p50"), ("TPOT p90 ms", "tpot_s", "p90"))


def add_vidur_command(commands) -> None:
    vidur = commands.add_parser("vidur", help="one scenario on meshserve's simulator and on Vidur (PyPI vidur), "
                                              "same model shape, hardware profile and trace")
    vidur.add_argument("--hardware", default="h800", help="the hardware profile both simulators time ops with")
    vidur.add_argument("--model-config", default="llama-3-8b", help="a dense model Vidur knows (default: "
                                                                   "llama-3-8b)")
    vidur.add_argument("--parallel", default="attn=TP1 moe=TP1", help="one replica: attn=TPk moe=TPk")
    vidur.add_argument("--weights", default="bf16", choices=("bf16", "int8"))
    vidur.add_argument("--replicas", type=int, default=1, help="replicas (colocated TEs) behind the router "
                                                               "(default: 1)")
    vidur.add_argument("--routing", default="round_robin", choices=("round_robin", "load"),
                       help="meshserve's routing policy between replicas; Vidur's global scheduler is round_robin "
                            "or lor (least outstanding requests) for load (default: round_robin)")
    vidur.add_argument("--trace", help="a JSONL trace (arrival_s, prompt_len, output_len) instead of Poisson arrivals")
    vidur.add_argument("--rate", type=float, default=16.0, help="Poisson arrivals per second (default: 16)")
    vidur.add_argument("--requests", type=int, default=1000, help="Poisson requests (default: 1000)")
    vidur.add_argument("--input-len", default="32:1024", help="prompt lengths, uniform LOW:HIGH")
    vidur.add_argument("--output-len", default="16:512", help="output lengths, uniform LOW:HIGH")
    vidur.add_argument("--seed", type=int, default=0)
    vidur.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (Vidur: batch size cap)")
    vidur.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="tokens per step (Vidur: Sarathi's chunk size)")
    vidur.add_argument("--num-kv-blocks", type=int, default=4096, help="KV blocks, both simulators")
    vidur.add_argument("--block-size", type=int, default=16)
    vidur.add_argument("--max-model-len", type=int, default=4096, help="Vidur's Llama-3-8B holds 4,096 tokens")
    vidur.add_argument("--vidur-python", help="the interpreter with vidur installed (default: .venv-vidur, made by "
                                              "`make vidur`)")
    vidur.add_argument("--vidur-full-search", action="store_true",
                       help="Vidur's own grid search over its random forests (27 settings x 10 folds per op: "
                            "about 20 minutes on 2 cores) instead of the one setting it picks for most ops")
    vidur.add_argument("--kv-granularity", type=int, default=256,
                       help="Vidur's step in KV tokens: it predicts attention at each request's KV length rounded "
                            "up to a multiple (default: 256, its own)")
    vidur.add_argument("--vidur-args", default="", help="more flags for `vidur.main`, after meshserve's (a later "
                                                        "flag wins), e.g. to switch a modelled term off")
    vidur.add_argument("--timeout-s", type=float, default=3600.0, help="Vidur's run, at most (default: 3600)")
    vidur.add_argument("--json", default=DEFAULT_JSON, help=f"result file, a PNG beside it (default: {DEFAULT_JSON})")
    vidur.set_defaults(func=vidur_main)


def vidur_main(args: argparse.Namespace) -> int:
    from meshserve.sim.cluster import SimCluster, TESpec
    from meshserve.sim.dense_op_model import DenseStepModel
    from meshserve.sim.vidur import VidurError

    try:
        scenario = _scenario(args)
    except (ValueError, OSError, VidurError) as exc:  # ValueError: HardwareError, TraceError, StrategyError too
        print(f"meshserve simulate vidur: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    runs = {}
    for name, label, omit, depth in VARIANTS:
        timer = DenseStepModel(scenario.config, scenario.hardware, scenario.model.deployment, omit=omit)
        settings = dataclasses.replace(scenario.settings, pipeline_depth=depth)
        replicas = [TESpec(f"c{i}", "colocated", settings, timer) for i in range(args.replicas)]
        runs[name] = SimCluster(replicas, policy=args.routing, seed=args.seed).run(scenario.trace, progress=False)
        logging.info("%s: %.0f tokens/s", label, runs[name]["output_tokens_per_s"])
    try:
        runs["vidur"], vidur_meta = _run_vidur(args, scenario)
    except VidurError as exc:
        print(f"meshserve simulate vidur: {exc}", file=sys.stderr)
        return 1
    result = {"scenario": {"hardware": args.hardware, "model": args.model_config, "parallel": args.parallel,
                           "replicas": args.replicas, "routing": args.routing, "weights": args.weights,
                           "te": dataclasses.asdict(scenario.settings),
                           "trace": args.trace or f"poisson rate {args.rate:g}/s, {args.requests} requests, input "
                                                  f"{args.input_len}, output {args.output_len}, seed {args.seed}"},
              "vidur": vidur_meta, "runs": runs}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(vidur_lines(result)))
    png = plot_vidur(result, path.with_suffix(".png"))
    print(f"wrote {path} and {png}")
    return 0


@dataclasses.dataclass(frozen=True)
class _Scenario:
    config: dict
    hardware: object  # Hardware
    model: object  # DenseStepModel: the op model both simulators time with
    settings: object  # SimTESettings
    trace: list
    python: Path  # Vidur's interpreter
    vidur: object  # VidurRun
    vidur_args: list[str]  # --vidur-args, after meshserve's flags


def _scenario(args: argparse.Namespace) -> _Scenario:
    """What the flags name, each checked (ValueError: the user's to fix)."""
    from meshserve.entrypoints.simulate import _model_config, trace_of
    from meshserve.parallel.strategy import parse_strategy
    from meshserve.sim.dense_op_model import DenseStepModel, dense_deployment_of
    from meshserve.sim.hardware import Hardware
    from meshserve.sim.te import SimTESettings
    from meshserve.sim.vidur import VidurRun, vidur_model_name, vidur_python

    config = _model_config(args.model_config)
    hardware = Hardware.load(args.hardware)
    model = DenseStepModel(config, hardware, dense_deployment_of(parse_strategy(args.parallel), args.weights))
    vidur_model_name(model.ops)
    vidur = VidurRun(replicas=args.replicas, routing=args.routing, granularity=args.kv_granularity,
                     full_search=args.vidur_full_search, seed=args.seed)
    hardware.check_devices(args.replicas * model.deployment.tp)
    settings = SimTESettings(dp=1, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                             max_model_len=args.max_model_len, prefix_caching=False)
    trace = trace_of(args, settings.max_model_len)
    python = vidur_python(args.vidur_python)
    try:
        vidur_args = shlex.split(args.vidur_args)
    except ValueError as exc:
        raise ValueError(f"--vidur-args {args.vidur_args!r}: {exc}") from None
    return _Scenario(config, hardware, model, settings, trace, python, vidur, vidur_args)


def _run_vidur(args: argparse.Namespace, scenario: _Scenario) -> tuple[dict, dict]:
    """Vidur on the scenario: its tables from the op model (cached per table content under meshserve's cache, as
    are the forests it fits), the trace as its CSV, its run directory beside the result file."""
    from meshserve.sim.vidur import (
        read_vidur_metrics,
        run_vidur,
        vidur_arguments,
        vidur_cache,
        write_profiles,
        write_trace,
    )
    from meshserve.utils import envs

    cache = vidur_cache(envs.cache_dir(), scenario.vidur.full_search)
    ops, settings = scenario.model.ops, scenario.settings
    datasets = write_profiles(ops, settings, cache, scenario.vidur.granularity)
    work = Path(args.json).with_suffix("")
    work = work.parent / f"{work.name}-vidur"
    work.mkdir(parents=True, exist_ok=True)
    write_trace(scenario.trace, work / "trace.csv")
    arguments = vidur_arguments(ops, settings, scenario.vidur, trace_file=work / "trace.csv", datasets=datasets,
                                cache_dir=cache, out_dir=work / "runs")
    arguments += scenario.vidur_args
    logging.info("Vidur: %s -m vidur.main (log: %s)", scenario.python, work / "vidur.log")
    start = time.monotonic()
    run_dir = run_vidur(scenario.python, arguments, work / "vidur.log", args.timeout_s)
    wall = time.monotonic() - start
    metrics = read_vidur_metrics(run_dir, scenario.trace)
    logging.info("Vidur: %.0f tokens/s (%.0f s wall)", metrics["output_tokens_per_s"], wall)
    return metrics, {"run_dir": str(run_dir), "datasets": list(datasets), "wall_s": wall,
                     "forest_search": "vidur's grid" if args.vidur_full_search else "one setting"}


def _value(run: dict, key: str, percentile: str | None) -> float:
    """A rate as it is; a percentile of seconds in milliseconds."""
    return run[key] if percentile is None else 1e3 * run[key][percentile]


def vidur_lines(result: dict) -> list[str]:
    runs = result["runs"]
    names = [name for name, *_ in VARIANTS] + ["vidur"]
    labels = [label for _, label, *_ in VARIANTS] + ["Vidur", "Vidur / meshserve unpipelined"]
    lines = ["| metric | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
    for label, key, percentile in METRICS:
        values = [_value(runs[name], key, percentile) for name in names]
        cells = " | ".join(f"{value:.1f}" for value in values)
        lines.append(f"| {label} | {cells} | {values[-1] / values[-2]:.2f} |")
    return lines


def plot_vidur(result: dict, path: Path) -> Path:
    """TTFT and TPOT CDFs of meshserve's runs and Vidur's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {name: label for name, label, *_ in VARIANTS} | {"vidur": "Vidur"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("ttfts", "tpots"), ("TTFT", "TPOT")):
        for name, label in labels.items():
            values = sorted(1e3 * v for v in result["runs"][name][key])
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(title)
        ax.legend()
    scenario = result["scenario"]
    fig.suptitle(f"{scenario['model']} on {scenario['hardware']}, {scenario['replicas']} x {scenario['parallel']} "
                 f"({scenario['routing']}): {scenario['trace']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
