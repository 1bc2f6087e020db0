"""The job executor's reports to the cluster managers (`JobExecutorReport`).

Every `report_interval_s`, and at once when a TE registers (the manager times a scale-up until every JE
routes to the new TE), the JE tells each manager who it is, which TEs it routes to and, per pool
("GROUP/ROLE"), its demand since the last report: jobs held and routed, TTFT from a job's arrival here (the
prefill or colocated pool's) and TPOT (the decode or colocated pool's). A manager that is away or behind
misses reports; the next one says all it needs.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from meshserve.router.demand import DemandLog, PoolDemand
from meshserve.router.engine_registry import EngineRegistry
from meshserve.router.held_jobs import HeldJobs
from meshserve.router.routing import pool_key
from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.cluster import GroupDemand, JobExecutorReport


@dataclass(frozen=True)
class JobExecutorIdentity:
    """Who the JE is in its reports."""

    name: str
    http_addr: str
    register_addr: str


class ManagerReporter:
    """PUSH sockets to the cluster managers, and the reports sent on them (on the event loop's thread)."""

    def __init__(self, ctx: zmq.Context, manager_addrs: Sequence[str], interval_s: float,
                 identity: JobExecutorIdentity, registry: EngineRegistry, demand: DemandLog, held: HeldJobs) -> None:
        self.identity, self.interval_s = identity, interval_s
        self.registry, self.demand, self.held = registry, demand, held
        self._last_report = 0.0
        self._managers = [self._connect(ctx, addr) for addr in manager_addrs]

    @staticmethod
    def _connect(ctx: zmq.Context, addr: str) -> zmq.Socket:
        sock = cluster_auth.client(ctx.socket(zmq.PUSH), addr)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 16)  # a manager that is away misses reports; the next one says it all
        sock.connect(addr)
        return sock

    @property
    def enabled(self) -> bool:
        """Whether any cluster manager hears from this JE."""
        return bool(self._managers)

    def on_tick(self, now: float) -> None:
        """Report when the interval since the last report has passed."""
        if self._managers and now - self._last_report >= self.interval_s:
            self.send(now)

    def send(self, now: float) -> None:
        """Report now (the interval starts over)."""
        if not self._managers:
            return
        self._last_report = now
        frame = codec.encode(self.report(now))
        for sock in self._managers:
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the manager is away or behind: the next report says what it needs

    def report(self, now: float) -> JobExecutorReport:
        """This JE to the cluster managers: its routable TEs and per pool its demand since the last report."""
        demand = self.demand.take()
        held = self.held.live()
        oldest = max((now - j.held_since for j in held), default=0.0)
        waiting_for = self.held.waiting_for_pools() if held else []
        keys = sorted(set(demand) | set(waiting_for)
                      | {pool_key(r.heartbeat.group, r.role) for r in self.registry.tes.values()})
        groups = []
        for key in keys:
            d = demand.get(key, PoolDemand())
            waits = key in waiting_for
            groups.append(GroupDemand(group=key, held=len(held) if waits else 0,
                                      held_oldest_s=oldest if waits else 0.0, arrivals=d.arrivals,
                                      ttft_s=d.ttft_s, tpot_s=d.tpot_s))
        identity = self.identity
        return JobExecutorReport(name=identity.name, http_addr=identity.http_addr,
                                 register_addr=identity.register_addr, pid=os.getpid(),
                                 te_names=sorted(r.name for r in self.registry.routable()), groups=groups,
                                 timestamp=time.time())

    def close(self) -> None:
        for sock in self._managers:
            sock.close(0)
