"""The TE master process: scheduler + Relational Tensor Cache, driving executor processes.

It never touches tensors (it does not even import torch). Each loop turn it takes
client messages, collects finished steps from the executors and schedules new
ones. With `async_scheduling` up to two steps are in flight: step n+1 is
prepared and queued while step n runs, so the executors never wait on the
scheduler (deepserve §4.2, asynchronous execution).
"""
from __future__ import annotations

import logging
import os
import signal
import dataclasses
import time
import traceback
from collections import deque

import zmq

from meshserve.config import EngineConfig
from meshserve.engine import messages as msg
from meshserve.engine.errors import QueueFullError, RequestTooLongError
from meshserve.engine.processes import launch_module, module_arguments, stop_process
from meshserve.engine.request import Request
from meshserve.engine.rtc import RelationalTensorCache
from meshserve.engine.scheduler import Scheduler, SchedulerConfig
from meshserve.models.generation_config import max_position_embeddings
from meshserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle master checks that its peers are alive


class ExecutorGroup:
    """The executor processes of one TE and the sockets to reach them."""

    def __init__(self, ctx: zmq.Context, config: EngineConfig, ipc_dir: str, log_level: int) -> None:
        self.work = ctx.socket(zmq.PUSH)
        self.work.setsockopt(zmq.LINGER, 0)
        work_addr = f"ipc://{ipc_dir}/work"
        self.work.bind(work_addr)
        self.results = ctx.socket(zmq.PULL)
        result_addr = f"ipc://{ipc_dir}/results"
        self.results.bind(result_addr)
        self.procs = [
            launch_module("meshserve.engine.executor", rank=0, config=config.to_dict(), work_addr=work_addr,
                          result_addr=result_addr, log_level=log_level)
        ]

    def wait_ready(self, timeout_s: float) -> msg.ExecutorReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.results.poll(200):
                item = msg.decode(self.results.recv())
                if isinstance(item, msg.ExecutorReady):
                    return item
                if isinstance(item, msg.ExecutorFailure):
                    raise RuntimeError(f"executor {item.rank} failed to start: {item.message}")
            dead = self.dead_rank()
            if dead is not None:
                raise RuntimeError(f"executor {dead} exited during start-up (exit code {self.procs[dead].returncode})")
        raise RuntimeError(f"executors not ready after {timeout_s:.0f}s")

    def dead_rank(self) -> int | None:
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                return rank
        return None

    def shutdown(self) -> None:
        for _ in self.procs:
            try:
                self.work.send(msg.encode(msg.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for p in self.procs:
            stop_process(p, grace_s=10)
        self.work.close(0)
        self.results.close(0)


class EngineCore:
    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str, ipc_dir: str,
                 log_level: int = logging.INFO) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(input_addr)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(output_addr)
        self.parent = os.getppid()
        self.executors = ExecutorGroup(self.ctx, config, ipc_dir, log_level)
        ready = self.executors.wait_ready(config.startup_timeout_s)
        self.max_model_len = config.max_model_len or max_position_embeddings(config.model)
        self.kv_events = None
        self._kv_event_seq = 0
        if config.kv_events_endpoint:
            self.kv_events = self.ctx.socket(zmq.PUB)
            self.kv_events.setsockopt(zmq.LINGER, 0)
            self.kv_events.bind(config.kv_events_endpoint)
        self.rtc = RelationalTensorCache(ready.num_kv_blocks, config.block_size,
                                         enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=self.max_model_len, block_size=config.block_size,
                            enable_chunked_prefill=config.enable_chunked_prefill, max_waiting=config.max_waiting),
            self.rtc)
        self.pipeline_depth = 2 if config.async_scheduling else 1
        self.in_flight: deque[msg.SchedulerOutput] = deque()
        self.dead_error: str | None = None
        self.running = True
        self._send(msg.EngineReady(num_kv_blocks=ready.num_kv_blocks, block_size=config.block_size,
                                   kv_bytes_per_token=ready.kv_bytes_per_token, max_model_len=self.max_model_len))
        logger.info("engine ready: %d KV blocks, max_model_len %d, pipeline depth %d",
                    ready.num_kv_blocks, self.max_model_len, self.pipeline_depth)

    def _send(self, item) -> None:
        self.outbox.send(msg.encode(item))

    def _send_deltas(self, deltas: list[msg.RequestDelta]) -> None:
        if deltas:
            self._send(msg.EngineOutputs(deltas=deltas, timestamp=time.time()))

    # ------------------------------------------------------------------ client messages
    def _on_client(self, item) -> None:
        if isinstance(item, msg.AddRequest):
            self._add_request(item)
        elif isinstance(item, msg.AbortRequests):
            self.scheduler.abort_requests(item.req_ids)
        elif isinstance(item, msg.StatsQuery):
            stats = self.scheduler.stats()
            stats.healthy = self.dead_error is None
            stats.error = self.dead_error
            self._send(stats)
        elif isinstance(item, msg.Shutdown):
            self.running = False

    def _add_request(self, item: msg.AddRequest) -> None:
        def reject(error: Exception) -> None:
            self._send_deltas([msg.RequestDelta(req_id=item.req_id, new_token_ids=[], finish_reason="error",
                                                error=str(error), error_type=type(error).__name__,
                                                num_prompt_tokens=len(item.prompt_token_ids))])

        if self.dead_error is not None:
            reject(RuntimeError(f"engine is dead: {self.dead_error}"))
            return
        try:
            request = Request(req_id=item.req_id, prompt_token_ids=item.prompt_token_ids,
                              sampling_params=SamplingParams.from_dict(item.sampling_params),
                              arrival_time=item.arrival_time, priority=item.priority,
                              eos_token_ids=item.eos_token_ids)
            self.scheduler.add_request(request)
        except (QueueFullError, RequestTooLongError, ValueError) as exc:
            reject(exc)

    # ------------------------------------------------------------------ executors
    def _on_result(self, item) -> None:
        if isinstance(item, msg.ExecutorFailure):
            self._fail(f"executor {item.rank} failed: {item.message}")
            return
        sched = self.in_flight.popleft()
        if item.step_id != sched.step_id:
            self._fail(f"executor returned step {item.step_id}, expected {sched.step_id}")
            return
        self._send_deltas(self.scheduler.update_from_output(sched, item))
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        events = self.rtc.drain_events()
        if not events or self.kv_events is None:
            return
        self._kv_event_seq += 1
        batch = msg.KVCacheEvents(seq=self._kv_event_seq, timestamp=time.time(), events=[
            {"type": type(e).__name__, **dataclasses.asdict(e)} for e in events])
        self.kv_events.send(msg.encode(batch))

    def _fail(self, error: str) -> None:
        if self.dead_error is not None:
            return
        logger.error("engine failed: %s", error)
        self.dead_error = error
        self.in_flight.clear()
        # the error first: clients fail everything at once; the per-request deltas then only confirm it
        self._send(msg.EngineError(message=error, fatal=True))
        self._send_deltas(self.scheduler.fail_all(error))

    def _schedule(self) -> None:
        while (self.dead_error is None and len(self.in_flight) < self.pipeline_depth
               and self.scheduler.has_unfinished_requests()):
            sched = self.scheduler.schedule()
            if sched.is_empty:
                break
            self.executors.work.send(msg.encode(sched))
            self.in_flight.append(sched)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.executors.results, zmq.POLLIN)
        try:
            while self.running:
                self._schedule()
                stalled = not self.in_flight and self.scheduler.has_unfinished_requests()
                events = dict(poller.poll(50 if stalled else _IDLE_POLL_MS))
                if self.executors.results in events:
                    while self.executors.results.poll(0):
                        self._on_result(msg.decode(self.executors.results.recv()))
                if self.inbox in events:
                    while self.inbox.poll(0):
                        self._on_client(msg.decode(self.inbox.recv()))
                self._check_peers()
        finally:
            logger.info("shutting down")
            self.executors.shutdown()
            self.inbox.close(0)
            self.outbox.close()
            if self.kv_events is not None:
                self.kv_events.close(0)
            self.ctx.term()

    def _check_peers(self) -> None:
        if os.getppid() != self.parent:
            logger.warning("client is gone; shutting down")
            self.running = False
            return
        dead = self.executors.dead_rank()
        if dead is not None and self.dead_error is None:
            code = self.executors.procs[dead].returncode
            self._fail(f"executor {dead} died (exit code {code})")


def run_master(config: dict, input_addr: str, output_addr: str, ipc_dir: str,
               log_level: int = logging.INFO) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s master %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the parent stops us in order instead
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig.from_dict(config)
    try:
        core = EngineCore(config, input_addr, output_addr, ipc_dir, log_level)
    except Exception as exc:
        logger.error("start-up failed: %s", traceback.format_exc())
        ctx = zmq.Context.instance()
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 2000)
        out.connect(output_addr)
        out.send(msg.encode(msg.EngineError(message=f"engine start-up failed: {exc}", fatal=True)))
        out.close()
        raise SystemExit(1)
    core.run()


if __name__ == "__main__":
    import sys

    run_master(**module_arguments(sys.argv))
