"""`meshserve` command line: serve, make-model, train, profile, bench."""
from __future__ import annotations

import argparse
import logging
import sys

from meshserve.bench.commands import register_bench_commands
from meshserve.config import DEFAULT_ENGINE_PORT, ConfigError, RouterConfig
from meshserve.config.arguments import add_engine_arguments, add_struct_arguments
from meshserve.engine.core_client import EngineStartupError
from meshserve.entrypoints.cluster import add_cluster_commands
from meshserve.entrypoints.engine_args import add_deployment_arguments
from meshserve.entrypoints.openai.server_options import add_server_arguments
from meshserve.entrypoints.pool import add_pool_commands
from meshserve.entrypoints.profile_pd import add_profile_commands
from meshserve.entrypoints.quantize import add_quantize_parser
from meshserve.entrypoints.serve import serve as serve_main
from meshserve.entrypoints.simulate import add_simulate_commands
from meshserve.entrypoints.te_server import add_te_parser
from meshserve.entrypoints.train import add_train_parser
from meshserve.models.factory import add_make_model_arguments, make_model_main
from meshserve.utils import cluster_auth, envs
from meshserve.utils.processes import exit_without_teardown
from meshserve.worker.worker import WorkerJoinError, join_engine


def _worker(args: argparse.Namespace) -> int:
    """One rank of a TE whose master runs on another host (torch's MASTER_ADDR / RANK as defaults)."""
    engine = args.engine or envs.master_addr()
    if not engine:
        raise ConfigError("give the master's address: --engine tcp://HOST:PORT (or set MASTER_ADDR)")
    if "://" not in engine:
        engine = f"tcp://{engine}"
    if not engine.startswith("tcp://"):
        raise ConfigError(f"--engine must be a tcp://HOST:PORT address, got {engine!r}")
    if ":" not in engine.removeprefix("tcp://").rsplit("]", 1)[-1]:
        engine = f"{engine}:{DEFAULT_ENGINE_PORT}"
    rank = args.rank if args.rank is not None else envs.rank()
    if rank is None:
        raise ConfigError("give this worker's rank: --rank R (or set RANK)")
    if args.rejoin:
        from meshserve.worker.rejoin import run_rejoining

        return run_rejoining(engine, rank, args.timeout, args.rejoin_timeout, args.log_level)
    try:
        join_engine(engine, rank, args.timeout, getattr(logging, args.log_level.upper()))
    except WorkerJoinError as exc:
        print(f"meshserve: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _rank_template(args: argparse.Namespace) -> int:
    from meshserve.core.rank_template import run_rank_template

    run_rank_template(args.socket, watch_parent=False, log_level=getattr(logging, args.log_level.upper()))
    return 0


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
    add_server_arguments(serve)
    add_deployment_arguments(serve)
    add_struct_arguments(serve, RouterConfig, "job executor (a multi-TE deployment)",
                         names=("routing", "register_port"))
    serve.add_argument("--also-register", action="append", default=[],
                       help="with a multi-TE deployment: another job executor's registration address its TEs also "
                            "register with (repeatable)")
    add_engine_arguments(serve)
    serve.set_defaults(func=serve_main)

    add_te_parser(sub)

    worker = sub.add_parser("worker", help="run one worker (rank) of an engine whose master is on another host")
    worker.add_argument("--engine", default=None,
                          help="the master's tcp://HOST:PORT for remote ranks (its --master-addr and --engine-port; "
                               "default: MASTER_ADDR and the default engine port)")
    worker.add_argument("--rank", type=int, default=None, help="this worker's rank (default: RANK)")
    worker.add_argument("--timeout", type=float, default=300.0,
                          help="seconds to wait for the master to answer (it may start later)")
    worker.add_argument("--rejoin", action="store_true",
                        help="join the TE again each time this rank's world ends (the TE restarts its ranks after a "
                             "failure), until the TE no longer answers: the rank's own supervisor")
    worker.add_argument("--rejoin-timeout", type=float, default=60.0,
                        help="with --rejoin: seconds to wait for the TE's next world before stopping (default: 60)")
    worker.set_defaults(func=_worker)

    template = sub.add_parser("rank-template", help="keep torch imported for this host's TEs: their forkservers "
                              "fork from this process (give them MESHSERVE_RANK_TEMPLATE=SOCKET)")
    template.add_argument("--socket", required=True, metavar="PATH", help="the unix socket to listen on")
    template.set_defaults(func=_rank_template)

    make = sub.add_parser("make-model", help="write a random, deterministic HF-format checkpoint")
    add_make_model_arguments(make)
    make.set_defaults(func=make_model_main)

    add_train_parser(sub)

    add_quantize_parser(sub)

    plan = sub.add_parser("plan", help="rank parallel strategies for a model on a cluster (MixServe cost model)")
    # start-up: yaml only once the parser is built
    from meshserve.entrypoints.plan import add_plan_arguments, plan_main

    add_plan_arguments(plan)
    plan.set_defaults(func=plan_main)

    # start-up: numpy only once the parser is built
    from meshserve.entrypoints.eplb import add_eplb_commands

    add_eplb_commands(sub)

    add_pool_commands(sub)

    add_cluster_commands(sub)

    # keeps torch out of importing this module: the predictor module loads it
    from meshserve.entrypoints.predictor import add_predictor_parser

    add_predictor_parser(sub)

    add_profile_commands(sub)

    add_simulate_commands(sub)

    bench = sub.add_parser("bench", help="benchmarks (offline throughput, online serving)")
    register_bench_commands(bench)
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


def run() -> None:
    """The `meshserve` command: `main`, then an exit that skips the interpreter's teardown (a second once a
    command has imported torch)."""
    try:
        code: int | str | None = main()
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
    exit_without_teardown(code)


if __name__ == "__main__":
    run()
