"""The OpenAI-compatible HTTP API in front of one engine (FastAPI app + uvicorn runner).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{id}, POST /v1/context_caches, GET|DELETE /v1/context_caches/{id},
GET /v1/context_caches (admin), GET /health, GET /metrics, /admin/eplb/*.

Every request first passes `RequestGuard` (meshserve/entrypoints/openai/http_guard.py): keys, content
type, body size and read timeout. Tokenizing and chat templating run on one worker thread,
never on the event loop; prompts longer than `max_prompt_chars` are refused before it.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from meshserve.engine.protocol import EngineClientProtocol
from meshserve.entrypoints.openai.chat_prompt import ChatTemplateError, encode_chat
from meshserve.entrypoints.openai.context_caches import (
    DEFAULT_TTL_S,
    ContextCache,
    ContextCacheLimits,
    ContextCacheNotFound,
    ContextCacheQuotaExceeded,
    ContextCacheStore,
    new_cache_id,
)
from meshserve.entrypoints.openai.errors import (
    APIError,
    bad_request,
    engine_dead,
    from_exception,
    install_error_handlers,
    model_not_found,
)
from meshserve.entrypoints.openai.generation import (
    ClientDisconnected,
    EnginePrompt,
    GenerationRun,
    ServerStopping,
    unless_disconnected,
)
from meshserve.entrypoints.openai.http_guard import PRINCIPAL_SCOPE_KEY, Principal, RequestGuard, protocol_for
from meshserve.entrypoints.openai.metrics import ServerMetrics
from meshserve.entrypoints.openai.protocol import (
    EPLB_REBALANCE_OPENAPI,
    FAULT_OPENAPI,
    ChatCompletionRequest,
    CompletionRequest,
    ContextCacheCreateRequest,
    openapi_request_body,
    usage,
)
from meshserve.entrypoints.openai.renderers import ChatRenderer, CompletionRenderer, Renderer
from meshserve.entrypoints.openai.server_options import PROMPT_CHARS_PER_TOKEN, ServerOptions, check_bind
from meshserve.moe.placement import EMPTY as EMPTY_SLOT
from meshserve.moe.placement import ExpertPlacement
from meshserve.router.routing import POLICIES, REQUEST_ROUTING_POLICY, ROUTING_HEADER
from meshserve.utils.faults import Fault
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
RequestModel = TypeVar("RequestModel", bound=BaseModel)
T = TypeVar("T")
_MAX_REQUEST_ID_HEADER_LEN = 128
# after the grace period: time for the streams still running to send their error event and [DONE]
_STREAM_END_MARGIN_S = 5.0
# what a client that closed its connection gets logged with (nginx's convention; nobody receives it)
_CLIENT_CLOSED_STATUS = 499


class _EngineStreamResponse(StreamingResponse):
    """A stream that releases its engine requests however it ends (done, client gone, server stopping)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


def _generation_failed(error: str) -> APIError:
    return APIError(500, f"The request failed during generation: {error}")


def _shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; retry on another replica or after the restart.",
                    code="server_shutting_down")


def _principal(raw: Request) -> Principal:
    """Who sent the request (the guard sets it; an app served without the guard sees one local client)."""
    return raw.scope.get(PRINCIPAL_SCOPE_KEY) or Principal("client:local")


_BoundedInt = Annotated[int, Field(strict=True, ge=0, le=1 << 20)]
_Slot = Annotated[int, Field(strict=True, ge=EMPTY_SLOT, le=1 << 20)]  # a logical expert id, or empty
_LayerKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,6}$")]


class ExpertPlacementBody(BaseModel):
    """An expert placement as `meshserve eplb plan --out` writes it (meshserve/moe/placement.py)."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["meshserve-expert-placement/1"]
    num_logical: Annotated[int, Field(strict=True, ge=1, le=1 << 20)]
    num_ranks: Annotated[int, Field(strict=True, ge=1, le=1 << 16)]
    redundant_per_rank: _BoundedInt
    slots_per_rank: _BoundedInt | None = None
    layers: dict[_LayerKey, list[_Slot]] = Field(min_length=1)
    replicas: dict[_LayerKey, list[list[_BoundedInt]]] | None = None


class EplbRebalanceRequest(BaseModel):
    """`{}` (the server plans from its recorded load) or `{"placement": ...}`."""

    model_config = ConfigDict(extra="forbid")
    placement: ExpertPlacementBody | None = None


def _context_cache_not_found(exc: ContextCacheNotFound, param: str | None) -> APIError:
    if exc.expired:
        expired_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(exc.expired_at))
        return APIError(404, f"The context cache `{exc.cache_id}` expired at {expired_at}; create it again.",
                        error_type="not_found_error", param=param, code="context_cache_expired")
    return APIError(404, f"No context cache with id `{exc.cache_id}` exists.", error_type="not_found_error",
                    param=param, code="context_cache_not_found")


class OpenAIServing:
    """The request handlers, bound to one engine and one served model name."""

    def __init__(self, engine: EngineClientProtocol, model_name: str, metrics: ServerMetrics,
                 max_queue_hint: int | None, options: ServerOptions = ServerOptions()) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.max_queue_hint = max_queue_hint
        self.options = options
        self.created = int(time.time())
        self._active_ids: set[str] = set()
        self.max_prompt_chars = options.max_prompt_chars or engine.max_model_len * PROMPT_CHARS_PER_TOKEN
        self.context_caches = ContextCacheStore(limits=ContextCacheLimits(
            max_ttl_s=options.max_context_cache_ttl, caches_per_owner=options.context_caches_per_key,
            tokens_per_owner=options.context_cache_tokens_per_key or engine.max_model_len,
            total_caches=options.context_caches_total))
        # one thread: a fast tokenizer must not be used from two threads at once ("Already borrowed")
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        # set when a shutdown's grace period is over: the streams still running end with an error event
        self.stopping = asyncio.Event()

    # ---------------------------------------------------------------- endpoints
    async def completions(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = self._parse(CompletionRequest, await raw.body())
        self._check_model_and_engine(req.model)
        cache = self._context_cache(req.context_cache_id, "prompt", "/v1/completions", _principal(raw))
        prefix = cache.token_ids if cache is not None else []
        prompts, own_texts = [], []
        self._check_prompt_chars(sum(len(p) for p in req.prompt if isinstance(p, str)), "prompt")
        for prompt in req.prompt:
            if isinstance(prompt, str):
                # after a cached prefix the text continues it: no second set of special tokens
                text, token_ids = prompt, await self._encode(prompt, add_special_tokens=cache is None)
            else:
                text, token_ids = None, self._checked_token_ids(prompt)
            own_texts.append(text if text is not None else await self._tokenizing(self.engine.tokenizer.decode,
                                                                                   token_ids))
            token_ids = prefix + token_ids
            max_tokens = self._max_tokens(len(token_ids), req.max_tokens, "prompt")
            prompts.append(EnginePrompt(text, token_ids, req.to_sampling_params(max_tokens, req.logprobs),
                                        context_cache_id=req.context_cache_id))
        echo_texts = own_texts if req.echo else None  # the request's own prompt, not the cached prefix
        request_id = self._request_id(raw, "cmpl")
        renderer = CompletionRenderer(request_id, self.model_name, req.n, req.logprobs, req.include_usage_in_stream,
                                      echo_texts)
        return await self._generate(raw, request_id, prompts, req.priority, bool(req.stream), renderer, arrival)

    async def chat_completions(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = self._parse(ChatCompletionRequest, await raw.body())
        self._check_model_and_engine(req.model)
        cache = self._context_cache(req.context_cache_id, "messages", "/v1/chat/completions", _principal(raw))
        cached_messages = cache.messages if cache is not None else []
        messages = [m.for_template() for m in req.messages]
        self._check_message_chars(messages)
        # the cached conversation first, rendered together with the new messages
        # the template writes the control tokens (BOS, role markers); message contents stay plain text
        text, token_ids = await self._tokenizing(self._render_chat, cached_messages + messages)
        if not token_ids:
            raise bad_request("The messages render to an empty prompt.", param="messages")
        max_tokens = self._max_tokens(len(token_ids), req.requested_max_tokens, "messages")
        prompt = EnginePrompt(text, token_ids, req.to_sampling_params(max_tokens, req.num_logprobs),
                              context_cache_id=req.context_cache_id)
        request_id = self._request_id(raw, "chatcmpl")
        renderer = ChatRenderer(request_id, self.model_name, req.n, req.num_logprobs, req.include_usage_in_stream)
        return await self._generate(raw, request_id, [prompt], req.priority, bool(req.stream), renderer, arrival)

    async def create_context_cache(self, raw: Request) -> Response:
        """Have the engine compute a prefix's KV once and keep its blocks pinned under a new id until it expires."""
        arrival, created = time.monotonic(), time.time()
        req = self._parse(ContextCacheCreateRequest, await raw.body())
        self._check_model_and_engine(req.model)
        ttl_s = self._context_cache_ttl(req.ttl_seconds)
        text, token_ids, messages, param = await self._context_cache_prefix(req)
        if not token_ids:
            raise bad_request(f"The {param} renders to an empty prefix.", param=param)
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:  # a prefix must leave room for what follows it
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your {param} is "
                              f"{len(token_ids)} tokens, which leaves no room after the cached prefix.",
                              param=param, code="context_length_exceeded")
        cache_id, owner = new_cache_id(), _principal(raw).owner
        try:  # the quota counts this cache from now on, so concurrent creations cannot overshoot it
            self.context_caches.reserve(cache_id, owner, len(token_ids))
        except ContextCacheQuotaExceeded as exc:
            raise APIError(429, f"Context cache quota exceeded: {exc}.", code="context_cache_quota_exceeded") from None
        # one token: the engine computes the prompt's KV and pins its full blocks under the id
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        run = GenerationRun(self.engine, [EnginePrompt(text, token_ids, params, cache_id, ttl_s)], cache_id, 0,
                            [self.metrics.track(arrival)])
        try:
            await unless_disconnected(raw, run.start())
            await unless_disconnected(raw, self._collect(run))
        except BaseException as exc:
            self.context_caches.release(cache_id)
            await self._unpin_context_cache(cache_id)  # in case the engine pinned it before the failure
            if isinstance(exc, ClientDisconnected):
                return Response(status_code=_CLIENT_CLOSED_STATUS)
            raise
        finally:
            await run.close()
        cache = self.context_caches.add(cache_id, self.model_name, len(token_ids), ttl_s, created=created,
                                        owner=owner, token_ids=token_ids if messages is None else None,
                                        messages=messages)
        return JSONResponse(cache.to_dict())

    def _context_cache_ttl(self, requested: float | None) -> float:
        """The ttl asked for, refused beyond the operator's ceiling; absent, the default (within the ceiling)."""
        ceiling = self.context_caches.limits.max_ttl_s
        if requested is None:
            return min(DEFAULT_TTL_S, ceiling)
        if requested > ceiling:
            raise bad_request(f"ttl_seconds may be at most {ceiling:g} on this server, got {requested:g}.",
                              param="ttl_seconds")
        return float(requested)

    async def _context_cache_prefix(self, req: ContextCacheCreateRequest) -> tuple[
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

    def retrieve_context_cache(self, raw: Request, cache_id: str) -> dict[str, Any]:
        return self._owned_context_cache(cache_id, _principal(raw), None).to_dict()

    async def delete_context_cache(self, raw: Request, cache_id: str) -> dict[str, Any]:
        self._owned_context_cache(cache_id, _principal(raw), None)
        try:
            self.context_caches.delete(cache_id)
        except ContextCacheNotFound as exc:
            raise _context_cache_not_found(exc, None) from None
        await self._unpin_context_cache(cache_id)
        return {"id": cache_id, "object": "context_cache.deleted", "deleted": True}

    def list_context_caches(self) -> dict[str, Any]:
        """Every live cache with its owner (the admin's view: the ids give access to the cached prefixes)."""
        return {"object": "list", "data": [c.to_dict(with_owner=True) for c in self.context_caches.list()]}

    def _owned_context_cache(self, cache_id: str, principal: Principal, param: str | None) -> ContextCache:
        """The live cache, if `principal` created it (or is the admin); another owner's reads as unknown."""
        try:
            cache = self.context_caches.get(cache_id)
        except ContextCacheNotFound as exc:
            raise _context_cache_not_found(exc, param) from None
        if not principal.is_admin and cache.owner != principal.owner:
            raise _context_cache_not_found(ContextCacheNotFound(cache_id), param)
        return cache

    async def _unpin_context_cache(self, cache_id: str) -> None:
        """Free the engine's pinned blocks now (they would go at expiry anyway, so a failure is only logged)."""
        if not self.engine.healthy:
            return
        try:
            reply = await self.engine.admin("context_cache.delete", {"id": cache_id})
            if not reply.ok:
                logger.warning("engine did not unpin context cache %s: %s", cache_id, reply.error)
        except Exception as exc:
            logger.warning("could not unpin context cache %s: %s", cache_id, exc)

    def _context_cache(self, cache_id: str | None, kind: str, endpoint: str,
                       principal: Principal) -> ContextCache | None:
        """The live cache a request names, checked for its owner, this model and this endpoint; None without an id."""
        if cache_id is None:
            return None
        cache = self._owned_context_cache(cache_id, principal, "context_cache_id")
        if cache.model != self.model_name:
            raise bad_request(f"The context cache `{cache_id}` belongs to model `{cache.model}`.",
                              param="context_cache_id")
        if cache.kind != kind:
            other = "/v1/chat/completions" if cache.kind == "messages" else "/v1/completions"
            raise bad_request(f"The context cache `{cache_id}` was created from {cache.kind}; use it with {other}, "
                              f"not {endpoint}.", param="context_cache_id")
        return cache

    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    def retrieve_model(self, model: str) -> dict[str, Any]:
        if model != self.model_name:
            raise model_not_found(model)
        return self._model_card()

    def health(self) -> Response:
        # a deployment's job executor also says what can be routed now and what is missing
        detail = self.engine.health()
        if self.engine.healthy:
            return JSONResponse({"status": "ok", **detail})
        error = engine_dead(self.engine.dead_error or "unknown error")
        return JSONResponse({**detail, **error.to_dict()}, status_code=503)

    async def admin(self, op: str, args: dict | None = None) -> dict[str, Any]:
        """An operator command's result; a refused command is a 400 with the engine's reason."""
        if not self.engine.healthy:
            raise engine_dead(self.engine.dead_error or "unknown error")
        try:
            reply = await self.engine.admin(op, args)
        except EngineDeadError as exc:
            raise engine_dead(exc) from None
        if not reply.ok:
            raise APIError(400, reply.error or f"{op} failed")
        return reply.to_json()

    async def metrics_page(self) -> Response:
        await self.metrics.refresh(self.engine.get_stats)
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def inject_fault(self, raw: Request) -> dict[str, Any]:
        """Arm a fault in a TE (tests and benchmarks: `--enable-fault-injection`); the body is the fault
        (`meshserve.utils.faults.Fault`), plus `te` naming the TE in a deployment."""
        if not self.options.enable_fault_injection:
            raise APIError(404, "fault injection is off; start the server with --enable-fault-injection")
        try:
            body = json.loads(await raw.body() or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            args = {"te": str(body.pop("te"))} if "te" in body else {}
            fault = msgspec.convert(body, Fault)
        except (ValueError, msgspec.ValidationError) as exc:
            raise APIError(400, f"bad fault: {exc}") from None
        return await self.admin("fault.inject", {**args, "fault": msgspec.to_builtins(fault)})

    async def eplb_rebalance(self, raw: Request) -> dict[str, Any]:
        """Start a live expert reconfiguration; the body is validated here, before the engine sees it."""
        body = await raw.body()
        if not body.strip():
            return await self.admin("eplb.rebalance", {})
        try:
            req = EplbRebalanceRequest.model_validate_json(body)
        except ValidationError as exc:
            raise APIError(400, f"bad placement request: {from_exception(exc).message}") from None
        if req.placement is None:
            return await self.admin("eplb.rebalance", {})
        placement = req.placement.model_dump(exclude_none=True)
        try:  # the placement's own checks (shape, slot counts, expert ids) before the engine sees it
            ExpertPlacement.from_dict(placement)
        except ValueError as exc:
            raise APIError(400, f"bad placement: {exc}") from None
        return await self.admin("eplb.rebalance", {"placement": placement})

    def begin_shutdown(self, grace_s: float) -> None:
        """The server stopped accepting: running requests get `grace_s`, then what still runs is ended."""
        logger.info("shutting down: %d running request(s) get %g s to finish", len(self._active_ids), grace_s)
        asyncio.get_running_loop().call_later(grace_s, self.stopping.set)

    async def answer(self, work: Awaitable[Response]) -> Response:
        """`work`'s response, or the OpenAI error JSON for whatever it raised."""
        try:
            return await work
        except Exception as exc:
            return from_exception(exc, max_queue_hint=self.max_queue_hint).to_response()

    # ---------------------------------------------------------------- generation
    async def _generate(self, raw: Request, request_id: str, prompts: list[EnginePrompt], priority: int,
                        stream: bool, renderer: Renderer, arrival: float) -> Response:
        if self.stopping.is_set():
            raise _shutting_down()
        if request_id in self._active_ids:
            raise bad_request(f"Request id {request_id!r} is already in use by a running request.")
        policy = raw.headers.get(ROUTING_HEADER)
        if policy is not None:  # a deployment's job executor routes this request by it
            if policy not in POLICIES:
                raise bad_request(f"Unknown routing policy {policy!r} in the {ROUTING_HEADER} header; "
                                  f"expected one of {', '.join(POLICIES)}.")
            REQUEST_ROUTING_POLICY.set(policy)
        run = GenerationRun(self.engine, prompts, request_id, priority,
                            [self.metrics.track(arrival) for _ in prompts], stopping=self.stopping)
        self._active_ids.add(request_id)

        async def release() -> None:
            await run.close()
            self._active_ids.discard(request_id)

        headers = {"X-Request-Id": request_id}
        handed_to_stream = False
        try:
            await unless_disconnected(raw, run.start())
            if stream:
                handed_to_stream = True
                return _EngineStreamResponse(self._stream_events(run, renderer), release, headers)
            await unless_disconnected(raw, self._collect(run))
            return JSONResponse(renderer.response(run.choices, usage(*run.usage_counts())), headers=headers)
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED_STATUS)
        finally:
            if not handed_to_stream:
                await release()

    @staticmethod
    async def _collect(run: GenerationRun) -> None:
        try:
            async for _, output in run.outputs():
                if output.error is not None:
                    raise _generation_failed(output.error)
        except ServerStopping:
            raise _shutting_down() from None

    async def _stream_events(self, run: GenerationRun, renderer: Renderer) -> AsyncIterator[str]:
        for chunk in renderer.opening_chunks():
            yield _sse(chunk)
        try:
            async for prompt_index, output in run.outputs():
                if output.error is not None:
                    yield _sse(_generation_failed(output.error).to_dict())
                    break
                for choice in output.outputs:
                    chunk = renderer.delta_chunk(prompt_index, choice)
                    if chunk is not None:
                        yield _sse(chunk)
            else:
                if renderer.include_usage:
                    yield _sse(renderer.usage_chunk(usage(*run.usage_counts())))
        except ServerStopping:  # the shutdown grace period is over: end the stream properly, never cut it
            yield _sse(_shutting_down().to_dict())
        except Exception as exc:  # the status line is already sent: report in-band
            yield _sse(from_exception(exc, max_queue_hint=self.max_queue_hint).to_dict())
        yield _SSE_DONE

    # ---------------------------------------------------------------- request checks
    def _parse(self, model: type[RequestModel], body: bytes) -> RequestModel:
        if not body.strip():
            raise bad_request("The request body is empty; expected a JSON object.")
        # token ids (prompts, stop_token_ids) are checked against the model's vocabulary
        return model.model_validate_json(body, context={"vocab_size": len(self.engine.tokenizer)})

    def _check_model_and_engine(self, model: str) -> None:
        if model != self.model_name:
            raise model_not_found(model)
        if not self.engine.healthy:
            raise EngineDeadError(self.engine.dead_error or "the engine is not running")

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(await self._tokenizing(self.engine.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    async def _tokenizing(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args)` on the tokenizer thread: a long prompt must not stall every other stream."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                functools.partial(fn, *args, **kwargs))

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse a text no model context could hold before spending time on tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise bad_request(f"The {param} is {num_chars} characters; this server tokenizes at most "
                              f"{self.max_prompt_chars} (the model's context is {self.engine.max_model_len} "
                              "tokens).", param=param, code="context_length_exceeded")

    def _check_message_chars(self, messages: list[dict[str, Any]]) -> None:
        self._check_prompt_chars(sum(len(v) for m in messages for v in m.values() if isinstance(v, str)),
                                 "messages")

    def _checked_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = len(self.engine.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} in the prompt is outside the vocabulary [0, {vocab_size}).",
                              param="prompt")
        return list(token_ids)

    def _render_chat(self, messages: list[dict[str, str]],
                     add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation."""
        try:
            prompt = encode_chat(self.engine.tokenizer, messages, add_generation_prompt)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from exc
        return prompt.text, prompt.token_ids

    def _max_tokens(self, prompt_len: int, requested: int | None, prompt_name: str) -> int:
        """The completion budget; absent, it is whatever context the prompt leaves."""
        limit = self.engine.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your {prompt_name} "
                    f"is {prompt_len} tokens, which leaves no room for the completion. "
                    f"Please reduce the length of the {prompt_name}.",
                    param=prompt_name, code="context_length_exceeded")
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_name}, {requested} for the "
                f"completion). Please reduce the length of the {prompt_name} or the completion.",
                param="max_tokens", code="context_length_exceeded")
        return requested

    @staticmethod
    def _request_id(raw: Request, prefix: str) -> str:
        given = raw.headers.get("x-request-id")
        if given is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not given or len(given) > _MAX_REQUEST_ID_HEADER_LEN or not given.isprintable():
            raise bad_request(f"X-Request-Id must be 1 to {_MAX_REQUEST_ID_HEADER_LEN} printable characters.")
        return f"{prefix}-{given}"

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "meshserve",
                "root": self.model_name, "max_model_len": self.engine.max_model_len}


def build_app(engine: EngineClientProtocol, *, served_model_name: str | None = None,
              max_queue_hint: int | None = None, options: ServerOptions = ServerOptions()) -> FastAPI:
    """The API app for `engine`. `served_model_name` (default: engine.model_name) is the only `model` accepted;
    `max_queue_hint`, when known, is quoted in the 503 a full waiting queue produces; `options` sets keys,
    limits and quotas."""
    metrics = ServerMetrics()
    serving = OpenAIServing(engine, served_model_name or engine.model_name, metrics, max_queue_hint, options)
    app = FastAPI(title="meshserve", docs_url=None, redoc_url=None)
    app.state.serving = serving
    install_error_handlers(app)
    app.add_middleware(RequestGuard, options=options, on_reject=metrics.count_rejected)

    @app.post("/v1/completions", openapi_extra=openapi_request_body(CompletionRequest, serving.model_name))
    async def create_completion(raw: Request) -> Response:
        return await serving.answer(serving.completions(raw))

    @app.post("/v1/chat/completions", openapi_extra=openapi_request_body(ChatCompletionRequest, serving.model_name))
    async def create_chat_completion(raw: Request) -> Response:
        return await serving.answer(serving.chat_completions(raw))

    # explicit context caching (deepserve MatchByID)
    @app.post("/v1/context_caches", openapi_extra=openapi_request_body(ContextCacheCreateRequest, serving.model_name))
    async def create_context_cache(raw: Request) -> Response:
        return await serving.answer(serving.create_context_cache(raw))

    @app.get("/v1/context_caches")  # the admin's listing (RequestGuard requires the admin key)
    async def list_context_caches() -> dict[str, Any]:
        return serving.list_context_caches()

    @app.get("/v1/context_caches/{cache_id}")
    async def retrieve_context_cache(raw: Request, cache_id: str) -> dict[str, Any]:
        return serving.retrieve_context_cache(raw, cache_id)

    @app.delete("/v1/context_caches/{cache_id}")
    async def delete_context_cache(raw: Request, cache_id: str) -> dict[str, Any]:
        return await serving.delete_context_cache(raw, cache_id)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return serving.list_models()

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        return serving.retrieve_model(model)  # an unknown model raises APIError -> 404 via the handlers

    @app.get("/health")
    async def health() -> Response:
        return serving.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await serving.metrics_page()

    # operator endpoints: expert load balancing (xdeepserve §4.5)
    @app.get("/admin/eplb/load")
    async def eplb_load() -> dict[str, Any]:
        return await serving.admin("eplb.load")

    @app.get("/admin/eplb/status")
    async def eplb_status() -> dict[str, Any]:
        return await serving.admin("eplb.status")

    @app.post("/admin/eplb/rebalance", openapi_extra=EPLB_REBALANCE_OPENAPI)
    async def eplb_rebalance(raw: Request) -> dict[str, Any]:
        return await serving.eplb_rebalance(raw)

    # tests and benchmarks: kill, stall or break a part of the engine (off unless --enable-fault-injection)
    @app.post("/admin/faults", openapi_extra=FAULT_OPENAPI)
    async def inject_fault(raw: Request) -> dict[str, Any]:
        return await serving.inject_fault(raw)

    return app


class _Server(uvicorn.Server):
    """uvicorn's server without re-raising SIGINT/SIGTERM after its graceful shutdown, telling the app
    when shutdown begins.

    uvicorn re-delivers the signal once it has stopped, which would kill the process
    before the caller shuts the engine down; here `serve()` simply returns.
    """

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets=None) -> None:
        self._on_shutdown()  # uvicorn stops accepting now; the app starts the streams' grace period
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def serve_http(engine: EngineClientProtocol, host: str, port: int, log_level: str = "info", *,
                     served_model_name: str | None = None, max_queue_hint: int | None = None,
                     options: ServerOptions = ServerOptions()) -> None:
    """Serve until SIGINT/SIGTERM (or `should_exit`); running requests get `options.shutdown_grace_s` to
    end, then every stream still running ends with an error event and [DONE]."""
    check_bind(host, options)
    app = build_app(engine, served_model_name=served_model_name, max_queue_hint=max_queue_hint, options=options)
    await engine.start()  # a job executor starts taking TE heartbeats on this loop now, not at the first request
    grace_s = options.shutdown_grace_s
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=protocol_for(options.header_timeout_s),
                            limit_concurrency=options.max_connections,
                            timeout_graceful_shutdown=grace_s + _STREAM_END_MARGIN_S)  # type: ignore[arg-type]
    await _Server(config, on_shutdown=lambda: app.state.serving.begin_shutdown(grace_s)).serve()


def run_server(engine: EngineClientProtocol, host: str, port: int, log_level: str = "info", **kwargs: Any) -> None:
    """Blocking form of `serve_http`; returns normally after SIGINT/SIGTERM so the caller can stop the engine."""
    asyncio.run(serve_http(engine, host, port, log_level, **kwargs))
