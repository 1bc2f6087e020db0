"""Receiving a frame on a socket: decode it, and drop a bad one with one log line and a count
(`drop_frame`, `dropped_frames`, reported in each process's stats); nothing a peer sends stops a receiver."""
from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

import zmq

from meshserve.wire.base import Message
from meshserve.wire.codec import MAX_MESSAGE_BYTES, MessageError, RefusedFrame, decode

logger = logging.getLogger(__name__)


_dropped_lock = threading.Lock()


_dropped: collections.Counter = collections.Counter()


def drop_frame(socket_name: str, error: Exception | str) -> None:
    """Count a frame a receiver dropped and say why (the first ten per socket, then every thousandth,
    so a flood of bad frames cannot flood the log)."""
    with _dropped_lock:
        _dropped[socket_name] += 1
        count = _dropped[socket_name]
    if count <= 10 or count % 1000 == 0:
        logger.warning("dropped a bad frame on %s (%d so far): %s", socket_name, count, error)


def dropped_frames() -> dict[str, int]:
    """Frames this process dropped, per receiving socket."""
    with _dropped_lock:
        return dict(_dropped)


def recv_message(sock: zmq.Socket, socket_name: str, max_bytes: int = MAX_MESSAGE_BYTES,
                 on_refused: Callable[[RefusedFrame], None] | None = None) -> Message | None:
    """Receive one frame and decode it; a bad frame is dropped (logged, counted) and gives None, unless
    it is a request that can be answered and `on_refused` answers it."""
    data = sock.recv()
    try:
        return decode(data, max_bytes)
    except RefusedFrame as exc:
        if on_refused is None:
            drop_frame(socket_name, exc)
        else:
            on_refused(exc)
        return None
    except MessageError as exc:
        drop_frame(socket_name, exc)
        return None
