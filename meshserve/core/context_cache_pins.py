"""Explicit context caching (deepserve MatchByID) in one DP group: named caches' prompt blocks pinned in the
RTC's id index until their ttl passes.

A request that creates a cache pins its full prompt blocks once their KV is computed; a request naming a cache
reuses the pinned blocks that lead its prompt (checked token by token: an id alone proves nothing). Pinned
blocks hold at most `MAX_PINNED_FRACTION` of the group's KV blocks, so the rest keeps serving requests. The
counts and the expiry heap are kept as caches come and go: admission and expiry cost O(log n), not a scan.
"""
from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass

from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.request import Request

logger = logging.getLogger(__name__)

# named context caches may pin at most this share of a DP group's KV blocks: the rest keeps serving requests
MAX_PINNED_FRACTION = 0.5


@dataclass
class ContextCachePin:
    """A named context cache's blocks, pinned in the RTC's id index until `deadline` (time.monotonic)."""

    token_ids: list[int]  # the tokens of the pinned full blocks, to check a request's prompt really starts with them
    deadline: float
    num_blocks: int = 0


class ContextCachePins:
    """The named context caches pinned in `kv_manager`'s id index (cache id -> `ContextCachePin`)."""

    def __init__(self, kv_manager: KVCacheManager) -> None:
        self.kv_manager = kv_manager
        self.block_size = kv_manager.block_size
        self.pins: dict[str, ContextCachePin] = {}
        self.num_pinned_blocks = 0
        self._deadlines: list[tuple[float, str]] = []  # heap; an entry whose pin is gone or renewed is skipped

    def match(self, cache_id: str | None, tokens: list[int], limit: int) -> list[int]:
        """The pinned blocks of `cache_id` that lead `tokens` (within `limit` tokens); none for an id this
        engine does not know (it restarted, or another engine made it): prefix matching alone serves it."""
        pin = self.pins.get(cache_id) if cache_id is not None else None
        if pin is None:
            return []
        blocks = self.kv_manager.match_by_id(cache_id) or []
        bs = self.block_size
        n = 0
        while (n < len(blocks) and (n + 1) * bs <= limit
               and tokens[n * bs:(n + 1) * bs] == pin.token_ids[n * bs:(n + 1) * bs]):
            n += 1
        return blocks[:n]

    def can_pin(self, num_blocks: int) -> bool:
        """Whether named context caches may pin `num_blocks` more blocks here."""
        return self.num_pinned_blocks + num_blocks <= int(MAX_PINNED_FRACTION * self.kv_manager.num_blocks)

    def pin(self, req: Request) -> None:
        """Once a creating request's prompt KV is computed, pin its full prompt blocks under the cache id."""
        bs = self.block_size
        num_full = req.num_prompt_tokens // bs
        if req.num_kv_ready_tokens < num_full * bs:
            return
        if not self.can_pin(num_full):  # others were pinned since its admission: it stays a plain prefix
            logger.warning("context cache %s not pinned: named caches would hold over %.0f%% of the KV blocks",
                           req.context_cache_id, 100 * MAX_PINNED_FRACTION)
            req.context_cache_ttl_s = None
            return
        self.kv_manager.register_id(req.context_cache_id, req.block_ids[:num_full])  # one reference each: never evicted
        pin = ContextCachePin(token_ids=list(req.prompt_token_ids[:num_full * bs]),
                              deadline=time.monotonic() + req.context_cache_ttl_s, num_blocks=num_full)
        self.forget(req.context_cache_id)
        self.pins[req.context_cache_id] = pin
        self.num_pinned_blocks += num_full
        heapq.heappush(self._deadlines, (pin.deadline, req.context_cache_id))
        req.context_cache_ttl_s = None
        logger.debug("context cache %s: %d blocks pinned", req.context_cache_id, num_full)

    def forget(self, cache_id: str) -> bool:
        """Drop `cache_id`'s pin from the books (its blocks stay registered: the caller unregisters them)."""
        pin = self.pins.pop(cache_id, None)
        if pin is not None:
            self.num_pinned_blocks -= pin.num_blocks
        return pin is not None

    def expired(self, now: float) -> list[str]:
        """The caches whose ttl has passed by `now`, each once (taken off the expiry heap)."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, cache_id = heapq.heappop(self._deadlines)
            pin = self.pins.get(cache_id)
            if pin is not None and pin.deadline == deadline:
                expired.append(cache_id)
        return expired
