"""The job executor's inbound sockets and the thread that reads them.

Every TE sends its jobs' outputs (and admin replies) to the JE's output socket and its heartbeats to the
registration socket; the KV-event SUB socket (the registry's) carries their prefix-cache events, and the
monitors of the JE's sockets to the TEs say when a TE's link drops (te_links.py). A reader thread polls them
and hands each batch of messages to the event loop, where all job state lives. Every
socket is authenticated (CurveZMQ with the cluster secret), and a frame that does not decode, or a message
whose handling fails, is logged, counted and dropped: nothing a peer sends stops the reader. Should the
reader itself fail, `error` says why (the JE is unhealthy from then on).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import zmq

from meshserve.router.engine_registry import EngineRegistry
from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.heartbeat import EngineHeartbeat

logger = logging.getLogger(__name__)

TICK_S = 0.2  # the longest the reader waits for a frame: liveness and KV-sync checks run at least this often
_MAX_REGISTRATION_BYTES = 1 << 20  # a heartbeat is a few hundred bytes; a peer sending more is cut off


class FrameReader:
    def __init__(self, ctx: zmq.Context, host: str, register_port: int, registry: EngineRegistry,
                 on_items: Callable[[list], None]) -> None:
        """Bind the output socket (a free port) and the registration socket (`register_port`, 0: a free one) on
        `host`; `on_items` takes each batch of messages on the event loop's thread."""
        self.registry, self.on_items = registry, on_items
        self.outputs = cluster_auth.server(ctx.socket(zmq.PULL))  # every TE's outputs for jobs from here
        self.outputs.setsockopt(zmq.RCVHWM, 0)
        self.output_addr = f"tcp://{host}:{self.outputs.bind_to_random_port(f'tcp://{host}')}"
        self.registrations = cluster_auth.server(ctx.socket(zmq.PULL))  # TEs' heartbeats
        self.registrations.setsockopt(zmq.MAXMSGSIZE, _MAX_REGISTRATION_BYTES)
        if register_port:
            self.registrations.bind(f"tcp://{host}:{register_port}")
        else:
            register_port = self.registrations.bind_to_random_port(f"tcp://{host}")
        self.register_addr = f"tcp://{host}:{register_port}"
        self.bad_frames = 0  # frames dropped: undecodable, or their handling failed
        self.error: str | None = None  # why the reader thread ended, when it ended on its own
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the messages go to (None before the JE is first used from one)."""
        return self._loop

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver messages to `loop` (a JE used from a new loop moves its reader there)."""
        if self._loop is loop:
            return
        if self._thread is not None:
            self._stop.set()
            self._thread.join(5)
            self._stop = threading.Event()
        self._loop = loop
        self._thread = threading.Thread(target=self._read_forever, args=(self._stop,), name="meshserve-je-reader",
                                        daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def take_heartbeats(self, timeout_ms: int, on_heartbeat: Callable[[EngineHeartbeat, float], None]) -> None:
        """Before the event loop uses the JE: hand the heartbeats that arrive within `timeout_ms` to
        `on_heartbeat` (with the time.monotonic() they are taken at) on this thread."""
        if self.registrations.poll(timeout_ms):
            while self.registrations.poll(0):
                item = self.decode(self.registrations.recv(), "registration")
                if isinstance(item, EngineHeartbeat):
                    self.guarded(on_heartbeat, item, time.monotonic())

    def close(self) -> None:
        """Stop the reader thread and close the sockets (the registry closes its own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.outputs.close(0)
        self.registrations.close(0)

    def decode(self, frame: bytes, source: str):
        """A message, or None for a frame that is not one (logged and counted, never fatal)."""
        try:
            return codec.decode(frame)
        except Exception as exc:  # noqa: BLE001 - whatever a peer sends, the reader goes on
            self._count_bad_frame(f"dropped a {len(frame)}-byte {source} frame that does not decode: {exc}")
            return None

    def guarded(self, handler: Callable, *args) -> None:
        """Run a message's handler; a failure is logged and counted, and the next message is handled."""
        try:
            handler(*args)
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop the others
            what = type(args[0]).__name__ if args else handler.__name__
            self._count_bad_frame(f"dropped a {what} whose handling failed: {type(exc).__name__}: {exc}",
                                  exc_info=True)

    def _count_bad_frame(self, why: str, exc_info: bool = False) -> None:
        self.bad_frames += 1
        if self.bad_frames in (1, 10, 100) or self.bad_frames % 1000 == 0:  # a flood gets a few lines
            logger.warning("%s (%d bad frame(s) so far)", why, self.bad_frames, exc_info=exc_info)

    def _read_forever(self, stop: threading.Event) -> None:
        try:
            self._read_until(stop)
        except BaseException as exc:  # noqa: BLE001 - recorded: health must say the reader is gone
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception("job executor reader stopped; /health answers 503 from now on")

    def _read_until(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        sources = ((self.registrations, "registration"), (self.outputs, "output"),
                   (self.registry.kv_events, "KV event"))
        for sock, _ in sources:
            poller.register(sock, zmq.POLLIN)
        links = self.registry.links
        for monitor in links.monitors():  # a reader moved to a new loop keeps watching the links it knew
            poller.register(monitor, zmq.POLLIN)
        while not stop.is_set():
            try:
                self.registry.apply_subscription_changes()
                links.apply(poller)
                ready = dict(poller.poll(int(TICK_S * 1000)))
            except zmq.ContextTerminated:
                return
            items = []
            for sock, source in sources:
                if sock in ready:
                    while sock.poll(0):
                        item = self.decode(sock.recv(), source)
                        if item is not None:
                            items.append(item)
            for monitor in links.monitors():
                if monitor in ready:
                    items.extend(links.read(monitor, poller))
            if not self._post(items):
                return

    def _post(self, items: list) -> bool:
        try:
            self._loop.call_soon_threadsafe(self.on_items, items)
        except RuntimeError:  # the loop closed
            return False
        return True
