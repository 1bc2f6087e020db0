"""The injected `collective_error` (tests and benchmarks, meshserve/utils/faults.py), hooked around the MoE
dispatch of this process once such a fault is armed: until then the dispatchers run unwrapped.

The fault fires at the entry of the first dispatch of each attempt at a step (the hook on the step marks its
start), so `after_steps` counts steps whatever the number of MoE layers. It raises what a broken link raises
(`torch.distributed.DistNetworkError`), so the step takes the production path: the ranks roll it back, agree
through the store, rebuild their groups and run it again (meshserve/parallel/rollback.py). A fault for one
rank leaves its peers waiting in the dispatch until the collective timeout fails it for them too.
"""
from __future__ import annotations

import torch.distributed as dist

from meshserve.moe.comm import EPDispatcher, HybridMoEComm
from meshserve.utils import faults


class CollectiveFault:
    """Fires a rank's injected collective errors: `on_step` before each attempt at a step, `on_dispatch` before
    each MoE dispatch."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.step_started = False  # this attempt has not reached its first dispatch yet

    def on_step(self, *args, **kwargs) -> None:
        self.step_started = True

    def on_dispatch(self, *args, **kwargs) -> None:
        if not self.step_started:
            return
        self.step_started = False
        if faults.fire(faults.FaultKind.COLLECTIVE_ERROR, rank=self.rank) is not None:
            raise dist.DistNetworkError(f"injected collective error on rank {self.rank} (MoE dispatch)")


def install(step_owner: object, step_method: str, rank: int) -> CollectiveFault:
    """Hook this process's MoE dispatchers (every instance: a rank runs one model) and the method that runs one
    attempt at a step (`step_owner.step_method`)."""
    hook = CollectiveFault(rank)
    faults.wrap_method(step_owner, step_method, hook.on_step)
    for comm in (EPDispatcher, HybridMoEComm):
        faults.wrap_method(comm, "dispatch", hook.on_dispatch)
    return hook
