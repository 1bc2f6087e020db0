"""Link probing (xdeepserve §6.1): a puller's thread that probes each peer it pulls from.

A KV pull runs outside the master's loop, so its stalls escape the heartbeats. Each watched peer is probed
every `interval_s` with `TransferEngine.probe` (a tiny dummy payload over the pull's path, timed, with its
own short timeout) and at once when its owner asks (`probe_now`: a pull from it failed or stalls). The
thread is the prober's own: pulls in flight never hold a probe back, so a probe that fails says the link
is broken, not that the puller is busy. Results queue up until the owner takes them (`take`); what they
mean (ok, saturated, down) is decided by whoever also sees the pulls (`meshserve.core.link_monitor`).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 2.0  # a probe's own timeout: far below a pull's I/O timeout (10 s)
MIN_GAP_S = 0.2  # probes of one peer asked for at once are this far apart at least
MAX_RESULTS = 1024  # kept until taken; the oldest go first


@dataclass(frozen=True)
class ProbeResult:
    peer: str
    ok: bool
    rtt_s: float  # the round trip (a failure: how long until it failed)
    error: str | None = None


@dataclass
class _Watched:
    next_at: float  # time.monotonic() of its next probe
    last_at: float = 0.0  # ... of its last probe's start
    failing_since: float | None = None  # the first of the current run of failures


class LinkProber:
    """Probes the watched peers from a thread of its own. `probe(peer, timeout)` returns the round trip in
    seconds and raises when the probe fails. Thread-safe."""

    def __init__(self, probe: Callable[[str, float], float], interval_s: float = PROBE_INTERVAL_S,
                 timeout_s: float = PROBE_TIMEOUT_S, name: str = "link-prober") -> None:
        self._probe = probe
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._name = name
        self._cond = threading.Condition()
        self._watched: dict[str, _Watched] = {}
        self._results: collections.deque[ProbeResult] = collections.deque(maxlen=MAX_RESULTS)
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, peer: str) -> None:
        """Probe `peer` from now on (its first probe one interval from now)."""
        with self._cond:
            if self._closed or peer in self._watched:
                return
            self._watched[peer] = _Watched(next_at=time.monotonic() + self.interval_s)
            if self._thread is None:  # started with the first peer: an engine nobody pulls for has no thread
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def forget(self, peer: str) -> None:
        with self._cond:
            self._watched.pop(peer, None)

    def probe_now(self, peer: str) -> None:
        """Probe a watched peer as soon as the last probe of it is MIN_GAP_S old."""
        with self._cond:
            watched = self._watched.get(peer)
            if watched is None:
                return
            watched.next_at = min(watched.next_at, watched.last_at + MIN_GAP_S)
            self._cond.notify()

    def failing_for(self, peer: str, now: float | None = None) -> float:
        """How long every probe of `peer` has failed (0: its last probe passed, or none failed yet)."""
        with self._cond:
            watched = self._watched.get(peer)
            if watched is None or watched.failing_since is None:
                return 0.0
            return (time.monotonic() if now is None else now) - watched.failing_since

    def take(self) -> list[ProbeResult]:
        """The results since the last call, oldest first."""
        with self._cond:
            out = list(self._results)
            self._results.clear()
        return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=self.timeout_s + 1.0)

    # ------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [peer for peer, w in self._watched.items() if w.next_at <= now]
                if not due:
                    wake = min((w.next_at for w in self._watched.values()), default=now + self.interval_s)
                    self._cond.wait(timeout=max(0.0, wake - now))
                    continue
                for peer in due:
                    watched = self._watched[peer]
                    watched.last_at, watched.next_at = now, now + self.interval_s
            for peer in due:
                self._record(self._probe_one(peer))

    def _probe_one(self, peer: str) -> ProbeResult:
        start = time.monotonic()
        try:
            rtt = self._probe(peer, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure of the probe is a failed probe
            return ProbeResult(peer, False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
        return ProbeResult(peer, True, rtt)

    def _record(self, result: ProbeResult) -> None:
        with self._cond:
            watched = self._watched.get(result.peer)
            if watched is None:  # forgotten while it was probed
                return
            if result.ok:
                watched.failing_since = None
            elif watched.failing_since is None:
                watched.failing_since = watched.last_at
                logger.warning("link probe of %s failed: %s", result.peer, result.error)
            self._results.append(result)
