"""DRAM preload (deepserve §6): a model's checkpoint read into the page cache ahead of the scale-up that will
load it, so the new TE loads from memory, not disk. The cluster manager decides which models to keep (pools
predicted to scale up); this reads them in the background."""
from __future__ import annotations

import logging
import threading
from collections import deque

logger = logging.getLogger(__name__)

TREND_WINDOW_S = 30.0  # the load trend scale-ups are predicted from


class DramPreloader:
    """Reads a model's checkpoint into the page cache in the background (one model at a time), and again
    when most of it was evicted since; checked at most every `RECHECK_S` per model."""

    RECHECK_S = 10.0
    RESIDENT_ENOUGH = 0.9

    def __init__(self) -> None:
        self._checked: dict[str, float] = {}
        self._busy: threading.Thread | None = None
        self.preloaded: list[tuple[str, int, float]] = []  # (model, bytes, seconds), for status and benchmarks
        self._load_history: dict[str, deque[tuple[float, float]]] = {}  # pool -> (time, load)

    def predicts_scale_up(self, pool: str, now: float, load: float, target: int, held: int, most: int) -> bool:
        """Whether `pool` (now at `target` TEs of at most `most`, its TEs' requests and the JEs' held jobs
        `load`) is predicted to scale up: it can grow and its load rose over the last `TREND_WINDOW_S`, or it
        waits at zero, or the JEs hold jobs for it."""
        history = self._load_history.setdefault(pool, deque())
        history.append((now, load))
        while history and now - history[0][0] > TREND_WINDOW_S:
            history.popleft()
        rising = len(history) > 1 and history[-1][1] > history[0][1]
        return target < most and (rising or target == 0 or held > 0)

    def keep(self, model: str, now: float) -> None:
        if self._busy is not None and self._busy.is_alive():
            return
        if now - self._checked.get(model, -self.RECHECK_S) < self.RECHECK_S:
            return
        self._checked[model] = now
        self._busy = threading.Thread(target=self._load, args=(model,), name="meshserve-preload", daemon=True)
        self._busy.start()

    def _load(self, model: str) -> None:
        # start-up: the page-cache helpers only when preloading
        from meshserve.utils import page_cache

        try:
            files = page_cache.checkpoint_files(model)
            if page_cache.resident_fraction(files) >= self.RESIDENT_ENOUGH:
                return
            nbytes, seconds = page_cache.preload(files)
            self.preloaded.append((model, nbytes, seconds))
            logger.info("DRAM preload: %s in the page cache (%.0f MB in %.1f s)", model, nbytes / 1e6, seconds)
        except OSError as exc:
            logger.warning("DRAM preload of %s failed: %s", model, exc)
