"""`meshserve pool ...`: run the memory pool's controller and servers, inspect and configure it.

  meshserve pool controller --bind tcp://127.0.0.1:PORT [--server-timeout S]
  meshserve pool server --controller ADDR --bind tcp://127.0.0.1:PORT --dram-gb X [--ssd-dir DIR --ssd-gb Y]
  meshserve pool stats --controller ADDR
  meshserve pool namespace NAME --quota-gb X --controller ADDR [--force]
  meshserve pool put-model DIR --controller ADDR [--model-id ID] [--chunk-mb 64] [--max-bytes N]
  meshserve pool models --controller ADDR [--evict ID[:VERSION]] [--prefetch ID[:VERSION]]

Bad arguments print one line and exit with status 2. Every socket is authenticated with the cluster
secret (`meshserve.utils.cluster_auth`); a command whose controller refuses this process's secret, or
does not answer, says so in one line and exits with status 1 (a refusal at once).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NoReturn

from meshserve.config import ConfigError
from meshserve.pool.controller import DEFAULT_SERVER_TIMEOUT_S, run_controller
from meshserve.pool.hashring import DEFAULT_VIRTUAL_NODES
from meshserve.pool.sdk import PoolClient
from meshserve.pool.server import run_server
from meshserve.utils import cluster_auth

GB = 1 << 30


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_pool_commands(subparsers) -> None:
    """Add the `pool` command and its subcommands to the top-level `meshserve` subparsers."""
    pool = subparsers.add_parser("pool", help="the caching cluster's memory pool: controller, servers, stats")
    commands = pool.add_subparsers(dest="pool_command", required=True, parser_class=_OneLineErrorParser)

    controller = commands.add_parser("controller", help="run the pool controller (membership, view, quotas)")
    controller.add_argument("--bind", required=True, help="tcp://HOST:PORT to listen on")
    controller.add_argument("--server-timeout", dest="server_timeout", type=float, default=DEFAULT_SERVER_TIMEOUT_S,
                            help="seconds without a heartbeat before a server leaves the view")
    controller.add_argument("--virtual-nodes", dest="virtual_nodes", type=int, default=DEFAULT_VIRTUAL_NODES,
                            help="points per server on the hash ring")
    controller.set_defaults(func=_controller_main)

    server = commands.add_parser("server", help="run one pool memory server (DRAM tier, optional SSD tier)")
    server.add_argument("--controller", required=True, help="the controller's tcp://HOST:PORT")
    server.add_argument("--bind", required=True, help="tcp://HOST:PORT to listen on (clients connect here)")
    server.add_argument("--dram-gb", dest="dram_gb", type=float, required=True, help="DRAM tier capacity")
    server.add_argument("--ssd-dir", dest="ssd_dir", default=None, help="SSD tier directory (data survives restarts)")
    server.add_argument("--ssd-gb", dest="ssd_gb", type=float, default=None, help="SSD tier capacity")
    server.add_argument("--id", dest="server_id", default=None,
                        help="server id, its place on the hash ring (default: HOST-PORT of --bind, so a "
                             "restarted server gets its keys back)")
    server.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    server.set_defaults(func=_server_main)

    stats = commands.add_parser("stats", help="print every live server's usage")
    stats.add_argument("--controller", required=True, help="the controller's tcp://HOST:PORT")
    stats.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each answer")
    stats.set_defaults(func=_stats_main)

    namespace = commands.add_parser("namespace", help="create a namespace or change its byte quota")
    namespace.add_argument("name")
    namespace.add_argument("--quota-gb", dest="quota_gb", type=float, required=True,
                           help="quota over the whole pool")
    namespace.add_argument("--controller", required=True, help="the controller's tcp://HOST:PORT")
    namespace.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    namespace.add_argument("--force", action="store_true",
                           help="allow a quota below the namespace's current use (the servers evict data down to it)")
    namespace.set_defaults(func=_namespace_main)

    put_model = commands.add_parser("put-model", help="store a model directory's weights in the pool (model cache)")
    put_model.add_argument("model_dir", metavar="DIR", help="HF-format model directory (config.json + safetensors)")
    put_model.add_argument("--controller", required=True, help="the controller's tcp://HOST:PORT")
    put_model.add_argument("--model-id", dest="model_id", default=None, help="model id (default: the directory name)")
    put_model.add_argument("--chunk-mb", dest="chunk_mb", type=float, default=64.0,
                           help="tensors larger than this are stored as several values (default: 64)")
    put_model.add_argument("--max-bytes", dest="max_bytes", type=_byte_count, default=None,
                           help="budget of the models namespace (e.g. 8G): least recently used whole models "
                                "are evicted first to stay within it")
    put_model.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each pool answer")
    put_model.set_defaults(func=_put_model_main)

    models = commands.add_parser("models", help="list the models cached in the pool; evict or prefetch one")
    models.add_argument("--controller", required=True, help="the controller's tcp://HOST:PORT")
    action = models.add_mutually_exclusive_group()
    action.add_argument("--evict", metavar="ID[:VERSION]", default=None,
                        help="delete one model (every version, or just VERSION) as a whole")
    action.add_argument("--prefetch", metavar="ID[:VERSION]", default=None,
                        help="read a model once so the pool servers hold it in DRAM (newest version by default)")
    models.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each pool answer")
    models.set_defaults(func=_models_main)


def check_address(flag: str, address: str) -> str:
    """A tcp://HOST:PORT address, or ConfigError (one line, exit 2)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} must be tcp://HOST:PORT, got {address!r}")
    return address


def _controller_refusal(controller: str, timeout_s: float) -> str | None:
    """A one-line error when the controller refuses this process's cluster secret (without it the call
    would only time out); None otherwise: a controller that is not there is reported by the call itself."""
    if cluster_auth.handshake(controller, min(timeout_s, 1.0)) is not cluster_auth.Handshake.REFUSED:
        return None
    return (f"the pool controller at {controller} refused this process: it does not share the cluster secret "
            f"(set {cluster_auth.ENV_SECRET} or {cluster_auth.ENV_SECRET_FILE} to the cluster's secret)")


def _fail(message: str) -> int:
    print(f"meshserve: error: {message}", file=sys.stderr)
    return 1


def _positive(flag: str, value: float | None) -> float:
    if value is None or not value > 0:
        raise ConfigError(f"{flag} must be > 0, got {value}")
    return value


def default_server_id(bind: str) -> str:
    host, _, port = bind.removeprefix("tcp://").rpartition(":")
    return f"{host.strip('[]')}-{port}"


def _controller_main(args: argparse.Namespace) -> int:
    bind = check_address("--bind", args.bind)
    _positive("--server-timeout", args.server_timeout)
    if args.virtual_nodes < 1:
        raise ConfigError(f"--virtual-nodes must be >= 1, got {args.virtual_nodes}")
    run_controller(bind, args.server_timeout, args.virtual_nodes)
    return 0


def _server_main(args: argparse.Namespace) -> int:
    bind = check_address("--bind", args.bind)
    controller = check_address("--controller", args.controller)
    dram_bytes = int(_positive("--dram-gb", args.dram_gb) * GB)
    _positive("--heartbeat", args.heartbeat)
    if (args.ssd_dir is None) != (args.ssd_gb is None):
        raise ConfigError("give --ssd-dir and --ssd-gb together (or neither)")
    ssd_bytes = int(_positive("--ssd-gb", args.ssd_gb) * GB) if args.ssd_gb is not None else 0
    run_server(server_id=args.server_id or default_server_id(bind), bind=bind, controller=controller,
               dram_bytes=dram_bytes, ssd_dir=args.ssd_dir, ssd_bytes=ssd_bytes, heartbeat_s=args.heartbeat)
    return 0


def _stats_main(args: argparse.Namespace) -> int:
    controller = check_address("--controller", args.controller)
    refusal = _controller_refusal(controller, _positive("--timeout", args.timeout))
    if refusal:
        return _fail(refusal)
    with PoolClient(controller, timeout_s=args.timeout) as client:
        view = client.view()
        if view is None:
            return _fail(f"the pool controller at {controller} does not answer")
        stats = client.stats()
    print(f"view version {view.version}: {len(view.servers)} servers")
    if view.quotas:
        print("quotas: " + ", ".join(f"{ns}={_size(q)}" for ns, q in sorted(view.quotas.items())))
    print(f"{'server':<24} {'address':<24} {'keys':>8} {'dram':>10} {'ssd':>10} {'hits':>8} {'misses':>8}  namespaces")
    for sid, address in sorted(view.servers.items()):
        s = stats.get(sid)
        if s is None:
            print(f"{sid:<24} {address:<24} {'(no answer)':>8}")
            continue
        namespaces = ", ".join(f"{ns}={_size(b)}" for ns, b in sorted(s.namespaces.items()))
        print(f"{sid:<24} {address:<24} {s.num_keys:>8} {_size(s.dram_bytes):>10} {_size(s.ssd_bytes):>10} "
              f"{s.hits:>8} {s.misses:>8}  {namespaces}")
    return 0


def _namespace_main(args: argparse.Namespace) -> int:
    controller = check_address("--controller", args.controller)
    if args.quota_gb < 0:
        raise ConfigError(f"--quota-gb must be >= 0, got {args.quota_gb}")
    refusal = _controller_refusal(controller, _positive("--timeout", args.timeout))
    if refusal:
        return _fail(refusal)
    with PoolClient(controller, timeout_s=args.timeout) as client:
        if not client.create_namespace(args.name, int(args.quota_gb * GB), force=args.force):
            return _fail(f"namespace {args.name!r} was not set: {client.namespace_error}")
    print(f"namespace {args.name}: quota {_size(int(args.quota_gb * GB))}")
    return 0


def _byte_count(text: str) -> int:
    """Bytes from '123', '64K', '512M', '8G' (powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": GB}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (use e.g. 512M or 8G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _model_ref(text: str) -> tuple[str, str | None]:
    """ID[:VERSION] -> (id, version or None); a version is the 16 hex digits `pool models` prints."""
    model_id, _, version = text.rpartition(":")
    if model_id and len(version) == 16 and all(c in "0123456789abcdef" for c in version):
        return model_id, version
    return text, None


def _put_model_main(args: argparse.Namespace) -> int:
    # keeps torch out of the other `meshserve pool` commands
    from meshserve.models.loader import load_hf_config
    from meshserve.worker.model_cache import ModelCacheError, put_model

    controller = check_address("--controller", args.controller)
    chunk_bytes = int(_positive("--chunk-mb", args.chunk_mb) * (1 << 20))
    try:
        load_hf_config(args.model_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    refusal = _controller_refusal(controller, _positive("--timeout", args.timeout))
    if refusal:
        return _fail(refusal)
    with PoolClient(controller, timeout_s=args.timeout) as client:
        view = client.view()
        if view is None or not view.servers:
            print(f"meshserve: error: the pool at {controller} has no live server (or its controller does not answer)",
                  file=sys.stderr)
            return 1
        try:
            entry = put_model(client, Path(args.model_dir), args.model_id, chunk_bytes, args.max_bytes,
                              progress=lambda line: print(line, flush=True))
        except (ModelCacheError, FileNotFoundError, ValueError) as e:
            print(f"meshserve: error: {e}", file=sys.stderr)
            return 1
    print(f"model {entry.model_id} version {entry.version}: {_size(entry.bytes)} in {entry.values} values")
    return 0


def _models_main(args: argparse.Namespace) -> int:
    # keeps torch out of the other `meshserve pool` commands
    from meshserve.worker.model_cache import evict_model, list_models, prefetch_model

    controller = check_address("--controller", args.controller)
    refusal = _controller_refusal(controller, _positive("--timeout", args.timeout))
    if refusal:
        return _fail(refusal)
    with PoolClient(controller, timeout_s=args.timeout) as client:
        if client.view() is None:
            print(f"meshserve: error: the pool controller at {controller} does not answer", file=sys.stderr)
            return 1
        if args.evict:
            evicted = evict_model(client, *_model_ref(args.evict))
            if not evicted:
                print(f"meshserve: error: no cached model {args.evict!r}", file=sys.stderr)
                return 1
            for entry in evicted:
                print(f"evicted {entry.model_id} version {entry.version} ({_size(entry.bytes)})")
            return 0
        if args.prefetch:
            found = prefetch_model(client, *_model_ref(args.prefetch))
            if not found:
                print(f"meshserve: error: no cached model {args.prefetch!r}", file=sys.stderr)
                return 1
            print(f"prefetched {args.prefetch}: {_size(found)}")
            return 0
        entries = list_models(client)
    print(f"{'model':<32} {'version':<17} {'bytes':>10} {'values':>7}  last used")
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))
        print(f"{e.model_id:<32} {e.version:<17} {_size(e.bytes):>10} {e.values:>7}  {used}")
    return 0


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", GB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f}{unit}"
    return f"{num_bytes}B"
