"""What the cluster manager keeps about each process it runs (`ManagedProcess`) and each TE start (`ScaleUp`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from meshserve.cluster.backends import ProcessHandle
from meshserve.cluster.state import ProcessRecord
from meshserve.wire.cluster import JobExecutorReport
from meshserve.wire.heartbeat import EngineHeartbeat, StartupTimeline


@dataclass
class ScaleUp:
    """One TE start, timed step by step (wall clock)."""

    te: str
    pool: str
    process: str  # cold | prewarmed
    weights: str  # checkpoint | fork
    reason: str
    decided_at: float
    launched_at: float = 0.0
    timeline: StartupTimeline | None = None
    registered_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.registered_at > 0

    def steps(self) -> dict[str, float]:
        """Seconds per step (deepserve §6: Scaler-Pre, TE-Pre-Load, TE-Load, TE-Post-Load, Scaler-Post)."""
        t = self.timeline
        if t is None or not (t.load_start and t.load_end and t.ready and self.registered_at):
            return {}
        return {"scaler_pre": self.launched_at - self.decided_at, "te_pre_load": t.load_start - self.launched_at,
                "te_load": t.load_end - t.load_start, "te_post_load": t.ready - t.load_end,
                "scaler_post": self.registered_at - t.ready, "total": self.registered_at - self.decided_at}

    def to_dict(self) -> dict[str, Any]:
        t = self.timeline
        return {"te": self.te, "pool": self.pool, "process": self.process, "weights": self.weights,
                "reason": self.reason, "load_source": t.load_source if t else "",
                "load_bytes": t.load_bytes if t else 0, "steps": self.steps(),
                "pre_load_parts": t.pre_load_parts(self.launched_at) if t and self.steps() else {}}


@dataclass
class ManagedProcess:
    """A process the manager runs: its record (what the state file keeps) and the live handle."""

    record: ProcessRecord
    handle: ProcessHandle | None
    last_seen: float = 0.0  # its last heartbeat / report (monotonic); 0: none yet
    heartbeat: EngineHeartbeat | None = None  # TEs
    report: JobExecutorReport | None = None  # JEs
    assign_addr: str = ""  # warm TEs: where to send WarmAssign (from its WarmReady)
    draining: bool = False  # a TE told to drain: its exit is expected
    quick_deaths: int = 0
    restart_at: float = 0.0  # a dead process waits for its restart until then (backoff)
    preempted: bool = False  # a prefill TE stopped to free its devices for a decode TE (kill-P-to-preserve-D)
    started_mono: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.record.name
