"""`meshserve` command line: serve, make-model, profile, bench."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing

from meshserve.config import ConfigError, EngineConfig
from meshserve.engine.core_client import EngineStartupError
from meshserve.utils import cluster_auth

_ENGINE_ARG_SKIP = {"model", "startup_timeout_s"}
_GIVEN_ENGINE_FLAGS = "_given_engine_flags"  # the namespace attribute naming the engine flags on the command line


def _note_given(namespace: argparse.Namespace, dest: str) -> None:
    given = getattr(namespace, _GIVEN_ENGINE_FLAGS, set())
    given.add(dest)
    setattr(namespace, _GIVEN_ENGINE_FLAGS, given)


class _StoreGiven(argparse.Action):
    """Store the value and remember the flag was given: a flag equal to its default still overrides a file."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        _note_given(namespace, self.dest)


class _BooleanGiven(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per EngineConfig field, typed from the dataclass."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _ENGINE_ARG_SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        if base is bool:
            group.add_argument(flag, dest=f.name, action=_BooleanGiven, default=f.default)
        else:
            group.add_argument(flag, dest=f.name, action=_StoreGiven, type=base, default=f.default,
                               help=f"default: {f.default}")


def add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallel layout")
    group.add_argument("--deployment", default=None,
                       help="deployment YAML (one TE: model, parallel strategy, engine settings, as `meshserve "
                            "plan --out` writes; or several TEs under te_groups) or a preset (colocated, "
                            "colocatedN, MpNd such as 1p1d, joined by +); flags given explicitly override it")
    for name, what in (("tp", "attention tensor-parallel degree"), ("dp", "attention data-parallel degree"),
                       ("ep", "expert-parallel degree (MoE TP fills the rest of the world)")):
        group.add_argument(f"--{name}", type=int, default=None,
                           help=f"{what}; shorthand for --parallel 'attn=TP<tp>+DP<dp> moe=TP<tp*dp/ep>+EP<ep>'")


def _explicit_engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields whose flag was given on the command line (whatever its value)."""
    given = getattr(args, _GIVEN_ENGINE_FLAGS, set())
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if f.name in given and f.name not in _ENGINE_ARG_SKIP}


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """Defaults, then the deployment file (if any), then the flags given explicitly."""
    from meshserve.parallel.strategy import ParallelStrategy, StrategyError

    kwargs = dict(getattr(args, "deployment_engine", None) or {})
    kwargs.update(_explicit_engine_kwargs(args))
    degrees = {name: getattr(args, name, None) for name in ("tp", "dp", "ep")}
    if any(value is not None for value in degrees.values()):
        if "parallel" in _explicit_engine_kwargs(args):
            raise ConfigError("give either --parallel or --tp/--dp/--ep, not both")
        try:
            strategy = ParallelStrategy.from_degrees(**{k: v if v is not None else 1 for k, v in degrees.items()})
        except StrategyError as exc:
            raise ConfigError(str(exc)) from None
        kwargs["parallel"] = str(strategy)
    return EngineConfig.from_kwargs(model, **kwargs)


def resolve_deployment(args: argparse.Namespace) -> None:
    """Read --deployment (if given) into args: its model unless --model is given, and its engine settings."""
    path = getattr(args, "deployment", None)
    if not path:
        return
    from meshserve.config import Deployment

    deployment = Deployment.load(path)
    args.deployment_engine = deployment.engine
    if getattr(args, "model", None) is None and deployment.model is not None:
        args.model = deployment.model


def _serve(args: argparse.Namespace) -> int:
    from meshserve.entrypoints.serve import serve

    return serve(args)


def _worker(args: argparse.Namespace) -> int:
    """One rank of a TE whose master runs on another host (torch's MASTER_ADDR / RANK as defaults)."""
    import os

    from meshserve.config import DEFAULT_ENGINE_PORT
    from meshserve.worker.worker import WorkerJoinError, join_engine

    engine = args.engine or os.environ.get("MASTER_ADDR")
    if not engine:
        raise ConfigError("give the master's address: --engine tcp://HOST:PORT (or set MASTER_ADDR)")
    if "://" not in engine:
        engine = f"tcp://{engine}"
    if not engine.startswith("tcp://"):
        raise ConfigError(f"--engine must be a tcp://HOST:PORT address, got {engine!r}")
    if ":" not in engine.removeprefix("tcp://").rsplit("]", 1)[-1]:
        engine = f"{engine}:{DEFAULT_ENGINE_PORT}"
    rank = args.rank
    if rank is None:
        if not os.environ.get("RANK", "").strip().isdigit():
            raise ConfigError("give this worker's rank: --rank R (or set RANK)")
        rank = int(os.environ["RANK"])
    try:
        join_engine(engine, rank, args.timeout, getattr(logging, args.log_level.upper()))
    except WorkerJoinError as exc:
        print(f"meshserve: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from meshserve.models.factory import make_model_main

    return make_model_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description="Serve Mixture-of-Experts language models.")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--cluster-secret-file", dest="cluster_secret_file", default=None, metavar="PATH",
                        help="the cluster secret every internal TCP socket authenticates with (default: "
                             "$MESHSERVE_CLUSTER_SECRET, else $MESHSERVE_CLUSTER_SECRET_FILE, else "
                             "~/.cache/meshserve/cluster_secret, created on first use); started processes inherit it")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", default=None,
                       help="HF-format model directory (default: the tiny deepseek_v3 model, created on first use)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; beyond loopback an API key is required (see --api-key)")
    serve.add_argument("--port", type=int, default=8000)
    from meshserve.entrypoints.openai.server_options import add_server_arguments

    add_server_arguments(serve)
    add_deployment_arguments(serve)
    serve.add_argument("--routing", default=None,
                       help="with a multi-TE deployment: the job executor's routing policy (round_robin, load, "
                            "locality, pd_aware, combined; default: the deployment's)")
    serve.add_argument("--register-port", type=int, default=0,
                       help="with a multi-TE deployment: where TEs register with the job executor (0: a free port)")
    serve.add_argument("--also-register", action="append", default=[],
                       help="with a multi-TE deployment: another job executor's registration address its TEs also "
                            "register with (repeatable)")
    add_engine_arguments(serve)
    serve.set_defaults(func=_serve)

    from meshserve.entrypoints.te_server import add_te_parser

    add_te_parser(sub)

    worker = sub.add_parser("worker", help="run one worker (rank) of an engine whose master is on another host")
    worker.add_argument("--engine", default=None,
                          help="the master's tcp://HOST:PORT for remote ranks (its --master-addr and --engine-port; "
                               "default: MASTER_ADDR and the default engine port)")
    worker.add_argument("--rank", type=int, default=None, help="this worker's rank (default: RANK)")
    worker.add_argument("--timeout", type=float, default=300.0,
                          help="seconds to wait for the master to answer (it may start later)")
    worker.set_defaults(func=_worker)

    make = sub.add_parser("make-model", help="write a random, deterministic HF-format checkpoint")
    from meshserve.models.factory import add_make_model_arguments

    add_make_model_arguments(make)
    make.set_defaults(func=_make_model)

    plan = sub.add_parser("plan", help="rank parallel strategies for a model on a cluster (MixServe cost model)")
    from meshserve.entrypoints.plan import add_plan_arguments, plan_main

    add_plan_arguments(plan)
    plan.set_defaults(func=plan_main)

    from meshserve.entrypoints.eplb import add_eplb_commands

    add_eplb_commands(sub)

    from meshserve.entrypoints.pool import add_pool_commands

    add_pool_commands(sub)

    from meshserve.entrypoints.predictor import add_predictor_parser

    add_predictor_parser(sub)

    from meshserve.entrypoints.profile_pd import add_profile_commands

    add_profile_commands(sub)

    bench = sub.add_parser("bench", help="benchmarks (offline throughput, online serving)")
    from meshserve.bench.cli import register_bench_commands

    register_bench_commands(bench.add_subparsers(dest="bench_command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.cluster_secret_file:
            cluster_auth.use_secret_file(args.cluster_secret_file)
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError, ValueError, EngineStartupError) as exc:
        print(f"meshserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
