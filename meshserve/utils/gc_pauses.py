"""Keeping the garbage collector's full passes short in a serving process.

A full (generation 2) collection walks every tracked object, so it pauses the event loop for as long as the
heap is large: after start-up the frontend holds the app, the tokenizer's Python side and the imported
modules, and a burst of requests (one with 128 choices) triggers a pass that held /health for about a second.
Those start-up objects live as long as the process, so they are moved out of the collector's sight once
start-up is over (`gc.freeze`, as vLLM's and SGLang's servers do); a pass that still takes long is logged.
"""
from __future__ import annotations

import gc
import logging
import time

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
