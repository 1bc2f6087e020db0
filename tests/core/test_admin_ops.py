"""Operator commands (`AdminOps`) over real schedulers, without ranks: results, and refusals with their reasons."""
from __future__ import annotations

import pytest

from meshserve.core.admin_ops import AdminError, AdminOps
from meshserve.core.drain import Drain
from meshserve.core.eplb_controller import EplbController, EplbError
from meshserve.core.kv_events import KVEventPublisher
from meshserve.core.waiting_queue import DPWaitingQueue
from meshserve.wire.client import AdminOp, AdminRequest, ContextCacheDeleted, EngineStats, StatsResult
from tests.core.test_scheduler import BS, make_scheduler


class _Ranks:
    def __init__(self) -> None:
        self.sent = []

    def send(self, item) -> None:
        self.sent.append(item)


def _ops(dead_error: str | None = None, eplb: EplbController | None = None) -> AdminOps:
    schedulers = [make_scheduler(num_blocks=16), make_scheduler(num_blocks=16)]
    return AdminOps(eplb=eplb or EplbController(None, [], 2, 1.0), schedulers=schedulers,
                    queue=DPWaitingQueue(schedulers, max_waiting=8, block_size=BS), workers=_Ranks(),
                    kv_events=KVEventPublisher(None, "", "te"), drain=Drain(),
                    engine_stats=lambda: EngineStats(num_running=3), dead_error=lambda: dead_error)


def test_a_context_cache_delete_without_an_id_is_an_admin_error_refused_with_its_reason():
    ops = _ops()
    with pytest.raises(AdminError) as refused:
        ops._context_cache_delete(AdminRequest(query_id=1, op=AdminOp.CONTEXT_CACHE_DELETE))
    assert not isinstance(refused.value, EplbError)
    reply = ops.reply(AdminRequest(query_id=7, op=AdminOp.CONTEXT_CACHE_DELETE))
    assert (reply.query_id, reply.ok, reply.error) == (7, False, "context_cache.delete needs a cache id")


def test_an_unknown_cache_id_is_deleted_nowhere():
    reply = _ops().reply(AdminRequest(query_id=2, op=AdminOp.CONTEXT_CACHE_DELETE, cache_id="nope"))
    assert reply.ok and reply.data == ContextCacheDeleted(id="nope", deleted=False)


def test_eplb_refusals_keep_their_own_message():
    reply = _ops().reply(AdminRequest(query_id=3, op=AdminOp.EPLB_REBALANCE))
    assert reply.ok is False and reply.error == "the model has no MoE layers to rebalance"


def test_a_dead_engine_refuses_a_rebalance():
    reply = _ops(dead_error="worker 0 died").reply(AdminRequest(query_id=4, op=AdminOp.EPLB_REBALANCE))
    assert reply.ok is False and reply.error == "engine is dead: worker 0 died"


def test_a_handler_that_fails_otherwise_is_refused_naming_the_operation(monkeypatch):
    ops = _ops()

    def broken():
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(ops.eplb, "status", broken)
    reply = ops.reply(AdminRequest(query_id=5, op=AdminOp.EPLB_STATUS))
    assert reply.ok is False and reply.error == "eplb.status failed: boom"


def test_a_drain_begins_once_and_answers_with_the_engines_stats():
    ops = _ops()
    first = ops.reply(AdminRequest(query_id=6, op=AdminOp.DRAIN))
    since = ops.drain.since
    assert first.ok and first.data == StatsResult(EngineStats(num_running=3)) and since is not None
    ops.reply(AdminRequest(query_id=7, op=AdminOp.DRAIN))
    assert ops.drain.active and ops.drain.since == since


def test_every_operation_has_a_handler():
    assert set(AdminOps._HANDLERS) == set(AdminOp)
