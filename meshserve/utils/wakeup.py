"""A wake-up for a loop that polls sockets: other threads say "look now" through a pipe the loop polls beside them.

A rank's loop waits on its work socket between steps and looks at its background work (KV pulls, pool fetches)
only when a step comes or the wait times out. A pull that ends on a transfer thread while the rank waits would be
reported a whole timeout late, and the request it feeds waits with it; the thread that finishes it writes a byte
here instead, and the poll returns at once.
"""
from __future__ import annotations

import contextlib
import os
import threading


class Wakeup:
    """A self-pipe: `notify` from any thread, the loop polls `fileno()` (a zmq.Poller takes a file descriptor) and
    calls `clear` before it looks at what woke it."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        # a notify racing close must not write to a descriptor number the process has reused meanwhile
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._read

    def notify(self) -> None:
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):  # a full pipe already holds a wake-up the loop has not taken
                os.write(self._write, b"\0")

    def clear(self) -> None:
        """Take every wake-up written so far (before looking at the work: one written after is kept)."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, 4096):
                pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read)
            os.close(self._write)
