"""A generation as an HTTP response: one JSON body, or a server-sent event stream that always ends with
[DONE], whatever ends it (the engine fails, the client leaves, the server's shutdown grace runs out).

The completion and chat routes hand their prompts and renderer to `generate_response`; a context cache's
creation waits for its one token with `collect`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from meshserve.entrypoints.openai.errors import APIError, bad_request
from meshserve.entrypoints.openai.generation import (
    ClientDisconnected,
    EnginePrompt,
    GenerationRun,
    ServerStopping,
    unless_disconnected,
)
from meshserve.entrypoints.openai.protocol import usage
from meshserve.entrypoints.openai.renderers import Renderer
from meshserve.entrypoints.openai.serving_base import ServingContext
from meshserve.router.routing import POLICIES, REQUEST_ROUTING_POLICY, ROUTING_HEADER

# what a client that closed its connection gets logged with (nginx's convention; nobody receives it)
CLIENT_CLOSED_STATUS = 499
_SSE_DONE = "data: [DONE]\n\n"


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


def _generation_failed(error: str) -> APIError:
    return APIError(500, f"The request failed during generation: {error}")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; retry on another replica or after the restart.",
                    code="server_shutting_down")


async def generate_response(context: ServingContext, raw: Request, request_id: str, prompts: list[EnginePrompt],
                            priority: int, stream: bool, renderer: Renderer, arrival: float) -> Response:
    """Run `prompts` as one request and answer with its JSON body or its event stream."""
    if context.stopping.is_set():
        raise shutting_down()
    if request_id in context.active_ids:
        raise bad_request(f"Request id {request_id!r} is already in use by a running request.")
    _route_by_header(raw)
    waiting = context.admission.reserve(sum(p.params.n for p in prompts))  # 503 queue_full without room
    run = GenerationRun(context.engine, prompts, request_id, priority,
                        [context.metrics.track(arrival) for _ in prompts], stopping=context.stopping, waiting=waiting)
    context.active_ids.add(request_id)

    async def release() -> None:
        await run.close()
        context.active_ids.discard(request_id)

    headers = {"X-Request-Id": request_id}
    handed_to_stream = False
    try:
        await unless_disconnected(raw, run.start())
        if stream:
            handed_to_stream = True
            return _EngineStreamResponse(_stream_events(context, run, renderer), release, headers)
        await unless_disconnected(raw, collect(run))
        return JSONResponse(renderer.response(run.choices, usage(*run.usage_counts())), headers=headers)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    finally:
        if not handed_to_stream:
            await release()


def _route_by_header(raw: Request) -> None:
    """A deployment's job executor routes this request by the policy its header names, if it names one."""
    policy = raw.headers.get(ROUTING_HEADER)
    if policy is None:
        return
    if policy not in POLICIES:
        raise bad_request(f"Unknown routing policy {policy!r} in the {ROUTING_HEADER} header; "
                          f"expected one of {', '.join(POLICIES)}.")
    REQUEST_ROUTING_POLICY.set(policy)


async def collect(run: GenerationRun) -> None:
    """Wait until every output is in (`run.choices`); a failure or the end of the shutdown grace raises."""
    try:
        async for _, output in run.outputs():
            if output.error is not None:
                raise _generation_failed(output.error)
    except ServerStopping:
        raise shutting_down() from None


async def _stream_events(context: ServingContext, run: GenerationRun, renderer: Renderer) -> AsyncIterator[str]:
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
        yield _sse(shutting_down().to_dict())
    except Exception as exc:  # the status line is already sent: report in-band
        yield _sse(context.error_json(exc))
    yield _SSE_DONE
