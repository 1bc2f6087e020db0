"""Where each named context cache lives (deepserve MatchByID): the TE whose KV cache pins its blocks.

A job that creates a cache (it has a ttl) pins its prompt's blocks on the TE that computes the prompt; a job
that uses the cache then goes to that TE while it is alive, since anywhere else it would only compute the
prefix again (same output, no reuse). A home is forgotten when its ttl ends or the cache is deleted.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from meshserve.router.jobs import Job
from meshserve.router.routing import RouteDecision, RoutingPolicy, TEView


class CacheHomes:
    def __init__(self) -> None:
        self._homes: dict[str, tuple[str, float]] = {}  # cache id -> (TE, expiry on time.monotonic)

    def pin(self, cache_id: str, te: str, ttl_s: float) -> None:
        """TE `te` computes the prompt that creates the cache: its blocks stay there for `ttl_s`."""
        self._homes[cache_id] = (te, time.monotonic() + ttl_s)

    def pop(self, cache_id: str) -> str | None:
        """Forget the cache (it is being deleted); the TE that pinned it, if it was known."""
        home = self._homes.pop(cache_id, None)
        return None if home is None else home[0]

    def route(self, job: Job, views: Sequence[TEView], routing: RoutingPolicy) -> RouteDecision | None:
        """The unit entered at the TE holding the job's cache, when the job uses one and that TE can take it."""
        self._expire(time.monotonic())
        if job.context_cache_id is None or job.context_cache_ttl_s is not None:
            return None
        home = self._homes.get(job.context_cache_id)
        if home is None:
            return None
        return routing.route_to(home[0], views, f"context cache {job.context_cache_id} is pinned there")

    def _expire(self, now: float) -> None:
        for cache_id in [c for c, (_, expiry) in self._homes.items() if expiry <= now]:
            del self._homes[cache_id]
