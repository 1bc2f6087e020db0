"""The cluster manager's Prometheus port: plain HTTP without a key, so it binds loopback unless configured,
even when the job executors' HTTP servers are opened to the network (`--host`)."""
from __future__ import annotations

import httpx
import psutil
from prometheus_client import CollectorRegistry, Counter

from meshserve.cluster.metrics_http import serve_metrics_http
from meshserve.config import ClusterConfig
from meshserve.config.cluster import CLUSTER_FLAGS


def _listening_addresses(port: int) -> set[str]:
    return {conn.laddr.ip for conn in psutil.Process().net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port}


def test_the_metrics_port_binds_loopback_by_default_whatever_the_http_host():
    config = ClusterConfig(host="0.0.0.0")
    registry = CollectorRegistry()
    Counter("meshserve_test_metric", "A metric to read back.", registry=registry).inc()
    port = serve_metrics_http(registry, config.metrics_host)
    assert _listening_addresses(port) == {"127.0.0.1"}
    assert "meshserve_test_metric_total 1.0" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def test_the_metrics_host_is_a_cluster_up_flag():
    assert "metrics_host" in CLUSTER_FLAGS
    assert ClusterConfig().metrics_host == "127.0.0.1"
