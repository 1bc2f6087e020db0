"""`meshserve plan`: rank every parallel strategy for a model on a cluster and write a deployment file.

`meshserve plan calibrate` measures this machine into a cluster file (meshserve/bench/calibrate.py).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import yaml

from meshserve.parallel.analyzer import (
    MOE_COMM_MODES,
    AnalyzerError,
    StrategyEstimate,
    Workload,
    analyze,
    model_spec_from_config,
    to_deployment,
)
from meshserve.parallel.cluster_file import CLUSTER_PRESETS, GB, MODEL_PRESETS, PlanError, load_cluster_file
from meshserve.parallel.disagg import compare, parse_disagg
from meshserve.parallel.strategy import StrategyError


class _OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad argument as one line (no usage block) and exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        # A sub-command's leftovers would otherwise reach the parent parser's multi-line error.
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    # The model and cluster are required for planning but not for `calibrate`: plan_main checks them.
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--config", help="HF config.json of the model (deepseek_v3 / kimi_k2 / qwen3_moe)")
    model.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), help="built-in model config")
    cluster = parser.add_mutually_exclusive_group()
    cluster.add_argument("--cluster", help="cluster YAML file")
    cluster.add_argument("--preset-cluster", choices=sorted(CLUSTER_PRESETS), help="built-in cluster")
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests b (default 16)")
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens L_in")
    parser.add_argument("--output-len", type=int, default=256, help="generated tokens L_out")
    parser.add_argument("--rate", type=float, default=4.0, help="request arrival rate, requests/s")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-itl-ms", type=float, default=None)
    parser.add_argument("--model-dir", default=None,
                        help="model directory recorded in the deployment file (default: none; serve's default model)")
    parser.add_argument("--moe-comm", choices=MOE_COMM_MODES, default="fused",
                        help="hybrid TP-EP collectives recorded in the deployment file (default: fused)")
    parser.add_argument("--int8-dispatch", action="store_true", help="record INT8 EP dispatch in the deployment file")
    parser.add_argument("--out", default=None, help="write the best strategy's deployment YAML here")
    parser.add_argument("--top", type=int, default=0, help="print only the best N rows (default: all)")
    parser.add_argument("--disagg", metavar="LAYOUT", default=None,
                        help="price one attention-expert disaggregated layout instead, e.g. 'attn=DP480 moe=EP256 "
                             "shared=EP32 disagg domains=3', beside colocated DP=EP on as many devices")
    commands = parser.add_subparsers(dest="plan_command", metavar="{calibrate}", parser_class=_OneLineErrorParser)
    calibrate = commands.add_parser("calibrate", help="measure this machine into a cluster YAML for --cluster",
                                    description="Measure collective latency/bandwidth, matmul rate and memory "
                                                "on a local world of ranks and write a cluster YAML.")
    add_calibrate_arguments(calibrate)
    calibrate.set_defaults(func=_calibrate_main)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else ("inf" if math.isinf(seconds) else f"{seconds * 1e3:.2f}")


def format_table(estimates: list[StrategyEstimate]) -> str:
    header = ("rank", "strategy", "fits", "mem GB", "TTFT ms", "ITL ms", "tokens/s", "meets SLO", "comm")
    rows = [header]
    for i, e in enumerate(estimates, 1):
        rows.append((str(i), str(e.strategy), "yes" if e.fits_memory else "no",
                     f"{e.memory_per_rank_bytes / GB:.1f}", _ms(e.ttft_s), _ms(e.itl_s),
                     f"{e.throughput_tok_s:.0f}" if e.fits_memory else "-",
                     ("yes" if e.meets_slo else "no") if e.fits_memory else "-", e.comm_model))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _load_model_config(args: argparse.Namespace) -> tuple[dict, str]:
    if args.model_preset:
        return MODEL_PRESETS[args.model_preset], args.model_preset
    try:
        with open(args.config, encoding="utf-8") as f:
            return json.load(f), args.config
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read model config {args.config}: {e}") from e


def run_plan(args: argparse.Namespace, out=None) -> dict:
    """Analyze, print the ranked table, write the deployment file; returns the deployment dict."""
    out = out or sys.stdout
    if not (args.config or args.model_preset):
        raise PlanError("one of --config or --model-preset is required")
    if not (args.cluster or args.preset_cluster):
        raise PlanError("one of --cluster or --preset-cluster is required")
    config, model_name = _load_model_config(args)
    model = model_spec_from_config(config, name=model_name)
    cluster = CLUSTER_PRESETS[args.preset_cluster] if args.preset_cluster else load_cluster_file(args.cluster)
    workload = Workload(batch=args.batch, input_len=args.input_len, output_len=args.output_len,
                        arrival_rate=args.rate,
                        slo_ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
                        slo_itl_s=None if args.slo_itl_ms is None else args.slo_itl_ms / 1e3)
    if args.disagg:
        return _plan_disagg(args.disagg, config, model, cluster, workload, out)
    estimates = analyze(model, cluster, workload, include_unfit=True)
    best = estimates[0]
    if not best.fits_memory:
        raise PlanError(f"no strategy fits {model.name} on {cluster.name}: the smallest per-rank footprint is "
                        f"{min(e.memory_per_rank_bytes for e in estimates) / GB:.1f} GB of "
                        f"{cluster.device_memory_bytes / GB:.1f} GB")
    print(f"model {model.name}: {model.total_params / 1e9:.1f}B params ({model.active_params / 1e9:.1f}B active), "
          f"cluster {cluster.name}: {cluster.nodes}x{cluster.devices_per_node} devices, "
          f"batch {workload.batch}, in {workload.input_len}, out {workload.output_len}, "
          f"rate {workload.arrival_rate:g} req/s", file=out)
    shown = estimates[:args.top] if args.top > 0 else estimates
    print(format_table(shown), file=out)
    deployment = to_deployment(best.strategy, args.model_dir, best, cluster=cluster, moe_comm=args.moe_comm,
                               int8_dispatch=args.int8_dispatch)
    deployment["estimate"].update({"model": model.name, "cluster": cluster.name})
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                yaml.safe_dump(deployment, f, sort_keys=False)
        except OSError as e:
            raise PlanError(f"cannot write {args.out}: {e}") from e
        print(f"chosen: {best.strategy} -> {args.out}", file=out)
    else:
        print(f"chosen: {best.strategy}", file=out)
    return deployment


def _plan_disagg(text: str, config: dict, model, cluster, workload: Workload, out) -> dict:
    """Price one disaggregated layout beside colocated DP=EP on as many devices; print both."""
    layout = parse_disagg(text)
    num_experts = config.get("n_routed_experts") or config.get("num_experts") or model.num_experts
    layout.check_model(num_experts, config.get("moe_intermediate_size") or config.get("intermediate_size", 1))
    result = compare(model, layout, cluster, workload)
    dis, colocated = result["disaggregated"], result["colocated"]
    print(f"model {model.name}, cluster {cluster.name}, batch {workload.batch} (decode)", file=out)
    print(f"{layout}: {layout.devices} devices; per layer attention {dis.attention_ms:.3f} ms, A2E/E2A "
          f"{dis.transfer_ms:.3f} ms each, experts {dis.expert_ms:.3f} ms per domain -> {dis.layer_ms:.3f} ms "
          f"({'the expert ranks set the pace' if dis.experts_bound else 'one domain sets the pace'})", file=out)
    print(f"  ITL {dis.itl_ms:.2f} ms, {dis.tokens_per_s_per_device:.0f} tokens/s per device, memory "
          f"{dis.attention_memory_bytes / GB:.1f} GB per attention rank, {dis.expert_memory_bytes / GB:.1f} GB "
          f"per expert rank{'' if dis.fits_memory else ' (does not fit)'}", file=out)
    if colocated.fits_memory:
        print(f"colocated {colocated.strategy}: ITL {colocated.itl_s * 1e3:.2f} ms, "
              f"{result['colocated_tokens_per_s_per_device']:.0f} tokens/s per device; disaggregated/colocated "
              f"{result['ratio']:.2f}x", file=out)
    else:
        print(f"colocated {colocated.strategy}: does not fit in {cluster.device_memory_bytes / GB:.0f} GB per "
              "device", file=out)
    return {"layout": str(layout), "tokens_per_s_per_device": dis.tokens_per_s_per_device, "ratio": result["ratio"]}


def plan_main(args: argparse.Namespace) -> int:
    try:
        run_plan(args)
    except (PlanError, AnalyzerError, StrategyError) as e:
        print(f"meshserve plan: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve plan", description=__doc__)
    add_plan_arguments(parser)
    parser.set_defaults(func=plan_main)
    args = parser.parse_args(argv)
    return args.func(args)


def add_calibrate_arguments(parser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="nodes the local ranks are grouped into (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--sizes", nargs="+", metavar="SIZE", default=None,
                        help="message sizes of the bandwidth fit, bytes with optional K/M suffix "
                             "(default: 256K 1M 4M)")
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per measurement; the median counts")
    parser.add_argument("--matmul-shapes", nargs="+", metavar="MxKxN", default=None,
                        help="matmul shapes, tokens x in x out features (default: 32x4096x1536 512x4096x1536)")
    parser.add_argument("--out", required=True, help="cluster YAML to write; the plot goes beside it as .png")


def _calibrate_main(args) -> int:
    from meshserve.bench.calibrate import calibrate_main  # torch is imported only when calibrating

    return calibrate_main(args)


if __name__ == "__main__":  # last: the functions above must exist first
    sys.exit(main())
