"""A TE's master process as a deployment runs it: the engine core behind `RouterLinks`.

`run_te` is the process entry of `meshserve te`, of the TEs `meshserve serve --deployment` and the cluster
manager start, and of a pre-warmed TE once it is handed its TE. This process is the TE's master
(scheduler, KV bookkeeping); it starts the TE's worker ranks (or takes a pre-warmed process's spare
ones). It listens for job executors on `listen`, sends each request's tokens straight to the frontend
that sent it, and heartbeats its registration and load to every `register` address.
"""
from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import time
import traceback

from meshserve.config import EngineConfig

ROLES = ("colocated", "prefill", "decode")
KV_TRANSFER_OF_ROLE = {"colocated": "none", "prefill": "producer", "decode": "consumer"}


def run_te(config: dict, role: str, group: str, listen: str, register: list[str],
           log_level: int = logging.INFO, watch_parent: bool = False, warmup: bool = False,
           started_at: float | None = None, spare_workers: list | None = None) -> None:
    """Run a TE until SIGTERM/SIGINT, a Shutdown message or the end of a drain (the master's loop).

    `warmup`: run one dummy request before registering, so the first real one is fast. `started_at`: when
    this TE's start began (a pre-warmed process passes the time it was handed the TE). `spare_workers`:
    a pre-warmed process's worker processes, ready to take ranks."""
    entry = time.time()
    process_start = started_at if started_at is not None else _process_start_time()
    # start-up: zmq and the master only when a TE runs
    import zmq

    from meshserve.core.client_links import RouterLinks
    from meshserve.core.master import engine_class
    from meshserve.wire.heartbeat import StartupTimeline

    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    engine_config = _te_config(EngineConfig.from_dict(config), role, listen)
    logging.basicConfig(level=log_level, format=f"%(asctime)s te[{engine_config.te_name}] %(levelname)s "
                                                f"%(message)s", force=True)
    _warn_refusing_job_executors(register)
    startup = StartupTimeline(process_start=process_start, prewarmed=spare_workers is not None, entry=entry,
                              imports_done=time.time())
    ctx = zmq.Context()
    link = RouterLinks(ctx, listen, register, advertise_host=engine_config.parallel_config.master_addr)
    ipc_dir = tempfile.mkdtemp(prefix="meshserve-te-")
    core = None

    def stop(signum, frame):
        if core is not None:
            core.stop_on_signal()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        try:
            core = engine_class(engine_config)(engine_config, ctx, link, ipc_dir, log_level, role=role,
                                               group=group, watch_parent=watch_parent, startup=startup,
                                               spare_workers=spare_workers or [])
        except Exception as exc:
            logging.getLogger(__name__).error("TE start-up failed: %s", traceback.format_exc())
            link.close()
            raise SystemExit(1) from exc
        logging.getLogger(__name__).info("TE %s (%s, group %s) listening on %s, registering with %s",
                                         engine_config.te_name, role, group, link.listen_addr,
                                         ", ".join(register) or "no job executor")
        core.run(warmup=warmup)
        if core.dead_error is not None:  # its owner (the cluster manager) starts a new one; the JEs moved its jobs
            raise SystemExit(1)
    finally:
        # the ranks' and groups' sockets: a host that restarts TEs all day would collect a directory per start
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _process_start_time() -> float:
    """When this process started (wall clock): the TE's start-up is timed from the interpreter's launch."""
    # start-up: psutil only when a TE runs
    import psutil

    return psutil.Process().create_time()


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
