"""Whether the job executor's link to each TE is up, as its socket sees it: a TE that dies (kill -9, a crash)
closes its inbox's TCP connections at once, long before its missed heartbeats time out.

Every TE's PUSH socket (the jobs the JE sends it) gets a ZMQ socket monitor. Its events are read on the JE's
reader thread beside the other inbound sockets and reach the event loop as `TELinkEvent`s: a disconnect takes
the TE out of the routable set (and so out of /health's) until the link is back (a new CurveZMQ handshake) or
the heartbeat timeout drops the TE. Only the heartbeat timeout drops it and moves its jobs: a link that comes
back lost nothing.
"""
from __future__ import annotations

import itertools
import logging
import queue
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

# the events that say the link is down or up, and that the monitor stopped (its socket closed: a dropped TE)
_DOWN = zmq.EVENT_DISCONNECTED
_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_WATCHED = _DOWN | _UP | zmq.EVENT_MONITOR_STOPPED


@dataclass(frozen=True)
class TELinkEvent:
    """The JE's link to TE `te` (registered with `input_addr`) went down or came back up."""
    te: str
    input_addr: str
    up: bool


class TELinkWatch:
    """The monitors of the JE's links to its TEs. `watch` runs where a TE registers (the loop's thread);
    `apply` and `read` run on the reader thread, which owns the monitor sockets."""

    def __init__(self) -> None:
        self._new: queue.SimpleQueue = queue.SimpleQueue()  # (monitor socket, event) waiting for the reader
        self._monitors: dict[zmq.Socket, tuple[str, str]] = {}  # monitor -> (TE, input address); reader's
        self._ids = itertools.count()

    def watch(self, sock: zmq.Socket, te: str, input_addr: str) -> None:
        """Monitor `sock` (call before it connects, so its first handshake is seen too). Each monitor gets an
        address of its own: pyzmq's default names it after the socket's file descriptor, which a TE registering
        again under its name reuses while the monitor of its dropped socket may still hold that address."""
        addr = f"inproc://te-link-monitor-{id(self)}-{next(self._ids)}"
        self._new.put((sock.get_monitor_socket(_WATCHED, addr=addr), (te, input_addr)))

    def apply(self, poller: zmq.Poller) -> None:
        """On the reader thread: poll the monitors registered since the last call."""
        while True:
            try:
                monitor, link = self._new.get_nowait()
            except queue.Empty:
                return
            self._monitors[monitor] = link
            poller.register(monitor, zmq.POLLIN)

    def monitors(self) -> list[zmq.Socket]:
        return list(self._monitors)

    def read(self, monitor: zmq.Socket, poller: zmq.Poller) -> list[TELinkEvent]:
        """The link events waiting on `monitor`; a stopped monitor (its TE was dropped) is closed."""
        te, input_addr = self._monitors[monitor]
        events = []
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                self._forget(monitor, poller)
                break
            events.append(TELinkEvent(te, input_addr, up=event == _UP))
        return events

    def _forget(self, monitor: zmq.Socket, poller: zmq.Poller) -> None:
        poller.unregister(monitor)
        del self._monitors[monitor]
        monitor.close(0)

    def close(self) -> None:
        """After the reader thread stopped: close what it still owned."""
        for monitor in self._monitors:
            monitor.close(0)
        self._monitors.clear()
        while True:
            try:
                monitor, _ = self._new.get_nowait()
            except queue.Empty:
                return
            monitor.close(0)
