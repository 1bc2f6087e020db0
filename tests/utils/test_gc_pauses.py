"""The serving process's start-up objects are frozen out of the garbage collector's passes, and a slow pass is
logged."""
from __future__ import annotations

import gc
import logging

import pytest

from meshserve.utils import gc_pauses


@pytest.fixture
def restored_gc():
    callbacks = list(gc.callbacks)
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
