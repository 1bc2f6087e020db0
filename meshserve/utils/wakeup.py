"""A wake-up for a loop that polls sockets: other threads say "look now" through a pipe the loop polls beside them.

A rank's loop waits on its work socket between steps and looks at its background work (KV pulls, pool fetches)
only when a step comes or the wait times out. A pull that ends on a transfer thread while the rank waits would be
reported a whole timeout late, and the request it feeds waits with it; the thread that finishes it writes a byte
here instead, and the poll returns at once.
"""
from __future__ import annotations

import contextlib
import os


class Wakeup:
    """A self-pipe: `notify` from any thread, the loop polls `fileno()` (a zmq.Poller takes a file descriptor) and
    calls `clear` before it looks at what woke it."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def notify(self) -> None:
        # a full pipe already holds a wake-up the loop has not taken; a closed one has no loop to wake
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"\0")

    def clear(self) -> None:
        """Take every wake-up written so far (before looking at the work: one written after is kept)."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, 4096):
                pass

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
