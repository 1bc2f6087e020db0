"""Serving a trace on one simulated TE: a deployment of that TE alone (meshserve/sim/cluster.py, which says how
virtual time runs and what is measured)."""
from __future__ import annotations

from collections.abc import Sequence

from meshserve.sim.cluster import ROLE_KV_TRANSFER, SimCluster, TESpec
from meshserve.sim.te import SimTE
from meshserve.sim.trace import TraceRequest


def simulate(trace: Sequence[TraceRequest], te: SimTE, progress: bool = True,
             slo: tuple[float | None, float | None] = (None, None)) -> dict:
    """Serve `trace` on `te`; the metrics of the run (virtual seconds) and what the run itself cost (wall);
    `slo`: a (TTFT, TPOT) objective in seconds whose attainment is reported."""
    role = next(role for role, kv in ROLE_KV_TRANSFER.items() if kv == te.settings.kv_transfer)
    return SimCluster([TESpec(te.name, role, te.settings, te.profile)], built={te.name: te}).run(trace, progress, slo)
