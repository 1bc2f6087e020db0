"""A worker process's fault hooks (tests and benchmarks, meshserve/utils/faults.py): registered once when the
rank starts serving, each wrapped around its target the first time a fault of its kinds is armed (from the
environment, or an `InjectFault` the master forwards). A rank with no fault armed runs unwrapped code.

- kill, stall: before a step's forward (the runner's `run_batch`, for a batch with work): `kill` ends this
  process at once, as a lost device does; `stall` hangs it for the fault's duration, neither stepping nor
  answering pings (so the master finds it hung), and leaves once its master is gone;
- collective_error: at the first MoE dispatch of each attempt at a step (meshserve/moe/fault_hooks.py);
- link_break, link_delay: the pulls and probes of the rank's P/D transfer engine
  (meshserve/transfer/fault_hooks.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from meshserve.utils import faults
from meshserve.utils.faults import FaultKind

logger = logging.getLogger(__name__)

_MASTER_CHECK_S = 1.0  # how often a stalled rank looks for its master


def fire_step_faults(rank: int, master_gone: Callable[[], bool]) -> bool:
    """Injected faults of a step's start (`kill`, then `stall`). False: the master went away during a stall."""
    faults.kill_when_fired(FaultKind.KILL, rank)()
    stall = faults.fire(FaultKind.STALL, rank=rank)
    if stall is None:
        return True
    logger.warning("stalling for %.1f s (injected fault)", stall.duration_s)
    deadline = time.monotonic() + stall.duration_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, _MASTER_CHECK_S))
        if master_gone():  # a hung rank still leaves once its master is gone
            return False
    return True


def _step_faults(rank: int, master_gone: Callable[[], bool]) -> Callable[..., None]:
    """The `before` hook of the runner's `run_batch`: a batch without work (control only) is no step."""

    def before(batch, *args, **kwargs) -> None:
        if batch.per_dp and not fire_step_faults(rank, master_gone):
            logger.warning("master is gone; exiting")
            raise SystemExit(0)

    return before


def _install_collective_fault(runner, rank: int) -> None:
    # imported when a fault is armed: the MoE hooks load torch, this module's importers stay without it
    from meshserve.moe import fault_hooks as moe_fault_hooks

    moe_fault_hooks.install(runner, "execute", rank)


def _install_link_faults(engine) -> None:
    # imported when a fault is armed, as above
    from meshserve.transfer import fault_hooks as transfer_fault_hooks

    transfer_fault_hooks.install(engine)


def install(runner, rank: int, master_gone: Callable[[], bool]) -> None:
    """Register this rank's hooks: each is wrapped around `runner` (or what it holds) when its faults are armed."""
    faults.on_arm({FaultKind.KILL, FaultKind.STALL},
                  lambda: faults.wrap_method(runner, "run_batch", _step_faults(rank, master_gone)))
    faults.on_arm({FaultKind.COLLECTIVE_ERROR}, lambda: _install_collective_fault(runner, rank))
    pd_connector = getattr(runner, "pd_connector", None)
    if pd_connector is not None:  # only a P/D rank pulls KV over links
        faults.on_arm({FaultKind.LINK_BREAK, FaultKind.LINK_DELAY}, lambda: _install_link_faults(pd_connector.engine))
