"""A worker process: one rank's model runner, fed by the master over ZMQ.

The master PUSHes the same `StepBatch` to every rank; each rank runs its DP
group's part of it, in order, in lockstep with the others (the ranks meet in the
model's collectives over torch.distributed). The driver rank of each DP group
PUSHes back the group's `ModelRunnerOutput`. If the master disappears the
worker exits on its own.

Between steps the loop answers the master's `WorkerPing`s (a rank stuck in a step
stays silent: that is how the master finds a hung rank) and arms the faults the
master forwards (`InjectFault`; tests and benchmarks). Injected faults fire from
hooks wrapped around the runner and what it holds once one is armed
(fault_hooks.py); the loop itself carries none.

The master starts its local ranks as child processes; a rank on another host joins
with `join_engine` (`meshserve worker`), which fetches the config and addresses
from the master and then runs the same loop.
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from meshserve.config import EngineConfig, ParallelConfig
from meshserve.core.remote_ranks import PeerMonitor, enable_heartbeats
from meshserve.utils import cluster_auth, envs, faults
from meshserve.utils.core_pinning import pin_rank
from meshserve.utils.gc_pauses import StepCollector
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.codec import MessageError
from meshserve.wire.receive import drop_frame, recv_message
from meshserve.wire.worker import (
    InjectFault,
    StepBatch,
    WorkerEvent,
    WorkerFailure,
    WorkerHandshake,
    WorkerPing,
    WorkerPong,
    WorkerReady,
)
from meshserve.worker import fault_hooks
from meshserve.worker.step_agreement import serve_agreeing

if TYPE_CHECKING:
    from meshserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PARENT_CHECK_MS = 1000
# a remote rank asks the master for its assignment again after this long without an answer, and this long
# after a master recovering from the loss of its previous process told it to
_HANDSHAKE_RESEND_S = 2.0
_MAX_REDIRECTS = 2  # a TE shell sends a rank on once, to its group's master
_HANDSHAKE_RETRY_S = 0.5
_BACKGROUND_POLL_MS = 20


def init_distributed(config: ParallelConfig, device: str, rank: int, init_method: str | None) -> None:
    """Join the TE's torch.distributed world (nothing to do for one rank)."""
    world = config.world_size
    if world == 1:
        return
    # keeps torch out of this module's importers (the CLI); a rank with a world loads it here
    import torch

    from meshserve.parallel.topology import init_world

    backend = config.dist_backend or ("nccl" if device.startswith("cuda") else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # the rendezvous store listens on the master address only (torch's tcp:// store binds every interface)
    init_world(backend, init_method, rank, world, timeout=datetime.timedelta(seconds=config.startup_timeout_s))


class WorkerJoinError(RuntimeError):
    """The master refused this rank, or did not answer; the CLI prints it as one line."""


def join_engine(engine_addr: str, rank: int, timeout_s: float, log_level: int = logging.INFO) -> None:
    """Run `rank` of the TE whose master listens for remote ranks at `engine_addr` (tcp://HOST:PORT)."""
    assignment = _handshake(engine_addr, rank, timeout_s)
    run_worker(rank, assignment.config.to_dict(), assignment.work_addr, assignment.result_addr,
               assignment.dist_init_method, log_level, remote=True)


def _handshake(engine_addr: str, rank: int, timeout_s: float) -> WorkerHandshake:
    """Ask the master for `rank`'s assignment until it answers or `timeout_s` passes, following a TE shell's
    `redirect` to the master of the rank's DP group."""
    deadline = time.monotonic() + timeout_s
    reply = _ask(engine_addr, rank, deadline)
    for _ in range(_MAX_REDIRECTS):
        if reply is None or not reply.redirect:
            break
        logger.info("rank %d: the engine at %s sends it on to %s", rank, engine_addr, reply.redirect)
        engine_addr = reply.redirect
        reply = _ask(engine_addr, rank, deadline)
    if reply is None or reply.retry:
        refused = cluster_auth.handshake(engine_addr, 1.0) is cluster_auth.Handshake.REFUSED
        raise WorkerJoinError(f"no answer from the engine at {engine_addr} within {timeout_s:.0f}s" + (
            ": it refuses this host's cluster secret" if refused else "") + (
            f" (last: {reply.error})" if reply is not None else ""))
    if reply.error is not None:
        raise WorkerJoinError(f"the engine at {engine_addr} refused rank {rank}: {reply.error}")
    if reply.redirect:
        raise WorkerJoinError(f"the engine at {engine_addr} sent rank {rank} on more than {_MAX_REDIRECTS} times")
    if reply.config is None:
        raise WorkerJoinError(f"the engine at {engine_addr} sent no engine config")
    return reply


def _ask(engine_addr: str, rank: int, deadline: float) -> WorkerHandshake | None:
    """The master's last answer by `deadline` (None: none came). The question is asked again every few seconds:
    a master recovering from the loss of this rank's previous process closes its handshake socket with the
    question unread and binds a new one (ZMQ reconnects; answers come in order, so the first one read is to the
    earliest question the master saw)."""
    ctx = zmq.Context()
    sock = cluster_auth.client(ctx.socket(zmq.DEALER), engine_addr)
    sock.setsockopt(zmq.LINGER, 0)
    reply = None
    try:
        try:
            sock.connect(engine_addr)  # the master may start later: ZMQ keeps trying
        except zmq.ZMQError as exc:
            raise WorkerJoinError(f"cannot connect to the engine at {engine_addr}: {exc}") from None
        while time.monotonic() < deadline:
            sock.send(codec.encode(WorkerHandshake(rank=rank)))
            wait_s = min(_HANDSHAKE_RESEND_S, max(0.0, deadline - time.monotonic()))
            if not sock.poll(int(wait_s * 1000)):
                continue
            reply = _decode_assignment(engine_addr, sock.recv())
            if not reply.retry:
                break
            time.sleep(min(_HANDSHAKE_RETRY_S, max(0.0, deadline - time.monotonic())))
    finally:
        sock.close(0)
        ctx.term()
    return reply


def _decode_assignment(engine_addr: str, data: bytes) -> WorkerHandshake:
    try:
        reply = codec.decode(data)
    except MessageError as exc:
        raise WorkerJoinError(f"the engine at {engine_addr} answered with a bad message: {exc}") from None
    if not isinstance(reply, WorkerHandshake):
        raise WorkerJoinError(f"the engine at {engine_addr} answered with {type(reply).__name__}")
    return reply


def _parent_gone() -> Callable[[], bool]:
    parent = os.getppid()
    return lambda: os.getppid() != parent


def run_worker(rank: int, config: dict, work_addr: str, result_addr: str, dist_init_method: str | None = None,
               log_level: int = logging.INFO, remote: bool = False) -> None:
    started = time.time()
    logging.basicConfig(level=log_level, format=f"%(asctime)s worker[{rank}] %(levelname)s %(message)s",
                        force=True)
    if not remote:
        # Ctrl-C reaches the whole process group; the parent stops us in order instead
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    runner = None
    work, master_link, master_gone = _connect_work(ctx, work_addr, remote)
    results = cluster_auth.client(ctx.socket(zmq.PUSH), result_addr)
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(result_addr)
    try:
        engine_config = EngineConfig.from_dict(config)
        runner = _start_runner(rank, engine_config, dist_init_method)
        results.send(codec.encode(_ready_message(rank, runner, started)))
        collector = StepCollector(engine_config.parallel_config.gc_collect_every_steps)
        collector.start()
        if engine_config.parallel_config.dp_groups == "self-contained":
            serve_agreeing(rank, runner, work, results, master_gone, collector)
        else:
            _serve(rank, runner, work, results, master_gone, collector)
    except Exception as exc:  # report, then die: the master fails in-flight requests
        logger.error("worker failed: %s", traceback.format_exc())
        try:
            results.send(codec.encode(WorkerFailure(rank=rank, message=f"{type(exc).__name__}: {exc}")))
        except zmq.ZMQError:
            pass
        raise SystemExit(1) from exc
    finally:
        if runner is not None:
            runner.close()
        if master_link is not None:
            master_link.close()
        work.close(0)
        results.close()
        ctx.term()
        _leave_distributed()


def _connect_work(ctx: zmq.Context, work_addr: str,
                  remote: bool) -> tuple[zmq.Socket, PeerMonitor | None, Callable[[], bool]]:
    """The socket the master's steps arrive on, its heartbeat monitor (remote ranks) and a "master is gone" test."""
    work = ctx.socket(zmq.PULL)
    if remote:
        # not our parent: the master is gone when the work connection drops (or stops answering heartbeats)
        enable_heartbeats(work)
        master_link = PeerMonitor(work)
        master_gone = master_link.update
    else:
        master_link = None
        master_gone = _parent_gone()
    cluster_auth.client(work, work_addr)
    work.connect(work_addr)
    return work, master_link, master_gone


def _start_runner(rank: int, engine_config: EngineConfig, dist_init_method: str | None) -> ModelRunner:
    """Join the TE's world and build this rank's model runner."""
    # keeps torch out of this module's importers (the CLI); a rank loads it here
    from meshserve.parallel.context import ParallelContext
    from meshserve.worker.model_runner import ModelRunner, configure_threads

    parallel_config = engine_config.parallel_config
    threads = configure_threads(parallel_config.num_threads, parallel_config.world_size)
    if parallel_config.pin_cores:  # before torch starts its thread pool: the pool's threads inherit the cores
        logger.info("pinned to cores %s", ",".join(map(str, pin_rank(rank, threads))))
    init_distributed(parallel_config, engine_config.model_config.device, rank, dist_init_method)
    parallel = ParallelContext.build(
        parallel_config.strategy, moe_comm=parallel_config.moe_comm, int8_dispatch=parallel_config.int8_dispatch,
        max_tokens_per_step=engine_config.scheduler_config.max_num_batched_tokens,
        redundant_experts_per_rank=engine_config.eplb_config.eplb_redundant_experts,
        collective_timeout_s=parallel_config.collective_timeout_s,
        agree_steps=parallel_config.dp_groups == "self-contained",
        board_host=parallel_config.master_addr if parallel_config.spans_hosts else None,
        board_host_id=envs.host_id())
    timeline = envs.a2e_timeline()
    if timeline:  # benchmarks only: the A2E timeline (a rank without it runs unwrapped code)
        from meshserve.moe import a2e_timeline

        a2e_timeline.install(timeline, rank)
    forward_s = envs.null_model_s()
    if forward_s is not None:  # benchmarks only: the control plane without the model (worker/null_runner.py)
        from meshserve.worker.null_runner import NullRunner

        return NullRunner(engine_config, parallel, forward_s)
    if parallel.is_expert_rank:  # a disaggregated layout's expert rank: experts only, no KV cache
        from meshserve.worker.expert_runner import ExpertRankRunner

        expert_runner = ExpertRankRunner(engine_config, parallel)
        logger.info("ready (%d torch threads; expert rank %d: EP rank %d, MoE TP rank %d, serving %d DP domain(s))",
                    threads, parallel.expert_index, parallel.ep_rank, parallel.moe_tp_rank, len(parallel.a2e_groups))
        return expert_runner
    runner = ModelRunner(engine_config, parallel)
    logger.info("ready (%d torch threads; DP group %d, attention TP rank %d, EP rank %d, MoE TP rank %d)",
                threads, parallel.dp_rank, parallel.attn_tp_rank, parallel.ep_rank, parallel.moe_tp_rank)
    return runner


def _ready_message(rank: int, runner: ModelRunner, started: float) -> WorkerReady:
    return WorkerReady(rank=rank, rank_start=started, num_kv_blocks=runner.num_blocks,
                           kv_bytes_per_token=runner.layout.bytes_per_token, moe_layers=runner.moe_layers,
                           num_logical_experts=runner.num_logical_experts, kv_region=runner.kv_region,
                           vocab_size=runner.vocab_size, load_start=runner.load_info.start,
                           load_end=runner.load_info.end, load_source=runner.load_info.source,
                           load_bytes=runner.load_info.nbytes, weights_addr=runner.weights_addr)


def _serve(rank: int, runner: ModelRunner, work: zmq.Socket, results: zmq.Socket,
           master_gone: Callable[[], bool], collector: StepCollector | None = None) -> None:
    """Run the master's steps until it says stop or is gone; report background work as it finishes. Garbage is
    collected after the steps the master marks (`collector`: the rank's schedule, its pauses)."""
    collector = collector or StepCollector(0)
    fault_hooks.install(runner, rank, master_gone)  # wraps nothing until a fault is armed
    poller = zmq.Poller()
    poller.register(work, zmq.POLLIN)
    wakeup = runner.background_wakeup  # a KV pull or pool fetch that ends between steps wakes the loop at once
    if wakeup is not None:
        poller.register(wakeup.fileno(), zmq.POLLIN)
    while True:
        for kind, detail in runner.poll_background():
            results.send(codec.encode(WorkerEvent(rank=rank, kind=kind, detail=detail)))
        report = runner.take_kv_connector_report()  # pool fetches, KV pulls that finished
        if report is not None:
            results.send(codec.encode(report))
        # background work (expert reconfiguration, remote KV) is reported promptly even when no step comes
        events = dict(poller.poll(_BACKGROUND_POLL_MS if runner.background_busy else _PARENT_CHECK_MS))
        if wakeup is not None and wakeup.fileno() in events:
            wakeup.clear()  # before the report at the top: a pull that ends after it wakes the loop again
        if work not in events:
            if not events and master_gone():
                logger.warning("master is gone; exiting")
                return
            continue
        item = recv_message(work, "worker-work")
        if isinstance(item, Shutdown):
            logger.info("shutting down")
            return
        if isinstance(item, WorkerPing):
            results.send(codec.encode(WorkerPong(rank=rank, seq=item.seq)))
            continue
        if isinstance(item, InjectFault):
            faults.arm(item.fault)
            continue
        if not isinstance(item, StepBatch):
            if item is not None:
                drop_frame("worker-work", f"unexpected {type(item).__name__}")
            continue
        out = runner.run_batch(item)
        if out is not None:
            results.send(codec.encode(out))
        if item.collect_garbage:  # every rank after the same step, its output already on the way
            collector.collect()


def _leave_distributed() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()
