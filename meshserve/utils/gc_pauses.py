"""Keeping the garbage collector's pauses short, and in a TE's step loop at set steps.

A full (generation 2) collection walks every tracked object, so it pauses the event loop for as long as the
heap is large: after start-up the frontend holds the app, the tokenizer's Python side and the imported
modules, and a burst of requests (one with 128 choices) triggers a pass that held /health for about a second.
Those start-up objects live as long as the process, so they are moved out of the collector's sight once
start-up is over (`gc.freeze`, as vLLM's and SGLang's servers do); a pass that still takes long is logged.

A TE's ranks meet at collectives every step, so a pass on one rank stalls all of them, and automatic passes
start on whichever rank allocates past its threshold first: every rank in turn. `StepCollector` turns the
automatic passes off and collects at set steps instead, the same step on every rank (xdeepserve §4.4).
"""
from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

SLOW_PASS_S = 0.2  # a collection this long is logged: it held the event loop as long


class _PauseWatch:
    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        if took > self.slow_s:
            logger.warning("garbage collection of generation %d took %.2f s (%d objects collected)",
                           info.get("generation", -1), took, info.get("collected", 0))


def freeze_startup_heap(slow_s: float = SLOW_PASS_S) -> None:
    """Collect once, then freeze what is left (it lives as long as the process) and log slow passes from now on.
    Call it once, when start-up is over and before the first request."""
    gc.collect()
    gc.freeze()
    if not any(isinstance(cb, _PauseWatch) for cb in gc.callbacks):
        gc.callbacks.append(_PauseWatch(slow_s))
    logger.debug("%d start-up objects frozen out of the garbage collector's passes", gc.get_freeze_count())


class StepCollector:
    """Garbage collection on a schedule: every `every_steps`-th step (and, with `idle_after_s`, when idle that
    long since the last pass) instead of whenever allocations trigger it. `every_steps` 0 leaves Python's
    automatic collection on; `collect` still runs a pass when asked (a rank collects when its master says)."""

    def __init__(self, every_steps: int, idle_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, keep_pauses: int = 1024) -> None:
        if every_steps < 0:
            raise ValueError(f"every_steps must be at least 0, got {every_steps}")
        self.every_steps = every_steps
        self.idle_after_s = idle_after_s
        self._clock = clock
        self._steps = 0
        self._last_pass = clock()
        self._was_enabled: bool | None = None  # gc.isenabled() before start(); None: not started
        self.collections = 0  # passes of this process, scheduled or idle
        self.marked_steps = 0  # steps `due` said a pass belongs after
        self.pauses: deque[float] = deque(maxlen=keep_pauses)  # the latest passes' durations, seconds

    @property
    def active(self) -> bool:
        """Started with a schedule: automatic collection is off."""
        return self._was_enabled is not None

    def start(self) -> None:
        """Once start-up is over: freeze the start-up heap and turn automatic collection off (no-op without a
        schedule, or when started already)."""
        if self.every_steps == 0 or self.active:
            return
        freeze_startup_heap()
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._last_pass = self._clock()
        logger.info("garbage collection every %d steps (automatic collection off)", self.every_steps)

    def stop(self) -> None:
        """Automatic collection as it was before start()."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def due(self) -> bool:
        """Count one step; whether a pass belongs right after it."""
        if not self.active:
            return False
        self._steps += 1
        if self._steps % self.every_steps:
            return False
        self.marked_steps += 1
        return True

    def collect(self) -> float:
        """One full pass now; its duration in seconds."""
        started = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - started
        self.pauses.append(took)
        self.collections += 1
        self._last_pass = self._clock()
        logger.debug("scheduled garbage collection took %.1f ms", took * 1000)
        return took

    def collect_if_idle(self, busy: Callable[[], bool]) -> bool:
        """A pass when the last one is `idle_after_s` old and `busy()` says nothing runs: garbage made without
        steps (requests refused, clients' messages) is not left to pile up. Whether it collected."""
        if not self.active or self.idle_after_s is None or self._clock() - self._last_pass < self.idle_after_s:
            return False
        if busy():
            return False
        self.collect()
        return True
