"""The pool SDK used inside TEs: batched put / get / exists / delete, synchronous and async.

`PoolClient` fetches the view from the controller, routes every key on the hash ring to its
server and batches the keys of one call per server. One background I/O thread owns every ZMQ
socket (they are not thread safe): callers hand it work through a queue and get a
`concurrent.futures.Future`. Values go out and come back as their own frames without copying
(`copy=False`); `get` returns memoryviews over the received frames.

The pool is a cache, so it never fails a caller: a server that is down or does not answer
within `timeout_s` yields misses (get / exists), False (put / delete) and one logged warning
per incident (the next warning for that server comes only after it has answered again).
"""
from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from meshserve.pool import messages as m
from meshserve.pool.hashring import HashRing
from meshserve.utils import cluster_auth

logger = logging.getLogger(__name__)

Value = bytes | bytearray | memoryview


@dataclass
class _Call:
    """One caller's request; it may span several servers."""
    kind: str  # put | get | exists | delete | stats
    namespace: str
    keys: list[str]
    values: list[Value]
    future: Future
    deadline: float
    result: Any = None
    outstanding: int = 0


@dataclass
class _ServerRequest:
    call: _Call
    server_id: str
    indices: list[int]  # positions in call.keys
    frames: list[Any] = field(default_factory=list)
    sent: bool = False


@dataclass
class _Server:
    address: str
    sock: zmq.Socket


class PoolClient:
    def __init__(self, controller_addr: str, timeout_s: float = 1.0, view_refresh_s: float = 2.0,
                 name: str = "pool-client"):
        self.controller_addr = controller_addr
        self.timeout_s = timeout_s
        self.view_refresh_s = view_refresh_s
        self._req_ids = itertools.count(1)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        # Everything below belongs to the I/O thread.
        self._context = zmq.Context()
        self._controller = cluster_auth.client(self._context.socket(zmq.DEALER), controller_addr)
        self._controller.setsockopt(zmq.LINGER, 0)
        self._controller.connect(controller_addr)
        self._view: m.View | None = None
        self._ring = HashRing()
        self._servers: dict[str, _Server] = {}
        self._pending: dict[int, _ServerRequest] = {}   # req_id -> request sent or waiting to be sent
        self._waiting_for_view: list[_Call] = []
        self._controller_calls: dict[int, Future] = {}  # CreateNamespace in flight
        self._controller_deadlines: dict[int, float] = {}
        self._view_query_at: float | None = None         # when the outstanding ViewQuery went out
        self._next_refresh = 0.0
        self._unhealthy: set[str] = set()                # servers (and "controller") in a warned incident
        self.namespace_error: str | None = None          # why the last create_namespace was refused
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public API
    def put_async(self, namespace: str, items: Mapping[str, Value]) -> Future:
        """Future of {key: stored}."""
        keys = list(items)
        return self._submit("put", namespace, keys, [items[k] for k in keys])

    def get_async(self, namespace: str, keys: Iterable[str]) -> Future:
        """Future of {key: value} for the keys found (misses are absent)."""
        return self._submit("get", namespace, list(keys))

    def exists_async(self, namespace: str, keys: Iterable[str]) -> Future:
        """Future of [found] in the order of `keys`."""
        return self._submit("exists", namespace, list(keys))

    def delete_async(self, namespace: str, keys: Iterable[str]) -> Future:
        """Future of [deleted] in the order of `keys`."""
        return self._submit("delete", namespace, list(keys))

    def put(self, namespace: str, items: Mapping[str, Value]) -> dict[str, bool]:
        return self._wait(self.put_async(namespace, items))

    def get(self, namespace: str, keys: Iterable[str]) -> dict[str, Value]:
        return self._wait(self.get_async(namespace, keys))

    def exists(self, namespace: str, keys: Iterable[str]) -> list[bool]:
        return self._wait(self.exists_async(namespace, keys))

    def delete(self, namespace: str, keys: Iterable[str]) -> list[bool]:
        return self._wait(self.delete_async(namespace, keys))

    def stats(self) -> dict[str, m.ServerStats | None]:
        """Usage of every server in the view (None for one that did not answer)."""
        return self._wait(self._submit("stats", "", []))

    def view(self) -> m.View | None:
        """The current view (fetched if there is none yet); None if the controller does not answer."""
        return self._wait(self._submit("view", "", []))

    def create_namespace(self, namespace: str, quota_bytes: int, force: bool = False) -> bool:
        """Set (or change) a namespace's byte quota over the whole pool; False if refused or unanswered
        (`namespace_error` then says why). A quota below the namespace's current use needs `force`."""
        future: Future = Future()
        self._inbox.put(("namespace", namespace, quota_bytes, force, future))
        self._wake()
        return self._wait(future)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(("close",))
        self._wake()
        self._thread.join(timeout=self.timeout_s + 5.0)
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ caller side
    def _submit(self, kind: str, namespace: str, keys: list[str], values: list[Value] | None = None) -> Future:
        future: Future = Future()
        if self._closed:
            raise RuntimeError("PoolClient is closed")
        call = _Call(kind, namespace, keys, values or [], future, deadline=time.monotonic() + self.timeout_s)
        self._inbox.put(("call", call))
        self._wake()
        return future

    def _wait(self, future: Future) -> Any:
        # The I/O thread completes every call by its deadline; the margin only guards against a dead thread.
        return future.result(timeout=2 * self.timeout_s + 10.0)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the buffer is full of wake-ups already, or we are closing

    # ------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        poller.register(self._controller, zmq.POLLIN)
        try:
            while True:
                if not self._drain_inbox(poller):
                    break
                self._maybe_refresh_view()
                self._retry_unsent()
                self._expire(time.monotonic())
                for sock, _ in poller.poll(self._poll_timeout_ms()):
                    if sock is self._controller:
                        self._on_controller_reply(poller)
                    elif isinstance(sock, zmq.Socket):
                        self._on_server_reply(sock)
        except Exception:  # never leave callers hanging on a dead thread
            logger.exception("pool client I/O thread failed")
        finally:
            self._shutdown()

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        wake = [self._next_refresh]
        wake += [r.call.deadline for r in self._pending.values()]
        wake += [c.deadline for c in self._waiting_for_view]
        wake += list(self._controller_deadlines.values())
        if self._view_query_at is not None:
            wake.append(self._view_query_at + self.timeout_s)
        if any(not r.sent for r in self._pending.values()):
            wake.append(now + 0.005)  # a server whose connection is still being made
        return max(0, min(1000, int((min(wake) - now) * 1000) + 1))

    def _drain_inbox(self, poller: zmq.Poller) -> bool:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if item[0] == "close":
                return False
            if item[0] == "namespace":
                self._send_create_namespace(*item[1:])
            else:
                self._start(item[1], poller)

    def _start(self, call: _Call, poller: zmq.Poller) -> None:
        if self._view is None:
            self._waiting_for_view.append(call)
            self._query_view()
            return
        if call.kind == "view":
            call.future.set_result(self._view)
            return
        call.result = _empty_result(call)
        if call.kind == "stats":
            groups = {sid: [] for sid in self._servers}
            call.result = dict.fromkeys(groups)
        else:
            groups: dict[str, list[int]] = {}
            for i, key in enumerate(call.keys):
                owner = self._ring.owner(key)
                if owner is not None:
                    groups.setdefault(owner, []).append(i)
        call.outstanding = len(groups)
        if not groups:
            call.future.set_result(call.result)
            return
        for sid, indices in groups.items():
            req_id = next(self._req_ids)
            request = _ServerRequest(call, sid, indices, _request_frames(call, req_id, indices))
            self._pending[req_id] = request
            self._send(req_id, request)

    def _send(self, req_id: int, request: _ServerRequest) -> None:
        server = self._servers.get(request.server_id)
        if server is None:
            self._fail(req_id, "left the view")
            return
        try:
            server.sock.send_multipart(request.frames, flags=zmq.NOBLOCK, copy=False)
            request.sent = True
            request.frames = []
        except zmq.Again:
            # Not connected (yet): a server already known to be down misses at once; otherwise we retry
            # until the deadline, since a fresh connection takes a moment.
            if request.server_id in self._unhealthy:
                self._fail(req_id, "not connected")

    def _retry_unsent(self) -> None:
        for req_id, request in list(self._pending.items()):
            if not request.sent:
                self._send(req_id, request)

    def _expire(self, now: float) -> None:
        for req_id, request in list(self._pending.items()):
            if request.call.deadline <= now:
                self._fail(req_id, f"no answer within {self.timeout_s:.2f} s")
        for call in [c for c in self._waiting_for_view if c.deadline <= now]:
            self._waiting_for_view.remove(call)
            _finish_unanswered(call)
        for req_id, deadline in list(self._controller_deadlines.items()):
            if deadline <= now:
                del self._controller_deadlines[req_id]
                self._warn_once("controller", f"pool controller {self.controller_addr} did not answer")
                self._controller_calls.pop(req_id).set_result(False)
        if self._view_query_at is not None and now - self._view_query_at > self.timeout_s:
            self._view_query_at = None
            self._warn_once("controller", f"pool controller {self.controller_addr} did not answer; "
                                          "serving from the last view")

    def _fail(self, req_id: int, why: str) -> None:
        """A server request that gets no answer: its keys count as misses."""
        request = self._pending.pop(req_id)
        self._warn_once(request.server_id, f"pool server {request.server_id} "
                                           f"({self._address_of(request.server_id)}): {why}; treating as misses")
        self._next_refresh = 0.0  # the view may have changed
        self._complete_part(request.call)

    def _complete_part(self, call: _Call) -> None:
        call.outstanding -= 1
        if call.outstanding == 0 and not call.future.done():
            call.future.set_result(call.result)

    def _on_server_reply(self, sock: zmq.Socket) -> None:
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        try:
            reply = m.decode(frames[0].bytes)
        except Exception as exc:
            logger.warning("pool client: undecodable answer from a server (%s)", exc)
            return
        request = self._pending.pop(getattr(reply, "req_id", None), None)
        if request is None:
            return  # an answer that came after its deadline
        try:
            self._apply_server_reply(request, reply, frames)
        except Exception as exc:  # a reply that does not match its request (e.g. fewer value frames than found)
            logger.warning("pool client: dropped a malformed answer from a server (%s)", exc)
            self._complete_part(request.call)

    def _apply_server_reply(self, request: _ServerRequest, reply: Any, frames: list) -> None:
        if request.server_id in self._unhealthy:
            self._unhealthy.discard(request.server_id)
            logger.info("pool server %s answers again", request.server_id)
        apply = _REPLY_HANDLERS.get(type(reply))
        if apply is None:  # an error answer: its keys are misses
            logger.warning("pool server %s refused a request: %s", request.server_id, reply)
        else:
            apply(request, reply, frames)
        if getattr(reply, "error", None):
            logger.warning("pool server %s: %s", request.server_id, reply.error)
        self._complete_part(request.call)

    # ------------------------------------------------------------ controller
    def _query_view(self) -> None:
        if self._view_query_at is not None:
            return
        try:
            self._controller.send(m.encode(m.ViewQuery(req_id=next(self._req_ids))), flags=zmq.NOBLOCK)
            self._view_query_at = time.monotonic()
        except zmq.Again:
            pass

    def _maybe_refresh_view(self) -> None:
        if time.monotonic() >= self._next_refresh:
            self._next_refresh = time.monotonic() + self.view_refresh_s
            self._query_view()

    def _send_create_namespace(self, namespace: str, quota_bytes: int, force: bool, future: Future) -> None:
        req_id = next(self._req_ids)
        self._controller_calls[req_id] = future
        self._controller_deadlines[req_id] = time.monotonic() + self.timeout_s
        self.namespace_error = f"the pool controller at {self.controller_addr} did not answer"
        try:
            self._controller.send(m.encode(m.CreateNamespace(req_id, namespace, quota_bytes, force)),
                                  flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # answered False at the deadline

    def _on_controller_reply(self, poller: zmq.Poller) -> None:
        try:
            frames = self._controller.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            reply = m.decode(frames[0])
        except m.PoolMessageError as exc:
            logger.warning("pool client: dropped an undecodable answer from the controller (%s)", exc)
            return
        if "controller" in self._unhealthy:
            self._unhealthy.discard("controller")
            logger.info("pool controller %s answers again", self.controller_addr)
        if isinstance(reply, m.View):
            self._view_query_at = None
            self._apply_view(reply, poller)
            waiting, self._waiting_for_view = self._waiting_for_view, []
            for call in waiting:
                self._start(call, poller)
        elif isinstance(reply, m.NamespaceReply):
            self._controller_deadlines.pop(reply.req_id, None)
            future = self._controller_calls.pop(reply.req_id, None)
            if future is not None:
                if not reply.ok:
                    logger.warning("pool namespace refused: %s", reply.error)
                self.namespace_error = None if reply.ok else reply.error
                future.set_result(bool(reply.ok))

    def _apply_view(self, view: m.View, poller: zmq.Poller) -> None:
        previous = self._view
        self._view = view
        if previous is not None and previous.version == view.version and previous.servers == view.servers:
            return
        for sid in list(self._servers):
            if view.servers.get(sid) != self._servers[sid].address:
                server = self._servers.pop(sid)
                poller.unregister(server.sock)
                server.sock.close(0)
        for sid, address in view.servers.items():
            if sid not in self._servers:
                sock = cluster_auth.client(self._context.socket(zmq.DEALER), address)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a server that is not connected
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                sock.connect(address)
                poller.register(sock, zmq.POLLIN)
                self._servers[sid] = _Server(address, sock)
        self._ring = HashRing(view.servers, view.virtual_nodes)
        # Membership changes are worth a line; the first view of a client is not.
        (logger.info if previous is not None else logger.debug)(
            "pool view %d: %d servers", view.version, len(view.servers))

    # ------------------------------------------------------------ helpers
    def _address_of(self, server_id: str) -> str:
        server = self._servers.get(server_id)
        return server.address if server else "?"

    def _warn_once(self, who: str, text: str) -> None:
        if who not in self._unhealthy:
            self._unhealthy.add(who)
            logger.warning(text)

    def _shutdown(self) -> None:
        for request in list(self._pending.values()):
            if not request.call.future.done():
                request.call.future.set_result(request.call.result)
        for call in self._waiting_for_view:
            _finish_unanswered(call)
        for future in self._controller_calls.values():
            future.set_result(False)
        self._pending.clear()
        for server in self._servers.values():
            server.sock.close(0)
        self._controller.close(0)
        self._context.term()
        # Calls submitted while closing complete as misses.
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "call":
                _finish_unanswered(item[1])
            elif item[0] == "namespace":
                item[-1].set_result(False)


def _apply_get(request: _ServerRequest, reply: m.GetReply, frames: list) -> None:
    values = iter(frames[1:])
    for i, found in zip(request.indices, reply.found):
        if found:
            request.call.result[request.call.keys[i]] = next(values).buffer


def _apply_put(request: _ServerRequest, reply: m.PutReply, frames: list) -> None:
    for i, stored in zip(request.indices, reply.stored):
        request.call.result[request.call.keys[i]] = bool(stored)


def _apply_exists(request: _ServerRequest, reply: m.ExistsReply, frames: list) -> None:
    for i, found in zip(request.indices, reply.found):
        request.call.result[i] = bool(found)


def _apply_delete(request: _ServerRequest, reply: m.DeleteReply, frames: list) -> None:
    for i, deleted in zip(request.indices, reply.deleted):
        request.call.result[i] = bool(deleted)


def _apply_stats(request: _ServerRequest, reply: m.ServerStats, frames: list) -> None:
    request.call.result[request.server_id] = reply


# a server's answer -> how it fills the call's result
_REPLY_HANDLERS = {m.GetReply: _apply_get, m.PutReply: _apply_put, m.ExistsReply: _apply_exists,
                   m.DeleteReply: _apply_delete, m.ServerStats: _apply_stats}


def _empty_result(call: _Call) -> Any:
    if call.kind in ("get", "stats"):
        return {}
    if call.kind == "put":
        return {key: False for key in call.keys}
    return [False] * len(call.keys)


def _finish_unanswered(call: _Call) -> None:
    if call.future.done():
        return
    if call.kind == "view":
        call.future.set_result(None)
    else:
        call.future.set_result(_empty_result(call))


def _request_frames(call: _Call, req_id: int, indices: list[int]) -> list[Any]:
    keys = [call.keys[i] for i in indices]
    if call.kind == "put":
        return [m.encode(m.Put(req_id, call.namespace, keys)), *(call.values[i] for i in indices)]
    if call.kind == "get":
        return [m.encode(m.Get(req_id, call.namespace, keys))]
    if call.kind == "exists":
        return [m.encode(m.Exists(req_id, call.namespace, keys))]
    if call.kind == "delete":
        return [m.encode(m.Delete(req_id, call.namespace, keys))]
    return [m.encode(m.ServerStatsQuery(req_id))]
