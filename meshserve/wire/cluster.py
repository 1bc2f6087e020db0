"""The cluster manager's protocol.

  JE      -> cluster manager : JobExecutorReport (routable TEs, per pool demand: held jobs, arrivals, TTFT, TPOT)
  warm TE <-> cluster manager : WarmReady (a pre-warmed process is ready), WarmAssign (become this TE)
  CLI     <-> cluster manager : ClusterQuery -> ClusterStatus (`meshserve status`, `cluster scale`, `cluster down`)
"""
from __future__ import annotations

from msgspec import field

from meshserve.config import EngineConfig
from meshserve.wire.base import Message
from meshserve.wire.heartbeat import EngineRole


class GroupDemand(Message):
    """What one job executor saw of one TE group since its last report (the autoscaler's request signals)."""

    group: str
    held: int = 0  # jobs waiting for the group to have a TE (it scaled to zero): held, not rejected
    held_oldest_s: float = 0.0  # how long the oldest held job has waited
    arrivals: int = 0  # jobs routed to the group
    ttft_s: list[float] = field(default_factory=list)  # time to first token of jobs that got one (bounded)
    tpot_s: list[float] = field(default_factory=list)  # mean time per output token of jobs that finished (bounded)


class JobExecutorReport(Message):
    """A job executor to the cluster manager, every report interval: who it is, the TEs it routes to, demand."""

    name: str
    http_addr: str  # http://HOST:PORT
    register_addr: str  # where TEs register with it
    pid: int
    te_names: list[str] = field(default_factory=list)  # TEs registered and routable (not draining)
    groups: list[GroupDemand] = field(default_factory=list)
    timestamp: float = 0.0


class WarmReady(Message):
    """A pre-warmed TE process to the cluster manager: imports, native kernels and spare worker processes are
    ready; it becomes a TE when it gets a `WarmAssign` at `assign_addr`."""

    name: str
    pid: int
    assign_addr: str
    num_workers: int  # spare worker processes it holds (a TE of more ranks starts the rest)
    host: str = ""


class WarmAssign(Message):
    """Become this TE (what `meshserve te` would run): settings, role, group and JEs to register with."""

    config: EngineConfig
    role: EngineRole
    group: str
    listen: str
    register: list[str]
    assigned_at: float = 0.0  # when the manager handed it over (the step's start)


class ClusterQuery(Message):
    """`meshserve status` / `cluster down` / `cluster scale` / `cluster capacity` to the manager's control socket."""

    op: str = "status"  # status | down | scale | capacity
    pool: str = ""  # scale: the pool ("GROUP/ROLE")
    target: int = 0  # scale: TEs it should run; capacity: the devices (ranks) usable now


class TEStatus(Message):
    name: str
    group: str
    role: str
    state: str  # starting | ready | draining | dead
    pid: int = 0
    host: str = ""
    source: str = ""  # how it started: cold | prewarmed | fork (+ its weight source)
    restarts: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    uptime_s: float = 0.0


class GroupStatus(Message):
    group: str
    role: str
    current: int
    target: int
    min_count: int
    max_count: int
    reason: str = ""  # the last scaling decision's reason


class JEStatus(Message):
    name: str
    http_addr: str
    pid: int = 0
    state: str = ""  # ready | starting | dead


class ClusterStatus(Message):
    name: str
    backend: str
    manager_pid: int
    tes: list[TEStatus] = field(default_factory=list)
    groups: list[GroupStatus] = field(default_factory=list)
    jes: list[JEStatus] = field(default_factory=list)
    warm: int = 0  # pre-warmed TE processes idle
    events: list[str] = field(default_factory=list)  # the latest scaling and healing decisions, newest last
    ok: bool = True
    error: str | None = None
