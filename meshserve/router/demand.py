"""What each pool ("GROUP/ROLE") saw of the job executor's jobs since its last report to the cluster managers:
arrivals, TTFT from a job's arrival here (the prefill or colocated pool's) and TPOT (the decode or colocated
pool's). The autoscaler sizes the pools by them."""
from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.router.engine_registry import EngineRegistry
from meshserve.router.routing import ANY_POOL, pool_key

MAX_SAMPLES = 256  # TTFT / TPOT samples per pool and report (a report stays a few kB)


@dataclass
class PoolDemand:
    """What one pool saw of this JE's jobs since the last report."""

    arrivals: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    def add_ttft(self, value: float) -> None:
        if len(self.ttft_s) < MAX_SAMPLES:
            self.ttft_s.append(value)

    def add_tpot(self, value: float) -> None:
        if len(self.tpot_s) < MAX_SAMPLES:
            self.tpot_s.append(value)


class DemandLog:
    """Per pool, the demand since the last report."""

    def __init__(self, registry: EngineRegistry) -> None:
        self.registry = registry
        self._pools: dict[str, PoolDemand] = {}  # pool key -> demand

    def of_te(self, te: str) -> PoolDemand:
        """The demand of TE `te`'s pool (a TE dropped since still names its pool)."""
        record = self.registry.tes.get(te)
        key = pool_key(record.heartbeat.group, record.role) if record is not None else ANY_POOL
        return self._pools.setdefault(key, PoolDemand())

    def take(self) -> dict[str, PoolDemand]:
        """The demand so far, by pool key; the log starts over."""
        pools, self._pools = self._pools, {}
        return pools
