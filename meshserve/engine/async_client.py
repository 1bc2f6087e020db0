"""The engine as the API server sees it: an asyncio front over a TE's processes.

A reader thread receives the master's messages and hands them to the event
loop; all request state (the output processor) lives on the loop's thread.
The client is healthy only while the master runs and that reader is alive.

When the master dies (killed, or ended after a failure it could not recover from), the reader starts a
new engine and every running request continues there from its prompt and the tokens it already streamed
(token recomputation): the caller sees one stream, nothing repeated or missing. Requests arriving
meanwhile wait for the new engine. Only after `max_recoveries` restarts within 10 minutes do requests fail.

A master stopped on purpose is not restarted: once the server begins to shut down (`begin_shutdown`, called
from its signal handler), or when the master exits because it was sent SIGTERM (a signal to the whole
process group reaches it before the server has stopped), the requests still running fail instead.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator

from meshserve.config import EngineConfig
from meshserve.core.rank_health import RecoveryState
from meshserve.engine.client_core import ClientCore
from meshserve.engine.core_client import EngineCoreClient
from meshserve.engine.detokenizer import load_tokenizer
from meshserve.engine.outputs import RequestOutput
from meshserve.models.generation_config import eos_token_ids
from meshserve.utils.processes import stopped_on_request
from meshserve.wire.client import (
    NO_TENANCY,
    AddRequest,
    AdminReply,
    AdminRequest,
    EngineError,
    EngineStats,
    StatsQuery,
    Tenancy,
)
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, log_level: int = logging.INFO) -> None:
        self.config = config
        model = config.model_config
        self.model_name = model.served_model_name or os.path.basename(os.path.normpath(model.model))
        self.tokenizer = load_tokenizer(model.model)
        self.eos_token_ids = eos_token_ids(model.model)
        self.log_level = log_level
        self.engine = EngineCoreClient(config, log_level=log_level)
        self.core = ClientCore(self.tokenizer, self._abort)  # touched on the loop's thread only
        self.restarts = RecoveryState(config.parallel_config.max_recoveries)
        self.restarting: str | None = None  # why the engine is being restarted now
        self._generation = 0  # engines started so far after the first
        self._sent_to: dict[str, int] = {}  # child id -> the engine generation it was sent to
        self.processor = self.core.processor
        self.max_model_len = self.engine.ready.max_model_len
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()
        self._stopping = threading.Event()  # shutdown has begun: a lost engine is not restarted

    # ------------------------------------------------------------------ lifecycle
    def _ensure_started(self) -> None:
        """Deliver engine messages to the running event loop (started on first use)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read_forever, name="meshserve-engine-reader", daemon=True)
        self._reader.start()

    def begin_shutdown(self) -> None:
        """The server is stopping (called from its SIGTERM/SIGINT handler): from now on an engine that ends
        is not restarted, so nothing outlives the server."""
        self._stopping.set()

    def shutdown(self) -> None:
        self._stopping.set()
        self._stop.set()
        if self._reader is not None:
            self._reader.join(5)
        self.engine.shutdown()

    def _read_forever(self) -> None:
        try:
            self._read_messages()
        except Exception as exc:  # noqa: BLE001 - without its reader nothing reaches a request: say so
            logger.exception("the engine reader failed")
            self._post(self.core.engine_died, f"the engine reader failed: {type(exc).__name__}: {exc}")

    def _read_messages(self) -> None:
        while not self._stop.is_set():
            item = self.engine.recv(500)
            if item is None:
                if not self.engine.alive and not self._stop.is_set():
                    if not self._engine_lost(f"engine process died (exit code {self.engine.proc.returncode})"):
                        return
                continue
            if isinstance(item, EngineError) and item.fatal:  # the master ends after it: start another
                if not self._engine_lost(item.message):
                    return
                continue
            if not self._post(self.core.on_message, item):
                return

    def _engine_lost(self, reason: str) -> bool:
        """On the reader thread: restart a crashed engine; fail the requests of one stopped on purpose."""
        if self._stopping.is_set() or stopped_on_request(self.engine.proc.poll()):
            logger.info("engine stopped (%s): not restarting it", reason)
            self._post(self.core.engine_died, f"the engine was stopped ({reason})")
            return False
        return self._restart_engine(reason)

    def _restart_engine(self, reason: str) -> bool:
        """On the reader thread: start a new engine and have the loop continue the running requests there.
        False (and every request failed) when the restart budget is spent or the restart fails."""
        now = time.monotonic()
        if not self.restarts.allow(now):
            self._post(self.core.engine_died, f"{reason} (after {self.restarts.total} engine restarts)")
            return False
        self.restarts.record(now)
        self.restarting = reason
        logger.warning("engine lost (%s): starting a new one; running requests continue there", reason)
        self.engine.shutdown()
        try:
            engine = EngineCoreClient(self.config, log_level=self.log_level)
        except Exception as exc:  # noqa: BLE001 - the requests fail with the reason
            self._post(self.core.engine_died, f"{reason}; starting a new engine failed: {exc}")
            return False
        if self._stopping.is_set():  # shutdown began while it started: it must not outlive the server
            engine.shutdown()
            self._post(self.core.engine_died, f"{reason}; the server is stopping")
            return False
        self.engine = engine
        return self._post(self._continue_requests, reason)

    def _continue_requests(self, reason: str) -> None:
        """On the loop: send every running child to the new engine with its tokens so far."""
        self._generation += 1
        children = self.core.processor.unfinished_children()
        for child_id, params, prompt_token_ids, token_ids, arrival, tenancy in children:
            if self._sent_to.get(child_id) == self._generation:
                continue  # submitted to the new engine already
            self._sent_to[child_id] = self._generation
            self.engine.send(AddRequest(req_id=child_id, prompt_token_ids=prompt_token_ids, sampling_params=params,
                                            arrival_time=arrival, eos_token_ids=self.eos_token_ids,
                                            output_token_ids=token_ids, tenancy=tenancy))
        self.restarts.migrated += len(children)
        live = {child_id for child_id, *_ in children}
        self._sent_to = {c: g for c, g in self._sent_to.items() if c in live}
        self.restarting = None
        logger.warning("new engine serving; %d request(s) continue from their tokens so far", len(children))

    def _abort(self, child_ids: list[str]) -> None:
        for child_id in child_ids:
            self._sent_to.pop(child_id, None)
        self.engine.abort(child_ids)

    def _post(self, handler, item) -> bool:
        """Hand `item` to the event loop; False once that loop has closed (nobody is left to serve)."""
        try:
            self._loop.call_soon_threadsafe(handler, item)
        except RuntimeError:  # the loop closed before shutdown() stopped this thread
            return False
        return True

    # ------------------------------------------------------------------ API (meshserve.engine.protocol)
    async def start(self) -> None:
        """Nothing to do before the first request: the reader starts on the loop of the first request."""

    @property
    def healthy(self) -> bool:
        return self.dead_error is None

    def health(self) -> dict:
        """Nothing beyond ok or not: one engine has no routes to report."""
        return {}

    @property
    def dead_error(self) -> str | None:
        if self.core.dead_error is not None:
            return self.core.dead_error
        if self.restarting is not None:
            return None  # requests are taken and wait for the new engine
        if not self.engine.alive:
            return "engine process is not running"
        if self._reader is not None and not self._reader.is_alive() and not self._stop.is_set():
            return "the engine reader thread has stopped"
        return None

    async def generate(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, context_cache_id: str | None = None,
                       context_cache_ttl_s: float | None = None,
                       tenancy: Tenancy = NO_TENANCY) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come. `context_cache_id` names a context cache whose pinned blocks lead
        the prompt; with `context_cache_ttl_s` this request creates that cache from its prompt instead.
        `tenancy`: its sender and prefix-cache namespace (meshserve.engine.protocol)."""
        self._ensure_started()
        if not self.healthy:
            raise EngineDeadError(self.dead_error or "engine is not running")

        def submit(children, now: float) -> None:
            if self.restarting is not None:
                return  # the new engine takes them with the running ones (`_continue_requests`)
            for child_id, _ in children:
                self._sent_to[child_id] = self._generation
            try:
                self.engine.submit(children, prompt_token_ids, now, priority, self.eos_token_ids,
                                   context_cache_id=context_cache_id, context_cache_ttl_s=context_cache_ttl_s,
                                   tenancy=tenancy)
            except EngineDeadError:
                if self.restarts.allow(time.monotonic()):
                    for child_id, _ in children:  # the reader restarts the engine and sends them there
                        self._sent_to.pop(child_id, None)
                    return
                raise

        async with contextlib.aclosing(self.core.stream(request_id, prompt, prompt_token_ids, params, submit,
                                                        tenancy)) as outs:
            async for out in outs:
                yield out

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def get_stats(self) -> EngineStats:
        self._ensure_started()
        if self.dead_error is not None:
            return EngineStats(healthy=False, error=self.dead_error)
        fut = asyncio.get_running_loop().create_future()
        self.core.replies.wait_for_stats(fut)
        self.engine.send(StatsQuery())
        try:
            return await asyncio.wait_for(fut, timeout=10)
        except TimeoutError:
            return EngineStats(healthy=self.healthy, error="engine did not answer a stats query in 10 s")

    async def admin(self, op: str, args: dict | None = None, timeout_s: float = 30.0) -> AdminReply:
        """An operator command to the engine's master (e.g. "eplb.status"); raises EngineDeadError."""
        self._ensure_started()
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        fut = asyncio.get_running_loop().create_future()
        query_id = self.core.replies.open(fut)
        self.engine.send(AdminRequest.of(query_id, op, args))
        try:
            return await asyncio.wait_for(fut, timeout=timeout_s)
        except TimeoutError:
            self.core.replies.forget(query_id)
            return AdminReply(query_id=query_id, ok=False,
                                  error=f"the engine did not answer {op} in {timeout_s:.0f} s")
