"""`meshserve te`: one task executor (TE) of a deployment, in the foreground.

This process is the TE's master (scheduler, KV bookkeeping); it starts the TE's worker ranks. It listens
for job executors on `--listen`, sends each request's tokens straight to the frontend that sent it, and
heartbeats its registration and load to every `--register` address (the JEs). A deployment started by
`meshserve serve --deployment` runs each TE this way; on other hosts start one by hand and point it at
the JE: `meshserve te --role decode --register tcp://JE_HOST:PORT --listen tcp://0.0.0.0:7701 ...`.
"""
from __future__ import annotations

import argparse
import logging
import socket

from meshserve.config import ConfigError
from meshserve.config.arguments import add_engine_arguments
from meshserve.core.te_process import ROLES, run_te
from meshserve.entrypoints.engine_args import add_deployment_arguments, engine_config_from_args, resolve_deployment
from meshserve.entrypoints.serve import resolve_model


def add_te_parser(subparsers) -> None:
    te = subparsers.add_parser("te", help="run one task executor of a deployment (registers with job executors)")
    te.add_argument("--model", default=None, help="HF-format model directory (default: the built-in default model)")
    te.add_argument("--role", choices=ROLES, default="colocated")
    te.add_argument("--group", default=None, help="TE group; a prefill and a decode TE pair within a group "
                                                  "(default: the role)")
    te.add_argument("--listen", default="tcp://127.0.0.1:0",
                    help="where job executors reach this TE (port 0: a free one)")
    te.add_argument("--register", action="append", default=[],
                    help="a job executor's registration address (repeat for several JEs)")
    add_deployment_arguments(te)
    add_engine_arguments(te)
    te.set_defaults(func=te_main)


def te_main(args: argparse.Namespace) -> int:
    resolve_deployment(args)
    model = resolve_model(args.model)
    if not args.listen.startswith("tcp://"):
        raise ConfigError(f"--listen must be a tcp://HOST:PORT address, got {args.listen!r}")
    config = engine_config_from_args(args, model)
    if config.te_name == "te":
        config = config.replace(te_name=f"{args.role}-{socket.gethostname()}")
    run_te(config.to_dict(), args.role, args.group or args.role, args.listen, args.register,
           getattr(logging, args.log_level.upper()))
    return 0
