"""A rank's loop reports a KV pull that ends between steps at once, woken by the thread that ended it."""
from __future__ import annotations

import threading

import pytest
import zmq

from meshserve.utils.wakeup import Wakeup
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.kv import KVConnectorReport, KVPullDone
from meshserve.worker import worker

pytestmark = pytest.mark.timeout(60)

NEVER_MS = 600_000  # the loop's poll timeouts: a report that comes was woken, not timed out
WAIT_MS = 10_000


class PullingRunner:
    """Stands in for a decode rank's runner whose KV pull is in flight: it ends on another thread."""

    background_busy = True

    def __init__(self) -> None:
        self.background_wakeup = Wakeup()
        self._done: list[KVPullDone] = []
        self._lock = threading.Lock()

    def end_pull(self, req_id: str) -> None:  # the transfer thread
        with self._lock:
            self._done.append(KVPullDone(req_id))
        self.background_wakeup.notify()

    def poll_background(self):
        return []

    def take_kv_connector_report(self):
        with self._lock:
            done, self._done = self._done, []
        return KVConnectorReport(rank=0, dp_rank=0, kv_pulls=done) if done else None


def test_a_pull_that_ends_while_the_rank_waits_is_reported_without_a_step(monkeypatch):
    monkeypatch.setattr(worker, "_BACKGROUND_POLL_MS", NEVER_MS)
    monkeypatch.setattr(worker, "_PARENT_CHECK_MS", NEVER_MS)
    ctx = zmq.Context()
    sockets = {name: ctx.socket(kind) for name, kind in
               (("to_worker", zmq.PUSH), ("work", zmq.PULL), ("results", zmq.PUSH), ("from_worker", zmq.PULL))}
    runner = PullingRunner()
    loop = threading.Thread(target=worker._serve, args=(0, runner, sockets["work"], sockets["results"],
                                                        lambda: False), daemon=True)
    try:
        sockets["work"].bind("inproc://work")
        sockets["to_worker"].connect("inproc://work")
        sockets["from_worker"].bind("inproc://results")
        sockets["results"].connect("inproc://results")
        loop.start()
        for req_id in ("first", "second"):  # the wake-up is taken each time: a second pull wakes it again
            threading.Timer(0.05, runner.end_pull, args=(req_id,)).start()
            assert sockets["from_worker"].poll(WAIT_MS), f"the pull of {req_id!r} was not reported while no step came"
            report = codec.decode(sockets["from_worker"].recv())
            assert report.kv_pulls == [KVPullDone(req_id)]
        sockets["to_worker"].send(codec.encode(Shutdown()))
        loop.join(WAIT_MS / 1000)
        assert not loop.is_alive()
    finally:
        for sock in sockets.values():
            sock.close(0)
        ctx.term()
        runner.background_wakeup.close()
