"""`meshserve bench routing`: the job executor's routing policies on one deployment (deepserve Fig. 7).

One deployment (default `colocated2+1p1d`: two colocated TEs and a P/D pair) is started once. The
workload has shared prefixes (a few system prompts, each followed by the request's own tokens) and the
two request classes of `bench pd` (long prompt + short output, short prompt + long output). Every policy
serves the same workload shape at a fixed rate, routed per request (REQUEST_ROUTING_POLICY); reported
per policy: mean JCT, TTFT and TPOT, the prefix-cache hit rate (prompt tokens found / looked up, from
the TEs' own counters), how many requests went disaggregated, and mean JCT against round-robin's.

Prefix caches would carry over from one policy's run to the next and favour the later ones. Each run
therefore uses fresh token ids (new prefixes, new suffixes) with the same shapes (classes, lengths,
order, which request shares which prefix): a prefix cached by an earlier run never matches, so every
run starts cold, as after a restart. This is cleaner than restarting the deployment per policy: the
TEs stay warm and identical for all policies, and the runs interleave (each repeat rotates the policy
order), so the drift of a shared, noisy machine falls on all policies alike. With --repeats N each
figure is the median over N runs.

Without --heatmap, pd_aware and combined use the router's built-in rule (disaggregate when the prompt
is at least as long as max_tokens); with it, the measured heatmap at (prompt length, predicted output
length), the prediction coming from --predictor or, without one, from max_tokens, which is exact here
since every request runs to max_tokens (ignore_eos).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

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
from meshserve.bench.mixed_workload import Mix, make_mixed_workload
from meshserve.bench.pd import add_mix_arguments, mix_from_args
from meshserve.config import ConfigError
from meshserve.router.pd_heatmap import PDHeatmap
from meshserve.utils import report

LOG = "bench routing"
BASELINE = "round_robin"
SETTLE_S = 1.0  # between runs: a couple of heartbeats, so the JE starts each run seeing idle TEs


class MaxTokensPredictor:
    """Predicts that a request generates max_tokens tokens: exact for requests with ignore_eos."""

    def predict_tokens(self, prompt_token_ids: Sequence[int], max_tokens: int) -> int:
        return max_tokens


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    # start-up: zmq only when the routing benchmark runs
    from meshserve.router.routing import POLICIES

    one_line_errors(parser, "meshserve bench routing")
    parser.add_argument("--model", default=None, help="HF-format model directory (default: the tiny default model)")
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")
    parser.add_argument("--deployment", default="colocated2+1p1d",
                        help="deployment preset or file (default: colocated2+1p1d)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"policies to compare; {BASELINE} is always run as the baseline "
                             f"(default: {','.join(POLICIES)})")
    parser.add_argument("--heatmap", default=None, help="PD heatmap (`meshserve profile pd` output) for pd_aware "
                                                        "and combined (default: the router's built-in rule)")
    parser.add_argument("--predictor", default=None, help="decode-length predictor (`meshserve predictor train` "
                                                          "output; default with --heatmap: max_tokens, exact here)")
    parser.add_argument("--requests", type=int, default=48, help="requests per run (default: 48)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s, evenly spaced (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per policy, median taken (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="workload shape seed (default: 0)")
    parser.add_argument("--num-prefixes", dest="num_prefixes", type=int, default=4,
                        help="shared prefixes (system prompts) (default: 4)")
    parser.add_argument("--prefix-len", dest="prefix_len", type=int, default=256,
                        help="tokens per shared prefix (default: 256)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="limit on one run's requests, seconds; unfinished ones are aborted (default: 600)")
    add_mix_arguments(parser, prompt_what="prompt (after the shared prefix)")
    parser.set_defaults(long_prompt="256:512", short_output="8:32", short_prompt="16:32", long_output="320:448")
    add_engine_flags(parser)
    parser.set_defaults(func=routing_main)


def routing_main(args: argparse.Namespace) -> int:
    # start-up: zmq only when the routing benchmark runs
    from meshserve.router.deployment import load_multi
    from meshserve.router.routing import POLICIES

    try:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        unknown = [p for p in policies if p not in POLICIES]
        if unknown or not policies:
            raise ValueError(f"--policies: unknown policy {unknown[0] if unknown else '(none given)'!r}; "
                             f"valid: {', '.join(POLICIES)}")
        policies = list(dict.fromkeys([BASELINE, *policies]))
        for name, value, low in (("--requests", args.requests, 1), ("--repeats", args.repeats, 1),
                                 ("--num-prefixes", args.num_prefixes, 1), ("--prefix-len", args.prefix_len, 1)):
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        for name, value in (("--rate", args.rate), ("--timeout", args.timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        mix = mix_from_args(args)
        engine = engine_settings(args)
        deployment = load_multi(args.deployment)
        heatmap, predictor, predictor_name = _routing_inputs(args.heatmap, args.predictor)
        model = check_model_dir(args.model)
        longest = args.prefix_len + mix.longest_request()
        if longest > model_max_len(model, engine):
            raise ValueError(f"the longest request ({longest} tokens) exceeds the model's context "
                             f"({model_max_len(model, engine)})")
        load = RoutingWorkload(mix, args.requests, args.rate, args.repeats, args.num_prefixes, args.prefix_len,
                               args.seed, args.timeout)
        result = run_routing_benchmark(model, deployment, args.deployment, policies, load, engine, heatmap,
                                       predictor)
    except (ValueError, OSError, ConfigError, RuntimeError, TimeoutError) as exc:
        print(f"meshserve bench routing: error: {exc}", file=sys.stderr)
        return 2
    result["settings"].update(heatmap=args.heatmap, predictor=predictor_name)
    json_path = report.write_json(args.json, result)
    png_path = plot_routing(result, report.png_path_for(json_path))
    for line in summary_lines(result):
        print(line)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _routing_inputs(heatmap_path: str | None, predictor_path: str | None):
    heatmap = predictor = None
    predictor_name = None
    if heatmap_path:
        heatmap = PDHeatmap.load(heatmap_path)
        # the router reads the heatmap only with a predictor
        predictor, predictor_name = MaxTokensPredictor(), "max_tokens (exact: ignore_eos)"
    if predictor_path:
        # keeps torch out of `meshserve` start-up (the bench parser imports this module)
        from meshserve.router.length_predictor import LengthPredictor

        predictor, predictor_name = LengthPredictor.load(predictor_path), predictor_path
    return heatmap, predictor, predictor_name


@dataclass(frozen=True)
class RoutingWorkload:
    """What each policy is measured on: `requests` of `mix` behind `num_prefixes` shared prefixes, at `rate`
    requests/s, `repeats` times; `timeout_s` bounds one run."""
    mix: Mix
    requests: int
    rate: float
    repeats: int
    num_prefixes: int
    prefix_len: int
    seed: int = 0
    timeout_s: float = 600.0


def run_routing_benchmark(model: str, deployment, deployment_name: str, policies: list[str],
                          load: RoutingWorkload, engine: dict, heatmap=None, predictor=None) -> dict:
    vocab_size, special = vocabulary(model)
    mix, num_requests, rate, repeats, seed = load.mix, load.requests, load.rate, load.repeats, load.seed
    num_prefixes, prefix_len, timeout_s = load.num_prefixes, load.prefix_len, load.timeout_s

    def workload(token_seed: int):
        return make_mixed_workload(num_requests, mix, vocab_size, seed=seed, token_seed=token_seed,
                                   exclude_token_ids=special, num_prefixes=num_prefixes, prefix_len=prefix_len)

    async def measure(je) -> dict[str, list[dict]]:
        longest = max(len(r.prompt_token_ids) for r in workload(0)[0])
        await warm_up(je, longest, vocab_size, special)
        runs: dict[str, list[dict]] = {p: [] for p in policies}
        for repeat in range(repeats):
            order = policies[repeat % len(policies):] + policies[:repeat % len(policies)]
            for position, policy in enumerate(order):
                # fresh token ids, same shapes: no run finds another run's prefixes cached
                requests, kinds = workload(token_seed=1 + seed * 100_000 + repeat * len(policies) + position)
                await asyncio.sleep(SETTLE_S)
                before = await te_counters(je)
                timings = await run_fixed_rate(je, requests, rate, policy=policy, kinds=kinds,
                                               tag=f"r{repeat}-{policy}", timeout_s=timeout_s)
                counters = counter_deltas(before, await te_counters(je))
                run = {"repeat": repeat, "position": position, **summarize_timings(timings),
                       **_cache_and_split(counters), "te_counters": counters}
                runs[policy].append(run)
                log(LOG, f"repeat {repeat + 1}/{repeats} {policy}: {run['completed']}/{len(timings)} ok, mean JCT "
                         f"{_ms(run['jct_ms']['mean'])}, hit rate {run['hit_rate']:.1%}, "
                         f"{run['disaggregated_requests']} disaggregated")
        return runs

    log(LOG, f"starting {deployment_name}")
    with started_deployment(model, deployment, engine, heatmap=heatmap, predictor=predictor) as je:
        runs = asyncio.run(measure(je))
    results = {policy: {"runs": policy_runs, "median": _medians(policy_runs)} for policy, policy_runs in runs.items()}
    base = results[BASELINE]
    for entry in results.values():
        entry["jct_vs_round_robin"] = _ratio(entry["median"]["jct_mean_ms"], base["median"]["jct_mean_ms"])
        entry["jct_vs_round_robin_per_repeat"] = [
            _ratio(run["jct_ms"]["mean"], base_run["jct_ms"]["mean"])
            for run, base_run in zip(entry["runs"], base["runs"])]
    return {
        "machine": report.machine_info(),
        "model": model,
        "settings": {"deployment": deployment_name, "tes": [t.name for t in deployment.tes()], "policies": policies,
                     "requests": num_requests, "rate": rate, "repeats": repeats, "seed": seed, "engine": engine,
                     "num_prefixes": num_prefixes, "prefix_len": prefix_len,
                     "mix": {"long_prompt": mix.long_prompt, "short_output": mix.short_output,
                             "short_prompt": mix.short_prompt, "long_output": mix.long_output,
                             "long_prompt_fraction": mix.long_prompt_fraction},
                     "cache_isolation": "fresh token ids per run, same shapes; policy order rotated per repeat",
                     "arrivals": "evenly spaced at the rate"},
        "baseline": BASELINE,
        "policies": results,
    }


def _cache_and_split(counters: dict[str, dict]) -> dict:
    queries = sum(c["prefix_cache_queries"] for c in counters.values())
    hits = sum(c["prefix_cache_hits"] for c in counters.values())
    return {"hit_rate": hits / queries if queries else 0.0, "prefix_cache_hits": hits,
            "prefix_cache_queries": queries,
            "disaggregated_requests": sum(c["kv_pulled"] for c in counters.values() if c["role"] == "decode")}


def _medians(runs: list[dict]) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    return {"jct_mean_ms": med(r["jct_ms"]["mean"] for r in runs), "jct_p99_ms": med(r["jct_ms"]["p99"] for r in runs),
            "ttft_mean_ms": med(r["ttft_ms"]["mean"] for r in runs),
            "tpot_mean_ms": med(r["tpot_ms"]["mean"] for r in runs),
            "hit_rate": med(r["hit_rate"] for r in runs),
            "disaggregated_requests": med(r["disaggregated_requests"] for r in runs),
            "failed": sum(r["failed"] for r in runs)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1000:.3f} s"


def summary_lines(result: dict) -> list[str]:
    settings = result["settings"]
    lines = [f"{settings['deployment']}: {settings['requests']} requests at {settings['rate']:g} rps, "
             f"median of {settings['repeats']} run(s) per policy",
             f"{'policy':<12}{'JCT ms':>10}{'TTFT ms':>10}{'TPOT ms':>10}{'hit rate':>10}{'disagg.':>9}"
             f"{'JCT vs rr':>11}{'failed':>8}"]
    num = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    for policy, entry in result["policies"].items():
        m = entry["median"]
        lines.append(f"{policy:<12}{num(m['jct_mean_ms'], '>10.1f')}{num(m['ttft_mean_ms'], '>10.1f')}"
                     f"{num(m['tpot_mean_ms'], '>10.2f')}{num(m['hit_rate'], '>10.1%')}"
                     f"{num(m['disaggregated_requests'], '>9g')}{num(entry['jct_vs_round_robin'], '>10.2f')}x"
                     f"{m['failed']:>8}")
    return lines


def plot_routing(result: dict, path):
    policies = list(result["policies"])
    panels = (("jct_ms", "mean JCT (ms)"), ("ttft_ms", "mean TTFT (ms)"), ("tpot_ms", "mean TPOT (ms)"),
              ("hit_rate", "prefix-cache hit rate"))
    fig, axes = report.new_figure(ncols=len(panels), width_per_panel=4.0)
    for ax, (field, label) in zip(axes[0], panels):
        per_policy = [[run[field] if field == "hit_rate" else run[field]["mean"]
                       for run in result["policies"][p]["runs"]] for p in policies]
        per_policy = [[v for v in values if v is not None] for values in per_policy]
        medians = [statistics.median(v) if v else 0.0 for v in per_policy]
        low = [m - min(v) if v else 0.0 for m, v in zip(medians, per_policy)]
        high = [max(v) - m if v else 0.0 for m, v in zip(medians, per_policy)]
        ax.bar(range(len(policies)), medians, yerr=[low, high], capsize=3, color="tab:blue")
        ax.set_xticks(range(len(policies)), policies, rotation=30, fontsize=8)
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    settings = result["settings"]
    fig.suptitle(f"bench routing on {settings['deployment']}: {settings['requests']} requests at "
                 f"{settings['rate']:g} rps (median and range of {settings['repeats']} runs)")
    return report.save_figure(fig, path)
