"""The OpenAI-compatible HTTP API in front of one engine (FastAPI app + uvicorn runner).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{id}, POST /v1/context_caches, GET|DELETE /v1/context_caches/{id},
GET /v1/context_caches (admin), GET /health, GET /metrics, /admin/eplb/*, POST /admin/faults.

This module builds the app, registers the routes and runs the server; the handlers live with their route
family (serving_completions.py, serving_chat.py, serving_caches.py, serving_status.py, serving_admin.py)
over one shared `ServingContext` (serving_base.py). Every request first passes `RequestGuard`
(meshserve/entrypoints/openai/http_guard.py): keys, content type, body size and read timeout, and its
tenant's limits (tenant_limits.py). Tokenizing
and chat templating run on one worker thread, never on the event loop; prompts longer than
`max_prompt_chars` are refused before it.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from meshserve.engine.protocol import EngineClientProtocol
from meshserve.entrypoints.openai.errors import install_error_handlers
from meshserve.entrypoints.openai.http_guard import RequestGuard, protocol_for
from meshserve.entrypoints.openai.metrics import ServerMetrics
from meshserve.entrypoints.openai.protocol import (
    EPLB_REBALANCE_OPENAPI,
    FAULT_OPENAPI,
    ChatCompletionRequest,
    CompletionRequest,
    ContextCacheCreateRequest,
    openapi_request_body,
)
from meshserve.entrypoints.openai.server_options import ServerOptions, check_bind
from meshserve.entrypoints.openai.serving_admin import AdminServing
from meshserve.entrypoints.openai.serving_base import ServingContext
from meshserve.entrypoints.openai.serving_caches import ContextCacheServing
from meshserve.entrypoints.openai.serving_chat import ChatServing
from meshserve.entrypoints.openai.serving_completions import CompletionServing
from meshserve.entrypoints.openai.serving_status import StatusServing
from meshserve.entrypoints.openai.serving_tokens import DetokenizeRequest, TokenizeRequest, TokenServing
from meshserve.entrypoints.openai.tenant_limits import TenantGate, connection_limiter
from meshserve.utils.gc_pauses import freeze_startup_heap

# after the grace period: time for the streams still running to send their error event and [DONE]
_STREAM_END_MARGIN_S = 5.0


def build_app(engine: EngineClientProtocol, *, served_model_name: str | None = None,
              max_queue_hint: int | None = None, options: ServerOptions = ServerOptions()) -> FastAPI:
    """The API app for `engine`. `served_model_name` (default: engine.model_name) is the only `model` accepted;
    `max_queue_hint`, when known, is quoted in the 503 a full waiting queue produces; `options` sets keys,
    limits and quotas."""
    metrics = ServerMetrics()
    context = ServingContext(engine, served_model_name or engine.model_name, metrics, max_queue_hint, options)
    app = FastAPI(title="meshserve", docs_url=None, redoc_url=None)
    app.state.serving = context
    install_error_handlers(app)
    limits = options.tenant_limits
    app.state.connection_limiter = connection_limiter(limits, metrics.tenants)  # the server's protocol counts
    app.add_middleware(RequestGuard, options=options, on_reject=metrics.count_rejected,
                       tenant_gate=TenantGate(limits, engine.max_model_len, metrics.tenants))
    caches = ContextCacheServing(context)
    _add_generation_routes(app, CompletionServing(context, caches), ChatServing(context, caches))
    _add_token_routes(app, TokenServing(context))
    _add_context_cache_routes(app, caches)
    _add_status_routes(app, StatusServing(context))
    _add_admin_routes(app, AdminServing(context))
    return app


def _add_generation_routes(app: FastAPI, completions: CompletionServing, chat: ChatServing) -> None:
    context = completions.context

    @app.post("/v1/completions", openapi_extra=openapi_request_body(CompletionRequest, context.model_name))
    async def create_completion(raw: Request) -> Response:
        return await context.answer(completions.create(raw))

    @app.post("/v1/chat/completions", openapi_extra=openapi_request_body(ChatCompletionRequest, context.model_name))
    async def create_chat_completion(raw: Request) -> Response:
        return await context.answer(chat.create(raw))


def _add_token_routes(app: FastAPI, tokens: TokenServing) -> None:
    context = tokens.context

    @app.post("/tokenize", openapi_extra=openapi_request_body(TokenizeRequest, context.model_name))
    async def tokenize(raw: Request) -> Response:
        return await context.answer(_json(tokens.tokenize(raw)))

    @app.post("/detokenize", openapi_extra=openapi_request_body(DetokenizeRequest, context.model_name))
    async def detokenize(raw: Request) -> Response:
        return await context.answer(_json(tokens.detokenize(raw)))


async def _json(body: Awaitable[dict[str, Any]]) -> Response:
    return JSONResponse(await body)


def _add_context_cache_routes(app: FastAPI, caches: ContextCacheServing) -> None:
    """Explicit context caching (deepserve MatchByID)."""
    context = caches.context

    @app.post("/v1/context_caches", openapi_extra=openapi_request_body(ContextCacheCreateRequest, context.model_name))
    async def create_context_cache(raw: Request) -> Response:
        return await context.answer(caches.create(raw))

    @app.get("/v1/context_caches")  # the admin's listing (RequestGuard requires the admin key)
    async def list_context_caches() -> dict[str, Any]:
        return caches.listing()

    @app.get("/v1/context_caches/{cache_id}")
    async def retrieve_context_cache(raw: Request, cache_id: str) -> dict[str, Any]:
        return caches.retrieve(raw, cache_id)

    @app.delete("/v1/context_caches/{cache_id}")
    async def delete_context_cache(raw: Request, cache_id: str) -> dict[str, Any]:
        return await caches.delete(raw, cache_id)


def _add_status_routes(app: FastAPI, status: StatusServing) -> None:
    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return status.list_models()

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        return status.retrieve_model(model)  # an unknown model raises APIError -> 404 via the handlers

    @app.get("/health")
    async def health() -> Response:
        return status.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await status.metrics_page()


def _add_admin_routes(app: FastAPI, admin: AdminServing) -> None:
    # operator endpoints: expert load balancing (xdeepserve §4.5)
    @app.get("/admin/eplb/load")
    async def eplb_load() -> dict[str, Any]:
        return await admin.command("eplb.load")

    @app.get("/admin/eplb/status")
    async def eplb_status() -> dict[str, Any]:
        return await admin.command("eplb.status")

    @app.post("/admin/eplb/rebalance", openapi_extra=EPLB_REBALANCE_OPENAPI)
    async def eplb_rebalance(raw: Request) -> dict[str, Any]:
        return await admin.eplb_rebalance(raw)

    # tests and benchmarks: kill, stall or break a part of the engine (off unless --enable-fault-injection)
    @app.post("/admin/faults", openapi_extra=FAULT_OPENAPI)
    async def inject_fault(raw: Request) -> dict[str, Any]:
        return await admin.inject_fault(raw)


class _Server(uvicorn.Server):
    """uvicorn's server without re-raising SIGINT/SIGTERM after its graceful shutdown, telling the app
    when shutdown begins.

    uvicorn re-delivers the signal once it has stopped, which would kill the process
    before the caller shuts the engine down; here `serve()` simply returns.
    """

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None],
                 on_signal: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self._on_signal = on_signal

    def _handle_signal(self, sig: int, frame) -> None:
        # at once, not when uvicorn's loop next looks: a process-group signal is ending the engine meanwhile
        if self._on_signal is not None:
            self._on_signal()
        self.handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self._on_shutdown()  # uvicorn stops accepting now; the app starts the streams' grace period
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def serve_http(engine: EngineClientProtocol, host: str, port: int, log_level: str = "info", *,
                     served_model_name: str | None = None, max_queue_hint: int | None = None,
                     options: ServerOptions = ServerOptions(),
                     on_signal: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or `should_exit`); running requests get `options.shutdown_grace_s` to
    end, then every stream still running ends with an error event and [DONE]. `on_signal` is called in the
    signal handler itself (the engine client stops restarting lost engines there)."""
    check_bind(host, options)
    app = build_app(engine, served_model_name=served_model_name, max_queue_hint=max_queue_hint, options=options)
    await engine.start()  # a job executor starts taking TE heartbeats on this loop now, not at the first request
    freeze_startup_heap()  # a full collection over the start-up objects would pause the loop for a second
    grace_s = options.shutdown_grace_s
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=protocol_for(options.header_timeout_s, app.state.connection_limiter),
                            limit_concurrency=options.max_connections,
                            timeout_graceful_shutdown=grace_s + _STREAM_END_MARGIN_S)  # type: ignore[arg-type]
    await _Server(config, on_shutdown=lambda: app.state.serving.begin_shutdown(grace_s),
                  on_signal=on_signal).serve()


def run_server(engine: EngineClientProtocol, host: str, port: int, log_level: str = "info", **kwargs: Any) -> None:
    """Blocking form of `serve_http`; returns normally after SIGINT/SIGTERM so the caller can stop the engine."""
    asyncio.run(serve_http(engine, host, port, log_level, **kwargs))
