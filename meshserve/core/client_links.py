"""How a TE master meets its clients.

`ClientLink`: one client that started the TE (the offline `LLM`, `meshserve serve` with one TE): the
client binds two IPC sockets and the master connects to them.

`GroupLink`: the master of one self-contained DP group, behind its TE shell.

`RouterLinks`: a TE in a deployment (`meshserve te`): the master binds its own input address, any
number of job executors send to it, and each request's outputs go straight to the frontend address the
request names (output short-circuiting). The TE announces itself to the job executors it was told about
with a heartbeat that carries its registration and its load.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.codec import MAX_INBOX_BYTES
from meshserve.wire.heartbeat import EngineHeartbeat

if TYPE_CHECKING:
    from meshserve.core.dp_group import GroupPlace

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
GROUP_REPORT_INTERVAL_S = 0.2  # a self-contained DP group's load report to its TE shell (placement reads it)


class ClientLink:
    def __init__(self, ctx: zmq.Context, input_addr: str, output_addr: str) -> None:
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.connect(input_addr)
        self.outbox = ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(output_addr)
        self.output_addr = output_addr  # self-contained DP groups send their outputs here themselves
        self.listen_addr = ""

    def send(self, item, reply_to: str = "") -> None:
        self.outbox.send(codec.encode(item))

    def broadcast(self, item) -> None:
        self.outbox.send(codec.encode(item))

    def send_to(self, addr: str, item) -> None:
        raise RuntimeError("a TE started by one client cannot reach other engines; run it with `meshserve te`")

    def tick(self, now: float, heartbeat: Callable[[], EngineHeartbeat]) -> None:
        pass

    def say_goodbye(self, heartbeat: EngineHeartbeat) -> None:
        pass

    def close(self) -> None:
        self.inbox.close(0)
        self.outbox.close()


class RouterLinks:
    def __init__(self, ctx: zmq.Context, listen_addr: str, register_addrs: list[str],
                 advertise_host: str = "127.0.0.1") -> None:
        self.ctx = ctx
        self.inbox = ctx.socket(zmq.PULL)
        # a larger frame closes its sender's connection before it is buffered whole
        self.inbox.setsockopt(zmq.MAXMSGSIZE, MAX_INBOX_BYTES)
        host, _, port = listen_addr.removeprefix("tcp://").rpartition(":")
        cluster_auth.server(self.inbox)  # only holders of the cluster secret may send this TE anything
        self.inbox.bind(f"tcp://{host}:{'*' if port in ('0', '') else port}")
        bound_port = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        # the address peers use: a wildcard bind is announced under this host's reachable name
        self.listen_addr = f"tcp://{advertise_host if host in ('0.0.0.0', '*') else host}:{bound_port}"
        self._peers = Peers(ctx)  # frontends, other TEs
        self._register = [self._peers.socket(addr) for addr in register_addrs]
        self._next_heartbeat = 0.0

    def send_to(self, addr: str, item) -> None:
        self._peers.send_to(addr, item)

    def send(self, item, reply_to: str = "") -> None:
        if reply_to:
            self.send_to(reply_to, item)
        else:
            logger.warning("dropping %s: the request named no reply address", type(item).__name__)

    def broadcast(self, item) -> None:
        """To every frontend that sent requests and every job executor this TE registers with."""
        for addr in self._peers.addrs():
            self.send_to(addr, item)

    def tick(self, now: float, heartbeat: Callable[[], EngineHeartbeat]) -> None:
        if now < self._next_heartbeat or not self._register:
            return
        self._next_heartbeat = now + HEARTBEAT_INTERVAL_S
        data = codec.encode(heartbeat())
        for sock in self._register:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                pass  # a JE that is not there yet gets the next one

    def say_goodbye(self, heartbeat: EngineHeartbeat) -> None:
        heartbeat.leaving = True
        heartbeat.timestamp = time.time()
        data = codec.encode(heartbeat)
        for sock in self._register:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        self.inbox.close(0)
        self._peers.close()


class GroupLink:
    """How a self-contained DP group's master meets the world (core/te_shell.py): requests and the shell's
    commands come from the TE shell; each request's outputs go straight to its client (the engine client's
    socket, or the frontend the request names), never through the shell; its heartbeats, readiness and
    failures go to the shell, which speaks for the TE."""

    def __init__(self, ctx: zmq.Context, place: GroupPlace, shell_addr: str, report_addr: str,
                 client_output_addr: str = "", te_addr: str = "") -> None:
        """`te_addr`: the TE's own input address (the shell's), where other TEs reach this group too (a decode
        TE's release of the KV this prefill group holds for it goes to the shell, which tells every group)."""
        self.place = place  # which group, in which world
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.connect(shell_addr)
        self._report = ctx.socket(zmq.PUSH)
        self._report.setsockopt(zmq.LINGER, 2000)
        self._report.connect(report_addr)
        self._client: zmq.Socket | None = None  # a TE of one client: its output socket
        if client_output_addr:
            self._client = ctx.socket(zmq.PUSH)
            self._client.setsockopt(zmq.LINGER, 2000)
            self._client.connect(client_output_addr)
        self._peers = Peers(ctx)
        self.listen_addr = te_addr
        self._next_heartbeat = 0.0

    @property
    def has_client(self) -> bool:
        """Started for one client (its outputs go to that client's socket, whatever a message names)."""
        return self._client is not None

    def send(self, item, reply_to: str = "") -> None:
        if self._client is not None:
            self._client.send(codec.encode(item))
        elif reply_to:
            self._peers.send_to(reply_to, item)
        else:
            logger.warning("dropping %s: the request named no reply address", type(item).__name__)

    def send_to(self, addr: str, item) -> None:
        self._peers.send_to(addr, item)

    def broadcast(self, item) -> None:
        """What concerns every client of the TE (its failure) goes to the shell, which tells them."""
        self.report(item)

    def report(self, item) -> None:
        self._report.send(codec.encode(item))

    def tick(self, now: float, heartbeat: Callable[[], EngineHeartbeat]) -> None:
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + GROUP_REPORT_INTERVAL_S
            self.report(heartbeat())

    def say_goodbye(self, heartbeat: EngineHeartbeat) -> None:
        pass

    def close(self) -> None:
        self.inbox.close(0)
        self._report.close()
        if self._client is not None:
            self._client.close()
        self._peers.close()


class Peers:
    """PUSH sockets to the peers a TE sends to by address (frontends, other TEs, job executors), opened on first
    use; sending never blocks: a peer that is gone (its queue full) loses the message, not the TE's loop."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._sockets: dict[str, zmq.Socket] = {}
        self._dropped = 0

    def socket(self, addr: str) -> zmq.Socket:
        sock = self._sockets.get(addr)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 500)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            cluster_auth.client(sock, addr)
            sock.connect(addr)
            self._sockets[addr] = sock
        return sock

    def addrs(self) -> list[str]:
        return list(self._sockets)

    def send_to(self, addr: str, item) -> None:
        try:
            self.socket(addr).send(codec.encode(item), zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1
            if self._dropped in (1, 10, 100) or self._dropped % 1000 == 0:
                logger.warning("%d message(s) dropped: peer %s does not take them", self._dropped, addr)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
