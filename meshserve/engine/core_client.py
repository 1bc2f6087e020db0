"""Starts a TE (master + workers) in its own processes and talks to it over ZMQ.

Used by the offline `LLM` and by the async API client. Addresses are `ipc://`
sockets in a private temporary directory; the client binds, the master connects.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time

import zmq

from meshserve.config import EngineConfig
from meshserve.utils.processes import launch, stop_process
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.client import NO_TENANCY, AbortRequests, AddRequest, EngineError, EngineReady, Tenancy
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.receive import recv_message

logger = logging.getLogger(__name__)

_OUTPUTS = "engine-outputs"  # the client's receiving socket, as dropped frames name it


class EngineStartupError(RuntimeError):
    pass


class EngineCoreClient:
    def __init__(self, config: EngineConfig, log_level: int = logging.INFO) -> None:
        self.config = config
        self.ipc_dir = tempfile.mkdtemp(prefix="meshserve-")
        self.ctx = zmq.Context()
        self.to_master = self.ctx.socket(zmq.PUSH)
        self.to_master.setsockopt(zmq.LINGER, 0)
        input_addr = f"ipc://{self.ipc_dir}/input"
        self.to_master.bind(input_addr)
        self.from_master = self.ctx.socket(zmq.PULL)
        output_addr = f"ipc://{self.ipc_dir}/output"
        self.from_master.bind(output_addr)
        # a fresh interpreter (not multiprocessing): callers' scripts need no __main__ guard
        self.proc = launch("master", config=config.to_dict(), input_addr=input_addr,
                           output_addr=output_addr, ipc_dir=self.ipc_dir, log_level=log_level,
                           parent_pid=os.getpid())
        self.closed = False
        try:
            # a margin over the master's own start-up limit, so the master can say why it is not ready
            self.ready = self._wait_ready(config.parallel_config.startup_timeout_s + 15)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout_s: float) -> EngineReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.from_master.poll(200):
                item = recv_message(self.from_master, _OUTPUTS)
                if isinstance(item, EngineReady):
                    return item
                if isinstance(item, EngineError):
                    raise EngineStartupError(item.message)
            elif self.proc.poll() is not None:
                raise EngineStartupError(f"engine process exited during start-up (exit code {self.proc.returncode})")
        raise EngineStartupError(f"engine not ready after {timeout_s:.0f}s")

    @property
    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None

    def send(self, item) -> None:
        if not self.alive:
            raise EngineDeadError("engine process is not running")
        self.to_master.send(codec.encode(item))

    def abort(self, req_ids: list[str]) -> None:
        """Stop these requests; a dead engine has nothing left to stop."""
        try:
            self.send(AbortRequests(req_ids=req_ids))
        except EngineDeadError:
            pass

    def submit(self, children, prompt_token_ids: list[int], arrival_time: float, priority: int,
               eos_token_ids: list[int], context_cache_id: str | None = None,
               context_cache_ttl_s: float | None = None, tenancy: Tenancy = NO_TENANCY) -> None:
        """Send the engine-level requests (child id, SamplingParams) of one caller request."""
        for child_id, params in children:
            self.send(AddRequest(req_id=child_id, prompt_token_ids=prompt_token_ids,
                                     sampling_params=params, arrival_time=arrival_time,
                                     priority=priority, eos_token_ids=eos_token_ids,
                                     context_cache_id=context_cache_id, context_cache_ttl_s=context_cache_ttl_s,
                                     tenancy=tenancy))

    def recv(self, timeout_ms: int) -> object | None:
        """The next message from the master, or None after `timeout_ms` (or for a frame that was
        not a message: it is dropped, logged and counted)."""
        if self.from_master.poll(timeout_ms):
            return recv_message(self.from_master, _OUTPUTS)
        return None

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None:
            try:
                self.to_master.send(codec.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        stop_process(self.proc, grace_s=15)
        self.to_master.close(0)
        self.from_master.close(0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
