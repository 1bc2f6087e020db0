"""Connections per client address against a real server (raw sockets): one address holding every connection
the server allows does not lock another address out; its own connections beyond its share get 429 with
Retry-After, and the server's global cap still answers 503 when many addresses fill it."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.openai.fake_server import running_fake_server
from tests.entrypoints.openai.test_api import assert_openai_error

MAX_CONNECTIONS = 8
PER_CLIENT = 4
NOISY, POLITE = "127.0.0.1", "127.0.0.2"  # two loopback source addresses


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    options = {"max_connections": MAX_CONNECTIONS, "max_connections_per_client": PER_CLIENT,
               "header_timeout_s": 30.0}
    with running_fake_server(options) as (base, proc):
        yield base
        assert proc.poll() is None


def _idle_connections(base: str, source: str, count: int) -> list[socket.socket]:
    port = int(base.rsplit(":", 1)[1])
    sockets = [socket.create_connection(("127.0.0.1", port), source_address=(source, 0)) for _ in range(count)]
    time.sleep(0.2)  # the server has accepted them
    return sockets


def _get(base: str, source: str) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10) as client:
        return client.get(f"{base}/v1/models")


def test_one_address_with_every_connection_does_not_lock_out_another(server):
    idle = _idle_connections(server, NOISY, MAX_CONNECTIONS + 4)  # more than the whole server's cap
    try:
        own = _get(server, NOISY)
        error = assert_openai_error(own, 429, "rate_limit_exceeded")
        assert error["code"] == "rate_limit_exceeded" and int(own.headers["retry-after"]) >= 1
        assert _get(server, POLITE).status_code == 200
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while _get(server, NOISY).status_code != 200:  # its share frees as its connections close
        assert time.monotonic() < deadline, "the address's connections were not freed"
        time.sleep(0.1)


def test_the_global_cap_still_holds_across_addresses(server):
    idle = _idle_connections(server, NOISY, PER_CLIENT) + _idle_connections(server, "127.0.0.3", PER_CLIENT)
    try:
        refused = _get(server, POLITE)
        assert assert_openai_error(refused, 503, "service_unavailable_error")["code"] == "too_many_connections"
    finally:
        for sock in idle:
            sock.close()
