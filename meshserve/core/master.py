"""The engine's master process: per DP group a scheduler + KV cache manager, driving the worker ranks.

It never touches tensors (it does not even import torch). Each loop turn it takes
client messages, collects finished steps from the workers and schedules new
ones; it also places requests on DP groups and drives expert-placement
reconfigurations (`eplb_controller`). Remote KV (the memory pool, prefill -> decode)
moves through the KV connectors (`meshserve.core.kv_connector`): the master builds
them and forwards their reports. With `async_scheduling` up to two steps are in flight:
step n+1 is prepared and queued while step n runs, so the workers never wait on the
scheduler (deepserve §4.2, asynchronous execution).

Its other concerns have modules of their own: the ranks' processes and sockets (`worker_group`), handling
the clients' messages and the ranks' results (`client_messages`, `worker_results`: mixins, as SGLang's
scheduler has), taking requests (`admission`, `waiting_queue`) and sending their outputs
(`request_outputs`), operator commands (`admin_ops`, `drain`), rank failures and recovery (`recovery`,
`rank_health`), prefix-cache events (`kv_events`), when to draft (`spec_controller`) and its stats and
heartbeat (`engine_report`).
"""
from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import zmq

from meshserve.config import ConfigError, EngineConfig
from meshserve.core.admin_ops import AdminOps
from meshserve.core.admission import Admission
from meshserve.core.client_links import ClientLink, GroupLink, RouterLinks
from meshserve.core.client_messages import ClientMessages
from meshserve.core.dp_group import GroupPlace, build_dp_groups, connector_metadata
from meshserve.core.drain import Drain
from meshserve.core.engine_report import engine_heartbeat, engine_stats
from meshserve.core.eplb_controller import EplbController
from meshserve.core.kv_connector import KVConnectors
from meshserve.core.kv_events import KVEventPublisher
from meshserve.core.recovery import RankRecovery, hand_over_request
from meshserve.core.request import Request
from meshserve.core.request_outputs import WARMUP_ID, RequestOutputs
from meshserve.core.spec_controller import StepSpeculation
from meshserve.core.waiting_queue import DPWaitingQueue
from meshserve.core.worker_group import DEAD_GRACE_S, SpareWorker, WeightServers, WorkerGroup, time_load
from meshserve.core.worker_results import WorkerResults
from meshserve.models.generation_config import max_position_embeddings
from meshserve.parallel.disagg import check_model_dir
from meshserve.parallel.strategy import StrategyError
from meshserve.utils import cluster_auth, faults
from meshserve.utils.gc_pauses import StepCollector
from meshserve.utils.processes import STOPPED_BY_SIGNAL_EXIT_CODE
from meshserve.wire import codec
from meshserve.wire.client import AddRequest, EngineError, EngineReady, EngineStats
from meshserve.wire.dp_group import HandOver, WorldRestart
from meshserve.wire.heartbeat import EngineHeartbeat, StartupTimeline
from meshserve.wire.sampling_params import SamplingParams
from meshserve.wire.worker import StepBatch, WorkerReady

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle master checks that its peers are alive
_WARMUP_TIMEOUT_S = 120.0
_IDLE_COLLECT_S = 5.0  # an idle master with scheduled garbage collection still collects this often


class EngineCore(ClientMessages, WorkerResults):
    """Scheduler(s) of one TE: one scheduler and KV cache per DP group, in lockstep steps.

    With several DP groups, requests wait in one shared queue until the DP balancer
    places them (`waiting_queue`); each step every group's scheduler contributes its part
    (possibly empty) to one `StepBatch`, since all ranks meet at every MoE layer.
    """

    def __init__(self, config: EngineConfig, ctx: zmq.Context, link: ClientLink | RouterLinks | GroupLink,
                 ipc_dir: str, log_level: int = logging.INFO, role: str = "colocated", group: str = "",
                 watch_parent: bool = True, startup: StartupTimeline | None = None,
                 spare_workers: list[SpareWorker] = ()) -> None:
        self.config = config
        # the master of one self-contained DP group (core/te_shell.py), or of every group of the TE (None)
        self.place: GroupPlace | None = link.place if isinstance(link, GroupLink) else None
        self.ctx = ctx
        self.link = link
        self.inbox = link.inbox
        self.role, self.group = role, group or role
        self.watch_parent = watch_parent
        self.parent = os.getppid()  # watched from the first loop turn on; `run_master` may name it instead
        self.startup = startup or StartupTimeline(process_start=time.time())
        self.ipc_dir, self.log_level = ipc_dir, log_level
        self.dead_error: str | None = None
        self.running = True
        self.stop_requested = False  # told to stop (SIGTERM): ranks dying now are part of the stop
        self.outputs = RequestOutputs(link)
        self.drain = Drain()
        # the queue and the EPLB controller are built again with each set of ranks: looked up when asked
        self.recovery = RankRecovery(config, self.outputs, restart=self._restart, fail=self._fail,
                                     unfinished=lambda: self.queue.unfinished(),
                                     admit=lambda request: self.queue.admit(request), replay=self._on_client,
                                     eplb=lambda: self.eplb,
                                     hand_over=self._hand_over if self.place is not None else None)
        self.kv_events = KVEventPublisher(ctx, config.cache_config.kv_events_endpoint, config.te_name)
        self.speculation = StepSpeculation(config.speculative_config)
        self.kv_connectors: KVConnectors | None = None
        self.microbatched_steps = 0
        self.requests_received = 0
        self.gc_schedule = StepCollector(config.parallel_config.gc_collect_every_steps, idle_after_s=_IDLE_COLLECT_S)
        # tests and benchmarks: a master that dies as it sends a step, wrapped in only once such a fault is armed
        faults.on_arm({faults.FaultKind.KILL_MASTER}, lambda: faults.wrap_method(
            self, "_send_step", faults.kill_when_fired(faults.FaultKind.KILL_MASTER)))
        strategy = config.parallel_config.strategy
        if strategy.disagg:  # a role layout the model cannot fill is refused before any rank starts
            check_model_dir(strategy.disagg_layout(), config.model_config.model)
        ready = self._start_workers(config, spare_workers)
        self.vocab_size = min(r.vocab_size for r in ready)  # every token id a request names must be below it
        self.max_model_len = config.scheduler_config.max_model_len or max_position_embeddings(config.model_config.model)
        self._build_state(config, ready)
        num_blocks = sum(s.kv_manager.num_blocks for s in self.schedulers)
        engine_ready = EngineReady(num_kv_blocks=num_blocks, block_size=config.cache_config.block_size,
                                   kv_bytes_per_token=ready[0].kv_bytes_per_token,
                                   max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        if isinstance(link, ClientLink):
            link.send(engine_ready)
        elif isinstance(link, GroupLink):  # the shell speaks for the TE once every group is ready
            if self.place.index == 0:  # what the shell's expert-load recorder needs of the model
                link.report(ready[0])
            link.report(engine_ready)
        logger.info("engine ready: %s, %d DP group(s), %d KV blocks, max_model_len %d, pipeline depth %d",
                    config.parallel_config.strategy, self.dp_size, num_blocks, self.max_model_len,
                    self.pipeline_depth)

    def _start_workers(self, config: EngineConfig, spare_workers: list[SpareWorker] = (),
                       on_wait=None) -> list[WorkerReady]:
        """Start the ranks of `config`'s layout and wait until each is ready (their WorkerReady, in rank order)."""
        ipc_dir = self.ipc_dir
        if self.recovery.state.total:  # the last ranks' sockets may not have let go of their names yet
            ipc_dir = os.path.join(self.ipc_dir, f"recovery-{self.recovery.state.total}")
            os.makedirs(ipc_dir, exist_ok=True)
        self.workers = WorkerGroup(self.ctx, config, ipc_dir, self.log_level, spare_workers, place=self.place)
        try:
            ready = self.workers.wait_ready(config.parallel_config.startup_timeout_s, on_wait)
        except BaseException:
            self.workers.shutdown(grace_s=DEAD_GRACE_S)  # ranks still waiting for the others give up
            raise
        time_load(self.startup, ready)
        self.weight_servers = WeightServers(ready)
        self.recovery.health.reset(len(ready))
        return ready

    def _build_state(self, config: EngineConfig, ready: list[WorkerReady]) -> None:
        """Schedulers, KV cache bookkeeping, connectors and what works on them, for the ranks just started
        (empty: no request yet)."""
        self.config = config
        strategy = config.parallel_config.strategy
        self.dp_size = strategy.attn_dp if self.place is None else 1
        if self.kv_connectors is not None:
            self.kv_connectors.close()
        self.groups, self.kv_connectors = build_dp_groups(config, ready, self.link.listen_addr, self.link.send_to,
                                                          self.max_model_len, self.speculation.config.num_draft_tokens,
                                                          self.place)
        self.schedulers = [group.scheduler for group in self.groups]
        self.queue = DPWaitingQueue(self.schedulers, config.scheduler_config.max_waiting,
                                    config.cache_config.block_size)
        self.admission = Admission(self.vocab_size, config.cache_config.block_size, self.queue, self.kv_connectors,
                                   self.outputs, self.recovery.state)
        # step n + 1 is scheduled while step n runs (verifications included, see _may_schedule)
        self.pipeline_depth = 2 if config.scheduler_config.async_scheduling else 1
        self.eplb = EplbController.for_ranks(config, ready[0])
        self.admin_ops = AdminOps(eplb=self.eplb, schedulers=self.schedulers, queue=self.queue, workers=self.workers,
                                  kv_events=self.kv_events, drain=self.drain, engine_stats=self._stats,
                                  dead_error=lambda: self.dead_error)
        for item in self.workers.early_results:
            self._take_result(item)

    def _restart(self, config: EngineConfig, removed: list[int]) -> EngineConfig | None:
        """The recovery's restart: new ranks for `config`, fresh state for them, and routers told that their
        caches start empty; the layout started. A self-contained group's layout is the one its shell names for
        the new world (None: the group has no rank in it)."""
        if self.place is not None:
            world = self._next_world(removed)
            if world.retire:
                return None
            config = world.config or config
        ready = self._start_workers(config, on_wait=self._serve_while_restarting)
        old_dp_size = self.dp_size
        self._build_state(config, ready)
        self.kv_events.publish_cleared(max(old_dp_size, self.dp_size), 0 if self.place is None else self.place.index)
        return config

    def _next_world(self, lost_ranks: list[int]) -> WorldRestart:
        """The world a self-contained group's ranks restart into, which the shell names for every group (asked
        for here, with the ranks this group lost, unless it told this group first)."""
        place = self.place
        if place.next_world is None or place.next_world.generation <= place.generation:
            self.link.report(WorldRestart(generation=place.generation + 1, index=place.index, lost_ranks=lost_ranks,
                                          reason=self.recovery.state.in_progress or ""))
            deadline = time.monotonic() + self.config.parallel_config.startup_timeout_s
            while place.next_world is None or place.next_world.generation <= place.generation:
                if time.monotonic() > deadline:
                    raise RuntimeError("the TE shell named no new world for the ranks")
                self.inbox.poll(20)
                self._serve_while_restarting()  # the shell's answer comes in with the clients' messages
        world = place.next_world
        place.generation = world.generation
        if not world.retire:
            place.dist_init = world.dist_init
            place.index = place.index if world.index is None else world.index
        return world

    def _hand_over(self, requests: list[Request], deferred: list) -> None:
        """This group has no rank in the shell's new layout: its requests (with their tokens so far) and the
        ones that waited for the ranks go to the shell for the groups left, and the master leaves."""
        moved = [hand_over_request(request, self.outputs.reply_to(request.req_id)) for request in requests]
        moved += [item for item in deferred if isinstance(item, AddRequest)]
        self.link.report(HandOver(requests=moved))
        logger.warning("DP group %d leaves the TE's layout: %d request(s) handed over", self.place.index,
                       len(moved))
        self.running = False

    def _on_world_restart(self, item: WorldRestart) -> None:
        """The shell names a new world: another group lost a rank, so this group's ranks restart too."""
        place = self.place
        if place is None or item.generation <= place.generation:
            return
        place.next_world = item
        if self.recovery.state.in_progress is None and self.dead_error is None:
            # the group whose rank is gone may hear of the restart from the shell before it sees the loss itself
            own = self.workers.failure()
            self._rank_failed(f"the TE's ranks restart ({own or item.reason or 'another DP group lost a rank'})", [])

    def _serve_while_restarting(self) -> None:
        """While the new ranks start: heartbeats go on (saying `recovering`) and stats queries are answered; every
        other message waits for the new ranks (`RankRecovery.defers`)."""
        self.link.tick(time.time(), self._heartbeat)
        self._take_client_messages()

    # ------------------------------------------------------------------ stopping and failing
    def stop_on_signal(self) -> None:
        """SIGTERM (on the main thread, between two steps): leave the loop and stop the ranks in order. A
        signal to the whole process group reaches the ranks too: their deaths are then no failure to recover."""
        self.stop_requested = True
        self.running = False

    def _fail(self, error: str) -> None:
        if self.dead_error is not None:
            return
        if self.stop_requested:  # a step cut short by the stop (its ranks got the signal too) is no failure
            logger.info("stopping; a step failed meanwhile: %s", error)
            return
        logger.error("engine failed: %s", error)
        self.dead_error = error
        for group in self.groups:
            group.in_flight.clear()
        # the error first: clients fail everything at once; the per-request deltas then only confirm it
        self.link.broadcast(EngineError(message=error, fatal=True, engine=self.config.te_name))
        deltas = self.queue.fail_all(error)
        for scheduler in self.schedulers:
            deltas.extend(scheduler.fail_all(error))
        self.outputs.send(deltas)
        # a dead engine serves nothing: its process ends, and its owner (the engine client, the cluster
        # manager) starts a new one while the clients move the requests on
        self.running = False

    # ------------------------------------------------------------------ steps
    def _steps_in_flight(self) -> int:
        return max(len(group.in_flight) for group in self.groups)

    def _may_schedule(self) -> bool:
        """Room in the pipeline. A verification in flight does not hold the next step back: the scheduler books
        it as if no draft were accepted and leaves the worker slots for all of them (see scheduler.py)."""
        return self._steps_in_flight() < self.pipeline_depth

    def _has_work(self) -> bool:
        return any(group.has_work() for group in self.groups)

    def _busy(self) -> bool:
        """Requests placed, waiting for a DP group, or steps in flight."""
        return bool(self._has_work() or self.queue.pending or self._steps_in_flight())

    def _schedule(self) -> None:
        if self.dead_error is None:
            self.queue.place()
        while self.dead_error is None and self._may_schedule() and self._has_work():
            self.speculation.decide(self.schedulers)
            scheds = [s.schedule() for s in self.schedulers]
            if all(sched.is_empty for sched in scheds):
                break
            # blocks freed while scheduling are stored before this step's forward can overwrite them
            eplb = self.eplb.step_control(time.time())
            collect = self.gc_schedule.due()  # the ranks collect after this step, all at once
            self._send_step(StepBatch(per_dp=scheds, eplb=eplb.eplb, report_load=eplb.report_load,
                                      kv_connector=connector_metadata(self.groups), collect_garbage=collect,
                                      microbatches=self._microbatches(scheds)))
            for group, sched in zip(self.groups, scheds):
                group.sent(sched)
            if collect:
                self.gc_schedule.collect()  # while the ranks run the step
        metadata = connector_metadata(self.groups) if self.dead_error is None else {}
        if self.dead_error is None and (self.eplb.has_pending_control or metadata):
            # no step carried it: send the control on its own (ranks apply it without a forward)
            eplb = self.eplb.idle_control()
            self.workers.send(StepBatch(per_dp=[], eplb=eplb.eplb, kv_connector=metadata))

    def _microbatches(self, scheds: list) -> int:
        """Two micro-batches where configured and the largest DP group's part is big enough to pay for them."""
        parallel = self.config.parallel_config
        largest = max(s.total_num_scheduled_tokens for s in scheds)
        if parallel.microbatches == 1 or largest < parallel.microbatch_min_tokens:
            return 1
        self.microbatched_steps += 1
        return 2

    def _send_step(self, batch: StepBatch) -> None:
        """A step with work for the ranks (fault injection's `kill_master` hooks here, `__init__`)."""
        self.workers.send(batch)

    # ------------------------------------------------------------------ what the TE tells others
    def _stats(self) -> EngineStats:
        return engine_stats(self)

    def _heartbeat(self) -> EngineHeartbeat:
        return engine_heartbeat(self)

    # ------------------------------------------------------------------ loop
    def warm_up(self) -> None:
        """Run one dummy request through every step of serving (first-call costs: kernel set-up, allocator,
        lazy imports), so the first real request is as fast as the next; nothing is sent anywhere."""
        t0 = time.monotonic()
        self.queue.admit(Request(req_id=WARMUP_ID, prompt_token_ids=[0, 1, 2, 3],
                                 sampling_params=SamplingParams(temperature=0.0, max_tokens=2),
                                 arrival_time=time.time()))
        while self.dead_error is None and self._busy():
            if time.monotonic() - t0 > _WARMUP_TIMEOUT_S:
                raise RuntimeError(f"the warm-up request did not finish in {_WARMUP_TIMEOUT_S:.0f} s")
            self._schedule()
            if self.workers.results.poll(50):
                self._take_results()
            self._check_peers()
        if self.dead_error is not None:
            raise RuntimeError(f"the warm-up request failed: {self.dead_error}")
        logger.info("warm-up request done in %.2f s", time.monotonic() - t0)

    def run(self, warmup: bool = False) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        results = self.workers.results
        poller.register(results, zmq.POLLIN)
        try:
            if warmup:
                self.warm_up()
            self.gc_schedule.start()  # after the warm-up: what it made lives on, e.g. lazily imported modules
            self.startup.ready = time.time()
            self.link.tick(self.startup.ready, self._heartbeat)  # register now, not after the first idle poll
            while self.running:
                if results is not self.workers.results:  # the ranks were recovered: a new results socket
                    poller.unregister(results)
                    results = self.workers.results
                    poller.register(results, zmq.POLLIN)
                self._schedule()
                stalled = not self._steps_in_flight() and (self._has_work() or bool(self.queue.pending))
                # a connector's lookup answers on another thread, not on these sockets: look again soon
                timeout_ms = 2 if self.kv_connectors.busy else 50 if stalled else _IDLE_POLL_MS
                events = dict(poller.poll(timeout_ms))
                if results in events:
                    self._take_results()
                if self.inbox in events:
                    self._take_client_messages()
                self._check_peers()
                if self.drain.done(self._busy_draining):
                    logger.info("drained: leaving")
                    self.running = False
                self._tick(time.time())
        finally:
            logger.info("shutting down")
            self.gc_schedule.stop()
            self.link.say_goodbye(self._heartbeat())
            self.workers.shutdown(grace_s=10.0 if self.dead_error is None else DEAD_GRACE_S)
            self.link.close()
            self.kv_events.close()
            self.kv_connectors.close()
            self.ctx.term()

    def _busy_draining(self) -> bool:
        """Requests left to finish, counting the ones a prefill TE holds for decode."""
        stats = self._stats()
        return self._busy() or bool(stats.kv_transfer_holds)

    def _tick(self, now: float) -> None:
        """What runs on the clock: EPLB, heartbeats, idle garbage collection, KV hold and context cache expiry."""
        self.eplb.tick(now)
        self.link.tick(now, self._heartbeat)
        self.gc_schedule.collect_if_idle(busy=self._busy)
        self.kv_connectors.expire()
        for scheduler in self.schedulers:
            for cache_id in scheduler.expire_context_caches():
                logger.info("context cache %s expired; its blocks are unpinned", cache_id)

    def _check_peers(self) -> None:
        if self.stop_requested:
            return
        if self.watch_parent and os.getppid() != self.parent:
            logger.warning("client is gone; shutting down")
            self.running = False
            return
        failure = self.workers.failure()
        if failure is not None and self.dead_error is None:
            self._rank_failed(failure, self.workers.dead_ranks())
            return
        if self.dead_error is None:  # ping the ranks, find a hung one, grow back after a shrink
            self.recovery.check(self.workers)


def run_master(config: dict, input_addr: str, output_addr: str, ipc_dir: str,
               log_level: int = logging.INFO, parent_pid: int | None = None) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s master %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the parent stops us in order instead
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig.from_dict(config)
    ctx = zmq.Context()
    try:
        core = engine_class(config)(config, ctx, ClientLink(ctx, input_addr, output_addr), ipc_dir, log_level)
    except Exception as exc:
        # a setting the model or the layout refuses is the user's to fix: one line, no traceback
        logger.error("start-up failed: %s", exc if isinstance(exc, (ConfigError, StrategyError))
                     else traceback.format_exc())
        ctx = zmq.Context.instance()
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 2000)
        cluster_auth.client(out, output_addr)
        out.connect(output_addr)
        out.send(codec.encode(EngineError(message=f"engine start-up failed: {exc}", fatal=True)))
        out.close()
        ctx.term()  # waits (LINGER) until the error is out: the process ends without a teardown
        raise SystemExit(1) from exc
    if parent_pid is not None:
        # the launcher's own pid: a launcher that died before this process read its parent would leave init's
        core.parent = parent_pid
    signal.signal(signal.SIGTERM, lambda signum, frame: core.stop_on_signal())
    core.run()
    if core.stop_requested:  # the engine client must not take this for a crash and start another engine
        raise SystemExit(STOPPED_BY_SIGNAL_EXIT_CODE)
    if core.dead_error is not None:  # the engine client starts a new engine
        raise SystemExit(1)


def engine_class(config: EngineConfig) -> type:
    """What runs a TE's process: the master of every DP group, or the shell of self-contained ones."""
    if config.parallel_config.dp_groups == "self-contained":
        # start-up: the shell only where it runs
        from meshserve.core.te_shell import TEShell

        return TEShell
    return EngineCore
