"""The pool with a cluster secret: a process without it cannot register as a server or change a quota
(and the CLI says so at once), malformed frames are dropped, and shrinking a quota below use needs force."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from meshserve.pool import messages as m
from meshserve.pool.controller import ControllerState, run_controller
from meshserve.pool.sdk import PoolClient
from meshserve.utils import cluster_auth
from tests.pool.pool_processes import free_address, pool_processes, wait_until

pytestmark = pytest.mark.timeout(120)

RIGHT, WRONG = "pool-test-secret", "not-the-secret"


@pytest.fixture
def controller(monkeypatch):
    """A controller in this process, keyed by RIGHT (so are the processes this test starts)."""
    monkeypatch.setenv(cluster_auth.ENV_SECRET, RIGHT)
    address, stop = free_address(), threading.Event()
    thread = threading.Thread(target=run_controller, args=(address, 1.0), kwargs={"stop": stop}, daemon=True)
    thread.start()
    wait_until(lambda: cluster_auth.probe(address, 1.0) is None, 10, "the controller")
    yield address
    stop.set()
    thread.join(10)


def env_with(secret: str) -> dict[str, str]:
    return {**os.environ, cluster_auth.ENV_SECRET: secret}


def start_server(controller: str, secret: str, tmp_path, name: str) -> subprocess.Popen:
    env = env_with(secret)
    with open(tmp_path / f"{name}.log", "a") as log:
        return subprocess.Popen([sys.executable, "-m", "meshserve.entrypoints.cli", "pool", "server",
                                 "--controller", controller, "--bind", free_address(), "--dram-gb", "0.01",
                                 "--heartbeat", "0.2", "--id", name],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def live_servers(client: PoolClient) -> set[str]:
    view = client.view()
    return set(view.servers) if view is not None else set()


def test_a_server_without_the_secret_cannot_register(controller, tmp_path):
    with pool_processes() as procs, PoolClient(controller, timeout_s=1.0, view_refresh_s=0.2) as client:
        procs.append(start_server(controller, WRONG, tmp_path, "intruder"))
        procs.append(start_server(controller, RIGHT, tmp_path, "member"))
        wait_until(lambda: "member" in live_servers(client), 60, "the server holding the secret to register")
        time.sleep(1.0)  # five of the intruder's heartbeats
        assert live_servers(client) == {"member"}


def run_cli(args: list[str], secret: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshserve.entrypoints.cli", "pool", *args],
                          capture_output=True, text=True, env=env_with(secret), timeout=60)


def test_the_cli_without_the_secret_is_refused_at_once(controller):
    started = time.monotonic()
    refused = run_cli(["namespace", "default", "--quota-gb", "0.000001", "--controller", controller,
                       "--timeout", "20"], WRONG)
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "does not share the cluster secret" in refused.stderr
    assert time.monotonic() - started < 15  # the refusal, not the 20 s answer timeout
    with PoolClient(controller, timeout_s=2.0) as client:
        assert "default" not in client.view().quotas
    accepted = run_cli(["namespace", "default", "--quota-gb", "1", "--controller", controller], RIGHT)
    assert accepted.returncode == 0, accepted.stderr
    with PoolClient(controller, timeout_s=2.0) as client:
        assert client.view().quotas["default"] == 1 << 30


def test_malformed_frames_are_dropped_and_the_controller_goes_on(controller):
    ctx = zmq.Context()
    sock = cluster_auth.client(ctx.socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(controller)
    before = m.decode_errors
    try:
        for frame in (b"", b"\xc1garbage", msgpack.packb(["Register", {"server_id": 1}]),
                      msgpack.packb(["CreateNamespace", {"req_id": 1, "namespace": "x", "quota_bytes": "all"}])):
            sock.send(frame)
        sock.send(m.encode(m.ViewQuery(req_id=7)))
        assert sock.poll(5000)
        assert m.decode(sock.recv()).req_id == 7
        assert m.decode_errors - before == 4
    finally:
        sock.close(0)
        ctx.term()


def test_shrinking_a_quota_below_use_needs_force():
    state = ControllerState(clock=lambda: 0.0)
    state.handle(m.Register("s0", "tcp://127.0.0.1:1", 1 << 20, 0))
    state.handle(m.Heartbeat("s0", {"default": 5000}))
    refused = state.handle(m.CreateNamespace(1, "default", 1000))
    assert not refused.ok and "holds 5000 bytes" in refused.error and "default" not in state.quotas
    assert state.handle(m.CreateNamespace(2, "default", 8000)).ok  # above use: no data goes
    assert state.handle(m.CreateNamespace(3, "default", 1000, force=True)).ok
    assert state.quotas["default"] == 1000
