"""`meshserve simulate`: a TE's own control plane (DP waiting queue and balancer, schedulers, KV cache managers, the
speculation controller, a decode TE's P/D pulls) on virtual time, with steps timed by a profile fitted on this
machine (`meshserve simulate calibrate`, from steps of the real engine) or by the op model of a hardware profile
(`--hardware`); `meshserve simulate seeds` compares the op model with the papers' decode results, `meshserve
simulate rank` the analyzer's ranking of parallel strategies with the simulator's, `meshserve simulate vidur` one
scenario with Vidur (entrypoints/simulate_vidur.py)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import sys
from pathlib import Path

from meshserve.entrypoints.simulate_calibrate import add_calibrate_command
from meshserve.entrypoints.simulate_vidur import add_vidur_command
from meshserve.router.routing import POLICIES
from meshserve.utils import report

DEFAULT_JSON = "bench-results/simulate.json"


def add_simulate_commands(sub) -> None:
    sim = sub.add_parser("simulate", help="a TE's control plane on virtual time, steps timed by a hardware profile")
    commands = sim.add_subparsers(dest="simulate_command", required=True)
    run = commands.add_parser("run", help="serve a trace on a simulated TE; TTFT, TPOT, tokens/s (JSON + PNG)")
    _add_run_arguments(run)
    run.add_argument("--tes", help="several TEs behind a job executor: counts of colocated (c), prefill (p) and "
                                   "decode (d) TEs, e.g. 1p+1d or 2c (default: one TE)")
    run.add_argument("--routing", default="load", choices=POLICIES, help="the job executor's routing policy")
    scaling = run.add_argument_group("autoscaling (with --tes)")
    scaling.add_argument("--autoscale", help="the pools the cluster manager's autoscaler sizes, ROLE=MIN:MAX by "
                                             "role letter, e.g. c=1:6 or p=1:4,d=1:4")
    scaling.add_argument("--autoscaler-settings", default="{}", help="the deployment file's `autoscaler:` mapping "
                                                                     "as JSON, e.g. '{\"interval_s\": 2}'")
    scaling.add_argument("--te-start-s", type=float, default=30.0, help="from a scale-up to the TE serving "
                                                                        "(default: 30)")
    scaling.add_argument("--prewarm-s", type=float, default=0.0, help="a pre-warmed pool: the replacement of the "
                                                                     "pre-warmed process a new TE took starts this "
                                                                     "long once the TE serves, busy on the host's "
                                                                     "cores (default: 0, no pool)")
    scaling.add_argument("--idle-before-s", type=float, default=0.0, help="the deployment idled this long before "
                                                                         "the trace starts: the autoscaler's window "
                                                                         "holds that idle time (default: 0)")
    run.add_argument("--own-cores", action="store_true", help="each TE on cores of its own: without the fitted "
                                                              "profile's term for TEs sharing this host's cores")
    run.add_argument("--sensitivity", type=float, metavar="PERCENT",
                     help="serve the trace again with every step PERCENT shorter and longer: how much each figure "
                          "moves per percent of step time (e.g. 5)")
    _add_op_model_and_te_arguments(run)
    run.set_defaults(func=run_main)
    seeds = commands.add_parser("seeds", help="the papers' decode results (CloudMatrix-Infer Table 5, xDeepServe "
                                              "section 7) beside the op model's simulation of them")
    seeds.add_argument("--groups", type=int, default=16, help="DP groups simulated per point, each standing for "
                                                              "dp/groups of them (default: 16)")
    seeds.add_argument("--points", help="comma-separated point names (default: every point)")
    seeds.add_argument("--json", default="bench-results/simulate-seeds.json", help="result file, a PNG beside it")
    seeds.set_defaults(func=seeds_main)
    rank = commands.add_parser("rank", help="the analyzer's ranking of parallel strategies (meshserve plan) against "
                                            "the simulator's, on one hardware profile at large world sizes")
    rank.add_argument("--hardware", default="ascend910c-cm384", help="a hardware profile with node and link figures "
                                                                     "(default: ascend910c-cm384)")
    rank.add_argument("--model-config", default="deepseek-r1", help="the model's shape: a preset name or a config.json")
    rank.add_argument("--worlds", default="32,64,128,256", help="world sizes, whole nodes of the profile "
                                                                "(default: 32,64,128,256)")
    rank.add_argument("--batch-per-device", type=int, default=16, help="requests per device, all at once (default: 16)")
    rank.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (default: 1024)")
    rank.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: 128)")
    rank.add_argument("--groups", type=int, default=4, help="DP groups simulated per strategy, each standing for "
                                                            "dp/groups of them (default: 4)")
    rank.add_argument("--no-weight-reads", action="store_true", help="the analyzer without the profile's HBM "
                                                                     "bandwidth: Eq. 4's FLOPs alone, as MixServe "
                                                                     "(default: a layer's weights read once a step)")
    rank.add_argument("--json", default="bench-results/simulate-rank.json", help="result file, a PNG beside it")
    rank.set_defaults(func=rank_main)
    compare = commands.add_parser("compare", help="the real engine and the simulation on one trace, side by side")
    compare.add_argument("--model", help="model directory (default: the default model, made on first use)")
    compare.add_argument("--parallel", default="attn=TP1+DP1 moe=TP1+EP1", help="the TE's layout (its DP degree "
                                                                                 "is the simulation's --dp)")
    _add_run_arguments(compare, requests=48, rate=2.0, output_len="16:64", profile_required=True)
    compare.set_defaults(func=compare_main)
    add_calibrate_command(commands)
    add_vidur_command(commands)


def _add_run_arguments(parser, requests: int = 200, rate: float = 4.0, output_len: str = "16:128",
                       profile_required: bool = False) -> None:
    parser.add_argument("--profile", required=profile_required,
                        help="the step-time profile fitted on this machine (JSON; `meshserve simulate calibrate`)")
    parser.add_argument("--dp", type=int, help="DP groups in lockstep (default: the profile's; with --hardware: the "
                                               "DP groups simulated, default every one)")
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
    parser.add_argument("--shared-prefixes", metavar="N:L", help="each Poisson prompt starts with one of N shared "
                                                                 "prefixes of L tokens (a system prompt, a document) "
                                                                 "before its --input-len tokens of its own")
    parser.add_argument("--max-model-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    parser.add_argument("--slo-ttft-ms", type=float, help="TTFT objective: the share of requests that meet it (and "
                                                          "--slo-tpot-ms) is reported")
    parser.add_argument("--slo-tpot-ms", type=float, help="TPOT objective")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"result file, a PNG beside it (default: {DEFAULT_JSON})")


def _add_op_model_and_te_arguments(parser) -> None:
    op = parser.add_argument_group("op model (instead of --profile)")
    op.add_argument("--hardware", help="a hardware profile of op-level figures: a name (ascend910c-cm384, h800) or "
                                       "a JSON file")
    op.add_argument("--model-config", default="deepseek-r1", help="the model's shape: a preset name or a config.json "
                                                                 "(default: deepseek-r1)")
    op.add_argument("--parallel", default="attn=DP1 moe=EP1", help="the TE's layout, meshserve's grammar "
                                                                  "(e.g. 'attn=DP480 moe=EP256 shared=EP32 disagg "
                                                                  "domains=3')")
    op.add_argument("--redundant", type=int, default=0, help="redundant routed-expert replicas (EPLB)")
    op.add_argument("--microbatches", type=int, default=1, choices=(1, 2))
    op.add_argument("--weights", default="int8", choices=("int8", "bf16"), help="weight format (default: int8)")
    op.add_argument("--expert-imbalance", type=float, default=1.0,
                    help="busiest expert device's tokens / the mean (default: 1, perfect EPLB)")
    op.add_argument("--expert-load", help="the imbalance meshserve's EPLB planner leaves with --redundant replicas "
                                          "on an expert load: zipf:H, a Zipf load whose hottest expert takes H x "
                                          "the mean (xDeepServe Fig. 11a: 30), or a file `meshserve eplb record` "
                                          "wrote; instead of --expert-imbalance")
    op.add_argument("--eplb-interval-s", type=float, help="live EPLB: each TE starts on the default placement, and "
                                                          "the served EPLB controller plans from the --expert-load "
                                                          "it records and moves its placement every this many "
                                                          "seconds (default: the planner's placement throughout)")
    op.add_argument("--eplb-rebalance-below", type=float,
                    help="live EPLB: a rebalance moves only while the placement balances the recorded load at most "
                         "this (the engine's eplb_rebalance_below; default: its default)")
    te = parser.add_argument_group("the simulated TEs")
    te.add_argument("--draft-tokens", type=int, default=0, help="MTP drafts per decode step (default: 0)")
    te.add_argument("--mtp-acceptance", type=float, default=0.0, help="the chance a draft is accepted")
    te.add_argument("--decode-only", action="store_true", help="a lone decode TE of P/D: prompts' KV is pulled")
    te.add_argument("--no-prefix-caching", action="store_true", help="hash no KV block (faster at scale)")
    te.add_argument("--kv-pool", action="store_true", help="the TEs share a memory pool of KV blocks (context "
                                                           "caching: the engine's pool connector, an op model's "
                                                           "KV link)")
    te.add_argument("--pool-latency-ms", type=float, default=2.0, help="the pool's round trip (the engine's "
                                                                      "pool_fetch_latency_ms; default: 2)")


def _scaler(args: argparse.Namespace):
    """The autoscaler of `--autoscale` (bounds per pool) and `--autoscaler-settings`."""
    from meshserve.cluster.autoscaler import Autoscaler, AutoscalerSettings
    from meshserve.sim.cluster import ROLE_LETTERS
    from meshserve.sim.scaling import SimScaler

    bounds = {}
    for part in args.autoscale.split(","):
        letter, _, span = part.strip().partition("=")
        low, _, high = span.partition(":")
        if letter not in ROLE_LETTERS or not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
            raise ValueError(f"--autoscale {args.autoscale!r}: each pool is ROLE=MIN:MAX with ROLE c, p or d and "
                             f"1 <= MIN <= MAX (scaling to zero is not simulated), e.g. p=1:4,d=1:4")
        bounds[f"group-0/{ROLE_LETTERS[letter]}"] = (int(low), int(high))
    try:
        mapping = json.loads(args.autoscaler_settings)
    except ValueError:
        raise ValueError(f"--autoscaler-settings is not JSON: {args.autoscaler_settings!r}") from None
    return SimScaler(Autoscaler(AutoscalerSettings.from_dict(mapping, "--autoscaler-settings"), bounds),
                     start_s=args.te_start_s, prewarm_s=args.prewarm_s)


def _range(text: str, flag: str, form: str = "LOW:HIGH") -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"{flag} must be {form}, got {text!r}") from None
    return low, high


def _inputs(args: argparse.Namespace, dp: int | None = None):
    """The step timer, the TE's settings and the trace the flags name (ValueError and the like: the user's to fix)."""
    from meshserve.sim.te import SimTESettings

    timer, groups = _step_timer(args)
    if dp is not None:  # (`compare`: a fitted profile)
        if timer.dp != dp:
            raise ValueError(f"--parallel has {dp} DP group(s): profile {args.profile} was fitted on a TE of "
                             f"{timer.dp} (calibrate one with this --parallel)")
        groups = dp
    settings = SimTESettings(dp=groups, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                             block_size=args.block_size, max_model_len=args.max_model_len,
                             num_draft_tokens=getattr(args, "draft_tokens", 0),
                             mtp_acceptance=getattr(args, "mtp_acceptance", 0.0),
                             kv_transfer="consumer" if getattr(args, "decode_only", False) else "none",
                             prefix_caching=not getattr(args, "no_prefix_caching", False),
                             live_eplb=_live_eplb(args), kv_pool_latency_s=_kv_pool_latency_s(args))
    if settings.live_eplb is not None:
        from meshserve.sim.live_eplb import check_layout

        check_layout(timer)
    if settings.kv_pool_latency_s is not None:
        from meshserve.sim.te import check_pool_timer

        check_pool_timer(timer)
    return timer, settings, trace_of(args, settings.max_model_len)


def trace_of(args: argparse.Namespace, max_model_len: int):
    """The trace of `--trace`, or of the Poisson flags; a request longer than `max_model_len` is refused."""
    from meshserve.sim.trace import TraceError, poisson, read_jsonl

    prefixes = _range(args.shared_prefixes, "--shared-prefixes", "N:L") if getattr(args, "shared_prefixes", None) \
        else None
    trace = read_jsonl(args.trace) if args.trace else poisson(
        args.rate, args.requests, _range(args.input_len, "--input-len"), _range(args.output_len, "--output-len"),
        args.seed, shared_prefixes=prefixes)
    too_long = [r for r in trace if r.prompt_len + r.output_len > max_model_len]
    if too_long:
        raise TraceError(f"a request of {too_long[0].prompt_len} + {too_long[0].output_len} tokens exceeds "
                         f"max_model_len {max_model_len}")
    return trace


def _step_timer(args: argparse.Namespace):
    """A fitted profile (`--profile`) and the --dp groups, or the op model of `--hardware` and the groups simulated."""
    from meshserve.sim.profile import StepProfile

    hardware = getattr(args, "hardware", None)
    if (args.profile is None) == (hardware is None):
        raise ValueError("give one of --profile (fitted on this machine) and --hardware (op-level figures)")
    if hardware is None:
        profile = StepProfile.load(args.profile)
        if args.dp is not None and args.dp >= 1 and args.dp != profile.dp:  # (< 1: the settings refuse it)
            raise ValueError(f"--dp {args.dp}: profile {args.profile} was fitted on a TE of {profile.dp} DP group(s) "
                             f"(calibrate one with that layout's --parallel)")
        return profile, profile.dp if args.dp is None else args.dp
    from meshserve.parallel.strategy import parse_strategy
    from meshserve.sim.dense_op_model import DENSE_MODEL_TYPES, DenseStepModel, dense_deployment_of
    from meshserve.sim.hardware import Hardware
    from meshserve.sim.op_model import MLAShape, OpStepModel, deployment_of, expert_imbalance, recorded_imbalance

    config = _model_config(args.model_config)
    if config.get("model_type") in DENSE_MODEL_TYPES:
        if args.redundant or args.microbatches != 1 or args.expert_load or args.expert_imbalance != 1.0:
            raise ValueError("a dense model has no experts and one micro-batch: drop --redundant, --microbatches, "
                             "--expert-load and --expert-imbalance")
        deployment = dense_deployment_of(parse_strategy(args.parallel), args.weights)
        return DenseStepModel(config, Hardware.load(hardware), deployment), 1
    shape = MLAShape.from_config(config)
    deployment = deployment_of(parse_strategy(args.parallel), shape.experts, redundant=args.redundant,
                               microbatches=args.microbatches, weight_format=args.weights,
                               expert_imbalance=args.expert_imbalance)
    if args.expert_load is not None:
        load = _expert_load(args, shape.experts)
        if args.eplb_interval_s is None:  # (live: the placement moves while serving)
            imbalance = (expert_imbalance(shape.experts, deployment.expert_dies, args.redundant, shape.top_k,
                                          hot_ratio=load) if isinstance(load, float) else
                         recorded_imbalance([load.layer_counts(layer) for layer in load.moe_layers],
                                            deployment.expert_dies, args.redundant))
            deployment = dataclasses.replace(deployment, expert_imbalance=imbalance)
    model = OpStepModel(config, Hardware.load(hardware), deployment)
    groups = deployment.dp if args.dp is None else args.dp
    if not 1 <= groups <= deployment.dp:
        raise ValueError(f"--dp {groups}: simulate 1 to {deployment.dp} of the layout's DP groups")
    return model, groups


def _kv_pool_latency_s(args: argparse.Namespace) -> float | None:
    """The pool's round trip with `--kv-pool` (None without)."""
    if not getattr(args, "kv_pool", False):
        return None
    if not args.pool_latency_ms >= 0:
        raise ValueError(f"--pool-latency-ms must be zero or more, got {args.pool_latency_ms:g}")
    return args.pool_latency_ms / 1e3


def _expert_load(args: argparse.Namespace, num_experts: int | None = None):
    """`--expert-load`: zipf:H gives the hot ratio H, a file the load it records (`meshserve eplb record`)."""
    kind, _, hot = args.expert_load.partition(":")
    if kind == "zipf":
        try:
            hot_ratio = float(hot)
        except ValueError:
            hot_ratio = 0.0
        if not hot_ratio > 1:
            raise ValueError(f"--expert-load zipf:H needs H > 1, got {args.expert_load!r}")
        return hot_ratio
    try:
        record = _read_load_record(args.expert_load)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--expert-load must be zipf:H or an expert-load file (meshserve eplb record): "
                         f"{args.expert_load}: {exc}") from None
    if num_experts is not None and record.num_logical != num_experts:
        raise ValueError(f"--expert-load {args.expert_load} records {record.num_logical} experts, the model has "
                         f"{num_experts}")
    return record


@functools.lru_cache(maxsize=4)
def _read_load_record(path: str):
    """A recorded expert load, read once (the step timer and live EPLB both take it)."""
    from meshserve.moe.load_record import ExpertLoadRecord

    return ExpertLoadRecord.load(path)


def _live_eplb(args: argparse.Namespace):
    """The live EPLB settings of `--eplb-interval-s` (None without it)."""
    from meshserve.sim.live_eplb import LiveEplbSettings

    interval = getattr(args, "eplb_interval_s", None)
    if interval is None:
        return None
    if getattr(args, "hardware", None) is None or args.expert_load is None:
        raise ValueError("--eplb-interval-s moves an op model's placement under an expert load: it needs "
                         "--hardware and --expert-load (zipf:H or a recorded load)")
    if not interval > 0:
        raise ValueError(f"--eplb-interval-s must be positive, got {interval:g}")
    below = {} if args.eplb_rebalance_below is None else {"rebalance_below": args.eplb_rebalance_below}
    if not 0 < below.get("rebalance_below", 1) <= 1:
        raise ValueError(f"--eplb-rebalance-below must be above 0 and at most 1, got {args.eplb_rebalance_below:g}")
    load = _expert_load(args)
    if isinstance(load, float):
        source = {"hot_ratio": load}
    else:  # the record's first MoE layer, slice after slice, stands for every layer
        source = {"recorded": tuple(tuple(counts) for counts in load.layer_counts(load.moe_layers[0])),
                  "recorded_slice_s": load.slice_seconds}
    return LiveEplbSettings(interval_s=interval, slice_s=min(10.0, interval), **source, **below)


def _model_config(name_or_path: str) -> dict:
    from meshserve.parallel.cluster_file import MODEL_PRESETS
    from meshserve.sim.dense_op_model import DENSE_PRESETS

    presets = {**MODEL_PRESETS, **DENSE_PRESETS}
    if name_or_path in presets:
        return dict(presets[name_or_path])
    try:
        config = json.loads(Path(name_or_path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model-config {name_or_path}: not a preset ({', '.join(presets)}) nor a readable "
                         f"config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model-config {name_or_path} is not a JSON object")
    return config


def _describe(args: argparse.Namespace, profile, settings) -> dict:
    described = profile.to_dict() if hasattr(profile, "to_dict") else {
        "name": profile.name, "hardware": args.hardware, "model": args.model_config, "parallel": args.parallel,
        "deployment": dataclasses.asdict(profile.deployment)}
    return {"profile": described, "te": dataclasses.asdict(settings),
            "trace": args.trace or f"poisson rate {args.rate:g}/s, {args.requests} requests, input {args.input_len}, "
                                   f"output {args.output_len}, seed {args.seed}"}


def _simulated_devices(timer, groups: int) -> float | None:
    """The devices one simulated TE stands for: its layout's devices over the share of its DP groups simulated (an
    op model's layout; a profile fitted on this machine counts none)."""
    deployment = getattr(timer, "deployment", None)
    if deployment is None:
        return None
    if hasattr(deployment, "devices"):  # a MoE layout: `groups` of its `dp` DP groups are simulated
        return deployment.devices * groups / deployment.dp
    return float(deployment.tp)  # one dense replica


def _per_device(result: dict, devices: float | None) -> dict:
    """Output tokens per second per device, over every simulated TE's held seconds (a scaled pool's TEs count
    while they are held)."""
    if devices is None:
        return {}
    device_seconds = devices * sum(te["seconds"] for te in result["tes"].values())
    return {"simulated_devices_per_te": devices,
            "output_tokens_per_s_per_device": result["output_tokens"] / device_seconds if device_seconds else 0.0}


def run_main(args: argparse.Namespace) -> int:
    from meshserve.sim.cluster import SimCluster, deployment_specs
    from meshserve.sim.run import simulate
    from meshserve.sim.sensitivity import ScaledSteps, sensitivity, sensitivity_lines
    from meshserve.sim.te import SimTE

    try:
        profile, settings, trace = _inputs(args)
        if args.tes is not None and getattr(args, "decode_only", False):
            raise ValueError("--decode-only simulates a lone decode TE; with --tes the roles come from --tes")
        specs = deployment_specs(args.tes, settings, profile) if args.tes is not None else None
        scaler = _scaler(args) if args.autoscale is not None else None
        if scaler is not None:
            pools = {f"{spec.group}/{spec.role}" for spec in specs or ()}
            unknown = sorted(set(scaler.autoscaler.bounds) - pools)
            if unknown:
                raise ValueError(f"--autoscale names pool(s) {', '.join(unknown)} that --tes does not have")
        if args.sensitivity is not None and not 0 < args.sensitivity < 100:
            raise ValueError(f"--sensitivity must be a percent between 0 and 100, got {args.sensitivity:g}")
    except (ValueError, OSError) as exc:  # ProfileError, TraceError and ConfigError are ValueErrors
        print(f"meshserve simulate: error: {exc}", file=sys.stderr)
        return 2
    slo = tuple(None if ms is None else ms / 1e3 for ms in (args.slo_ttft_ms, args.slo_tpot_ms))

    def serve(timer) -> dict:  # a fresh deployment (TEs, autoscaler) each time: they keep state
        if args.tes is None:
            return simulate(trace, SimTE(settings, timer, seed=args.seed), slo=slo)
        return SimCluster(deployment_specs(args.tes, settings, timer), policy=args.routing, seed=args.seed,
                          scaler=_scaler(args) if args.autoscale is not None else None,
                          share_cores=not args.own_cores).run(trace, slo=slo, idle_before_s=args.idle_before_s)
    result = serve(profile)
    result |= _per_device(result, _simulated_devices(profile, settings.dp))
    lines = summary_lines(result)
    if args.sensitivity is not None:
        result["sensitivity"] = sensitivity(lambda factor: serve(ScaledSteps(profile, factor)), result,
                                            args.sensitivity / 100)
        lines += sensitivity_lines(result["sensitivity"])
    result["config"] = _describe(args, profile, settings) | {"tes": args.tes, "routing": args.routing,
                                                             "autoscale": args.autoscale}
    report.publish(args.json, result, plot_simulation, lines)
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
            f"{result['virtual_s']:.1f} virtual s: {result['output_tokens_per_s']:.1f} tok/s" + (
                f", {result['output_tokens_per_s_per_device']:.1f} per device"
                if "output_tokens_per_s_per_device" in result else ""),
            f"TTFT ms p50 {ms(ttft, 'p50')} p90 {ms(ttft, 'p90')} p99 {ms(ttft, 'p99')}; "
            f"TPOT ms p50 {ms(tpot, 'p50')} p90 {ms(tpot, 'p90')} p99 {ms(tpot, 'p99')}",
            f"{result['steps']} steps (mean {result['mean_step_ms']:.1f} ms); {result['events']} events in "
            f"{result['wall_s']:.2f} s wall ({result['events_per_s']:.0f} events/s)"] + _breakdown_lines(result) + (
        [f"steps {result['shared_cores_slowdown_mean']:.2f}x longer on average on shared cores"]
        if "shared_cores_slowdown_mean" in result else []) + _live_eplb_lines(result) + (
        [f"SLO attainment {100 * result['slo_attainment']:.1f}%"] if result.get("slo_attainment") is not None else [])


def _live_eplb_lines(result: dict) -> list[str]:
    lines = []
    for name, te in result.get("tes", {}).items():
        if "eplb" in te:
            moves, timeline = te["eplb"]["reconfigurations"], te["eplb"]["imbalance"]
            lines.append(f"live EPLB on {name}: {moves} move(s) in {te['eplb']['rounds']} round(s); expert imbalance "
                         f"(busiest device / mean) {timeline[0][1]:.2f} at the start, {timeline[-1][1]:.2f} at the end")
    return lines


def _breakdown_lines(result: dict) -> list[str]:
    lines = []
    parts = result.get("step_breakdown_ms")
    if parts:
        lines.append("mean step by part (ms): " + ", ".join(f"{part} {ms:.2f}" for part, ms in parts.items()))
    if len(result.get("tes", {})) > 1:
        lines.append("routes: " + ", ".join(f"{kind} {n}" for kind, n in result["routes"].items()) + "; TE-seconds: "
                     + ", ".join(f"{pool} {seconds:.0f}" for pool, seconds in result["te_seconds"].items()))
    return lines


def plot_simulation(result: dict, path: Path) -> Path:
    scaling = result.get("scaling")
    fig, axes = report.new_figure(ncols=3 if scaling else 2)
    ttft_ax, tpot_ax = axes[0][:2]
    report.plot_cdf(ttft_ax, [1e3 * v for v in result["ttfts"]], "simulated", "TTFT (ms)")
    report.plot_cdf(tpot_ax, [1e3 * v for v in result["tpots"]], "simulated", "TPOT (ms)")
    ttft_ax.set_title(f"{result['completed']} requests, {result['output_tokens_per_s']:.0f} tok/s")
    tpot_ax.set_title(f"profile {result['config']['profile']['name']}")
    if scaling:  # the TEs each pool served with over time
        scale_ax = axes[0][2]
        for pool in sorted({pool for tick in scaling for pool in tick["serving"]}):
            scale_ax.step([tick["at_s"] for tick in scaling], [tick["serving"].get(pool, 0) for tick in scaling],
                          where="post", label=pool)
        scale_ax.set_xlabel("virtual time (s)")
        scale_ax.set_ylabel("TEs serving")
        scale_ax.legend()
    return report.save_figure(fig, path)


# ---------------------------------------------------------------- seeds
def seeds_main(args: argparse.Namespace) -> int:
    from meshserve.sim.hardware import HardwareError
    from meshserve.sim.seeds import SEED_POINTS, hardware_sources, run_point

    points = SEED_POINTS
    if args.points:
        wanted = args.points.split(",")
        unknown = sorted(set(wanted) - {p.name for p in SEED_POINTS})
        if unknown:
            print(f"meshserve simulate seeds: error: unknown point(s) {', '.join(unknown)} (points: "
                  f"{', '.join(p.name for p in SEED_POINTS)})", file=sys.stderr)
            return 2
        points = [p for p in SEED_POINTS if p.name in wanted]
    if args.groups < 1:
        print(f"meshserve simulate seeds: error: --groups must be at least 1, got {args.groups}", file=sys.stderr)
        return 2
    try:
        rows = []
        for point in points:
            print(f"[simulate seeds] {point.name}: {point.source}", file=sys.stderr, flush=True)
            rows.append(run_point(point, groups=args.groups))
        sources = {name: hardware_sources(name) for name in sorted({p.hardware for p in points})}
    except HardwareError as exc:
        print(f"meshserve simulate seeds: error: {exc}", file=sys.stderr)
        return 2
    result = {"rows": rows, "hardware_sources": sources, "groups": args.groups}
    report.publish(args.json, result, plot_seeds, seeds_lines(result))
    return 0


def seeds_lines(result: dict) -> list[str]:
    lines = [f"{'point':<15} {'dies':>5} {'batch':>5} {'TPOT ms paper':>13} {'simulated':>9} {'error':>7} "
             f"{'tok/s/die paper':>15} {'simulated':>9} {'error':>7}"]
    for row in result["rows"]:
        lines.append(f"{row['name']:<15} {row['devices']:>5} {row['batch_per_die']:>5} {row['paper_tpot_ms']:>13.1f} "
                     f"{row['tpot_ms']:>9.1f} {100 * row['tpot_error']:>+6.0f}% "
                     f"{row['paper_tokens_per_s_per_die']:>15.0f} {row['tokens_per_s_per_die']:>9.0f} "
                     f"{100 * row['throughput_error']:>+6.0f}%")
    return lines


def plot_seeds(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2)
    tpot_ax, rate_ax = axes[0]
    names = [row["name"] for row in result["rows"]]
    x = range(len(names))
    for ax, paper, simulated, label in ((tpot_ax, "paper_tpot_ms", "tpot_ms", "TPOT (ms)"),
                                        (rate_ax, "paper_tokens_per_s_per_die", "tokens_per_s_per_die",
                                         "output tokens/s per die")):
        ax.bar([i - 0.2 for i in x], [row[paper] for row in result["rows"]], width=0.4, label="paper")
        ax.bar([i + 0.2 for i in x], [row[simulated] for row in result["rows"]], width=0.4, label="simulated")
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend()
    tpot_ax.set_title("op model vs the papers' decode results")
    return report.save_figure(fig, path)


# ---------------------------------------------------------------- rank
def rank_main(args: argparse.Namespace) -> int:
    from meshserve.parallel.analyzer import AnalyzerError
    from meshserve.sim.hardware import Hardware, HardwareError
    from meshserve.sim.ranking import RankingWorkload, rank_world, world_sizes

    # hundreds of simulations: each one's line about its garbage-collection schedule would drown the progress lines
    logging.getLogger("meshserve.utils.gc_pauses").setLevel(logging.WARNING)
    try:
        worlds = world_sizes(args.worlds)
        workload = RankingWorkload(args.batch_per_device, args.input_len, args.output_len)
        if args.groups < 1:
            raise ValueError(f"--groups must be at least 1, got {args.groups}")
        config, hardware = _model_config(args.model_config), Hardware.load(args.hardware)
        for world in worlds:
            hardware.check_devices(world)  # every world refused before the first one runs
        results = [rank_world(config, hardware, world, workload, args.groups, weight_reads=not args.no_weight_reads,
                              progress=functools.partial(_rank_progress, world)) for world in worlds]
    except (ValueError, HardwareError, AnalyzerError) as exc:
        print(f"meshserve simulate rank: error: {exc}", file=sys.stderr)
        return 2
    result = {"hardware": hardware.name, "model": args.model_config, "workload": dataclasses.asdict(workload),
              "groups": args.groups, "weight_reads": not args.no_weight_reads, "worlds": results}
    report.publish(args.json, result, plot_ranking, rank_lines(result))
    return 0


def _rank_progress(world: int, index: int, total: int, estimate) -> None:
    if index % 16 == 0:
        print(f"[simulate rank] world {world}: strategy {index + 1}/{total} ({estimate.strategy})", file=sys.stderr,
              flush=True)


def rank_lines(result: dict) -> list[str]:
    lines = [f"{'world':>5} {'strategies':>10} {'Spearman':>8} {'top-5 shared':>12} {'pick / best':>11}  "
             f"analyzer's pick -> simulator's best"]
    for world in result["worlds"]:
        rho = world["spearman_rho"]
        lines.append(f"{world['world']:>5} {world['strategies']:>10} {'n/a' if rho is None else f'{rho:.2f}':>8} "
                     f"{world['top5_overlap']:>12} {world['pick_vs_best']:>11.2f}  {world['analyzer_pick']} -> "
                     f"{world['simulated_best']}")
    return lines


def plot_ranking(result: dict, path: Path) -> Path:
    worlds = result["worlds"]
    fig, axes = report.new_figure(ncols=len(worlds), width_per_panel=4.0)
    for ax, world in zip(axes[0], worlds):
        rows = world["rows"]
        ax.scatter([r["analyzer_tokens_per_s_per_device"] for r in rows], [r["tokens_per_s_per_device"] for r in rows],
                   s=10)
        pick = rows[0]
        ax.scatter([pick["analyzer_tokens_per_s_per_device"]], [pick["tokens_per_s_per_device"]], s=40, marker="x",
                   color="red", label="analyzer's pick")
        ax.set_xlabel("analyzer tokens/s per device")
        ax.set_ylabel("simulated tokens/s per device")
        rho = world["spearman_rho"]
        ax.set_title(f"world {world['world']}: Spearman {'n/a' if rho is None else f'{rho:.2f}'}", fontsize=9)
        ax.legend(fontsize=7)
    return report.save_figure(fig, path)
