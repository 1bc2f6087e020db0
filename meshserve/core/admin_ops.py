"""Operator commands to a TE (`AdminRequest`): one handler per `AdminOp`.

Expert placement (EPLB load, status, rebalance), stats, a prefix-cache snapshot for routers, named
context caches (delete, list), a drain for a scale-down, and fault injection for tests and benchmarks.
A command the TE cannot carry out is refused with its reason (`AdminError`, `EplbError`); a handler that
fails otherwise is refused too, naming the operation: an operator command never takes the TE down.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from meshserve.core.drain import Drain
from meshserve.core.eplb_controller import EplbController, EplbError
from meshserve.core.kv_events import KVEventPublisher
from meshserve.core.scheduler import Scheduler
from meshserve.core.waiting_queue import DPWaitingQueue
from meshserve.core.worker_group import WorkerGroup
from meshserve.utils import faults
from meshserve.wire.client import (
    AdminOp,
    AdminReply,
    AdminRequest,
    ContextCacheDeleted,
    ContextCacheInfo,
    ContextCacheListing,
    EngineStats,
    EplbStatus,
    ExpertLoad,
    KVSnapshot,
    StatsResult,
)
from meshserve.wire.worker import InjectFault

logger = logging.getLogger(__name__)


class AdminError(RuntimeError):
    """An operator command the TE refuses (its reason shown to the operator as is)."""


class AdminOps:
    """The operator commands over the ranks served now (built again with them); `engine_stats` and
    `dead_error` ask the engine."""

    def __init__(self, *, eplb: EplbController, schedulers: list[Scheduler], queue: DPWaitingQueue,
                 workers: WorkerGroup, kv_events: KVEventPublisher, drain: Drain,
                 engine_stats: Callable[[], EngineStats], dead_error: Callable[[], str | None]) -> None:
        self.eplb = eplb
        self.schedulers = schedulers
        self.queue = queue
        self.workers = workers
        self.kv_events = kv_events
        self.drain = drain
        self.engine_stats = engine_stats
        self.dead_error = dead_error

    def reply(self, item: AdminRequest) -> AdminReply:
        """The command's result, or its refusal."""
        try:
            data = self._HANDLERS[item.op](self, item)
        except (AdminError, EplbError) as exc:
            return AdminReply(query_id=item.query_id, ok=False, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a failing operator command is refused, never fatal
            logger.exception("admin operation %r failed", item.op)
            return AdminReply(query_id=item.query_id, ok=False, error=f"{item.op} failed: {exc}")
        return AdminReply(query_id=item.query_id, data=data)

    def _eplb_load(self, item: AdminRequest) -> ExpertLoad:
        return self.eplb.load()

    def _eplb_status(self, item: AdminRequest) -> EplbStatus:
        return self.eplb.status()

    def _eplb_rebalance(self, item: AdminRequest) -> EplbStatus:
        dead_error = self.dead_error()
        if dead_error is not None:
            raise AdminError(f"engine is dead: {dead_error}")
        self.eplb.rebalance(item.placement)
        return self.eplb.status()

    def _stats(self, item: AdminRequest) -> StatsResult:
        return StatsResult(self.engine_stats())

    def _kv_snapshot(self, item: AdminRequest) -> KVSnapshot:
        """A router rebuilding its view of this TE's prefix caches."""
        return KVSnapshot(seq=self.kv_events.seq,
                          blocks={g: s.kv_manager.snapshot() for g, s in enumerate(self.schedulers)})

    def _context_cache_delete(self, item: AdminRequest) -> ContextCacheDeleted:
        """Unpin a named context cache's blocks."""
        if item.cache_id is None:
            raise AdminError("context_cache.delete needs a cache id")
        deleted = [s.drop_context_cache(item.cache_id) for s in self.schedulers]
        return ContextCacheDeleted(id=item.cache_id, deleted=any(deleted))

    def _context_cache_list(self, item: AdminRequest) -> ContextCacheListing:
        now = time.monotonic()
        return ContextCacheListing(caches={
            cache_id: ContextCacheInfo(dp_rank=g, num_tokens=len(pin.token_ids),
                                       expires_in_s=max(0.0, pin.deadline - now))
            for g, s in enumerate(self.schedulers) for cache_id, pin in s.context_caches.items()})

    def _drain(self, item: AdminRequest) -> StatsResult:
        """A scale-down: take nothing new, finish what runs (and what prefill holds for decode), then leave."""
        self.drain.begin(num_running=sum(s.num_running for s in self.schedulers),
                         num_waiting=len(self.queue.pending) + sum(s.num_waiting for s in self.schedulers))
        return StatsResult(self.engine_stats())

    def _fault_inject(self, item: AdminRequest) -> StatsResult:
        """Arm a fault (tests and benchmarks): the master's own here, the others on every rank."""
        if item.fault.kind in faults.MASTER_KINDS:
            faults.arm(item.fault)
        else:
            self.workers.send(InjectFault(fault=item.fault))
        return StatsResult(self.engine_stats())

    _HANDLERS = {AdminOp.EPLB_LOAD: _eplb_load, AdminOp.EPLB_STATUS: _eplb_status,
                 AdminOp.EPLB_REBALANCE: _eplb_rebalance, AdminOp.STATS: _stats, AdminOp.KV_SNAPSHOT: _kv_snapshot,
                 AdminOp.CONTEXT_CACHE_DELETE: _context_cache_delete,
                 AdminOp.CONTEXT_CACHE_LIST: _context_cache_list, AdminOp.DRAIN: _drain,
                 AdminOp.FAULT_INJECT: _fault_inject}
