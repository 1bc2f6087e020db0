"""Named context caches as the API sees them: id -> what the cached prefix is, and until when.

Explicit context caching (deepserve §4.3, `MatchByID`): a client names a prefix once
(`POST /v1/context_caches`), the engine computes its KV and keeps the blocks pinned under
the id until the cache expires or is deleted, and later requests that reference the id
put the prefix first. This store holds the frontend's half: the prefix itself (token ids
for /v1/completions, chat messages for /v1/chat/completions) and the expiry.

An expired id leaves a tombstone for a while, so a late reference is told that its cache
expired rather than that it never existed. Thread-safe.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

DEFAULT_TTL_S = 300.0
MAX_TTL_S = 86400.0
ID_PREFIX = "ctxc-"

# how long, and how many, expired ids are remembered as expired (then they read as unknown)
TOMBSTONE_S = 3600.0
MAX_TOMBSTONES = 4096


class ContextCacheNotFound(KeyError):
    """No live cache has this id; `expired` says whether one did until its ttl ran out."""

    def __init__(self, cache_id: str, expired_at: float | None = None) -> None:
        super().__init__(cache_id)
        self.cache_id = cache_id
        self.expired_at = expired_at

    @property
    def expired(self) -> bool:
        return self.expired_at is not None


@dataclass(frozen=True)
class ContextCache:
    id: str
    model: str
    created: float  # unix time
    expires_at: float  # unix time
    num_tokens: int  # the prefix's length in tokens
    token_ids: list[int] | None = None  # a prompt prefix (for /v1/completions)
    messages: list[dict[str, str]] | None = None  # a conversation prefix (for /v1/chat/completions)

    @property
    def kind(self) -> Literal["prompt", "messages"]:
        return "messages" if self.messages is not None else "prompt"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "context_cache", "model": self.model, "num_tokens": self.num_tokens,
                "created": int(self.created), "expires_at": int(self.expires_at)}


def new_cache_id() -> str:
    return f"{ID_PREFIX}{uuid.uuid4().hex}"


class ContextCacheStore:
    def __init__(self, clock: Callable[[], float] = time.time, tombstone_s: float = TOMBSTONE_S,
                 max_tombstones: int = MAX_TOMBSTONES) -> None:
        self._clock = clock
        self._tombstone_s = tombstone_s
        self._max_tombstones = max_tombstones
        self._lock = threading.Lock()
        self._caches: dict[str, ContextCache] = {}
        self._tombstones: OrderedDict[str, float] = OrderedDict()  # id -> when it expired, oldest first

    def add(self, cache_id: str, model: str, num_tokens: int, ttl_s: float, *, token_ids: list[int] | None = None,
            messages: list[dict[str, str]] | None = None, created: float | None = None) -> ContextCache:
        """Record a cache whose prefix the engine has computed; it lives `ttl_s` from `created` (default now)."""
        if (token_ids is None) == (messages is None):
            raise ValueError("a context cache holds either token ids or messages")
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl must be in (0, {MAX_TTL_S:.0f}] seconds, got {ttl_s}")
        created = self._clock() if created is None else created
        cache = ContextCache(cache_id, model, created, created + ttl_s, num_tokens,
                             token_ids=list(token_ids) if token_ids is not None else None,
                             messages=[dict(m) for m in messages] if messages is not None else None)
        with self._lock:
            self._sweep(self._clock())
            if cache_id in self._caches:
                raise ValueError(f"context cache id {cache_id!r} is already in use")
            self._tombstones.pop(cache_id, None)
            self._caches[cache_id] = cache
        return cache

    def get(self, cache_id: str) -> ContextCache:
        """The live cache; raises ContextCacheNotFound (with `expired` set when its ttl ran out)."""
        with self._lock:
            self._sweep(self._clock())
            cache = self._caches.get(cache_id)
            if cache is None:
                raise ContextCacheNotFound(cache_id, self._tombstones.get(cache_id))
            return cache

    def delete(self, cache_id: str) -> ContextCache:
        """Forget a live cache (a deleted id then reads as unknown); raises ContextCacheNotFound."""
        with self._lock:
            self._sweep(self._clock())
            cache = self._caches.pop(cache_id, None)
            if cache is None:
                raise ContextCacheNotFound(cache_id, self._tombstones.get(cache_id))
            return cache

    def __len__(self) -> int:
        with self._lock:
            self._sweep(self._clock())
            return len(self._caches)

    def _sweep(self, now: float) -> None:
        expired = sorted((c for c in self._caches.values() if c.expires_at <= now), key=lambda c: c.expires_at)
        for cache in expired:
            del self._caches[cache.id]
            self._tombstones[cache.id] = cache.expires_at
        while self._tombstones:
            oldest_id, expired_at = next(iter(self._tombstones.items()))
            if len(self._tombstones) <= self._max_tombstones and expired_at > now - self._tombstone_s:
                break
            del self._tombstones[oldest_id]
