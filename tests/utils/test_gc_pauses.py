"""The serving process's start-up objects are frozen out of the garbage collector's passes, and a slow pass is
logged."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest

from meshserve.utils import gc_pauses


@pytest.fixture
def restored_gc():
    """No pause watch of this process's earlier work (a server or master started in it installs one), and the
    collector's callbacks and frozen heap as they were afterwards."""
    callbacks = list(gc.callbacks)
    gc.callbacks[:] = [cb for cb in callbacks if not isinstance(cb, gc_pauses._PauseWatch)]
    yield
    gc.unfreeze()
    gc.callbacks[:] = callbacks


def test_start_up_objects_are_frozen_and_the_watch_is_installed_once(restored_gc):
    survivor = [object() for _ in range(1000)]  # start-up state that lives as long as the process
    gc_pauses.freeze_startup_heap()
    gc_pauses.freeze_startup_heap()
    assert gc.get_freeze_count() >= len(survivor)
    assert not any(gc.is_tracked(o) and o is survivor for o in gc.get_objects(generation=2))  # out of the passes
    assert sum(isinstance(cb, gc_pauses._PauseWatch) for cb in gc.callbacks) == 1


def test_a_pass_longer_than_the_bound_is_logged(restored_gc, caplog):
    gc.callbacks.append(gc_pauses._PauseWatch(slow_s=0.0))  # every pass is "slow"
    with caplog.at_level(logging.WARNING, logger=gc_pauses.__name__):
        gc.collect()
    assert any("garbage collection of generation 2 took" in r.getMessage() for r in caplog.records)
    caplog.clear()
    gc.callbacks[-1] = gc_pauses._PauseWatch(slow_s=3600.0)
    with caplog.at_level(logging.WARNING, logger=gc_pauses.__name__):
        gc.collect()
    assert not caplog.records


# ---------------------------------------------------------------- garbage collection on a schedule (StepCollector)
@pytest.fixture
def gc_as_it_was(restored_gc):
    enabled = gc.isenabled()
    yield
    gc.enable() if enabled else gc.disable()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_schedule_freezes_the_heap_turns_automatic_collection_off_and_back_on(gc_as_it_was):
    gc.enable()
    survivor = [object() for _ in range(1000)]
    collector = gc_pauses.StepCollector(3)
    collector.start()
    assert collector.active and not gc.isenabled()
    assert gc.get_freeze_count() >= len(survivor)
    collector.start()  # started once only: stop() still restores what was before the first start
    collector.stop()
    assert not collector.active and gc.isenabled()


def test_every_nth_step_is_due(gc_as_it_was):
    collector = gc_pauses.StepCollector(3)
    assert not collector.due()  # not started: automatic collection still runs, no step is marked
    collector.start()
    assert [collector.due() for _ in range(9)] == [False, False, True] * 3
    assert collector.marked_steps == 3


def test_without_a_schedule_collection_stays_automatic_and_no_step_is_due(gc_as_it_was):
    gc.enable()
    collector = gc_pauses.StepCollector(0)
    collector.start()
    assert not collector.active and gc.isenabled()
    assert not any(collector.due() for _ in range(500))
    with pytest.raises(ValueError, match="every_steps must be at least 0"):
        gc_pauses.StepCollector(-1)


def test_a_pass_collects_cycles_and_records_its_pause(gc_as_it_was):
    collector = gc_pauses.StepCollector(2)
    collector.start()

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle
    alive = weakref.ref(cycle)
    del cycle
    assert alive() is not None  # automatic collection is off: the cycle waits for the scheduled pass
    took = collector.collect()
    assert alive() is None
    assert collector.collections == 1 and list(collector.pauses) == [took] and took >= 0


def test_an_idle_process_collects_once_the_last_pass_is_old_enough(gc_as_it_was):
    clock = _Clock()
    collector = gc_pauses.StepCollector(200, idle_after_s=5.0, clock=clock)
    collector.start()
    clock.now += 4.0
    assert not collector.collect_if_idle(busy=lambda: False)  # too soon
    clock.now += 2.0
    assert not collector.collect_if_idle(busy=lambda: True)  # steps run: they collect on their schedule
    assert collector.collect_if_idle(busy=lambda: False)
    assert not collector.collect_if_idle(busy=lambda: False)  # that pass was just now
    assert collector.collections == 1 and collector.marked_steps == 0  # no step of the ranks' marked
    assert not gc_pauses.StepCollector(200, clock=clock).collect_if_idle(busy=lambda: False)  # no idle bound
