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
import signal
import socket
import tempfile
import traceback

from meshserve.config import ConfigError, EngineConfig
from meshserve.config.arguments import add_engine_arguments
from meshserve.entrypoints.engine_args import add_deployment_arguments, engine_config_from_args, resolve_deployment
from meshserve.entrypoints.serve import resolve_model

ROLES = ("colocated", "prefill", "decode")
KV_TRANSFER_OF_ROLE = {"colocated": "none", "prefill": "producer", "decode": "consumer"}


def run_te(config: dict, role: str, group: str, listen: str, register: list[str],
           log_level: int = logging.INFO, watch_parent: bool = False) -> None:
    """Run a TE until SIGTERM/SIGINT or a Shutdown message (the master's loop)."""
    # start-up: zmq and the master only when a TE runs
    import zmq

    from meshserve.core.client_links import RouterLinks
    from meshserve.core.master import EngineCore

    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    engine_config = _te_config(EngineConfig.from_dict(config), role, listen)
    logging.basicConfig(level=log_level, format=f"%(asctime)s te[{engine_config.te_name}] %(levelname)s "
                                                f"%(message)s", force=True)
    _warn_refusing_job_executors(register)
    ctx = zmq.Context()
    link = RouterLinks(ctx, listen, register, advertise_host=engine_config.parallel_config.master_addr)
    ipc_dir = tempfile.mkdtemp(prefix="meshserve-te-")
    core = None

    def stop(signum, frame):
        if core is not None:
            core.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        core = EngineCore(engine_config, ctx, link, ipc_dir, log_level, role=role, group=group,
                          watch_parent=watch_parent)
    except Exception as exc:
        logging.getLogger(__name__).error("TE start-up failed: %s", traceback.format_exc())
        link.close()
        raise SystemExit(1) from exc
    logging.getLogger(__name__).info("TE %s (%s, group %s) listening on %s, registering with %s",
                                     engine_config.te_name, role, group, link.listen_addr, ", ".join(register) or
                                     "no job executor")
    core.run()


def _te_config(config: EngineConfig, role: str, listen: str) -> EngineConfig:
    """The settings this TE runs with: its role's part in KV transfer, and an address for cache events."""
    settings = {"kv_transfer": KV_TRANSFER_OF_ROLE[role]}
    if not config.cache_config.kv_events_endpoint:
        host = listen.removeprefix("tcp://").rsplit(":", 1)[0]
        events_host = "127.0.0.1" if host in ("0.0.0.0", "*") else host
        settings["kv_events_endpoint"] = f"tcp://{events_host}:*"  # the master binds a port of its choosing
    return config.replace(**settings)


def _warn_refusing_job_executors(register: list[str]) -> None:
    """A JE keyed by another cluster secret drops this TE's heartbeats without a word: say so here."""
    # start-up: zmq and the master only when a TE runs
    import zmq

    from meshserve.utils import cluster_auth

    for addr in register:
        if cluster_auth.handshake(addr, 0.5, socket_type=zmq.PUSH) is cluster_auth.Handshake.REFUSED:
            logging.getLogger(__name__).error(
                "the job executor at %s refuses this TE: it does not share the cluster secret (set %s or %s "
                "to the cluster's secret)", addr, cluster_auth.ENV_SECRET, cluster_auth.ENV_SECRET_FILE)


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
