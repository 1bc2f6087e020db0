"""Driving the engine for one API request: one engine request per prompt, merged into one stream.

The run owns its engine requests until they finish: whatever way the HTTP side
ends (client gone, server shutting down, an error), `close()` aborts the ones
still running so the engine frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import anyio
from starlette.requests import Request

from meshserve.engine.outputs import CompletionOutput, RequestOutput
from meshserve.engine.protocol import EngineClientProtocol
from meshserve.entrypoints.openai.admission import WaitingChoices
from meshserve.entrypoints.openai.metrics import RequestTracker
from meshserve.wire.client import NO_TENANCY, Tenancy
from meshserve.wire.sampling_params import SamplingParams

T = TypeVar("T")
# engine requests submitted in one turn of the event loop: each costs a little, a large request's many would
# hold up every other request's turn
_SUBMIT_BATCH = 16


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


class ServerStopping(Exception):
    """The server's shutdown grace period ran out before this run finished."""


@dataclass
class EnginePrompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    context_cache_id: str | None = None  # the named context cache leading token_ids
    context_cache_ttl_s: float | None = None  # set: this prompt creates that cache
    tenancy: Tenancy = NO_TENANCY  # its sender and prefix-cache namespace (`CacheNamespaces.tenancy`)


@dataclass
class _EngineRequest:
    request_id: str
    prompt: EnginePrompt
    stream: AsyncIterator[RequestOutput]
    tracker: RequestTracker
    last: RequestOutput | None = None
    done: bool = False


async def _next_or_none(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


class GenerationRun:
    def __init__(self, engine: EngineClientProtocol, prompts: list[EnginePrompt], request_id: str,
                 priority: int, trackers: list[RequestTracker], stopping: asyncio.Event | None = None,
                 waiting: WaitingChoices | None = None) -> None:
        self._engine = engine
        self._stopping = stopping
        self._waiting = waiting  # the choices admission counts as queued, until each one's first output
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self._requests = [
            _EngineRequest(rid, p, engine.generate(p.text, p.token_ids, p.params, rid, priority,
                                                   context_cache_id=p.context_cache_id,
                                                   context_cache_ttl_s=p.context_cache_ttl_s,
                                                   tenancy=p.tenancy), tracker)
            for rid, p, tracker in zip(ids, prompts, trackers)
        ]
        self._pending: dict[asyncio.Task, int] = {}
        # every choice's latest state, keyed by (prompt index, choice index within the prompt)
        self.choices: dict[tuple[int, int], CompletionOutput] = {}

    async def start(self) -> None:
        """Submit every prompt and wait for its first output.

        Admission failures (queue full, engine dead, too long) surface here, before
        any response is sent, so they can still become an HTTP status.
        """
        for index in range(len(self._requests)):
            self._schedule(index)
            if index % _SUBMIT_BATCH == _SUBMIT_BATCH - 1:
                await asyncio.sleep(0)  # the submissions so far run; other requests (and /health) get a turn
        await asyncio.wait(self._pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in self._pending:
            if task.done() and task.exception() is not None:
                raise task.exception()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine produces them, across all prompts; raises ServerStopping
        once `stopping` is set."""
        stop = asyncio.ensure_future(self._stopping.wait()) if self._stopping is not None else None
        try:
            async for item in self._outputs(stop):
                yield item
        finally:
            if stop is not None:
                stop.cancel()

    async def _outputs(self, stop: asyncio.Future | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._pending:
            waiting = set(self._pending) if stop is None else {*self._pending, stop}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if stop is not None and stop in done:
                raise ServerStopping()
            for task in sorted(done, key=self._pending.__getitem__):
                index = self._pending.pop(task)
                req = self._requests[index]
                output = task.result()
                if output is None:  # the engine ended the stream without a final output
                    raise RuntimeError(f"the engine ended request {req.request_id} without finishing it")
                req.tracker.observe(output)
                req.last = output
                for choice in output.outputs:
                    if self._waiting is not None and (index, choice.index) not in self.choices:
                        self._waiting.started()
                    self.choices[(index, choice.index)] = choice
                if output.finished:
                    req.done = True
                else:
                    self._schedule(index)
                yield index, output

    def _schedule(self, index: int) -> None:
        task = asyncio.ensure_future(_next_or_none(self._requests[index].stream))
        self._pending[task] = index

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens) over every prompt and choice."""
        prompt = sum(len(r.prompt.token_ids) for r in self._requests)
        completion = sum(len(c.token_ids) for c in self.choices.values())
        cached = sum(r.last.num_cached_tokens for r in self._requests if r.last is not None)
        return prompt, completion, cached

    async def close(self) -> None:
        """Abort what is still running and release the engine streams; safe to call more than once."""
        with anyio.CancelScope(shield=True):
            if self._waiting is not None:
                self._waiting.release()
            pending, self._pending = list(self._pending), {}
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task
            for req in self._requests:
                with contextlib.suppress(Exception):
                    await req.stream.aclose()
                if not req.done:
                    req.done = True
                    await self._engine.abort(req.request_id)


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (the request body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or raise ClientDisconnected (cancelling it) if the client leaves first."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait((work_task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watcher):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
    if work_task.cancelled() or not work_task.done():
        raise ClientDisconnected()
    return work_task.result()
