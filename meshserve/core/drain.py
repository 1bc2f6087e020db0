"""A TE's drain, for a scale-down: take nothing new, finish what runs, then leave.

The `drain` admin operation starts it; the heartbeat says `draining`, so job executors send the TE no new
requests. The TE leaves once nothing is left to run (nor held by a prefill TE for decode), or after
DRAIN_TIMEOUT_S with requests left: their job executors move them.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 300.0


class Drain:
    def __init__(self) -> None:
        self.since: float | None = None  # time.monotonic() when the drain began

    @property
    def active(self) -> bool:
        return self.since is not None

    def begin(self, num_running: int, num_waiting: int) -> None:
        if self.since is None:
            self.since = time.monotonic()
            logger.info("draining: finishing %d running and %d waiting request(s), then leaving", num_running,
                        num_waiting)

    def done(self, busy: Callable[[], bool]) -> bool:
        """Whether a draining TE may leave now: `busy()` says whether it still has requests to finish."""
        if self.since is None:
            return False
        if time.monotonic() - self.since > DRAIN_TIMEOUT_S:
            logger.warning("draining for %.0f s: leaving with requests left", DRAIN_TIMEOUT_S)
            return True
        return not busy()
