"""Named context caches as the API sees them: id -> what the cached prefix is, and until when.

Explicit context caching (deepserve §4.3, `MatchByID`): a client names a prefix once
(`POST /v1/context_caches`), the engine computes its KV and keeps the blocks pinned under
the id until the cache expires or is deleted, and later requests that reference the id
put the prefix first. This store holds the frontend's half: the prefix itself (token ids
for /v1/completions, chat messages for /v1/chat/completions) and the expiry.

An expired id leaves a tombstone for a while, so a late reference is told that its cache
expired rather than that it never existed. Every cache has an owner (an API key's hash, or a
client address); `ContextCacheLimits` bounds what one owner, and everyone together, may hold,
counting caches still being created. Lookups are dict reads; expiry pops a heap. Thread-safe.
"""
from __future__ import annotations

import heapq
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


@dataclass(frozen=True)
class ContextCacheLimits:
    max_ttl_s: float = MAX_TTL_S  # the operator's ceiling on a cache's ttl
    caches_per_owner: int = 16
    tokens_per_owner: int | None = None  # prefix tokens one owner may keep pinned (None: no limit)
    total_caches: int = 1024


class ContextCacheQuotaExceeded(Exception):
    """Creating this cache would take its owner (or the server) past a limit; the message says which."""


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
    owner: str = ""  # who created it (quotas and access are per owner)
    token_ids: list[int] | None = None  # a prompt prefix (for /v1/completions)
    messages: list[dict[str, str]] | None = None  # a conversation prefix (for /v1/chat/completions)

    @property
    def kind(self) -> Literal["prompt", "messages"]:
        return "messages" if self.messages is not None else "prompt"

    def to_dict(self, with_owner: bool = False) -> dict[str, Any]:
        data = {"id": self.id, "object": "context_cache", "model": self.model, "num_tokens": self.num_tokens,
                "created": int(self.created), "expires_at": int(self.expires_at)}
        if with_owner:
            data["owner"] = self.owner
        return data


def new_cache_id() -> str:
    return f"{ID_PREFIX}{uuid.uuid4().hex}"


class ContextCacheStore:
    def __init__(self, clock: Callable[[], float] = time.time, tombstone_s: float = TOMBSTONE_S,
                 max_tombstones: int = MAX_TOMBSTONES, limits: ContextCacheLimits = ContextCacheLimits()) -> None:
        self._clock = clock
        self._tombstone_s = tombstone_s
        self._max_tombstones = max_tombstones
        self.limits = limits
        self._lock = threading.Lock()
        self._caches: dict[str, ContextCache] = {}
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, id); deleted ids linger until popped
        self._reserved: dict[str, tuple[str, int]] = {}  # id -> (owner, tokens) of caches being created
        self._usage: dict[str, list[int]] = {}  # owner -> [caches, tokens], live and reserved together
        self._tombstones: OrderedDict[str, float] = OrderedDict()  # id -> when it expired, oldest first

    def reserve(self, cache_id: str, owner: str, num_tokens: int) -> None:
        """Count a cache about to be created against its owner's quota; raises ContextCacheQuotaExceeded."""
        with self._lock:
            self._sweep(self._clock())
            if cache_id in self._caches or cache_id in self._reserved:
                raise ValueError(f"context cache id {cache_id!r} is already in use")
            self._check_quota(owner, num_tokens)
            self._reserved[cache_id] = (owner, num_tokens)
            self._count(owner, 1, num_tokens)

    def release(self, cache_id: str) -> None:
        """Give back a reservation whose cache was not created (a no-op once `add` took it)."""
        with self._lock:
            reserved = self._reserved.pop(cache_id, None)
            if reserved is not None:
                self._count(reserved[0], -1, -reserved[1])

    def add(self, cache_id: str, model: str, num_tokens: int, ttl_s: float, *, token_ids: list[int] | None = None,
            messages: list[dict[str, str]] | None = None, created: float | None = None,
            owner: str = "") -> ContextCache:
        """Record a cache whose prefix the engine has computed; it lives `ttl_s` from `created` (default now).
        Takes over the id's reservation if there is one, else checks the owner's quota here."""
        if (token_ids is None) == (messages is None):
            raise ValueError("a context cache holds either token ids or messages")
        if not 0 < ttl_s <= self.limits.max_ttl_s:
            raise ValueError(f"ttl must be in (0, {self.limits.max_ttl_s:g}] seconds, got {ttl_s}")
        created = self._clock() if created is None else created
        cache = ContextCache(cache_id, model, created, created + ttl_s, num_tokens, owner,
                             token_ids=list(token_ids) if token_ids is not None else None,
                             messages=[dict(m) for m in messages] if messages is not None else None)
        with self._lock:
            self._sweep(self._clock())
            if cache_id in self._caches:
                raise ValueError(f"context cache id {cache_id!r} is already in use")
            reserved = self._reserved.pop(cache_id, None)
            if reserved is not None:
                self._count(reserved[0], -1, -reserved[1])
            self._check_quota(owner, num_tokens)
            self._count(owner, 1, num_tokens)
            self._tombstones.pop(cache_id, None)
            self._caches[cache_id] = cache
            heapq.heappush(self._expiry, (cache.expires_at, cache_id))
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
            self._count(cache.owner, -1, -cache.num_tokens)
            self._compact_expiry()
            return cache

    def list(self, owner: str | None = None) -> list[ContextCache]:
        """Live caches (of one owner, or all), oldest first."""
        with self._lock:
            self._sweep(self._clock())
            caches = [c for c in self._caches.values() if owner is None or c.owner == owner]
        return sorted(caches, key=lambda c: c.created)

    def usage(self, owner: str) -> tuple[int, int]:
        """(caches, prefix tokens) the owner holds or is creating."""
        with self._lock:
            self._sweep(self._clock())
            caches, tokens = self._usage.get(owner, (0, 0))
            return caches, tokens

    def __len__(self) -> int:
        with self._lock:
            self._sweep(self._clock())
            return len(self._caches)

    def _check_quota(self, owner: str, num_tokens: int) -> None:
        limits = self.limits
        caches, tokens = self._usage.get(owner, (0, 0))
        if len(self._caches) + len(self._reserved) >= limits.total_caches:
            raise ContextCacheQuotaExceeded(f"the server holds its maximum of {limits.total_caches} context "
                                            "caches; retry when some expire")
        if caches >= limits.caches_per_owner:
            raise ContextCacheQuotaExceeded(f"you hold {caches} context caches, the most one key may hold "
                                            f"({limits.caches_per_owner}); delete one first")
        if limits.tokens_per_owner is not None and tokens + num_tokens > limits.tokens_per_owner:
            raise ContextCacheQuotaExceeded(f"this cache's {num_tokens} tokens would bring your context caches to "
                                            f"{tokens + num_tokens} tokens, over the {limits.tokens_per_owner} one "
                                            "key may keep pinned; delete one first")

    def _count(self, owner: str, caches: int, tokens: int) -> None:
        usage = self._usage.setdefault(owner, [0, 0])
        usage[0] += caches
        usage[1] += tokens
        if usage[0] <= 0:
            del self._usage[owner]

    def _sweep(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, cache_id = heapq.heappop(self._expiry)
            cache = self._caches.get(cache_id)
            if cache is None or cache.expires_at != expires_at:  # deleted (or re-added) since it was pushed
                continue
            del self._caches[cache_id]
            self._count(cache.owner, -1, -cache.num_tokens)
            self._tombstones[cache_id] = expires_at
        while self._tombstones:
            oldest_id, expired_at = next(iter(self._tombstones.items()))
            if len(self._tombstones) <= self._max_tombstones and expired_at > now - self._tombstone_s:
                break
            del self._tombstones[oldest_id]

    def _compact_expiry(self) -> None:
        """Drop deleted ids from the heap once they outnumber the live ones (keeps it O(live caches))."""
        if len(self._expiry) > 2 * len(self._caches) + 64:
            self._expiry = [(c.expires_at, c.id) for c in self._caches.values()]
            heapq.heapify(self._expiry)
