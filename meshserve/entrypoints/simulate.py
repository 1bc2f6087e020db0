"""`meshserve simulate`: a TE's own control plane (DP waiting queue and balancer, schedulers, KV cache managers) on
virtual time, with steps timed by a hardware profile (meshserve/sim/); `meshserve simulate calibrate` fits the
profile of this machine from steps of the real engine."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from meshserve.utils import report

DEFAULT_JSON = "bench-results/simulate.json"


def add_simulate_commands(sub) -> None:
    sim = sub.add_parser("simulate", help="a TE's control plane on virtual time, steps timed by a hardware profile")
    commands = sim.add_subparsers(dest="simulate_command", required=True)
    run = commands.add_parser("run", help="serve a trace on a simulated TE; TTFT, TPOT, tokens/s (JSON + PNG)")
    _add_run_arguments(run)
    run.set_defaults(func=run_main)
    compare = commands.add_parser("compare", help="the real engine and the simulation on one trace, side by side")
    compare.add_argument("--model", help="model directory (default: the default model, made on first use)")
    compare.add_argument("--parallel", default="attn=TP1+DP1 moe=TP1+EP1", help="the TE's layout (its DP degree "
                                                                                 "is the simulation's --dp)")
    _add_run_arguments(compare, requests=48, rate=2.0, output_len="16:64")
    compare.set_defaults(func=compare_main)
    calibrate = commands.add_parser("calibrate", help="fit this machine's step-time profile from real engine steps")
    calibrate.add_argument("--model", help="model directory (default: the default model, made on first use)")
    calibrate.add_argument("--parallel", default="attn=TP1+DP1 moe=TP1+EP1", help="the TE's layout")
    calibrate.add_argument("--out", required=True, help="the profile file to write")
    calibrate.add_argument("--repeats", type=int, default=3, help="runs of each workload; medians (default: 3)")
    calibrate.set_defaults(func=calibrate_main)


def _add_run_arguments(parser, requests: int = 200, rate: float = 4.0, output_len: str = "16:128") -> None:
    parser.add_argument("--profile", required=True, help="the step-time profile (JSON; `meshserve simulate "
                                                         "calibrate`)")
    parser.add_argument("--dp", type=int, default=1, help="DP groups in lockstep (default: 1)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences per group per step (default: 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per group per step")
    parser.add_argument("--num-kv-blocks", type=int, default=4096, help="KV blocks per group (default: 4096)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--trace", help="a JSONL trace (arrival_s, prompt_len, output_len per line) instead of "
                                        "Poisson arrivals")
    parser.add_argument("--rate", type=float, default=rate, help=f"Poisson arrivals per second (0: all at once; "
                                                                 f"default: {rate:g})")
    parser.add_argument("--requests", type=int, default=requests, help=f"Poisson requests (default: {requests})")
    parser.add_argument("--input-len", default="32:256", help="prompt lengths, uniform LOW:HIGH (default: 32:256)")
    parser.add_argument("--output-len", default=output_len,
                        help=f"output lengths, uniform LOW:HIGH (default: {output_len})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"result file, a PNG beside it (default: {DEFAULT_JSON})")


def _range(text: str, flag: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"{flag} must be LOW:HIGH, got {text!r}") from None
    return low, high


def _inputs(args: argparse.Namespace, dp: int | None = None):
    """The profile, the TE's settings and the trace the flags name (ValueError and the like: the user's to fix)."""
    from meshserve.sim.profile import StepProfile
    from meshserve.sim.te import SimTESettings
    from meshserve.sim.trace import TraceError, poisson, read_jsonl

    profile = StepProfile.load(args.profile)
    settings = SimTESettings(dp=args.dp if dp is None else dp, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                             block_size=args.block_size)
    trace = read_jsonl(args.trace) if args.trace else poisson(
        args.rate, args.requests, _range(args.input_len, "--input-len"), _range(args.output_len, "--output-len"),
        args.seed)
    too_long = [r for r in trace if r.prompt_len + r.output_len > settings.max_model_len]
    if too_long:
        raise TraceError(f"a request of {too_long[0].prompt_len} + {too_long[0].output_len} tokens exceeds "
                         f"max_model_len {settings.max_model_len}")
    return profile, settings, trace


def _describe(args: argparse.Namespace, profile, settings) -> dict:
    return {"profile": profile.to_dict(), "te": dataclasses.asdict(settings),
            "trace": args.trace or f"poisson rate {args.rate:g}/s, {args.requests} requests, input {args.input_len}, "
                                   f"output {args.output_len}, seed {args.seed}"}


def run_main(args: argparse.Namespace) -> int:
    from meshserve.sim.run import simulate
    from meshserve.sim.te import SimTE

    try:
        profile, settings, trace = _inputs(args)
    except (ValueError, OSError) as exc:  # ProfileError and TraceError are ValueErrors
        print(f"meshserve simulate: error: {exc}", file=sys.stderr)
        return 2
    result = simulate(trace, SimTE(settings, profile, seed=args.seed))
    result["config"] = _describe(args, profile, settings)
    report.publish(args.json, result, plot_simulation, summary_lines(result))
    return 0


def compare_main(args: argparse.Namespace) -> int:
    from meshserve.bench.deployment_load import check_model_dir
    from meshserve.parallel.strategy import StrategyError, parse_strategy
    from meshserve.sim.compare import compare

    try:
        strategy = parse_strategy(args.parallel)
        profile, settings, trace = _inputs(args, dp=strategy.attn_dp)
        model = check_model_dir(args.model)
    except (StrategyError, ValueError, OSError) as exc:
        print(f"meshserve simulate compare: error: {exc}", file=sys.stderr)
        return 2
    result = compare(model, args.parallel, settings, profile, trace, args.seed)
    result["config"] = {**_describe(args, profile, settings), "model": model, "parallel": args.parallel}
    report.publish(args.json, result, plot_comparison, comparison_lines(result))
    return 0


def comparison_lines(result: dict) -> list[str]:
    lines = [f"{'metric':<22} {'measured':>10} {'simulated':>10} {'error':>8}"]
    for row in result["rows"]:
        scale = 1.0 if row["metric"] == "output_tokens_per_s" else 1e3  # seconds shown as ms
        unit = "" if scale == 1.0 else " ms"
        error = f"{100 * row['error']:+.1f}%" if row["error"] is not None else "-"
        lines.append(f"{row['metric'] + unit:<22} {scale * row['measured']:>10.1f} {scale * row['simulated']:>10.1f} "
                     f"{error:>8}")
    return lines


def plot_comparison(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2)
    ttft_ax, tpot_ax = axes[0]
    for label, run in (("measured", result["measured"]), ("simulated", result["simulated"])):
        report.plot_cdf(ttft_ax, [1e3 * v for v in run["ttfts"]], label, "TTFT (ms)")
        report.plot_cdf(tpot_ax, [1e3 * v for v in run["tpots"]], label, "TPOT (ms)")
    ttft_ax.legend()
    tpot_ax.legend()
    ttft_ax.set_title(f"{result['config']['parallel']}: TTFT")
    tpot_ax.set_title(f"profile {result['config']['profile']['name']}", fontsize=9)
    return report.save_figure(fig, path)


def summary_lines(result: dict) -> list[str]:
    ttft, tpot = result["ttft_s"] or {}, result["tpot_s"] or {}

    def ms(summary: dict, key: str) -> str:
        return f"{1e3 * summary[key]:.1f}" if summary.get(key) is not None else "-"
    return [f"{result['completed']}/{result['requests']} requests, {result['output_tokens']} tokens in "
            f"{result['virtual_s']:.1f} virtual s: {result['output_tokens_per_s']:.1f} tok/s",
            f"TTFT ms p50 {ms(ttft, 'p50')} p90 {ms(ttft, 'p90')} p99 {ms(ttft, 'p99')}; "
            f"TPOT ms p50 {ms(tpot, 'p50')} p90 {ms(tpot, 'p90')} p99 {ms(tpot, 'p99')}",
            f"{result['steps']} steps (mean {result['mean_step_ms']:.1f} ms); {result['events']} events in "
            f"{result['wall_s']:.2f} s wall ({result['events_per_s']:.0f} events/s)"]


def plot_simulation(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2)
    ttft_ax, tpot_ax = axes[0]
    report.plot_cdf(ttft_ax, [1e3 * v for v in result["ttfts"]], "simulated", "TTFT (ms)")
    report.plot_cdf(tpot_ax, [1e3 * v for v in result["tpots"]], "simulated", "TPOT (ms)")
    ttft_ax.set_title(f"{result['completed']} requests, {result['output_tokens_per_s']:.0f} tok/s")
    tpot_ax.set_title(f"profile {result['config']['profile']['name']}")
    return report.save_figure(fig, path)


# ---------------------------------------------------------------- calibrate
def calibrate_main(args: argparse.Namespace) -> int:
    from meshserve.bench.deployment_load import check_model_dir
    from meshserve.parallel.strategy import StrategyError, parse_strategy
    from meshserve.sim.calibrate import calibrate

    try:
        strategy = parse_strategy(args.parallel)
        model = check_model_dir(args.model)
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    except (StrategyError, ValueError, OSError) as exc:
        print(f"meshserve simulate calibrate: error: {exc}", file=sys.stderr)
        return 2
    profile = calibrate(model, args.parallel, strategy.attn_dp, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    print(json.dumps(profile.to_dict(), indent=2))
    print(f"wrote {args.out}")
    return 0
