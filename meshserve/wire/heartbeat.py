"""A TE's heartbeat: its registration and load, repeated to every job executor and cluster manager
that it registers with (`meshserve te --register`), with its start-up timeline and weight servers."""
from __future__ import annotations

import enum

from msgspec import field

from meshserve.wire.base import Message
from meshserve.wire.client import EngineStats


class EngineRole(enum.StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


# TE-Pre-Load's parts: interpreter and process runner; the master's imports and settings; the forkserver (its
# torch import) and the ranks' fork; a rank's set-up before it reads weights (threads, process groups, model)
PRE_LOAD_PARTS = ("interpreter", "master_imports", "ranks_start", "rank_setup")


class StartupTimeline(Message):
    """When a TE went through its start-up steps (wall-clock `time.time()`; 0: not reached), so the cluster
    manager can time each scale-up step by step (deepserve §6: TE-Pre-Load, TE-Load, TE-Post-Load)."""

    process_start: float = 0.0  # the process started, or a pre-warmed one was handed this TE
    # TE-Pre-Load step by step (a new process only): the TE's entry function ran (the interpreter and the
    # process runner before it), the master's modules imported, the first rank's process entered its code
    # (the forkserver and its torch import, the fork)
    entry: float = 0.0
    imports_done: float = 0.0
    rank_start: float = 0.0
    load_start: float = 0.0  # the first rank began reading weights (process start up to here: TE-Pre-Load)
    load_end: float = 0.0  # the last rank holds its weights (TE-Load)
    ready: float = 0.0  # KV cache allocated and the warm-up request answered: it can serve (TE-Post-Load)
    load_source: str = ""  # disk | page-cache | pool | fork
    load_bytes: int = 0  # weight bytes all ranks read
    prewarmed: bool = False  # the TE ran in a pre-warmed process

    def pre_load_parts(self, launched_at: float) -> dict[str, float]:
        """TE-Pre-Load (from `launched_at`, when the process was launched) in seconds per part; empty for a
        pre-warmed TE or a timeline without them."""
        marks = (launched_at, self.entry, self.imports_done, self.rank_start, self.load_start)
        if self.prewarmed or not all(marks):
            return {}
        return {name: end - start for name, start, end in zip(PRE_LOAD_PARTS, marks, marks[1:])}


class EngineHeartbeat(Message):
    """A TE announcing itself to a job executor, repeated every heartbeat interval: its registration
    (addresses, role, layout) and its current load. A JE that misses several heartbeats drops the TE."""

    name: str
    role: EngineRole
    group: str  # the deployment's TE group
    input_addr: str  # where the JE sends AddRequest / AbortRequests / StatsQuery / AdminRequest
    kv_events_addr: str  # the TE's KVCacheEvents PUB socket
    model: str
    max_model_len: int
    block_size: int
    attn_tp: int
    attn_dp: int
    stats: EngineStats = field(default_factory=EngineStats)
    kv_event_seq: int = 0  # the last KVCacheEvents seq published (a subscriber that lags behind resyncs)
    timestamp: float = 0.0
    leaving: bool = False  # the TE is shutting down: route nothing new to it
    draining: bool = False  # the TE finishes what it runs and then leaves: route nothing new to it
    pid: int = 0  # the master's process id
    startup: StartupTimeline | None = None
    weights_addrs: list[str] = field(default_factory=list)  # per rank: its weight server, for forks
