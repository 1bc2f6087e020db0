"""The self-pipe that wakes a rank's socket poll from another thread."""
from __future__ import annotations

import threading

import zmq

from meshserve.utils.wakeup import Wakeup

POLL_MS = 10_000  # far longer than the test waits: a poll that returns was woken


def test_a_notify_from_another_thread_ends_a_zmq_poll_and_clear_takes_it():
    wakeup, ctx = Wakeup(), zmq.Context()
    idle = ctx.socket(zmq.PULL)
    try:
        idle.bind("inproc://nothing-comes")
        poller = zmq.Poller()
        poller.register(idle, zmq.POLLIN)
        poller.register(wakeup.fileno(), zmq.POLLIN)
        threading.Timer(0.05, wakeup.notify).start()
        assert dict(poller.poll(POLL_MS)) == {wakeup.fileno(): zmq.POLLIN}
        wakeup.clear()
        assert poller.poll(0) == []  # taken: the next poll waits again
    finally:
        idle.close(0)
        ctx.term()
        wakeup.close()


def test_many_notifies_never_block_and_one_clear_takes_them_all():
    wakeup = Wakeup()
    try:
        for _ in range(200_000):  # more than a pipe holds: the writer drops what would block
            wakeup.notify()
        poller = zmq.Poller()
        poller.register(wakeup.fileno(), zmq.POLLIN)
        assert poller.poll(0)
        wakeup.clear()
        assert poller.poll(0) == []
    finally:
        wakeup.close()


def test_notify_after_close_writes_nowhere_even_to_a_reused_descriptor():
    """A pool client's thread may answer a fetch after its rank closed the runner, when the pipe's descriptor
    numbers may already belong to a file the process opened since."""
    import os

    wakeup = Wakeup()
    write_end = wakeup._write
    wakeup.close()
    reader, writer = os.pipe()  # the lowest free numbers: the closed pipe's
    try:
        assert write_end in (reader, writer)
        wakeup.notify()
        wakeup.close()  # twice: harmless
        os.set_blocking(reader, False)
        try:
            leaked = os.read(reader, 16)
        except BlockingIOError:
            leaked = b""
        assert leaked == b""
    finally:
        os.close(reader)
        os.close(writer)
