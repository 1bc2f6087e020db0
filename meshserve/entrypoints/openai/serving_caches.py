"""Explicit context caching (deepserve MatchByID): POST /v1/context_caches, GET|DELETE
/v1/context_caches/{id}, and the admin's listing GET /v1/context_caches.

A cache is a prefix whose KV the engine computes once and keeps pinned under a new id until it expires;
completion and chat requests name it with `context_cache_id` (`for_request` checks the name). Each cache
belongs to the API key (or client) that created it, within the quotas of `ServerOptions`.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from meshserve.entrypoints.openai.context_caches import (
    DEFAULT_TTL_S,
    ContextCache,
    ContextCacheLimits,
    ContextCacheNotFound,
    ContextCacheQuotaExceeded,
    ContextCacheStore,
    new_cache_id,
)
from meshserve.entrypoints.openai.errors import APIError, bad_request
from meshserve.entrypoints.openai.generation import ClientDisconnected, EnginePrompt, GenerationRun, unless_disconnected
from meshserve.entrypoints.openai.http_guard import Principal
from meshserve.entrypoints.openai.protocol import ContextCacheCreateRequest
from meshserve.entrypoints.openai.responses import CLIENT_CLOSED_STATUS, collect
from meshserve.entrypoints.openai.serving_base import ServingBase, ServingContext, principal_of
from meshserve.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _context_cache_not_found(exc: ContextCacheNotFound, param: str | None) -> APIError:
    if exc.expired:
        expired_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(exc.expired_at))
        return APIError(404, f"The context cache `{exc.cache_id}` expired at {expired_at}; create it again.",
                        error_type="not_found_error", param=param, code="context_cache_expired")
    return APIError(404, f"No context cache with id `{exc.cache_id}` exists.", error_type="not_found_error",
                    param=param, code="context_cache_not_found")


class ContextCacheServing(ServingBase):
    """The context-cache routes, and the check of a cache that a generation request names."""

    def __init__(self, context: ServingContext) -> None:
        super().__init__(context)
        options, max_model_len = context.options, context.engine.max_model_len
        self.store = ContextCacheStore(limits=ContextCacheLimits(
            max_ttl_s=options.max_context_cache_ttl, caches_per_owner=options.context_caches_per_key,
            tokens_per_owner=options.context_cache_tokens_per_key or max_model_len,
            total_caches=options.context_caches_total))

    async def create(self, raw: Request) -> Response:
        """Have the engine compute a prefix's KV once and keep its blocks pinned under a new id until it expires."""
        arrival, created = time.monotonic(), time.time()
        req = await self._parse(ContextCacheCreateRequest, await raw.body())
        self._check_model_and_engine(req.model)
        ttl_s = self._ttl(req.ttl_seconds)
        text, token_ids, messages, param = await self._prefix(req)
        if not token_ids:
            raise bad_request(f"The {param} renders to an empty prefix.", param=param)
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:  # a prefix must leave room for what follows it
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your {param} is "
                              f"{len(token_ids)} tokens, which leaves no room after the cached prefix.",
                              param=param, code="context_length_exceeded")
        cache_id, owner = new_cache_id(), principal_of(raw).owner
        try:  # the quota counts this cache from now on, so concurrent creations cannot overshoot it
            self.store.reserve(cache_id, owner, len(token_ids))
        except ContextCacheQuotaExceeded as exc:
            raise APIError(429, f"Context cache quota exceeded: {exc}.", code="context_cache_quota_exceeded") from None
        # one token: the engine computes the prompt's KV and pins its full blocks under the id
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        # the creator's namespace: its blocks serve the creator's later prompts too, never another tenant's
        prompt = EnginePrompt(text, token_ids, params, cache_id, ttl_s, tenancy=self._tenancy(raw))
        run = GenerationRun(self.engine, [prompt], cache_id, 0, [self.context.metrics.track(arrival)])
        try:
            await unless_disconnected(raw, run.start())
            await unless_disconnected(raw, collect(run))
        except BaseException as exc:
            self.store.release(cache_id)
            await self._unpin(cache_id)  # in case the engine pinned it before the failure
            if isinstance(exc, ClientDisconnected):
                return Response(status_code=CLIENT_CLOSED_STATUS)
            raise
        finally:
            await run.close()
        cache = self.store.add(cache_id, self.model_name, len(token_ids), ttl_s, created=created, owner=owner,
                               token_ids=token_ids if messages is None else None, messages=messages)
        return JSONResponse(cache.to_dict())

    def _ttl(self, requested: float | None) -> float:
        """The ttl asked for, refused beyond the operator's ceiling; absent, the default (within the ceiling)."""
        ceiling = self.store.limits.max_ttl_s
        if requested is None:
            return min(DEFAULT_TTL_S, ceiling)
        if requested > ceiling:
            raise bad_request(f"ttl_seconds may be at most {ceiling:g} on this server, got {requested:g}.",
                              param="ttl_seconds")
        return float(requested)

    async def _prefix(self, req: ContextCacheCreateRequest) -> tuple[
            str | None, list[int], list[dict[str, str]] | None, str]:
        """(text, token ids, messages, the parameter that gave them) of the prefix to cache."""
        if req.messages is not None:
            messages = [m.for_template() for m in req.messages]
            self._check_message_chars(messages)
            # no generation prompt: the conversation goes on with the messages of the requests that use it
            text, token_ids = await self._tokenizing(self._render_chat, messages, False)
            return text, token_ids, messages, "messages"
        if isinstance(req.prompt, str):
            self._check_prompt_chars(len(req.prompt), "prompt")
            return req.prompt, await self._encode(req.prompt, add_special_tokens=True), None, "prompt"
        return None, self._checked_token_ids(req.prompt), None, "prompt"

    def retrieve(self, raw: Request, cache_id: str) -> dict[str, Any]:
        return self._owned(cache_id, principal_of(raw), None).to_dict()

    async def delete(self, raw: Request, cache_id: str) -> dict[str, Any]:
        self._owned(cache_id, principal_of(raw), None)
        try:
            self.store.delete(cache_id)
        except ContextCacheNotFound as exc:
            raise _context_cache_not_found(exc, None) from None
        await self._unpin(cache_id)
        return {"id": cache_id, "object": "context_cache.deleted", "deleted": True}

    def listing(self) -> dict[str, Any]:
        """Every live cache with its owner (the admin's view: the ids give access to the cached prefixes)."""
        return {"object": "list", "data": [c.to_dict(with_owner=True) for c in self.store.list()]}

    def for_request(self, cache_id: str | None, kind: str, endpoint: str,
                    principal: Principal) -> ContextCache | None:
        """The live cache a request names, checked for its owner, this model and this endpoint; None without an id."""
        if cache_id is None:
            return None
        cache = self._owned(cache_id, principal, "context_cache_id")
        if cache.model != self.model_name:
            raise bad_request(f"The context cache `{cache_id}` belongs to model `{cache.model}`.",
                              param="context_cache_id")
        if cache.kind != kind:
            other = "/v1/chat/completions" if cache.kind == "messages" else "/v1/completions"
            raise bad_request(f"The context cache `{cache_id}` was created from {cache.kind}; use it with {other}, "
                              f"not {endpoint}.", param="context_cache_id")
        return cache

    def _owned(self, cache_id: str, principal: Principal, param: str | None) -> ContextCache:
        """The live cache, if `principal` created it (or is the admin); another owner's reads as unknown."""
        try:
            cache = self.store.get(cache_id)
        except ContextCacheNotFound as exc:
            raise _context_cache_not_found(exc, param) from None
        if not principal.is_admin and cache.owner != principal.owner:
            raise _context_cache_not_found(ContextCacheNotFound(cache_id), param)
        return cache

    async def _unpin(self, cache_id: str) -> None:
        """Free the engine's pinned blocks now (they would go at expiry anyway, so a failure is only logged)."""
        if not self.engine.healthy:
            return
        try:
            reply = await self.engine.admin("context_cache.delete", {"id": cache_id})
            if not reply.ok:
                logger.warning("engine did not unpin context cache %s: %s", cache_id, reply.error)
        except Exception as exc:
            logger.warning("could not unpin context cache %s: %s", cache_id, exc)
