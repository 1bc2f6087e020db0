"""The pool server over real ZMQ, in its own process, with a stub controller in the test."""
from __future__ import annotations

import os
import signal
import threading
import time

import msgpack
import pytest
import zmq

from meshserve.pool import messages as m
from meshserve.utils import cluster_auth
from meshserve.utils.processes import free_tcp_port, launch, stop_process

TIMEOUT_S = 15.0


class StubController:
    """A controller ROUTER that records what servers send and answers with fixed quotas."""

    def __init__(self, quotas: dict[str, int], num_servers: int):
        self.address = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.quotas, self.num_servers = quotas, num_servers
        self.received: list = []
        self.refuse_next_heartbeat = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(5)

    def _serve(self) -> None:
        context = zmq.Context()
        sock = cluster_auth.server(context.socket(zmq.ROUTER))
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._ready.set()
        while not self._stop.is_set():
            if not sock.poll(50):
                continue
            identity, header = sock.recv_multipart()
            message = m.decode(header)
            self.received.append(message)
            accepted = True
            if isinstance(message, m.Heartbeat) and self.refuse_next_heartbeat:
                self.refuse_next_heartbeat, accepted = False, False
            reply = m.RegisterReply(accepted=accepted, quotas=self.quotas, num_servers=self.num_servers)
            sock.send_multipart([identity, m.encode(reply)])
        sock.close(0)
        context.term()

    def of_type(self, cls) -> list:
        return [message for message in list(self.received) if isinstance(message, cls)]

    def wait_for(self, predicate, what: str):
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            hit = predicate()
            if hit:
                return hit
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}; got {self.received[-5:]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Client:
    def __init__(self, address: str):
        self.context = zmq.Context()
        self.sock = cluster_auth.client(self.context.socket(zmq.DEALER))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def raw(self, header: bytes, values=()) -> tuple:
        self.sock.send_multipart([header, *values], copy=False)
        assert self.sock.poll(int(TIMEOUT_S * 1000)), "no reply from the pool server"
        reply, *frames = self.sock.recv_multipart()
        return m.decode(reply), frames

    def request(self, message, values=()) -> tuple:
        return self.raw(m.encode(message), values)

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


def _start_server(server_id: str, port: int, controller: str, ssd_dir) -> object:
    return launch("pool-server", server_id=server_id, bind=f"tcp://127.0.0.1:{port}", controller=controller,
                  dram_bytes=64 << 20, ssd_dir=str(ssd_dir), ssd_bytes=256 << 20, heartbeat_s=0.2)


def _terminate(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(10)
    finally:
        stop_process(proc, grace_s=0)


@pytest.fixture
def controller():
    stub = StubController(quotas={"capped": 300_000}, num_servers=2)  # 150 000 bytes per server
    yield stub
    stub.close()


def test_server_round_trip_quotas_heartbeats_and_restart(controller, tmp_path):
    port = free_tcp_port()
    address = f"tcp://127.0.0.1:{port}"
    proc = _start_server("s0", port, controller.address, tmp_path)
    client = Client(address)
    try:
        register = controller.wait_for(lambda: controller.of_type(m.Register), "Register")[0]
        assert (register.server_id, register.address) == ("s0", address)
        assert register.dram_capacity == 64 << 20 and register.ssd_capacity == 256 << 20

        # multi-frame put / get / exists / delete (an empty value, a small one, one kept as a frame)
        values = {"empty": b"", "small": b"hello", "big": os.urandom(100_000)}
        reply, _ = client.request(m.Put(1, "ctx", list(values)), list(values.values()))
        assert reply == m.PutReply(1, [True, True, True])
        reply, frames = client.request(m.Get(2, "ctx", ["big", "missing", "small", "empty"]))
        assert reply == m.GetReply(2, [True, False, True, True])
        assert frames == [values["big"], values["small"], values["empty"]]
        reply, _ = client.request(m.Exists(3, "ctx", ["small", "missing"]))
        assert reply == m.ExistsReply(3, [True, False])
        reply, _ = client.request(m.Delete(4, "ctx", ["small", "small2"]))
        assert reply == m.DeleteReply(4, [True, False])
        reply, _ = client.request(m.Exists(5, "other-namespace", ["big"]))
        assert reply == m.ExistsReply(5, [False])  # namespaces never share keys

        large = os.urandom(20 << 20)
        reply, _ = client.request(m.Put(6, "ctx", ["large"]), [large])
        assert reply == m.PutReply(6, [True])
        reply, frames = client.request(m.Get(7, "ctx", ["large"]))
        assert reply.found == [True] and frames == [large]

        # bad requests get an error reply and the server carries on
        reply, _ = client.raw(msgpack.packb(["Bogus", {"req_id": 8}]))
        assert isinstance(reply, m.Error) and reply.req_id == 8 and "Bogus" in reply.message
        reply, _ = client.request(m.ViewQuery(9))
        assert isinstance(reply, m.Error) and reply.req_id == 9
        reply, _ = client.raw(b"\xc1 not msgpack")
        assert isinstance(reply, m.Error) and reply.req_id == -1
        reply, _ = client.raw(msgpack.packb(["Get", {"req_id": 10, "namespace": "ctx", "keys": [1, 2]}]))
        assert isinstance(reply, m.Error) and reply.req_id == 10
        reply, _ = client.request(m.Put(11, "ctx", ["a", "b"]), [b"only one"])
        assert reply.stored == [False, False] and "value frames" in reply.error

        # the namespace's share of its quota holds on this server, evicting only its own keys
        controller.wait_for(lambda: controller.of_type(m.Heartbeat), "a heartbeat")
        for i in range(4):
            reply, _ = client.request(m.Put(20 + i, "capped", [f"k{i}"]), [bytes(50_000)])
            assert reply.stored == [True]
        reply, _ = client.request(m.Put(24, "capped", ["too-big"]), [bytes(150_001)])
        assert reply.stored == [False]
        reply, _ = client.request(m.Exists(25, "capped", [f"k{i}" for i in range(4)]))
        assert reply.found == [False, True, True, True]
        reply, frames = client.request(m.Get(26, "ctx", ["big", "large"]))
        assert reply.found == [True, True]

        reply, _ = client.request(m.ServerStatsQuery(27))
        expected_ctx = 100_000 + (20 << 20)
        assert reply.server_id == "s0" and reply.num_keys == 6
        assert reply.namespaces == {"ctx": expected_ctx, "capped": 150_000}
        assert reply.ssd_bytes == expected_ctx + 150_000 and reply.dram_bytes == expected_ctx + 150_000
        assert (reply.hits, reply.misses) == (6, 1)

        # heartbeats carry the usage; a refused heartbeat (a controller restart) makes it register again
        controller.wait_for(lambda: any(h.namespaces == reply.namespaces for h in controller.of_type(m.Heartbeat)),
                            "a heartbeat with the usage")
        controller.refuse_next_heartbeat = True
        controller.wait_for(lambda: len(controller.of_type(m.Register)) >= 2, "a second Register")
        assert _terminate(proc) == 0

        # restart on the same SSD directory, with no controller listening: the data is back
        dead_controller = f"tcp://127.0.0.1:{free_tcp_port()}"
        proc = _start_server("s0", port, dead_controller, tmp_path)
        reply, frames = client.request(m.Get(30, "ctx", ["big", "large", "small", "empty"]))
        assert reply.found == [True, True, False, True]
        assert frames == [values["big"], large, b""]
        reply, _ = client.request(m.ServerStatsQuery(31))
        assert reply.num_keys == 6 and reply.namespaces["capped"] == 150_000
        reply, _ = client.request(m.Put(32, "ctx", ["after-restart"]), [b"x"])
        assert reply.stored == [True]
        assert _terminate(proc) == 0
    finally:
        client.close()
        stop_process(proc, grace_s=0)


def test_controller_link_retries_a_silent_controller_and_follows_quotas(controller):
    from meshserve.pool.server import ControllerLink, namespace_limits

    assert namespace_limits(m.RegisterReply(True, {"a": 1000, "b": 0}, num_servers=3)) == {"a": 333, "b": 0}
    context = zmq.Context()
    register = m.Register("s9", "tcp://127.0.0.1:1", 10, 0)
    silent = ControllerLink(context, f"tcp://127.0.0.1:{free_tcp_port()}", register, heartbeat_s=0.5)
    live = ControllerLink(context, controller.address, register, heartbeat_s=0.5)
    try:
        first_socket = silent.socket
        assert not silent.tick(100.0, {})  # sends Register, waits for the answer
        assert not silent.tick(101.0, {})  # still within the reply timeout
        assert silent.tick(100.0 + silent.reply_timeout_s, {})  # gives up: fresh socket, registers again
        assert silent.socket is not first_socket and not silent.registered

        live.tick(0.0, {"a": 5})
        assert live.socket.poll(int(TIMEOUT_S * 1000))
        assert live.receive() == {"capped": 150_000} and live.registered
        live.tick(1.0, {"capped": 7})  # now a heartbeat with the usage
        controller.wait_for(lambda: any(h.namespaces == {"capped": 7} for h in controller.of_type(m.Heartbeat)),
                            "the heartbeat")
    finally:
        silent.close()
        live.close()
        context.term()
