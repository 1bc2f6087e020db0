"""Running a cluster manager: `meshserve cluster up` (`run_manager`, in the foreground or as its own process
with `--detach`) and a deployment served in the background of a benchmark or a test (`serving_in_background`)."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from meshserve.cluster.backends import make_backend
from meshserve.cluster.manager import ClusterManager
from meshserve.cluster.state import load_state
from meshserve.config import ClusterConfig

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def serving_in_background(manager: ClusterManager, timeout_s: float = 600.0):
    """Start the manager's deployment, wait until it serves, run the manager's loop on a thread; on exit stop
    the loop and take down everything it started (benchmarks and tests)."""
    loop = None
    try:
        manager.start()
        manager.wait_serving(timeout_s)
        loop = threading.Thread(target=manager.run, name="cluster-manager", daemon=True)
        loop.start()
        yield manager
    finally:
        manager.stop()
        if loop is not None:
            loop.join(10)
        manager.down()
        manager.close()


def run_manager(deployment: str, model: str, state_dir: str, cluster: dict[str, Any] | None = None,
                engine_overrides: dict | None = None, log_level: int = logging.INFO, server: dict | None = None,
                ready_file: str | None = None) -> None:
    """`meshserve cluster up` (also run as its own process with `--detach`): start or take over the
    deployment and manage it until SIGTERM/SIGINT (which stop the deployment) or `cluster down`.
    `cluster`: the ClusterConfig settings (by name; the rest keep their defaults)."""
    # start-up: the deployment loader only here
    from meshserve.router.deployment import load_multi

    logging.basicConfig(level=log_level, format="%(asctime)s manager %(levelname)s %(message)s", force=True)
    config = ClusterConfig.from_dict(cluster or {})
    spec = load_multi(deployment)
    backend_impl = make_backend(config.backend, Path(state_dir) / "logs", host=config.host,
                                ray_address=config.ray_address, namespace=f"meshserve-{config.name}")
    manager = ClusterManager(spec, deployment, model, backend_impl, state_dir, config,
                             engine_overrides=engine_overrides, log_level=log_level, server=server)

    def on_signal(signum, frame):
        manager.down_requested = True
        manager.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    taking_over = load_state(state_dir) is not None
    try:
        try:
            manager.start()
            timeout = max((c.parallel_config.startup_timeout_s for c in manager.configs.values()), default=0) + 60
            manager.wait_serving(timeout)
        except BaseException:
            # a deployment that never served is stopped again; one taken over keeps running
            manager.down_requested |= not taking_over and manager.state is not None
            raise
        logger.info("serving %s on %s (manager: %s, status: `meshserve status --state-dir %s`)", model,
                    ", ".join(manager.http_addrs()), manager.control_addr, state_dir)
        if ready_file:
            Path(ready_file).write_text(" ".join(manager.http_addrs()))
        manager.run()
    finally:
        if manager.down_requested:
            manager.down()
        manager.close()
