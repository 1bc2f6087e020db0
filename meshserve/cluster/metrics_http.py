"""The cluster manager's Prometheus metrics listener: plain HTTP with no key, so loopback unless the operator
names another address (`--metrics-host`); its port is kept in the deployment's state across manager restarts."""
from __future__ import annotations

import logging
from typing import Any

from meshserve.utils.processes import free_tcp_port

logger = logging.getLogger(__name__)


def serve_metrics_http(registry: Any, host: str, port: int = 0) -> int:
    """Serve `registry` (a prometheus_client CollectorRegistry) on `host`:`port` (0: a free port) on a daemon
    thread; a port taken while no manager ran moves to a free one. Returns the port served."""
    # start-up: prometheus_client only once a manager serves
    from prometheus_client import start_http_server

    if not port:
        port = free_tcp_port(host)
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # metrics elsewhere, serving goes on
        port = free_tcp_port(host)
        logger.warning("metrics port taken (%s); serving metrics on %s:%d", exc, host, port)
        start_http_server(port, addr=host, registry=registry)
    return port
