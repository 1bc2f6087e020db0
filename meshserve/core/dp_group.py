"""A TE's DP groups as the master holds them: each with its own scheduler and KV cache manager, and the steps
it has in flight (xdeepserve §4.1-4.2). The groups step in lockstep (every rank meets every MoE collective), so
one `StepBatch` carries every group's part; each group's output comes back on its own and is applied to its
own scheduler.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from meshserve.config import EngineConfig
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.kv_connector import KVConnectors
from meshserve.core.scheduler import Scheduler
from meshserve.wire.client import RequestDelta
from meshserve.wire.dp_group import WorldRestart
from meshserve.wire.kv import KVConnectorMetadata
from meshserve.wire.worker import ModelRunnerOutput, SchedulerOutput, WorkerReady


@dataclass
class GroupPlace:
    """Where a self-contained DP group's master sits in its TE (core/te_shell.py): its group's index, the
    torch.distributed world its ranks join with the other groups' (renamed by the shell after each failure), and
    the port its ranks on other hosts join it on (0: it has none)."""

    index: int
    dist_init: str
    generation: int = 0
    join_port: int = 0
    next_world: WorldRestart | None = None  # the world the shell named last, once it names a new one


class StepMismatchError(RuntimeError):
    """A DP group returned another step than the one it was sent next: the master's view of it is lost."""


class DPGroup:
    def __init__(self, index: int, scheduler: Scheduler) -> None:
        self.index = index
        self.scheduler = scheduler
        self.in_flight: deque[SchedulerOutput] = deque()  # sent, output not back yet, oldest first

    @property
    def kv_manager(self) -> KVCacheManager:
        return self.scheduler.kv_manager

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def sent(self, sched: SchedulerOutput) -> None:
        self.in_flight.append(sched)

    def take_output(self, out: ModelRunnerOutput) -> tuple[SchedulerOutput, list[RequestDelta]]:
        """Apply a step's output: the step it answers, and the requests' new tokens and endings."""
        sched = self.in_flight.popleft()
        if out.step_id != sched.step_id:
            raise StepMismatchError(f"DP group {self.index} returned step {out.step_id}, expected {sched.step_id}")
        return sched, self.scheduler.update_from_output(sched, out)


def build_dp_groups(config: EngineConfig, ready: list[WorkerReady], listen_addr: str, send_to: Callable,
                    max_model_len: int, num_draft_tokens: int,
                    place: GroupPlace | None = None) -> tuple[list[DPGroup], KVConnectors]:
    """One group per attention-DP rank of `config`'s layout (a self-contained group's master, `place`: its own
    only, `ready` its ranks), its KV cache as large as the smallest of its ranks allows; remote KV (memory
    pool, prefill -> decode) comes through KV connectors, one set per group."""
    strategy = config.parallel_config.strategy
    kv_managers = []
    for group in range(strategy.attn_dp if place is None else 1):
        ranks = ready[group * strategy.attn_tp:(group + 1) * strategy.attn_tp]
        kv_managers.append(KVCacheManager(min(r.num_kv_blocks for r in ranks), config.cache_config.block_size,
                                          enable_prefix_caching=config.cache_config.enable_prefix_caching))
    first_group = 0 if place is None else place.index
    connectors = KVConnectors(config, ready, kv_managers, listen_addr, send_to, first_group)
    scheduler_config = msgspec.structs.replace(config.scheduler_config, max_model_len=max_model_len)
    groups = [DPGroup(first_group + index, Scheduler(scheduler_config, kv_manager, connectors.per_group[index],
                                                     num_speculative_tokens=num_draft_tokens))
              for index, kv_manager in enumerate(kv_managers)]
    return groups, connectors


def connector_metadata(groups: list[DPGroup]) -> dict[int, KVConnectorMetadata]:
    """Each DP group's KV connector work not yet sent (loads, stores)."""
    metadata = {group.index: group.scheduler.build_connector_meta() for group in groups}
    return {index: meta for index, meta in metadata.items() if meta is not None}
