"""The master marks every Nth step for the ranks' garbage collection and collects as it sends that step
(xdeepserve §4.4): its step loop (`EngineCore._schedule`) over a real scheduler and a fake rank."""
from __future__ import annotations

import gc

import pytest

from meshserve.config import EngineConfig, SpeculativeConfig
from meshserve.core.dp_group import DPGroup
from meshserve.core.eplb_controller import EplbController
from meshserve.core.master import EngineCore
from meshserve.core.spec_controller import StepSpeculation
from meshserve.core.waiting_queue import DPWaitingQueue
from meshserve.utils.gc_pauses import StepCollector
from meshserve.wire.worker import StepBatch
from tests.core.test_scheduler import BS, FakeWorker, make_request, make_scheduler, prompt_of


class _Ranks:
    """Stands in for the master's worker group: what it was sent."""

    def __init__(self) -> None:
        self.sent: list[StepBatch] = []

    def send(self, batch: StepBatch) -> None:
        self.sent.append(batch)


def _master(every_steps: int, **settings) -> EngineCore:
    """An EngineCore holding only what its step loop touches: one DP group, no EPLB, no speculation."""
    core = EngineCore.__new__(EngineCore)
    core.config = EngineConfig.from_kwargs("m", **settings)
    core.microbatched_steps = 0
    scheduler = make_scheduler()
    core.dead_error = None
    core.groups, core.schedulers = [DPGroup(0, scheduler)], [scheduler]
    core.queue = DPWaitingQueue(core.schedulers, max_waiting=64, block_size=BS)
    core.pipeline_depth = 1
    core.speculation = StepSpeculation(SpeculativeConfig())
    core.eplb = EplbController(None, [], world_size=1, slice_s=1.0)
    core.workers = _Ranks()
    core.gc_schedule = StepCollector(every_steps)
    return core


def _serve(core: EngineCore, requests: int, max_tokens: int) -> list[StepBatch]:
    """Run the requests to the end, one step in flight; the batches the ranks got."""
    rank = FakeWorker()
    for i in range(requests):
        core.queue.admit(make_request(f"r{i}", prompt_of(i, 6), max_tokens=max_tokens))
    for _ in range(200):
        core._schedule()
        group = core.groups[0]
        if not group.in_flight:
            return core.workers.sent
        group.take_output(rank.execute(group.in_flight[0]))
    raise AssertionError("the requests did not finish")


@pytest.fixture
def gc_as_it_was():
    enabled, callbacks = gc.isenabled(), list(gc.callbacks)
    yield
    gc.unfreeze()
    gc.callbacks[:] = callbacks
    gc.enable() if enabled else gc.disable()


def test_every_nth_step_is_marked_and_the_master_collects_as_it_sends_it(gc_as_it_was):
    core = _master(every_steps=3)
    core.gc_schedule.start()
    batches = _serve(core, requests=2, max_tokens=10)
    assert len(batches) >= 10
    marked = [i for i, batch in enumerate(batches) if batch.collect_garbage]
    assert marked == list(range(2, len(batches), 3))
    assert core.gc_schedule.collections == core.gc_schedule.marked_steps == len(marked)
    assert not gc.isenabled()  # until the master's loop ends (`stop`)


def test_without_a_schedule_no_step_is_marked_and_collection_stays_automatic(gc_as_it_was):
    gc.enable()
    core = _master(every_steps=0)
    core.gc_schedule.start()
    batches = _serve(core, requests=2, max_tokens=10)
    assert batches and not any(batch.collect_garbage for batch in batches)
    assert core.gc_schedule.collections == 0 and gc.isenabled()


def test_a_step_is_split_in_two_micro_batches_only_where_its_largest_group_has_enough_tokens():
    core = _master(every_steps=0, parallel="attn=TP1+DP2 moe=TP1+EP2", microbatches=2, microbatch_min_tokens=4)
    batches = _serve(core, requests=3, max_tokens=4)
    # the prefill step (3 x 6 tokens) splits; decode steps of 3 tokens do not
    assert [b.microbatches for b in batches] == [2] + [1] * (len(batches) - 1)
    assert core.microbatched_steps == 1
    single = _master(every_steps=0)
    assert {b.microbatches for b in _serve(single, requests=3, max_tokens=4)} == {1}
