"""`meshserve cluster up|down` and `meshserve status`: a managed deployment (meshserve.cluster.manager).

`cluster up DEPLOYMENT` runs the cluster manager in the foreground (Ctrl-C stops the deployment); with
`--detach` it runs in the background and the command returns once the deployment serves. Run again on the
same state directory after the manager died, it takes the running deployment over. `cluster down` stops
it all; `status` prints the live deployment as tables.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from meshserve.config import ClusterConfig, ConfigError
from meshserve.config.arguments import add_engine_arguments, add_struct_arguments, given_engine_settings, given_settings
from meshserve.config.cluster import CLUSTER_FLAGS
from meshserve.entrypoints.openai.server_options import add_server_arguments
from meshserve.utils import envs

_QUERY_TIMEOUT_S = 5.0


def default_state_dir(name: str) -> Path:
    return envs.cache_dir() / "cluster" / name


def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir) if args.state_dir else default_state_dir(args.name)


def add_cluster_commands(sub) -> None:
    cluster = sub.add_parser("cluster", help="a managed deployment: restarts what dies, scales, takes over after "
                                             "its own restart")
    commands = cluster.add_subparsers(dest="cluster_command", required=True)
    up = commands.add_parser("up", help="start (or take over) a deployment and manage it")
    up.add_argument("deployment", help="deployment file or preset (colocated, colocatedN, MpNd, joined by +)")
    up.add_argument("--model", default=None, help="HF-format model directory (default: the deployment's, else "
                                                  "the built-in default model)")
    up.add_argument("--detach", action="store_true", help="run the manager in the background; return once serving")
    _add_state_dir_argument(up)
    add_struct_arguments(up, ClusterConfig, "cluster manager", names=CLUSTER_FLAGS)  # --name among them
    add_server_arguments(up)
    add_engine_arguments(up)
    up.set_defaults(func=cluster_up)
    scale = commands.add_parser("scale", help="set a pool's TE count (within its min and max)")
    scale.add_argument("pool", help="GROUP/ROLE, e.g. main/colocated or pd/decode")
    scale.add_argument("target", type=int, help="TEs the pool should run")
    _add_state_arguments(scale)
    scale.set_defaults(func=cluster_scale)
    capacity = commands.add_parser("capacity", help="set the devices (ranks) the deployment's TEs may hold now "
                                                    "(devices lost or back); a dead decode TE that does not fit "
                                                    "stops a prefill TE (kill-P-to-preserve-D)")
    capacity.add_argument("devices", type=int, help="ranks usable now")
    _add_state_arguments(capacity)
    capacity.set_defaults(func=cluster_capacity)
    down = commands.add_parser("down", help="stop a managed deployment and everything it runs")
    _add_state_arguments(down)
    down.set_defaults(func=cluster_down)
    status = sub.add_parser("status", help="the live deployment of a cluster manager: TEs, roles, load, state")
    _add_state_arguments(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=status_main)


def _add_state_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default=ClusterConfig().name, help="the deployment's name (its state directory)")
    _add_state_dir_argument(parser)


def _add_state_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default=None,
                        help="where the manager keeps its state and logs (default: <cache>/cluster/NAME)")


def cluster_up(args: argparse.Namespace) -> int:
    # start-up: the manager, the deployment reader and the server options only for this command
    from meshserve.cluster.run import run_manager
    from meshserve.entrypoints.openai.server_options import check_bind, server_options_from_args
    from meshserve.entrypoints.serve import resolve_model
    from meshserve.router.deployment import load_multi
    from meshserve.utils import cluster_auth

    cluster = ClusterConfig(**given_settings(args, ClusterConfig))
    options = server_options_from_args(args)
    check_bind(cluster.host, options)
    deployment = load_multi(args.deployment)  # a bad file fails here, in one line
    model = resolve_model(args.model or deployment.model)
    os.environ.update(options.secrets_env)  # the JEs read the API keys from their environment
    cluster_auth.cluster_secret()  # every process inherits it; a bad one is reported once, here
    state_dir = _state_dir(args)
    kwargs = dict(deployment=args.deployment, model=model, state_dir=str(state_dir), cluster=cluster.to_dict(),
                  engine_overrides=given_engine_settings(args), log_level=getattr(logging, args.log_level.upper()),
                  server=options.public_kwargs())
    if not args.detach:
        run_manager(**kwargs)
        return 0
    return _detach(kwargs, state_dir)


def _detach(kwargs: dict, state_dir: Path) -> int:
    """Start the manager as a background process; wait until it serves (or fails)."""
    # start-up: the process table only here
    import json

    from meshserve.utils.processes import PROCESS_ENTRY_POINTS, RUNNER_MODULE

    state_dir.mkdir(parents=True, exist_ok=True)
    ready_file = state_dir / "serving"
    ready_file.unlink(missing_ok=True)
    log_path = state_dir / "manager.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", RUNNER_MODULE, PROCESS_ENTRY_POINTS["cluster-manager"],
                                 json.dumps({**kwargs, "ready_file": str(ready_file)})],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while not ready_file.exists():
        if proc.poll() is not None:
            raise ConfigError(f"the cluster manager exited (code {proc.returncode}); see {log_path}")
        time.sleep(0.2)
    print(f"serving on {ready_file.read_text()} (manager pid {proc.pid}, log {log_path})")
    return 0


def cluster_capacity(args: argparse.Namespace) -> int:
    query_manager(_state_dir(args), "capacity", target=args.devices)
    print(f"capacity set to {args.devices} device(s)")
    return 0


def cluster_scale(args: argparse.Namespace) -> int:
    query_manager(_state_dir(args), "scale", pool=args.pool, target=args.target)
    print(f"pool {args.pool}: target {args.target} TEs")
    return 0


def query_manager(state_dir: Path, op: str = "status", **fields):
    """Ask the manager of `state_dir` (`ClusterStatus`); ConfigError when none answers."""
    # start-up: zmq and the messages only for this command
    import zmq

    from meshserve.cluster.state import load_state, manager_running
    from meshserve.utils import cluster_auth
    from meshserve.wire import codec
    from meshserve.wire.cluster import ClusterQuery, ClusterStatus

    state = load_state(state_dir)
    if state is None:
        raise ConfigError(f"no managed deployment in {state_dir} (start one with `meshserve cluster up`)")
    if not manager_running(state):
        raise ConfigError(f"the cluster manager of {state_dir} (pid {state.manager_pid}) is not running; its "
                          f"deployment may still serve: `meshserve cluster up {state.deployment}` takes it over")
    addr = f"tcp://{state.host}:{state.control_port}"
    ctx = zmq.Context()
    sock = cluster_auth.client(ctx.socket(zmq.DEALER), addr)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send(codec.encode(ClusterQuery(op=op, **fields)))
        if not sock.poll(int(_QUERY_TIMEOUT_S * 1000)):
            raise ConfigError(f"the cluster manager at {addr} did not answer within {_QUERY_TIMEOUT_S:.0f} s")
        reply = codec.decode(sock.recv())
    finally:
        sock.close(0)
        ctx.term()
    if not isinstance(reply, ClusterStatus):
        raise ConfigError(f"the cluster manager at {addr} answered with {type(reply).__name__}")
    if not reply.ok:
        raise ConfigError(reply.error or "the cluster manager refused")
    return reply


def cluster_down(args: argparse.Namespace) -> int:
    from meshserve.cluster.state import load_state, manager_running

    state_dir = _state_dir(args)
    state = load_state(state_dir)
    if state is None:
        raise ConfigError(f"no managed deployment in {state_dir}")
    if manager_running(state):
        query_manager(state_dir, "down")
        deadline = time.monotonic() + 60
        while manager_running(state) and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"stopped the deployment of {state_dir}")
        return 0
    _stop_orphans(state, state_dir)
    return 0


def _stop_orphans(state, state_dir: Path) -> None:
    """No manager runs: stop the recorded processes that still do, through the backend that started them."""
    from meshserve.cluster.backends import make_backend
    from meshserve.cluster.state import state_path

    backend = make_backend(state.backend, state_dir / "logs", host=state.host, ray_address=state.ray_address,
                           namespace=f"meshserve-{state.name}")
    handles = [h for h in (backend.adopt(r.handle) for r in state.processes) if h is not None]
    for handle in handles:
        handle.stop()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(h.alive() for h in handles):
        time.sleep(0.2)
    for handle in handles:
        if handle.alive():
            handle.kill()
    remove_all = getattr(backend, "remove_all", None)
    if remove_all is not None:
        remove_all()
    backend.close()
    state_path(state_dir).unlink(missing_ok=True)
    print(f"no manager was running; stopped {len(handles)} process(es) of {state_dir}")


def format_status(status) -> str:
    """The status as three tables (pools, TEs, JEs) and the latest events."""
    lines = [f"deployment {status.name} ({status.backend} backend, manager pid {status.manager_pid}, "
             f"{status.warm} pre-warmed TE(s) idle)", ""]

    def table(header: list[str], rows: list[list]) -> None:
        cells = [header] + [[str(c) for c in row] for row in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        for row in cells:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        lines.append("")

    table(["POOL", "TES", "TARGET", "MIN", "MAX", "LAST DECISION"],
          [[f"{g.group}/{g.role}", g.current, g.target, g.min_count, g.max_count, g.reason] for g in status.groups])
    table(["TE", "ROLE", "STATE", "PID", "HOST", "STARTED AS", "RESTARTS", "RUNNING", "WAITING", "KV", "UP"],
          [[t.name, t.role, t.state, t.pid, t.host, t.source, t.restarts, t.num_running, t.num_waiting,
            f"{t.kv_usage:.0%}", f"{t.uptime_s:.0f}s"] for t in status.tes])
    table(["JE", "ADDRESS", "STATE", "PID"], [[j.name, j.http_addr, j.state, j.pid] for j in status.jes])
    if status.events:
        lines.append("recent events:")
        lines.extend(f"  {event}" for event in status.events[-10:])
    return "\n".join(lines)


def status_main(args: argparse.Namespace) -> int:
    import msgspec

    status = query_manager(_state_dir(args))
    if args.json:
        print(msgspec.json.encode(status).decode())
    else:
        print(format_status(status))
    return 0
