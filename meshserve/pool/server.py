"""A pool memory server: a ROUTER socket in front of a TieredStore (DRAM over an SSD directory).

Serves Put/Get/Exists/Delete/ServerStatsQuery (meshserve/pool/messages.py); values travel as
their own frames, received and sent without copying where ZMQ allows. The server registers
with the controller and heartbeats its usage per namespace; every answer carries the
namespace quotas and the server count, from which the server sets its per-namespace limits.

A namespace's limit on one server is `quota // num_servers`. This is an approximation: it
assumes keys hash evenly over the servers (what the consistent hash ring aims for), so a
namespace whose keys cluster on one server is held below its pool-wide quota there. A
namespace without a quota has no limit.

The server keeps serving when the controller is down: it logs a warning and re-registers
until the controller answers again.

Run: `meshserve pool server ...`, or the entry point `pool-server` of meshserve.utils.processes.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import msgpack
import zmq

from meshserve.pool import messages as m
from meshserve.pool.tiers import TieredStore
from meshserve.utils import cluster_auth

logger = logging.getLogger(__name__)

# Values at least this large keep the received frame's buffer instead of a copy. Smaller frames
# may share a receive buffer with other messages, which a kept reference would pin.
KEEP_FRAME_BYTES = 64 * 1024
_POLL_MS = 100  # longest wait between checks of the stop flag and the heartbeat clock
_DRAIN_BATCH = 64  # requests handled per wake-up before the heartbeat clock is checked again


class BadRequest(ValueError):
    pass


def namespace_limits(reply: m.RegisterReply) -> dict[str, int]:
    """Per-server byte limits from pool-wide quotas: an even share of each (see module doc)."""
    servers = max(1, int(reply.num_servers))
    return {namespace: int(quota) // servers for namespace, quota in reply.quotas.items()}


class ControllerLink:
    """Register, then heartbeat; re-register after silence or a refusal, never blocking the server."""

    def __init__(self, context: zmq.Context, address: str, register: m.Register, heartbeat_s: float):
        self.context = context
        self.address = address
        self.register = register
        self.heartbeat_s = heartbeat_s
        self.reply_timeout_s = max(3 * heartbeat_s, 2.0)
        self.registered = False
        self.socket: zmq.Socket | None = None
        self._awaiting_since: float | None = None
        self._next_send = 0.0
        self._silent_warned = False
        self._connect()

    def _connect(self) -> None:
        if self.socket is not None:
            self.socket.close(0)  # drops whatever queued for a controller that is not there
        self.socket = cluster_auth.client(self.context.socket(zmq.DEALER), self.address)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(self.address)

    def tick(self, now: float, usage: dict[str, int]) -> bool:
        """Send what is due; returns True when the socket was replaced (the caller re-polls it)."""
        if self._awaiting_since is not None:
            if now - self._awaiting_since < self.reply_timeout_s:
                return False
            if not self._silent_warned:
                why = cluster_auth.probe(self.address, 0.5) or "it takes connections but does not answer"
                logger.warning("pool controller is not answering (%s); serving on and retrying", why)
                self._silent_warned = True
            self.registered = False
            self._awaiting_since = None
            self._connect()
            self._send(now, usage)
            return True
        if now >= self._next_send:
            self._send(now, usage)
        return False

    def _send(self, now: float, usage: dict[str, int]) -> None:
        message = self.register if not self.registered else m.Heartbeat(self.register.server_id, usage)
        try:
            self.socket.send(m.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the reply timeout handles a controller that cannot take it
        self._awaiting_since = now
        self._next_send = now + self.heartbeat_s

    def receive(self) -> dict[str, int] | None:
        """Handle one answer; returns the namespace limits it sets, or None."""
        try:
            reply = m.decode(self.socket.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None
        except Exception as exc:
            logger.warning("bad message from the pool controller: %s", exc)
            return None
        self._awaiting_since = None
        if not isinstance(reply, m.RegisterReply):
            logger.warning("unexpected %s from the pool controller", type(reply).__name__)
            return None
        if self._silent_warned:
            logger.info("pool controller %s answers again", self.address)
            self._silent_warned = False
        if not reply.accepted:
            if self.registered or reply.error:
                logger.warning("pool controller refused us (%s); registering again", reply.error)
            self.registered = False
            self._next_send = 0.0  # register at once
            return None
        if not self.registered:
            logger.info("registered with the pool controller (%d server(s))", reply.num_servers)
        self.registered = True
        return namespace_limits(reply)

    def close(self) -> None:
        self.socket.close(0)


class PoolServer:
    def __init__(self, server_id: str, bind: str, controller: str | None, dram_bytes: int,
                 ssd_dir: str | None = None, ssd_bytes: int = 0, heartbeat_s: float = 1.0,
                 advertise: str | None = None):
        self.server_id = server_id
        self.store = TieredStore(dram_bytes, ssd_dir, ssd_bytes)
        self.context = zmq.Context()
        self.router = cluster_auth.server(self.context.socket(zmq.ROUTER), bind)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(bind)
        # where clients reach us: the bound endpoint (resolves port 0/`*`) unless told otherwise
        self.address = advertise or self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.hits = 0
        self.misses = 0
        self.running = True
        self.link = None
        if controller:
            register = m.Register(server_id=server_id, address=self.address,
                                  dram_capacity=dram_bytes, ssd_capacity=ssd_bytes if ssd_dir else 0)
            self.link = ControllerLink(self.context, controller, register, heartbeat_s)
        logger.info("pool server %s serving on %s (%d keys from SSD, DRAM %d bytes, SSD %s)",
                    server_id, self.address, self.store.num_keys, dram_bytes,
                    f"{ssd_bytes} bytes in {ssd_dir}" if ssd_dir else "off")

    def stop(self, *_: Any) -> None:
        self.running = False

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        link_socket = self._poll_link(poller, None)
        try:
            while self.running:
                events = dict(poller.poll(_POLL_MS))
                if self.router in events:
                    for _ in range(_DRAIN_BATCH):
                        try:
                            frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._serve_one(frames)
                if self.link is not None:
                    if link_socket in events:
                        limits = self.link.receive()
                        if limits is not None:
                            self.store.set_namespace_limits(limits)
                    if self.link.tick(time.monotonic(), self.store.namespace_bytes()):
                        link_socket = self._poll_link(poller, link_socket)
        finally:
            self.close()

    def _poll_link(self, poller: zmq.Poller, old: zmq.Socket | None) -> zmq.Socket | None:
        if old is not None:
            poller.unregister(old)
        if self.link is None:
            return None
        poller.register(self.link.socket, zmq.POLLIN)
        return self.link.socket

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.router.close(0)
        self.context.term()
        logger.info("pool server %s stopped", self.server_id)

    # ------------------------------------------------------------ requests
    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        identity, header, values = frames[0], frames[1].bytes if len(frames) > 1 else b"", frames[2:]
        try:
            reply, reply_values = self.handle(header, values)
        except BadRequest as exc:
            reply, reply_values = m.Error(req_id=_req_id_of(header), message=str(exc)), []
        except Exception as exc:  # a request must never take the server down
            logger.exception("pool server %s: request failed", self.server_id)
            reply, reply_values = m.Error(req_id=_req_id_of(header), message=f"server error: {exc}"), []
        self.router.send_multipart([identity, m.encode(reply), *reply_values], copy=False)

    def handle(self, header: bytes, frames: list[zmq.Frame]) -> tuple[Any, list]:
        """The reply (and its value frames) to one request."""
        try:
            request = m.decode(header)
        except Exception as exc:
            raise BadRequest(f"undecodable request: {exc}") from None
        handler = self._HANDLERS.get(type(request))
        if handler is None:
            raise BadRequest(f"{type(request).__name__} is not a pool server request")
        return handler(self, request, frames)

    def _on_put(self, request: m.Put, frames: list[zmq.Frame]) -> tuple[m.PutReply, list]:
        return self._put(request, frames), []

    def _on_stats(self, request: m.ServerStatsQuery, frames: list[zmq.Frame]) -> tuple[m.ServerStats, list]:
        return self._stats(request), []

    def _on_get(self, request: m.Get, frames: list[zmq.Frame]) -> tuple[m.GetReply, list]:
        return self._get(request)

    def _on_exists(self, request: m.Exists, frames: list[zmq.Frame]) -> tuple[m.ExistsReply, list]:
        return m.ExistsReply(request.req_id, [self.store.exists(request.namespace, k) for k in request.keys]), []

    def _on_delete(self, request: m.Delete, frames: list[zmq.Frame]) -> tuple[m.DeleteReply, list]:
        return m.DeleteReply(request.req_id, [self.store.delete(request.namespace, k) for k in request.keys]), []

    _HANDLERS: ClassVar[dict[type, Callable]] = {
        m.Put: _on_put, m.ServerStatsQuery: _on_stats, m.Get: _on_get, m.Exists: _on_exists, m.Delete: _on_delete}

    def _put(self, request: m.Put, frames: list[zmq.Frame]) -> m.PutReply:
        if len(frames) != len(request.keys):
            return m.PutReply(request.req_id, [False] * len(request.keys),
                              error=f"{len(request.keys)} keys but {len(frames)} value frames")
        stored = [self.store.put(request.namespace, key, _value_of(frame))
                  for key, frame in zip(request.keys, frames)]
        return m.PutReply(request.req_id, stored)

    def _get(self, request: m.Get) -> tuple[m.GetReply, list]:
        found, values = [], []
        for key in request.keys:
            value = self.store.get(request.namespace, key)
            found.append(value is not None)
            if value is not None:
                values.append(value)
        self.hits += len(values)
        self.misses += len(found) - len(values)
        return m.GetReply(request.req_id, found), values

    def _stats(self, request: m.ServerStatsQuery) -> m.ServerStats:
        return m.ServerStats(req_id=request.req_id, server_id=self.server_id, dram_bytes=self.store.dram_used,
                             ssd_bytes=self.store.ssd_used, num_keys=self.store.num_keys,
                             namespaces=self.store.namespace_bytes(), hits=self.hits, misses=self.misses)


def _value_of(frame: zmq.Frame) -> bytes | memoryview:
    return frame.buffer if len(frame) >= KEEP_FRAME_BYTES else frame.bytes


def _req_id_of(header: bytes) -> int:
    """The request's id when the header carries one, so the client can match the error."""
    try:
        _, fields = msgpack.unpackb(header, raw=False, strict_map_key=False)
        req_id = fields.get("req_id", -1)
        return req_id if isinstance(req_id, int) else -1
    except Exception:
        return -1


def run_server(server_id: str, bind: str, controller: str | None, dram_bytes: int,
               ssd_dir: str | None = None, ssd_bytes: int = 0, heartbeat_s: float = 1.0,
               advertise: str | None = None, log_level: int = logging.INFO) -> None:
    """Serve until SIGTERM/SIGINT (signals are only caught when called on the main thread)."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s pool-server {server_id} %(levelname)s %(message)s")
    server = PoolServer(server_id, bind, controller, dram_bytes, ssd_dir, ssd_bytes, heartbeat_s, advertise)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, server.stop)
    server.serve()
