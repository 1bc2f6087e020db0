"""What every client of engines does with its requests, written once.

The offline `LLM`, the async client behind the HTTP server and the router (which talks to many engines)
each register caller requests (and their `n` children), route the engines' deltas to them, turn a
refusal at admission into the exception the caller sees, abort what the caller gave up, and match
replies to the queries they asked. `ClientCore` holds that state; its owner says how an abort reaches
the engine(s) and how a request's outputs reach the caller (a `deliver` callable per request: an
asyncio queue's `put_nowait`, or a list's `append`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from meshserve.engine.output_processor import OutputProcessor
from meshserve.engine.outputs import RequestOutput
from meshserve.wire.client import NO_TENANCY, AdminReply, EngineError, EngineOutputs, EngineStats, RequestDelta, Tenancy
from meshserve.wire.errors import ADMISSION_ERRORS, EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Children = list[tuple[str, SamplingParams]]  # the engine-level requests (child id, params) of one caller request
Deliver = Callable[[RequestOutput | Exception], None]


def admission_error(delta: RequestDelta) -> Exception | None:
    """The exception the caller sees when the master refused the request at admission, else None."""
    error_class = ADMISSION_ERRORS.get(delta.error_type) if delta.error_type is not None else None
    return None if error_class is None else error_class(delta.error)


class ReplyWaiter(Protocol):
    """What waits for a reply: an asyncio or a concurrent future, or a `ReplyCallback`."""

    def done(self) -> bool: ...

    def set_result(self, result) -> None: ...

    def set_exception(self, exception: BaseException) -> None: ...


class ReplyCallback:
    """A waiter that hands the reply to a function (for replies nobody awaits, e.g. a KV snapshot)."""

    def __init__(self, on_reply: Callable[[AdminReply], None]) -> None:
        self._on_reply = on_reply

    def done(self) -> bool:
        return False

    def set_result(self, result: AdminReply) -> None:
        self._on_reply(result)

    def set_exception(self, exception: BaseException) -> None:
        pass  # nobody awaits it


class PendingReplies:
    """Query ids and the waiters of their replies; a reply nobody waits for (any more) is ignored.

    Admin queries carry an id; a stats query has none, so every waiting stats query takes the next stats.
    Id 0 is never handed out: a client answering a query itself (nothing to ask an engine) replies with 0.
    """

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._waiters: dict[int, ReplyWaiter] = {}
        self._stats_waiters: list[ReplyWaiter] = []

    def open(self, waiter: ReplyWaiter) -> int:
        """A new query id whose reply goes to `waiter`."""
        query_id = next(self._ids)
        self._waiters[query_id] = waiter
        return query_id

    def wait_for_stats(self, waiter: ReplyWaiter) -> None:
        self._stats_waiters.append(waiter)

    def forget(self, query_id: int) -> None:
        """The asker stopped waiting (timeout): its late reply is ignored."""
        self._waiters.pop(query_id, None)

    def on_reply(self, reply: AdminReply) -> None:
        _resolve(self._waiters.pop(reply.query_id, None), reply)

    def on_stats(self, stats: EngineStats) -> None:
        waiters, self._stats_waiters = self._stats_waiters, []
        for waiter in waiters:
            _resolve(waiter, stats)

    def fail_all(self, error: BaseException) -> None:
        waiters = [*self._stats_waiters, *self._waiters.values()]
        self._stats_waiters, self._waiters = [], {}
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)


def _resolve(waiter: ReplyWaiter | None, reply) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(reply)


class ClientCore:
    """Caller requests and their children, their outputs, aborts and pending replies, for one client.

    `send_aborts(child_ids)` tells the engine(s) to stop those children (a dead engine is not asked).
    """

    def __init__(self, tokenizer, send_aborts: Callable[[list[str]], None]) -> None:
        self.processor = OutputProcessor(tokenizer)
        self.replies = PendingReplies()
        self.dead_error: str | None = None  # set once the (single) engine died
        self._send_aborts = send_aborts
        self._deliver: dict[str, Deliver] = {}  # caller request id -> where its outputs go
        self._children: dict[str, list[str]] = {}  # caller request id -> its child ids
        self._parent: dict[str, str] = {}  # child id -> caller request id
        self._handlers: dict[type, Callable] = {
            EngineOutputs: self.on_outputs, EngineStats: self.replies.on_stats,
            AdminReply: self.replies.on_reply, EngineError: lambda error: self.engine_died(error.message)}

    # ------------------------------------------------------------------ registration
    def register(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, deliver: Deliver, tenancy: Tenancy = NO_TENANCY) -> Children:
        """Register a caller request; returns its children to send. Raises ValueError for a duplicate id."""
        if request_id in self._deliver:
            raise ValueError(f"duplicate request id {request_id!r}")
        children = self.processor.add_request(request_id, prompt, prompt_token_ids, params, arrival_time, tenancy)
        self._deliver[request_id] = deliver
        self._children[request_id] = [child_id for child_id, _ in children]
        for child_id, _ in children:
            self._parent[child_id] = request_id
        return children

    def release(self, request_id: str, finished: bool) -> None:
        """The caller stopped listening; a request it left unfinished is aborted (its engine blocks freed)."""
        self._deliver.pop(request_id, None)
        for child_id in self._children.pop(request_id, []):
            self._parent.pop(child_id, None)
        if not finished:
            self.abort(request_id)

    async def stream(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                     submit: Callable[[Children, float], None],
                     tenancy: Tenancy = NO_TENANCY) -> AsyncIterator[RequestOutput]:
        """Register the request, `submit(children, arrival_time)` it, and yield its outputs until it
        finishes; an admission error (or a failure of its outputs) is raised. A caller that leaves early
        (client disconnect) aborts it."""
        queue: asyncio.Queue = asyncio.Queue()
        now = time.time()
        children = self.register(request_id, prompt, prompt_token_ids, params, now, queue.put_nowait, tenancy)
        finished = False
        try:
            submit(children, now)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self.release(request_id, finished)

    # ------------------------------------------------------------------ engine messages
    def on_message(self, item) -> None:
        """A message from a single engine's master; other kinds are not the core's."""
        handler = self._handlers.get(type(item))
        if handler is not None:
            handler(item)

    def on_outputs(self, outputs: EngineOutputs) -> None:
        now = time.time()
        for delta in outputs.deltas:
            try:
                self.on_delta(delta, now)
            except Exception as exc:  # noqa: BLE001 - one request's output must not lose the others'
                logger.exception("processing the output of request %s failed", delta.req_id)
                self.fail_request(delta.req_id, exc)

    def on_delta(self, delta: RequestDelta, now: float) -> None:
        """A child's delta: a refusal at admission fails the caller's request, anything else is its output."""
        error = admission_error(delta)
        if error is not None:
            self.fail_request(delta.req_id, error)
        else:
            self.apply_delta(delta, now)

    def apply_delta(self, delta: RequestDelta, now: float) -> None:
        """A child's tokens (or its end) into the caller's output; a matched stop string aborts the child."""
        out, to_abort = self.processor.process(delta, now)
        self._abort_children(to_abort)
        if out is not None:
            self._deliver_output(out)

    def fail_request(self, child_id: str, error: Exception) -> None:
        """End the caller's request (all its children) with `error`; unknown ids are ignored."""
        request_id = self._parent.get(child_id)
        if request_id is not None:
            self.abort(request_id)
            self._deliver[request_id](error)

    def engine_died(self, error: str) -> None:
        """The (single) engine is gone: every live request ends with "error", every query with EngineDeadError."""
        if self.dead_error is None:
            logger.error("engine died: %s", error)
            self.dead_error = error
        for out in self.processor.fail_all(error):
            self._deliver_output(out)
        self.replies.fail_all(EngineDeadError(error))

    def _deliver_output(self, out: RequestOutput) -> None:
        deliver = self._deliver.get(out.request_id)
        if deliver is not None:  # else the caller has stopped listening
            deliver(out)

    # ------------------------------------------------------------------ aborts
    def abort(self, request_id: str) -> None:
        """Finish the request here with "abort" and tell the engine(s) to stop its running children."""
        self._abort_children(self.processor.abort(request_id))

    def _abort_children(self, child_ids: list[str]) -> None:
        if child_ids and self.dead_error is None:
            self._send_aborts(child_ids)
