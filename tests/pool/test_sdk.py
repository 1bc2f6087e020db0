"""The pool SDK against real processes started with the CLI, and against misbehaving peers."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest
import zmq

from meshserve.entrypoints.cli import main
from meshserve.pool import messages as m
from meshserve.pool.controller import run_controller
from meshserve.pool.hashring import HashRing
from meshserve.pool.sdk import PoolClient
from meshserve.utils import cluster_auth
from tests.pool.pool_processes import free_address, pool_processes, start_pool, wait_until

SDK_LOGGER = "meshserve.pool.sdk"


def block(i: int, size: int = 1024) -> bytes:
    return bytes([i % 251]) * size


def server_warnings(caplog, server_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == SDK_LOGGER and r.levelno == logging.WARNING and f"pool server {server_id}" in r.getMessage()]


def start_server(procs, tmp_path, controller: str, server_id: str, bind: str) -> None:
    ssd = tmp_path / f"ssd-{server_id}"
    procs.append(start_pool(["server", "--controller", controller, "--bind", bind, "--id", server_id,
                             "--dram-gb", "0.004", "--ssd-dir", str(ssd), "--ssd-gb", "0.008",
                             "--heartbeat", "0.2"], tmp_path / f"{server_id}.log"))


def test_pool_round_trip_failover_restart_and_quotas(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger=SDK_LOGGER)
    controller = free_address()
    binds = {"s0": free_address(), "s1": free_address()}
    with pool_processes() as procs:
        procs.append(start_pool(["controller", "--bind", controller, "--server-timeout", "1.0"],
                                tmp_path / "controller.log"))
        for sid, bind in binds.items():
            start_server(procs, tmp_path, controller, sid, bind)
        with PoolClient(controller, timeout_s=1.0, view_refresh_s=0.2) as client:
            wait_until(lambda: (v := client.view()) is not None and len(v.servers) == 2, 30, "two servers")

            # ---- batched round trip; the keys spread over both servers
            items = {f"k{i}": block(i) for i in range(64)}
            assert client.put("ns", items) == {k: True for k in items}
            got = client.get("ns", list(items) + ["absent"])
            assert set(got) == set(items)
            assert all(bytes(got[k]) == v for k, v in items.items())
            assert isinstance(got["k0"], memoryview)  # received frames, not copies
            assert client.exists("ns", ["k1", "absent", "k2"]) == [True, False, True]
            assert client.exists("other-ns", ["k1"]) == [False]  # namespaces never share keys
            assert client.delete("ns", ["k1", "absent"]) == [True, False]
            assert client.exists("ns", ["k1"]) == [False]
            stats = client.stats()
            assert set(stats) == {"s0", "s1"} and all(s.num_keys > 0 for s in stats.values())
            assert sum(s.num_keys for s in stats.values()) == 63
            assert main(["pool", "stats", "--controller", controller]) == 0
            printed = capsys.readouterr().out
            assert "2 servers" in printed and all(f"{sid} " in printed for sid in binds), printed

            # ---- async variants: several calls in flight at once
            futures = [client.put_async("ns", {f"a{i}": block(i, 64)}) for i in range(8)]
            assert all(isinstance(f, Future) for f in futures)
            assert all(f.result(timeout=10) == {f"a{i}": True} for i, f in enumerate(futures))
            get_future = client.get_async("ns", [f"a{i}" for i in range(8)])
            assert {k: bytes(v) for k, v in get_future.result(timeout=10).items()} == \
                {f"a{i}": block(i, 64) for i in range(8)}
            assert client.exists_async("ns", ["a0"]).result(timeout=10) == [True]
            assert client.delete_async("ns", ["a0"]).result(timeout=10) == [True]

            # ---- namespace quotas: a tenant over quota evicts its own blocks, not another tenant's
            assert client.create_namespace("tenant-a", 64 * 1024)  # 32 KiB per server
            assert client.create_namespace("tenant-b", 1 << 20)
            time.sleep(1.0)  # five heartbeats: the quotas reach both servers
            b_items = {f"b{i}": block(i, 4096) for i in range(8)}
            assert all(client.put("tenant-b", b_items).values())
            for i in range(64):  # 256 KiB into a 64 KiB quota, oldest first
                client.put("tenant-a", {f"a{i}": block(i, 4096)})
            a_present = client.exists("tenant-a", [f"a{i}" for i in range(64)])
            assert sum(a_present) <= 16 and all(a_present[-4:])  # its newest survive, its oldest went
            assert not any(a_present[:8])
            assert client.exists("tenant-b", list(b_items)) == [True] * len(b_items)
            usage = {sid: s.namespaces.get("tenant-a", 0) for sid, s in client.stats().items()}
            assert all(b <= 32 * 1024 for b in usage.values()), usage

            # ---- killing s1 costs only misses: every call returns, one warning per incident
            ring = HashRing(binds, client.view().virtual_nodes)
            s1_keys = [k for k in items if k != "k1" and ring.owner(k) == "s1"]
            s0_keys = [k for k in items if k != "k1" and ring.owner(k) == "s0"]
            assert s1_keys and s0_keys
            caplog.clear()
            os.kill(procs[2].pid, signal.SIGKILL)
            procs[2].wait(timeout=10)
            for _ in range(5):
                got = client.get("ns", s0_keys + s1_keys)
                assert set(s0_keys) <= set(got)
                exists = client.exists("ns", s1_keys)
                assert len(exists) == len(s1_keys)
                stored = client.put("ns", {"new": b"x"})
                assert set(stored) == {"new"}
            wait_until(lambda: set(client.view().servers) == {"s0"}, 10, "s1 to leave the view")
            assert not set(s1_keys) & set(client.get("ns", s1_keys))  # its keys now route to s0: misses
            assert len(server_warnings(caplog, "s1")) == 1, server_warnings(caplog, "s1")

            # ---- restarting s1 with the same SSD directory brings its data back
            start_server(procs, tmp_path, controller, "s1", binds["s1"])
            wait_until(lambda: set(client.get("ns", s1_keys)) == set(s1_keys), 30, "s1's keys back", 0.2)
            got = client.get("ns", s1_keys)
            assert all(bytes(got[k]) == items[k] for k in s1_keys)


@pytest.fixture
def controller_thread():
    """An in-process controller (a long server timeout, so fake servers need no heartbeats)."""
    address = free_address()
    stop = threading.Event()
    thread = threading.Thread(target=run_controller, args=(address, 60.0, 16, stop), daemon=True)
    thread.start()
    yield address
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_silent_server_yields_misses_and_one_warning(controller_thread, caplog):
    """A server that takes requests and never answers: calls return at the timeout with misses."""
    caplog.set_level(logging.WARNING, logger=SDK_LOGGER)
    context = zmq.Context()
    silent = cluster_auth.server(context.socket(zmq.ROUTER))
    silent.setsockopt(zmq.LINGER, 0)
    silent_address = free_address()
    silent.bind(silent_address)
    link = cluster_auth.client(context.socket(zmq.DEALER))
    link.setsockopt(zmq.LINGER, 0)
    link.connect(controller_thread)
    try:
        link.send(m.encode(m.Register("silent", silent_address, 1, 0)))
        assert link.poll(5000)
        assert m.decode(link.recv()).accepted
        with PoolClient(controller_thread, timeout_s=0.3) as client:
            for _ in range(2):
                assert client.get("ns", ["a", "b"]) == {}
                assert client.exists("ns", ["a"]) == [False]
                assert client.put("ns", {"a": b"1"}) == {"a": False}
            assert client.delete_async("ns", ["a"]).result(timeout=10) == [False]
            assert client.stats() == {"silent": None}
            assert silent.poll(1000)  # the requests did reach it
            assert len(server_warnings(caplog, "silent")) == 1
            assert client.create_namespace("t", 10)
            link.send(m.encode(m.Heartbeat("silent")))
            assert link.poll(5000)
            assert m.decode(link.recv()).quotas == {"t": 10}
    finally:
        silent.close(0)
        link.close(0)
        context.term()


def test_no_controller_yields_misses(caplog):
    caplog.set_level(logging.WARNING, logger=SDK_LOGGER)
    with PoolClient(free_address(), timeout_s=0.2) as client:
        assert client.get("ns", ["a"]) == {}
        assert client.exists("ns", ["a", "b"]) == [False, False]
        assert client.put("ns", {"a": b"1"}) == {"a": False}
        assert client.view() is None
        assert client.create_namespace("t", 10) is False
    assert any("controller" in r.getMessage() for r in caplog.records if r.name == SDK_LOGGER)
    with pytest.raises(RuntimeError):
        client.get("ns", ["a"])
