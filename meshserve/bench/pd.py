"""`meshserve bench pd`: colocated TEs vs a disaggregated P/D pair on the same cores (deepserve Fig. 4).

Both deployments (default `colocated2` and `1p1d`: two TEs each, so each gets the same cores) serve
the same mixed workload, one after the other: half the requests have long prompts and short
outputs, half short prompts and long outputs, in a seeded order, sent evenly spaced at a fixed rate
through a job executor. Reports TTFT and TPOT p50/p99 and mean JCT of both, and the ratios
disaggregated / colocated measured in the same run; writes JSON and a PNG of the distributions.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from meshserve.bench.deployment_load import (
    add_engine_flags,
    check_model_dir,
    counter_deltas,
    engine_settings,
    log,
    model_max_len,
    one_line_errors,
    run_fixed_rate,
    started_deployment,
    summarize_timings,
    te_counters,
    vocabulary,
    warm_up,
)
from meshserve.bench.mixed_workload import KINDS, Mix, make_mixed_workload
from meshserve.bench.workload import parse_range
from meshserve.config import ConfigError
from meshserve.utils import report

LOG = "bench pd"
SETUPS = ("colocated", "disaggregated")
# (summary field, percentile) pairs whose disaggregated / colocated ratio is reported
RATIOS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"), ("jct_ms", "mean"))


def add_mix_arguments(parser: argparse.ArgumentParser, prompt_what: str = "prompt") -> None:
    """The two request classes' length ranges (A:B or N, tokens)."""
    mix = parser.add_argument_group("workload: half long prompt + short output, half short prompt + long output")
    mix.add_argument("--long-prompt", dest="long_prompt", default="1024",
                     help=f"{prompt_what} length of the long-prompt class (default: 1024)")
    mix.add_argument("--short-output", dest="short_output", default="16",
                     help="output length of the long-prompt class (default: 16)")
    mix.add_argument("--short-prompt", dest="short_prompt", default="64",
                     help=f"{prompt_what} length of the long-output class (default: 64)")
    mix.add_argument("--long-output", dest="long_output", default="256",
                     help="output length of the long-output class (default: 256)")
    mix.add_argument("--long-prompt-fraction", dest="long_prompt_fraction", type=float, default=0.5,
                     help="share of long-prompt requests (default: 0.5)")


def mix_from_args(args: argparse.Namespace) -> Mix:
    return Mix(parse_range(args.long_prompt, "--long-prompt"), parse_range(args.short_output, "--short-output"),
               parse_range(args.short_prompt, "--short-prompt"), parse_range(args.long_output, "--long-output"),
               args.long_prompt_fraction)


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, "meshserve bench pd")
    parser.add_argument("--model", default=None, help="HF-format model directory (default: the tiny default model)")
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")
    parser.add_argument("--requests", type=int, default=32, help="requests per setup (default: 32)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s, evenly spaced (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--colocated", default="colocated2", help="colocated deployment preset or file "
                                                                  "(default: colocated2)")
    parser.add_argument("--disaggregated", default="1p1d", help="disaggregated deployment preset or file "
                                                                "(default: 1p1d)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="limit on one setup's requests, seconds; unfinished ones are aborted (default: 600)")
    add_mix_arguments(parser)
    add_engine_flags(parser)
    parser.set_defaults(func=pd_main)


def pd_main(args: argparse.Namespace) -> int:
    # start-up: zmq only when a deployment runs
    from meshserve.router.deployment import load_multi

    try:
        if args.requests < 1:
            raise ValueError(f"--requests must be at least 1, got {args.requests}")
        if not args.rate > 0:
            raise ValueError(f"--rate must be positive, got {args.rate}")
        if not args.timeout > 0:
            raise ValueError(f"--timeout must be positive, got {args.timeout}")
        mix = mix_from_args(args)
        engine = engine_settings(args)
        deployments = {"colocated": load_multi(args.colocated), "disaggregated": load_multi(args.disaggregated)}
        model = check_model_dir(args.model)
        if mix.longest_request() > model_max_len(model, engine):
            raise ValueError(f"the longest request ({mix.longest_request()} tokens) exceeds the model's context "
                             f"({model_max_len(model, engine)})")
        result = run_pd_benchmark(model, deployments, {"colocated": args.colocated,
                                                       "disaggregated": args.disaggregated},
                                  mix, args.requests, args.rate, engine, args.seed, args.timeout)
    except (ValueError, OSError, ConfigError, RuntimeError, TimeoutError) as exc:
        print(f"meshserve bench pd: error: {exc}", file=sys.stderr)
        return 2
    json_path = report.write_json(args.json, result)
    png_path = plot_pd(result, report.png_path_for(json_path))
    for line in summary_lines(result):
        print(line)
    print(f"wrote {json_path} and {png_path}")
    return 0


def run_pd_benchmark(model: str, deployments: dict, names: dict[str, str], mix: Mix, num_requests: int,
                     rate: float, engine: dict, seed: int = 0, timeout_s: float = 600.0) -> dict:
    vocab_size, special = vocabulary(model)
    requests, kinds = make_mixed_workload(num_requests, mix, vocab_size, seed=seed, exclude_token_ids=special)
    setups = {}
    for setup in SETUPS:
        log(LOG, f"{setup} ({names[setup]}): starting")
        with started_deployment(model, deployments[setup], engine) as je:
            timings, counters = asyncio.run(_measure(je, requests, kinds, rate, vocab_size, special, setup,
                                                     timeout_s, max(len(r.prompt_token_ids) for r in requests)))
        summary = summarize_timings(timings)
        log(LOG, f"{setup}: {summary['completed']}/{len(timings)} ok, mean JCT {_mean_s(summary)}")
        setups[setup] = {
            "deployment": names[setup],
            "summary": summary,
            "by_kind": {kind: summarize_timings([t for t in timings if t.kind == kind]) for kind in KINDS},
            "te_counters": counters,
            "requests": [t.to_dict() for t in timings],
        }
    ratios = {}
    for field, stat in RATIOS:
        colocated = setups["colocated"]["summary"][field][stat]
        disaggregated = setups["disaggregated"]["summary"][field][stat]
        ratios[f"{field.removesuffix('_ms')}_{stat}"] = (disaggregated / colocated if colocated and disaggregated
                                                         is not None else None)
    return {
        "machine": report.machine_info(),
        "model": model,
        "settings": {"requests": num_requests, "rate": rate, "seed": seed, "engine": engine,
                     "mix": {"long_prompt": mix.long_prompt, "short_output": mix.short_output,
                             "short_prompt": mix.short_prompt, "long_output": mix.long_output,
                             "long_prompt_fraction": mix.long_prompt_fraction},
                     "arrivals": "evenly spaced at the rate"},
        "setups": setups,
        "ratios_disaggregated_vs_colocated": ratios,
    }


async def _measure(je, requests, kinds, rate, vocab_size, special, setup, timeout_s, longest_prompt):
    await warm_up(je, longest_prompt, vocab_size, special)
    before = await te_counters(je)
    timings = await run_fixed_rate(je, requests, rate, kinds=kinds, tag=setup, timeout_s=timeout_s)
    return timings, counter_deltas(before, await te_counters(je))


def _mean_s(summary: dict) -> str:
    mean = summary["jct_ms"]["mean"]
    return "n/a" if mean is None else f"{mean / 1000:.3f} s"


def summary_lines(result: dict) -> list[str]:
    setups = result["setups"]
    fmt = lambda v: f"{v:>10.1f}" if v is not None else f"{'-':>10}"  # noqa: E731
    header = f"{'':<28}" + "".join(f"{f.removesuffix('_ms') + ' ' + s:>10}" for f, s in RATIOS) + "   (ms)"
    lines = [f"{result['settings']['requests']} requests at {result['settings']['rate']:g} rps", header]
    for setup in SETUPS:
        summary = setups[setup]["summary"]
        label = f"{setup} ({setups[setup]['deployment']})"
        lines.append(f"{label:<28}" + "".join(fmt(summary[f][s]) for f, s in RATIOS)
                     + f"   {summary['failed']} failed")
    ratios = result["ratios_disaggregated_vs_colocated"]
    lines.append(f"{'disaggregated / colocated':<28}" + "".join(
        f"{ratios[f.removesuffix('_ms') + '_' + s]:>9.2f}x" if ratios[f.removesuffix('_ms') + '_' + s] is not None
        else f"{'-':>10}" for f, s in RATIOS))
    return lines


def plot_pd(result: dict, path):
    fig, axes = report.new_figure(ncols=3)
    for ax, (field, label) in zip(axes[0], (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"), ("jct_s", "JCT (ms)"))):
        for setup in SETUPS:
            data = result["setups"][setup]
            values = [r[field] * 1000 for r in data["requests"] if r["ok"] and r[field] is not None]
            report.plot_cdf(ax, values, f"{setup} ({data['deployment']})", label)
        ax.set_title(label.split(" ")[0])
    fig.suptitle(f"bench pd: {result['settings']['requests']} requests at {result['settings']['rate']:g} rps")
    return report.save_figure(fig, path)
