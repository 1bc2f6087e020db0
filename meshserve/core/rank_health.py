"""The master's view of its ranks' health, and its budget of recoveries (xdeepserve §6.1, §6.2).

The lowest tier of the health checks: the master sends every rank a `WorkerPing` each second on the
same queue as the steps, and a rank answers with a `WorkerPong` from its loop, between steps. A rank
stuck in a kernel, a deadlock or a collective whose peer is gone answers nothing, so a rank silent for
`hang_timeout_s` is hung, found in seconds rather than at the 300 s collective timeout. The master's own
heartbeat (to its JEs and the cluster manager) comes from its loop too, so a hung master shows up as a
silent one one tier up. A rank that rolls a step back after a transient collective error and runs it again
(xdeepserve §6.2) reports it: the TE counts such steps.
"""
from __future__ import annotations

import logging
import time
from collections import deque

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 1.0
RECOVERY_WINDOW_S = 600.0  # max_recoveries counts the recoveries within this window


class RankHealth:
    def __init__(self, hang_timeout_s: float) -> None:
        self.hang_timeout_s = hang_timeout_s
        self._seq = 0
        self._first_seq = 1  # pongs to pings of ranks from before the last restart are ignored
        self._last_ping = 0.0
        self._answered: list[float] = []  # per rank: time.monotonic() of its last pong (or of the restart)
        self.num_rollbacks = 0  # steps the ranks rolled back and ran again (a transient collective error)
        self._rollbacks_of_rank: dict[int, int] = {}  # ROLLED_BACK events per rank (num_rollbacks: the most)

    def reset(self, world_size: int) -> None:
        """New ranks: each counts as having answered now."""
        now = time.monotonic()
        self._answered = [now] * world_size
        self._first_seq = self._seq + 1
        self._last_ping = now

    def ping_due(self, now: float) -> int | None:
        """The sequence number of the ping to send now, or None when the last one is recent."""
        if now - self._last_ping < PING_INTERVAL_S:
            return None
        self._last_ping = now
        self._seq += 1
        return self._seq

    def on_pong(self, rank: int, seq: int, now: float) -> None:
        if seq >= self._first_seq and 0 <= rank < len(self._answered):
            self._answered[rank] = now

    def hung(self, now: float) -> list[int]:
        """The ranks silent for longer than the timeout."""
        return [rank for rank, at in enumerate(self._answered) if now - at > self.hang_timeout_s]

    def silent_for(self, now: float) -> list[float]:
        return [now - at for at in self._answered]

    def on_rolled_back(self, rank: int, detail: str) -> None:
        # every rank rolls the same step back and reports it: the TE's count is the most any rank reported
        count = self._rollbacks_of_rank[rank] = self._rollbacks_of_rank.get(rank, 0) + 1
        if count > self.num_rollbacks:
            self.num_rollbacks = count
            logger.warning("a step was rolled back and run again (rank %d: %s)", rank, detail)


class RecoveryState:
    """How many recoveries the engine may still try: `max_recoveries` within RECOVERY_WINDOW_S."""

    def __init__(self, max_recoveries: int) -> None:
        self.max_recoveries = max_recoveries
        self._times: deque[float] = deque()
        self.total = 0
        self.migrated = 0  # requests continued from their tokens so far
        self.in_progress: str | None = None  # why the ranks are being restarted now
        self.shrunk_since: float | None = None  # time.monotonic() when the TE went on with fewer ranks
        self.last_failure: str | None = None  # what the last recovery was for
        self.last_failure_silent_s = 0.0  # a hung rank: how long it had been silent when found

    def note_failure(self, reason: str, silent_s: float = 0.0) -> None:
        self.last_failure, self.last_failure_silent_s = reason, silent_s

    def allow(self, now: float) -> bool:
        while self._times and now - self._times[0] > RECOVERY_WINDOW_S:
            self._times.popleft()
        return len(self._times) < self.max_recoveries

    def record(self, now: float) -> None:
        self._times.append(now)
        self.total += 1
