"""The cluster manager's autoscaling on virtual time: every `interval_s` the served `Autoscaler`
(meshserve/cluster/autoscaler.py) sets each pool's target from its TEs' heartbeat loads and the job executor's
demand (arrivals, TTFT and TPOT samples per pool since the last tick, as `meshserve.router.demand` reports them);
then, as the manager reconciles, a pool below its target starts TEs (serving `start_s` later: a TE's cold start)
and a pool above it drains its least busy (a starting one first), which finish their requests and leave. With a
pre-warmed pool (`prewarm_s`), the manager replaces the pre-warmed process a new TE took once that TE serves; the
replacement works `prewarm_s` (imports, native kernels) on the host's cores meanwhile."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

from meshserve.cluster.autoscaler import Autoscaler, PoolSignals
from meshserve.router.demand import PoolDemand
from meshserve.wire.cluster import GroupDemand

JOB_EXECUTOR = "je-sim"


@dataclass
class SimScaler:
    autoscaler: Autoscaler
    start_s: float = 30.0  # from a scale-up to the new TE serving
    prewarm_s: float = 0.0  # a replacement pre-warmed process's start, after a new TE serves (0: no pre-warm pool)
    warming_until: list[float] = field(default_factory=list)  # when each replacement is warm
    demand: dict[str, PoolDemand] = field(default_factory=lambda: defaultdict(PoolDemand))
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (when, pool -> TEs serving)

    def __post_init__(self) -> None:
        if not self.start_s >= 0:
            raise ValueError(f"a TE's start time must be zero or more, got {self.start_s}")
        if not self.prewarm_s >= 0:
            raise ValueError(f"a pre-warmed process's start time must be zero or more, got {self.prewarm_s}")

    def on_ready(self, now: float) -> None:
        """A TE the autoscaler started serves: the pre-warmed process it took is replaced."""
        if self.prewarm_s > 0:
            self.warming_until.append(now + self.prewarm_s)

    def warming(self, now: float) -> int:
        """Replacement pre-warmed processes still starting (each keeps the host's cores as busy as a TE)."""
        return sum(until > now for until in self.warming_until)

    @property
    def interval_s(self) -> float:
        return self.autoscaler.settings.interval_s

    # ------------------------------------------------------------ the job executor's demand
    def on_route(self, tes: list[str], cluster) -> None:
        for te in tes:
            self.demand[cluster.members[te].pool].arrivals += 1

    def on_first_token(self, te: str, ttft_s: float, cluster) -> None:
        self.demand[cluster.members[te].pool].add_ttft(ttft_s)

    def on_finished(self, te: str, tpot_s: float, cluster) -> None:
        self.demand[cluster.members[te].pool].add_tpot(tpot_s)

    # ------------------------------------------------------------ the manager's tick
    def tick(self, cluster) -> None:
        now = cluster.now
        demand, self.demand = self.demand, defaultdict(PoolDemand)
        self.autoscaler.observe_demand(JOB_EXECUTOR, [
            GroupDemand(group=pool, arrivals=d.arrivals, ttft_s=d.ttft_s, tpot_s=d.tpot_s)
            for pool, d in demand.items()], now)
        pools = self._pools(cluster)
        signals = {}
        for pool, members in pools.items():
            loads = [cluster.load_of(m) for m in members if m.state == "serving"]
            signals[pool] = PoolSignals(loads=loads, running=len(loads), starting=len(members) - len(loads))
        for decision in self.autoscaler.decide(now, signals):
            self._reconcile(cluster, decision.key, pools[decision.key], decision.target)
        self.timeline.append((now, {pool: sum(m.state == "serving" for m in members)
                                    for pool, members in self._pools(cluster).items()}))

    @staticmethod
    def _pools(cluster) -> dict[str, list]:
        """Pool key -> its TEs starting or serving (a draining TE no longer counts)."""
        pools: dict[str, list] = {key: [] for key in {m.pool for m in cluster.members.values()}}
        for member in cluster.members.values():
            if member.state in ("starting", "serving"):
                pools[member.pool].append(member)
        return pools

    def _reconcile(self, cluster, pool: str, members: list, target: int) -> None:
        if len(members) < target:
            spec = next(m.spec for m in cluster.members.values() if m.pool == pool)  # the pool's TEs are alike
            for _ in range(target - len(members)):
                name = f"{spec.name.rstrip('0123456789')}{len(cluster.members)}"
                cluster.add(replace(spec, name=name), ready_in=self.start_s)
        elif len(members) > target:
            # the least busy go first; a TE still starting goes before one that serves (as the manager does)
            order = sorted(members, key=lambda m: (m.state == "serving", _busy(cluster, m)))
            for member in order[:len(members) - target]:
                cluster.drain(member.spec.name)


def _busy(cluster, member) -> int:
    load = cluster.load_of(member)
    return load.num_running + load.num_waiting
