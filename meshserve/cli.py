"""`meshserve` command line: serve, make-model, bench."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing

from meshserve.config import ConfigError, EngineConfig
from meshserve.engine.core_client import EngineStartupError

_ENGINE_ARG_SKIP = {"model", "startup_timeout_s"}


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
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            group.add_argument(flag, dest=f.name, type=base, default=f.default, help=f"default: {f.default}")


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name not in _ENGINE_ARG_SKIP and hasattr(args, f.name)}
    return EngineConfig.from_kwargs(model, **kwargs)


def _serve(args: argparse.Namespace) -> int:
    from meshserve.platform.serve import serve

    return serve(args)


def _make_model(args: argparse.Namespace) -> int:
    from meshserve.models.factory import make_model_main

    return make_model_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description="Serve Mixture-of-Experts language models.")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", default=None,
                       help="HF-format model directory (default: the tiny deepseek_v3 model, created on first use)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    add_engine_arguments(serve)
    serve.set_defaults(func=_serve)

    make = sub.add_parser("make-model", help="write a random, deterministic HF-format checkpoint")
    from meshserve.models.factory import add_make_model_arguments

    add_make_model_arguments(make)
    make.set_defaults(func=_make_model)

    plan = sub.add_parser("plan", help="rank parallel strategies for a model on a cluster (MixServe cost model)")
    from meshserve.parallel.plan_cli import add_plan_arguments, plan_main

    add_plan_arguments(plan)
    plan.set_defaults(func=plan_main)

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
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError, ValueError, EngineStartupError) as exc:
        print(f"meshserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
