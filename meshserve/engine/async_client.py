"""The engine as the API server sees it: an asyncio front over a TE's processes.

A reader thread receives the master's messages and hands them to the event
loop; all request state (the output processor) lives on the loop's thread.
The client is healthy only while the master runs and that reader is alive.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator

from meshserve.config import EngineConfig
from meshserve.core import messages as msg
from meshserve.engine.core_client import EngineCoreClient
from meshserve.engine.detokenizer import load_tokenizer
from meshserve.core.errors import ADMISSION_ERRORS, EngineDeadError
from meshserve.engine.output_processor import OutputProcessor
from meshserve.models.generation_config import eos_token_ids
from meshserve.engine.outputs import RequestOutput
from meshserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, log_level: int = logging.INFO) -> None:
        self.config = config
        self.model_name = config.served_model_name or os.path.basename(os.path.normpath(config.model))
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(config.model)
        self.processor = OutputProcessor(self.tokenizer)
        self.engine = EngineCoreClient(config, log_level=log_level)
        self.max_model_len = self.engine.ready.max_model_len
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._admin_waiters: dict[int, asyncio.Future] = {}
        self._admin_ids = itertools.count()
        self._dead_error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def _ensure_started(self) -> None:
        """Deliver engine messages to the running event loop (started on first use)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read_forever, name="meshserve-engine-reader", daemon=True)
        self._reader.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(5)
        self.engine.shutdown()

    def _read_forever(self) -> None:
        try:
            self._read_messages()
        except Exception as exc:  # noqa: BLE001 - without its reader nothing reaches a request: say so
            logger.exception("the engine reader failed")
            self._post(self._on_dead, f"the engine reader failed: {type(exc).__name__}: {exc}")

    def _read_messages(self) -> None:
        while not self._stop.is_set():
            item = self.engine.recv(500)
            if item is None:
                if not self.engine.alive and not self._stop.is_set():
                    self._post(self._on_dead, "engine process died")
                    return
                continue
            if not self._post(self._dispatch, item):
                return

    def _post(self, handler, item) -> bool:
        """Hand `item` to the event loop; False once that loop has closed (nobody is left to serve)."""
        try:
            self._loop.call_soon_threadsafe(handler, item)
        except RuntimeError:  # the loop closed before shutdown() stopped this thread
            return False
        return True

    # ------------------------------------------------------------------ on the loop thread
    def _dispatch(self, item) -> None:
        if isinstance(item, msg.EngineOutputs):
            now = time.time()
            for delta in item.deltas:
                try:
                    self._on_delta(delta, now)
                except Exception as exc:  # noqa: BLE001 - one request's output must not lose the others'
                    logger.exception("processing the output of request %s failed", delta.req_id)
                    self._fail_request(delta.req_id, exc)
        elif isinstance(item, msg.EngineStats):
            waiters, self._stats_waiters = self._stats_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(item)
        elif isinstance(item, msg.AdminReply):
            fut = self._admin_waiters.pop(item.query_id, None)
            if fut is not None and not fut.done():
                fut.set_result(item)
        elif isinstance(item, msg.EngineError):
            self._on_dead(item.message)

    def _on_delta(self, delta: msg.RequestDelta, now: float) -> None:
        if delta.error_type in ADMISSION_ERRORS:
            self._fail_request(delta.req_id, ADMISSION_ERRORS[delta.error_type](delta.error))
            return
        out, to_abort = self.processor.process(delta, now)
        self._send_aborts(to_abort)
        if out is not None and out.request_id in self._queues:
            self._queues[out.request_id].put_nowait(out)

    def _fail_request(self, child_id: str, error: Exception) -> None:
        """End the caller's request (all its samples) with `error`."""
        parent = self._parent_of(child_id)
        if parent is not None:
            self._send_aborts(self.processor.abort(parent))
            self._queues[parent].put_nowait(error)

    def _parent_of(self, child_id: str) -> str | None:
        if child_id in self._queues:
            return child_id
        head, _, tail = child_id.rpartition("-")
        return head if tail.isdigit() and head in self._queues else None

    def _on_dead(self, error: str) -> None:
        if self._dead_error is not None:
            return
        logger.error("engine died: %s", error)
        self._dead_error = error
        for out in self.processor.fail_all(error):
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for fut in [*self._stats_waiters, *self._admin_waiters.values()]:
            if not fut.done():
                fut.set_exception(EngineDeadError(error))
        self._stats_waiters = []
        self._admin_waiters = {}

    def _send_aborts(self, child_ids: list[str]) -> None:
        if child_ids and self._dead_error is None:
            try:
                self.engine.send(msg.AbortRequests(req_ids=child_ids))
            except EngineDeadError:
                pass

    # ------------------------------------------------------------------ API
    @property
    def healthy(self) -> bool:
        return self.dead_error is None

    @property
    def dead_error(self) -> str | None:
        if self._dead_error is not None:
            return self._dead_error
        if not self.engine.alive:
            return "engine process is not running"
        if self._reader is not None and not self._reader.is_alive() and not self._stop.is_set():
            return "the engine reader thread has stopped"
        return None

    async def generate(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, context_cache_id: str | None = None,
                       context_cache_ttl_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come. `context_cache_id` names a context cache whose pinned blocks lead
        the prompt; with `context_cache_ttl_s` this request creates that cache from its prompt instead."""
        self._ensure_started()
        if not self.healthy:
            raise EngineDeadError(self.dead_error or "engine is not running")
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            now = time.time()
            self.engine.submit(self.processor.add_request(request_id, prompt, prompt_token_ids, params, now),
                               prompt_token_ids, now, priority, self.eos_token_ids,
                               context_cache_id=context_cache_id, context_cache_ttl_s=context_cache_ttl_s)
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the caller went away (client disconnect): free the engine's blocks
                self._send_aborts(self.processor.abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._send_aborts(self.processor.abort(request_id))

    async def get_stats(self) -> msg.EngineStats:
        self._ensure_started()
        if self.dead_error is not None:
            return msg.EngineStats(healthy=False, error=self.dead_error)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self.engine.send(msg.StatsQuery())
        try:
            return await asyncio.wait_for(fut, timeout=10)
        except asyncio.TimeoutError:
            return msg.EngineStats(healthy=self.healthy, error="engine did not answer a stats query in 10 s")

    async def admin(self, op: str, args: dict | None = None, timeout_s: float = 30.0) -> msg.AdminReply:
        """An operator command to the engine's master (e.g. "eplb.status"); raises EngineDeadError."""
        self._ensure_started()
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        query_id = next(self._admin_ids)
        fut = asyncio.get_running_loop().create_future()
        self._admin_waiters[query_id] = fut
        self.engine.send(msg.AdminRequest(query_id=query_id, op=op, args=args or {}))
        try:
            return await asyncio.wait_for(fut, timeout=timeout_s)
        except asyncio.TimeoutError:
            self._admin_waiters.pop(query_id, None)
            return msg.AdminReply(query_id=query_id, ok=False, error=f"the engine did not answer {op} in {timeout_s:.0f} s")
