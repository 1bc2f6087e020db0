"""The pool controller: membership of the memory servers, the DHT view, namespace quotas.

Servers Register once and then Heartbeat; each gets a RegisterReply with the current quotas
and server count, so quota and membership changes reach them within one heartbeat. A server
silent for `server_timeout_s` leaves the view and the view's version goes up; clients (the
SDK) ask for the view with ViewQuery and route keys themselves on the hash ring it describes.
Lowering a namespace's quota below what the servers hold of it evicts data, so it needs `force`.
Only holders of the cluster secret reach the controller (CurveZMQ, `meshserve.utils.cluster_auth`);
a frame that is not a pool message is logged, counted and dropped. State lives in memory: after a
controller restart the servers register again on their next heartbeat (they get `accepted=False`
for a heartbeat from an unknown id).

Run: `meshserve pool controller --bind tcp://127.0.0.1:PORT`, or the entry point `pool-controller` of
meshserve.utils.processes.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import zmq

from meshserve.pool import messages as m
from meshserve.pool.hashring import DEFAULT_VIRTUAL_NODES
from meshserve.utils import cluster_auth

logger = logging.getLogger(__name__)

DEFAULT_SERVER_TIMEOUT_S = 5.0


@dataclass
class ServerEntry:
    address: str
    dram_capacity: int
    ssd_capacity: int
    last_seen: float
    usage: dict[str, int] = field(default_factory=dict)  # bytes per namespace, from its last heartbeat


class ControllerState:
    """What the controller knows, and its answer to each message (no I/O, so it is testable with a fake clock)."""

    def __init__(self, server_timeout_s: float = DEFAULT_SERVER_TIMEOUT_S,
                 virtual_nodes: int = DEFAULT_VIRTUAL_NODES, clock: Callable[[], float] = time.monotonic):
        self.server_timeout_s = server_timeout_s
        self.virtual_nodes = virtual_nodes
        self.clock = clock
        self.servers: dict[str, ServerEntry] = {}
        self.quotas: dict[str, int] = {}
        self.version = 0

    def handle(self, message: Any) -> Any:
        """The reply to one message (None for messages that get none)."""
        self.expire()
        handler = self._HANDLERS.get(type(message))
        if handler is None:
            logger.warning("pool controller: unexpected %s", type(message).__name__)
            return None
        return handler(self, message)

    def _view_query(self, message: m.ViewQuery) -> m.View:
        return self.view(message.req_id)

    def expire(self) -> list[str]:
        """Drop servers silent for longer than the timeout; returns their ids."""
        now = self.clock()
        gone = [sid for sid, entry in self.servers.items() if now - entry.last_seen > self.server_timeout_s]
        for sid in gone:
            del self.servers[sid]
            logger.warning("pool server %s left the view (silent for more than %.1f s)", sid, self.server_timeout_s)
        if gone:
            self.version += 1
        return gone

    def view(self, req_id: int = 0) -> m.View:
        return m.View(req_id=req_id, version=self.version,
                      servers={sid: e.address for sid, e in sorted(self.servers.items())},
                      virtual_nodes=self.virtual_nodes, quotas=dict(self.quotas))

    def namespace_usage(self, namespace: str) -> int:
        """Bytes of `namespace` the live servers held at their last heartbeats."""
        return sum(entry.usage.get(namespace, 0) for entry in self.servers.values())

    def _register_reply(self) -> m.RegisterReply:
        return m.RegisterReply(accepted=True, quotas=dict(self.quotas), num_servers=len(self.servers))

    def _register(self, msg: m.Register) -> m.RegisterReply:
        if not msg.server_id or not msg.address:
            return m.RegisterReply(accepted=False, error="a server needs an id and an address")
        known = self.servers.get(msg.server_id)
        if known is None or known.address != msg.address:
            self.version += 1
            logger.info("pool server %s joined at %s", msg.server_id, msg.address)
        self.servers[msg.server_id] = ServerEntry(
            address=msg.address, dram_capacity=msg.dram_capacity, ssd_capacity=msg.ssd_capacity,
            last_seen=self.clock(), usage=known.usage if known else {})
        return self._register_reply()

    def _heartbeat(self, msg: m.Heartbeat) -> m.RegisterReply:
        entry = self.servers.get(msg.server_id)
        if entry is None:
            return m.RegisterReply(accepted=False, quotas=dict(self.quotas), num_servers=len(self.servers),
                                   error=f"unknown server {msg.server_id!r}: register again")
        entry.last_seen = self.clock()
        entry.usage = dict(msg.namespaces)
        return self._register_reply()

    def _create_namespace(self, msg: m.CreateNamespace) -> m.NamespaceReply:
        if not msg.namespace:
            return m.NamespaceReply(req_id=msg.req_id, ok=False, error="a namespace needs a name")
        if msg.quota_bytes < 0:
            return m.NamespaceReply(req_id=msg.req_id, ok=False,
                                    error=f"quota must be >= 0 bytes, got {msg.quota_bytes}")
        used = self.namespace_usage(msg.namespace)
        if msg.quota_bytes < used and not msg.force:
            return m.NamespaceReply(req_id=msg.req_id, ok=False, error=(
                f"namespace {msg.namespace!r} holds {used} bytes now; a quota of {msg.quota_bytes} bytes would "
                f"evict the rest; shrink it with force (`meshserve pool namespace ... --force`)"))
        self.quotas[msg.namespace] = msg.quota_bytes
        logger.info("pool namespace %s: quota %d bytes", msg.namespace, msg.quota_bytes)
        return m.NamespaceReply(req_id=msg.req_id, ok=True)

    _HANDLERS: ClassVar[dict[type, Callable]] = {m.Register: _register, m.Heartbeat: _heartbeat,
                                                 m.ViewQuery: _view_query, m.CreateNamespace: _create_namespace}


def run_controller(bind: str, server_timeout_s: float = DEFAULT_SERVER_TIMEOUT_S,
                   virtual_nodes: int = DEFAULT_VIRTUAL_NODES, stop: threading.Event | None = None) -> None:
    """Serve the controller on a ROUTER socket at `bind` until `stop` is set (or forever)."""
    state = ControllerState(server_timeout_s, virtual_nodes)
    context = zmq.Context()
    sock = cluster_auth.server(context.socket(zmq.ROUTER), bind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    logger.info("pool controller listening on %s (server timeout %.1f s)", bind, server_timeout_s)
    # Wake up often enough to notice silent servers and the stop event without traffic.
    tick_ms = max(10, min(200, int(server_timeout_s * 1000 / 4)))
    try:
        while stop is None or not stop.is_set():
            if not sock.poll(tick_ms, zmq.POLLIN):
                state.expire()
                continue
            identity, *frames = sock.recv_multipart()
            try:
                reply = state.handle(m.decode(frames[0] if frames else b""))
            except Exception as exc:  # a malformed message must not stop the controller
                logger.warning("pool controller: dropped a bad message (%s; %d bad frame(s) so far)", exc,
                               m.decode_errors)
                continue
            if reply is not None:
                sock.send_multipart([identity, m.encode(reply)])
    finally:
        sock.close(0)
        context.term()


def run_controller_process(bind: str, server_timeout_s: float = DEFAULT_SERVER_TIMEOUT_S,
                           virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
    """The controller as a process of its own (the entry point `pool-controller`), until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run_controller(bind, server_timeout_s, virtual_nodes)
    except KeyboardInterrupt:
        pass
