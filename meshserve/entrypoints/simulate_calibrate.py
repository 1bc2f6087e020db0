"""`meshserve simulate calibrate`: fit this machine's step-time profile from the real engine
(meshserve/sim/calibrate.py), or extend one with what TEs sharing this host's cores cost each other (`--shared-tes`)
and what a scale-up costs the serving TEs (`--scale-up`)."""
from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path


def add_calibrate_command(commands) -> None:
    calibrate = commands.add_parser("calibrate", help="fit this machine's step-time profile from real engine steps")
    calibrate.add_argument("--model", help="model directory (default: the default model, made on first use)")
    calibrate.add_argument("--parallel", default="attn=TP1+DP1 moe=TP1+EP1", help="the TE's layout")
    calibrate.add_argument("--out", required=True, help="the profile file to write")
    calibrate.add_argument("--repeats", type=int, default=3, help="runs of each workload; medians (default: 3)")
    calibrate.add_argument("--url", help="measure a running server instead (`meshserve serve`, any deployment), "
                                         "through its HTTP API as `meshserve bench serve` loads it")
    calibrate.add_argument("--pd", action="store_true", help="with --url: the deployment hands prompts to other TEs "
                                                             "(P/D) on this host: no mixed workloads, and how much "
                                                             "each TE's steps stretch while the other works")
    calibrate.add_argument("--shared-tes", type=int, help="with --url and --alone: the deployment runs this many TEs "
                                                          "on this host's cores; measure how much a TE's step "
                                                          "stretches beside the others and write --alone with it")
    calibrate.add_argument("--alone", help="with --shared-tes: the profile of one TE alone on this host (calibrated "
                                           "first, through the same kind of server); with --scale-up: the profile "
                                           "calibrated with --shared-tes")
    calibrate.add_argument("--scale-up", metavar="POOL", help="with --url and --alone: the deployment runs under a "
                                                              "cluster manager (--name); add a TE to POOL (GROUP/ROLE)"
                                                              " while a batch decodes, and measure what its start "
                                                              "costs the serving TEs")
    calibrate.add_argument("--name", default="default", help="with --scale-up: the managed deployment's name "
                                                             "(default: default)")
    calibrate.set_defaults(func=calibrate_main)


def calibrate_main(args: argparse.Namespace) -> int:
    from meshserve.bench.deployment_load import check_model_dir
    from meshserve.parallel.strategy import StrategyError, parse_strategy
    from meshserve.sim.calibrate import (
        EngineStreamer,
        HTTPStreamer,
        calibrate,
        calibrate_scale_up,
        calibrate_shared,
    )

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the rounds' lines
    try:
        strategy = parse_strategy(args.parallel)
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
        if args.pd and args.url is None:
            raise ValueError("--pd describes the deployment behind --url")
        alone = _shared_tes_inputs(args)
        if args.url is not None:
            streamer = HTTPStreamer(args.url, _served_model(args.url), "P/D deployment" if args.pd else "deployment")
        else:
            streamer = EngineStreamer(check_model_dir(args.model), args.parallel)
    except (StrategyError, ValueError, OSError) as exc:
        print(f"meshserve simulate calibrate: error: {exc}", file=sys.stderr)
        return 2
    if alone is not None and args.scale_up is not None:
        from meshserve.entrypoints.cluster import default_state_dir, query_manager

        ask = functools.partial(query_manager, default_state_dir(args.name))
        try:
            profile = calibrate_scale_up(streamer, alone, ask, args.scale_up, args.repeats)
        except (ValueError, RuntimeError) as exc:  # ConfigError: no manager answers
            print(f"meshserve simulate calibrate: error: {exc}", file=sys.stderr)
            return 1
    elif alone is not None:
        profile = calibrate_shared(streamer, alone, args.shared_tes, args.repeats)
    else:
        profile = calibrate(streamer, strategy.attn_dp, args.repeats, mixed=not args.pd, pd=args.pd)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    print(json.dumps(profile.to_dict(), indent=2))
    print(f"wrote {args.out}")
    return 0


def _shared_tes_inputs(args: argparse.Namespace):
    """The profile of a TE alone that `--shared-tes` extends (None without it); ValueError on a bad combination."""
    from meshserve.sim.profile import StepProfile

    if args.scale_up is not None:
        if args.url is None or args.alone is None or args.pd or args.shared_tes is not None:
            raise ValueError("--scale-up measures a running managed deployment: give --url and --alone (a profile "
                             "calibrated with --shared-tes), not --pd or --shared-tes")
        alone = StepProfile.load(args.alone)
        if not alone.stretch_beside_tes:
            raise ValueError(f"--scale-up weighs a start against a stepping TE: {args.alone} has no "
                             f"stretch_beside_tes (calibrate it with --shared-tes first)")
        return alone
    if args.shared_tes is None:
        if args.alone is not None:
            raise ValueError("--alone goes with --shared-tes or --scale-up")
        return None
    if args.shared_tes < 2:
        raise ValueError(f"--shared-tes counts the TEs sharing the host: at least 2, got {args.shared_tes}")
    if args.url is None or args.alone is None or args.pd:
        raise ValueError("--shared-tes measures a running colocated deployment: give --url and --alone, not --pd")
    return StepProfile.load(args.alone)


def _served_model(url: str) -> str:
    """The first model a server lists (OSError when it cannot be asked)."""
    import httpx

    try:
        models = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise OSError(f"cannot list the models of {url}: {type(exc).__name__}: {exc}") from None
    if not models:
        raise OSError(f"{url} serves no model")
    return models[0]["id"]
