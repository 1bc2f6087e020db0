"""The TE shell of a TE with self-contained DP groups (xdeepserve §4.2, Fig. 9).

Each DP group is a process of its own (`group_master`): scheduler, KV cache manager and output path, its ranks
agreeing on every step with the other groups' ranks (worker/step_agreement.py). The shell, in the TE's own
process, does only what needs the whole TE:

- it places each request on a group (the DP balancer of `dp_balancer`, from the groups' load reports, the
  requests it sent since and the prefixes each group caches, `group_prefixes`) and forwards aborts and operator
  commands to the groups;
- it triggers expert load balancing (xdeepserve §4.5): the groups' masters send it their ranks' expert load and
  the ranks' phase acknowledgements; its `EplbController` plans and moves the placement as a lockstep master
  does, each phase relayed to every group's ranks (`EplbRelay`), which apply it at one agreed forward;
- it coordinates health: a group's failed ranks restart the whole world (`WorldRestart`: the shell names one
  new rendezvous address for every group, and each group continues its own requests from their tokens so far),
  or with `on_rank_failure shrink` the world goes on without the lost ranks' groups and grows back later
  (core/group_world.py); a group master that dies fails the TE;
- it speaks for the TE: readiness, stats and heartbeats summed over the groups, and one stream of prefix-cache
  events for job executors (each group's, numbered again) with its snapshot; ranks on other hosts knock at its
  engine port and are sent on to their group's master (`JoinDirectory`).

No per-step message passes through it: outputs go from each group straight to the clients.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import ClassVar

import zmq

from meshserve.config import EngineConfig
from meshserve.core.client_links import ClientLink, RouterLinks
from meshserve.core.dp_balancer import DEFAULT_EXPECTED_OUTPUT_TOKENS, DPGroupLoad, cdiv, place_request
from meshserve.core.eplb_controller import EplbController, EplbError
from meshserve.core.group_prefixes import GroupPrefixes
from meshserve.core.group_world import GroupWorld
from meshserve.core.kv_events import KVEventPublisher
from meshserve.core.remote_ranks import JoinDirectory
from meshserve.utils.processes import free_tcp_port, launch, stop_process
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.client import (
    AbortRequests,
    AddRequest,
    AdminOp,
    AdminReply,
    AdminRequest,
    EngineError,
    EngineReady,
    EngineStats,
    EplbStatus,
    KVSnapshot,
    ReleaseKV,
    StatsQuery,
    StatsResult,
)
from meshserve.wire.codec import MAX_INBOX_BYTES, RefusedFrame
from meshserve.wire.dp_group import EplbRelay, GroupExpertLoad, HandOver, WorldRestart
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole, StartupTimeline
from meshserve.wire.kv import KVCacheEvents
from meshserve.wire.receive import drop_frame, recv_message
from meshserve.wire.worker import WorkerEvent, WorkerReady

logger = logging.getLogger(__name__)

_INBOX, _REPORTS = "te-inbox", "dp-group-reports"
_POLL_MS = 100
# aborts remembered for requests a retiring group hands over after the abort reached the groups (a handover
# follows its group's failure within seconds; this many aborts cover that at any realistic rate)
_RECENT_ABORTS = 4096
_STOP_GRACE_S = 15.0
_START_FAILURES_S = 2.0  # after a group fails to start, how long the others' reasons are awaited


class GroupView:
    """What the shell knows of one group: its process, its last load report and the requests sent since."""

    def __init__(self, index: int, proc, inbox: zmq.Socket, kv_events: zmq.Socket) -> None:
        self.index, self.inbox = index, inbox
        self.started(proc, kv_events)

    def started(self, proc, kv_events: zmq.Socket) -> None:
        """Its master's process, new (at start, and when a retired group rejoins the layout), and the socket
        its prefix-cache events come in on."""
        self.proc, self.kv_events = proc, kv_events
        self.ready: EngineReady | None = None
        self.stats = EngineStats()
        self.num_sent = 0
        # (prompt tokens, KV blocks) of the requests sent that the last report does not count yet, oldest first
        self.unreported: collections.deque[tuple[int, int]] = collections.deque()

    def send(self, item) -> None:
        self.inbox.send(codec.encode(item))

    def sent_request(self, tokens: int, blocks: int) -> None:
        self.num_sent += 1
        self.unreported.append((tokens, blocks))

    def load(self, max_num_seqs: int) -> DPGroupLoad:
        stats = self.stats
        return DPGroupLoad(num_requests=stats.num_running + stats.num_waiting + len(self.unreported),
                           max_num_seqs=max_num_seqs, num_blocks=stats.num_kv_blocks or self.ready.num_kv_blocks,
                           num_used_blocks=round(stats.kv_usage * stats.num_kv_blocks),
                           reserved_blocks=sum(blocks for _, blocks in self.unreported),
                           pending_prefill_tokens=stats.waiting_tokens + sum(t for t, _ in self.unreported))

    def on_report(self, heartbeat: EngineHeartbeat) -> None:
        """A load report: the requests it counts as received are in its figures; the rest are counted on top."""
        self.stats = heartbeat.stats
        while self.unreported and self.num_sent - len(self.unreported) < heartbeat.stats.requests_received:
            self.unreported.popleft()


class TEShell:
    """A TE whose DP groups run on their own; `run_master` and `run_te` run it in place of `EngineCore` when
    `dp_groups` is self-contained (the same constructor and loop)."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context, link: ClientLink | RouterLinks, ipc_dir: str,
                 log_level: int = logging.INFO, role: str = "colocated", group: str = "",
                 watch_parent: bool = True, startup: StartupTimeline | None = None,
                 spare_workers: Sequence = ()) -> None:
        self.config, self.ctx, self.link, self.inbox = config, ctx, link, link.inbox
        self.role, self.group = role, group or role
        self.watch_parent, self.parent = watch_parent, os.getppid()
        self.startup = startup or StartupTimeline(process_start=time.time())
        self.running, self.stop_requested = True, False
        self.dead_error: str | None = None
        self.rank0: WorkerReady | None = None  # what the expert-load recorder needs of the model (group 0 sends it)
        for spare in spare_workers:  # each group's master starts its own ranks
            spare.release()
        strategy = config.parallel_config.strategy
        self.reports = ctx.socket(zmq.PULL)
        self._ipc_dir, self._log_level = ipc_dir, log_level
        self._report_addr = f"ipc://{ipc_dir}/shell-reports"
        self.reports.bind(self._report_addr)
        # ranks on other hosts knock at the TE's engine port and are sent on to their group's master
        parallel = config.parallel_config
        self._join_ports = {index: free_tcp_port(parallel.master_addr) for index in range(strategy.attn_dp)
                            if (index + 1) * strategy.attn_tp > parallel.num_local_ranks}
        self.join_directory = JoinDirectory(ctx, parallel, self._join_ports) if self._join_ports else None
        dist_init = self._new_rendezvous()
        self.prefixes = GroupPrefixes(config.cache_config.block_size)
        self._recent_aborts: collections.deque[str] = collections.deque(maxlen=_RECENT_ABORTS)
        # what job executors subscribe to: every group's prefix-cache events, numbered again
        self.kv_events = KVEventPublisher(ctx, config.cache_config.kv_events_endpoint, config.te_name)
        self.groups: list[GroupView] = []
        for index in range(strategy.attn_dp):
            inbox = ctx.socket(zmq.PUSH)
            inbox.setsockopt(zmq.LINGER, 0)
            inbox.bind(self._group_inbox_addr(index))
            proc, kv_events = self._launch_group(index, config, dist_init, 0)
            self.groups.append(GroupView(index, proc, inbox, kv_events))
        self.world = GroupWorld(config, self.groups, _group_config)
        try:
            self._wait_ready(config.parallel_config.startup_timeout_s)
        except BaseException:
            self._stop_groups(grace_s=2.0)
            if self.join_directory is not None:
                self.join_directory.close()
            raise
        ready = [g.ready for g in self.groups]
        self.max_model_len = min(r.max_model_len for r in ready)
        self.engine_ready = EngineReady(num_kv_blocks=sum(r.num_kv_blocks for r in ready),
                                        block_size=ready[0].block_size, kv_bytes_per_token=ready[0].kv_bytes_per_token,
                                        max_model_len=self.max_model_len, vocab_size=min(r.vocab_size for r in ready))
        self.eplb = EplbController.for_ranks(config, self.rank0)
        if isinstance(link, ClientLink):
            link.send(self.engine_ready)
        logger.info("TE shell ready: %d self-contained DP group(s) of %s, %d KV blocks", len(self.groups),
                    strategy, self.engine_ready.num_kv_blocks)

    # ------------------------------------------------------------------ start and stop
    def _new_rendezvous(self) -> str:
        """A torch.distributed rendezvous address for a new world of the groups' ranks (rank 0 runs here)."""
        host = self.config.parallel_config.master_addr if self.join_directory is not None else "127.0.0.1"
        return f"tcp://{host}:{free_tcp_port(host)}"

    def _group_inbox_addr(self, index: int) -> str:
        return f"ipc://{self._ipc_dir}/group-{index}-inbox"

    def _launch_group(self, index: int, config: EngineConfig, dist_init: str, generation: int
                      ) -> tuple[object, zmq.Socket]:
        """Start DP group `index`'s master, its ranks joining world `generation` at `dist_init`; its process and
        a socket subscribed to its prefix-cache events."""
        group_dir = os.path.join(self._ipc_dir, f"group-{index}-{generation}")
        os.makedirs(group_dir, exist_ok=True)
        events_addr = f"ipc://{group_dir}/kv-events"
        client_output = self.link.output_addr if isinstance(self.link, ClientLink) else ""
        proc = launch("group-master", config=_group_config(config).replace(kv_events_endpoint=events_addr).to_dict(),
                      place={"index": index, "dist_init": dist_init, "generation": generation,
                             "join_port": self._join_ports.get(index, 0)},
                      shell_addr=self._group_inbox_addr(index), report_addr=self._report_addr,
                      client_output_addr=client_output, te_addr=self.link.listen_addr, ipc_dir=group_dir,
                      shell_pid=os.getpid(), log_level=self._log_level)
        events = self.ctx.socket(zmq.SUB)
        events.setsockopt(zmq.LINGER, 0)
        events.setsockopt(zmq.SUBSCRIBE, b"")
        events.connect(events_addr)
        self.prefixes.forget(index)  # a new master numbers its events from the start
        self.kv_events.publish_cleared(1, index)
        return proc, events

    def _wait_ready(self, timeout_s: float) -> None:
        """Every group's EngineReady. A group's failure fails the start, named with the failures of the others
        that follow within a moment (a group whose rank never joined from another host fails at the same time as
        the groups whose ranks waited for it: its message is the one that says why)."""
        settle_by = time.monotonic() + timeout_s + _START_FAILURES_S  # the groups' own verdicts come first
        errors: list[str] = []
        while any(g.ready is None for g in self.groups) and time.monotonic() < settle_by:
            if self.join_directory is not None:
                self.join_directory.answer()
            if self.reports.poll(200):
                item = recv_message(self.reports, _REPORTS)
                if isinstance(item, EngineError):
                    errors.append(item.message)
                    settle_by = min(settle_by, time.monotonic() + _START_FAILURES_S)
                elif isinstance(item, EngineReady):
                    self._group_of_ready().ready = item
                elif isinstance(item, WorkerReady):
                    self.rank0 = item
            elif not errors:
                exited = next((g for g in self.groups if g.proc.poll() is not None), None)
                if exited is not None:
                    errors.append(f"DP group {exited.index}'s master exited during start-up (exit code "
                                  f"{exited.proc.returncode})")
                    settle_by = time.monotonic() + _START_FAILURES_S
        if errors:
            raise RuntimeError("; ".join(errors))
        missing = [g.index for g in self.groups if g.ready is None]
        if missing:
            raise RuntimeError(f"DP group(s) {missing} not ready after {timeout_s:.0f} s")

    def _group_of_ready(self) -> GroupView:
        """EngineReady names no group; every group sends one, in any order, and the groups' figures differ at
        most in their KV blocks, which their load reports correct from the first report on."""
        return next(g for g in self.groups if g.ready is None)

    def stop_on_signal(self) -> None:
        self.stop_requested = True
        self.running = False

    def _stop_groups(self, grace_s: float = _STOP_GRACE_S) -> None:
        for g in self.groups:
            if g.proc.poll() is None:
                g.proc.send_signal(signal.SIGTERM)
        for g in self.groups:
            stop_process(g.proc, grace_s=grace_s)
            g.inbox.close(0)
            g.kv_events.close(0)

    def _fail(self, error: str) -> None:
        if self.dead_error is not None or self.stop_requested:
            return
        logger.error("TE failed: %s", error)
        self.dead_error = error
        self.link.broadcast(EngineError(message=error, fatal=True, engine=self.config.te_name))
        self.running = False

    # ------------------------------------------------------------------ loop
    def run(self, warmup: bool = False) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.reports, zmq.POLLIN)
        if self.join_directory is not None:
            poller.register(self.join_directory.handshakes.sock, zmq.POLLIN)
        kv_sockets = self._watch_kv_events(poller, {})
        self.startup.ready = time.time()
        try:
            while self.running:
                events = dict(poller.poll(_POLL_MS))
                for socket, group in kv_sockets.items():
                    if socket in events:
                        self._take_kv_events(group)
                if self.reports in events:
                    while self.reports.poll(0):
                        self._on_report(recv_message(self.reports, _REPORTS))
                if self.inbox in events:
                    while self.inbox.poll(0):
                        item = recv_message(self.inbox, _INBOX, MAX_INBOX_BYTES, self._answer_refused)
                        if item is not None:
                            self._on_client(item)
                if self.join_directory is not None:
                    self.join_directory.answer()
                self._check_groups()
                if self._tick_world(time.monotonic()):
                    kv_sockets = self._watch_kv_events(poller, kv_sockets)
                now = time.time()
                self._tick_eplb(now)
                self.link.tick(now, self._heartbeat)
        finally:
            logger.info("shutting down")
            self.link.say_goodbye(self._heartbeat())
            self._stop_groups(grace_s=_STOP_GRACE_S if self.dead_error is None else 2.0)
            if self.join_directory is not None:
                self.join_directory.close()
            self.reports.close(0)
            self.kv_events.close()
            self.link.close()
            self.ctx.term()

    def _watch_kv_events(self, poller: zmq.Poller, watched: dict) -> dict:
        """Poll each group's prefix-cache event socket (new ones after a group's master started again)."""
        for socket in watched:
            poller.unregister(socket)
        watched = {g.kv_events: g for g in self.groups}
        for socket in watched:
            poller.register(socket, zmq.POLLIN)
        return watched

    def _take_kv_events(self, group: GroupView) -> None:
        while group.kv_events.poll(0):
            batch = recv_message(group.kv_events, "dp-group-kv-events")
            if isinstance(batch, KVCacheEvents):
                self._on_group_events(group, batch)
            elif batch is not None:
                drop_frame("dp-group-kv-events", f"a {type(batch).__name__} is not a batch of cache events")

    def _on_group_events(self, group: GroupView, batch: KVCacheEvents) -> None:
        """A group's prefix-cache events: for placement, and again for job executors under the shell's numbers."""
        if not self.prefixes.apply(group.index, batch):
            self.kv_events.publish_cleared(1, group.index)  # batches were missed: the group starts again
        self.kv_events.publish(group.index, batch.events)

    def _answer_refused(self, refused: RefusedFrame) -> None:
        logger.warning("refused a request: %s", refused)
        self.link.send(refused.answer, refused.reply_to)

    def _check_groups(self) -> None:
        if self.stop_requested:
            return
        if self.watch_parent and os.getppid() != self.parent:
            logger.warning("client is gone; shutting down")
            self.running = False
            return
        for g in self.world.retired():  # its master leaves once it has handed its requests over: reaped here
            g.proc.poll()
        served = self.world.served
        ended = [g for g in served if g.proc.poll() is not None]
        failed = next((g for g in ended if g.proc.returncode != 0), None)
        if failed is not None:
            self._fail(f"DP group {failed.index}'s master exited (exit code {failed.proc.returncode})")
        elif len(ended) == len(served):
            logger.info("every DP group left (drained): leaving")
            self.running = False

    # ------------------------------------------------------------------ the groups' reports
    def _on_report(self, item) -> None:
        if isinstance(item, EngineHeartbeat):
            group = next((g for g in self.groups if g.proc.pid == item.pid), None)
            if group is not None:
                group.on_report(item)
        elif isinstance(item, WorldRestart):
            self.world.on_request(item, time.monotonic())
        elif isinstance(item, HandOver):
            aborted = set(self._recent_aborts)
            for request in item.requests:  # they go on from their tokens so far in the groups left
                if request.req_id not in aborted:  # its client left while it was on its way
                    self._place(request).send(request)
        elif isinstance(item, EngineReady) and any(g.ready is None for g in self.groups):
            self._group_of_ready().ready = item  # a retired group back in the layout
        elif isinstance(item, WorkerReady):
            self.rank0 = item
        elif isinstance(item, GroupExpertLoad):
            self.eplb.on_counts(item.counts)
        elif isinstance(item, WorkerEvent):
            self.eplb.on_event(item.rank, item.kind, item.detail)
        elif isinstance(item, EngineError):
            self._fail(item.message)
        elif item is not None:
            drop_frame(_REPORTS, f"a {type(item).__name__} is not a DP group's report")

    def _tick_world(self, now: float) -> bool:
        """A new world once it is due: every group's message, the retired groups' masters started again (True:
        some were)."""
        if self.dead_error is not None or not self.world.due(now):
            return False
        placement = self.eplb.placement
        change = self.world.decide(now, self._new_rendezvous(), placement,
                                   self.eplb.record() if placement is not None else None)
        for g in change.relaunch:
            g.kv_events.close(0)
            g.started(*self._launch_group(g.index, self.config, change.dist_init, change.generation))
        for g, message in change.messages:
            g.send(message)
        # the new ranks start from the layout's own placement, any move under way dropped
        self.eplb = EplbController.for_ranks(change.config, self.rank0)
        return bool(change.relaunch)

    # ------------------------------------------------------------------ the clients' messages
    def _on_client(self, item) -> None:
        if isinstance(item, AddRequest):
            self._place(item).send(item)
        elif isinstance(item, (AbortRequests, ReleaseKV)):
            if isinstance(item, AbortRequests):  # one handed over from a retiring group may still be on its way
                self._recent_aborts.extend(item.req_ids)
            for g in self.world.served:  # the group holding a request forgets it; the others never heard of it
                g.send(item)
        elif isinstance(item, StatsQuery):
            self.link.send(self._stats(), item.reply_to)
        elif isinstance(item, AdminRequest):
            self._on_admin(item)
        elif isinstance(item, Shutdown):
            self.running = False
        else:
            drop_frame(_INBOX, f"a {type(item).__name__} is not a message for a TE")

    def _on_admin(self, item: AdminRequest) -> None:
        """What the shell holds it answers (stats, expert load balancing); the rest every group applies and the
        first answers."""
        answer = self._ADMIN_ANSWERS.get(item.op)
        if answer is None:
            for g in self.world.served:
                g.send(item)
            return
        try:
            reply = AdminReply(query_id=item.query_id, ok=True, data=answer(self, item))
        except EplbError as exc:
            reply = AdminReply(query_id=item.query_id, ok=False, error=str(exc))
        self._reply(item, reply)

    def _eplb_rebalance(self, item: AdminRequest) -> EplbStatus:
        if self.dead_error is not None:
            raise EplbError(f"engine is dead: {self.dead_error}")
        self.eplb.rebalance(item.placement)
        return self.eplb.status()

    _ADMIN_ANSWERS: ClassVar[dict] = {
        AdminOp.STATS: lambda self, item: StatsResult(stats=self._stats()),
        AdminOp.EPLB_LOAD: lambda self, item: self.eplb.load(),
        AdminOp.EPLB_STATUS: lambda self, item: self.eplb.status(),
        AdminOp.EPLB_REBALANCE: _eplb_rebalance,
        # the blocks as of the last batch the shell published: its own numbers, not a group's
        AdminOp.KV_SNAPSHOT: lambda self, item: KVSnapshot(
            seq=self.kv_events.seq, blocks=self.prefixes.snapshot([g.index for g in self.world.served])),
    }

    def _tick_eplb(self, now: float) -> None:
        """Close load slices, start a due rebalance, and relay a phase that is due to every group's ranks."""
        self.eplb.tick(now)
        command = self.eplb.idle_control().eplb
        if command is not None:
            for g in self.world.served:
                g.send(EplbRelay(command=command))

    def _reply(self, item: AdminRequest, reply: AdminReply) -> None:
        if item.reply_to or isinstance(self.link, ClientLink):  # a sender that names no address wants none
            self.link.send(reply, item.reply_to)

    def _place(self, item: AddRequest) -> GroupView:
        """The group for a new request: the DP balancer's choice (xdeepserve §4.3), the least loaded group when
        every group is at its batch limit (it waits there)."""
        block_size = self.engine_ready.block_size
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        # a group that rejoins the layout takes requests once its master is ready (they wait in the others')
        groups = [g for g in self.world.served if g.ready is not None]
        loads = [g.load(max_num_seqs) for g in groups]
        expected = item.sampling_params.max_tokens or DEFAULT_EXPECTED_OUTPUT_TOKENS
        num_prompt = len(item.prompt_token_ids)
        # a request handed over from a retired group goes on from its tokens so far: they are its prefix too
        hits = self.prefixes.hits([*item.prompt_token_ids, *item.output_token_ids], item.tenancy.cache_salt,
                                  [g.index for g in groups])
        choice = place_request(num_prompt, expected, block_size, loads, hits)
        index = choice.group if choice is not None else min(range(len(loads)), key=lambda i: loads[i].num_requests)
        group = groups[index]
        group.sent_request(num_prompt, cdiv(num_prompt + expected, block_size))
        return group

    # ------------------------------------------------------------------ what the TE tells others
    def _stats(self) -> EngineStats:
        parts = [g.stats for g in self.world.served]
        # a rollback or a recovery is the whole world's: every group counts the same one
        return EngineStats.merge(parts, num_recoveries=max((p.num_recoveries for p in parts), default=0),
                                 num_rollbacks=max((p.num_rollbacks for p in parts), default=0),
                                 recovering=next((p.recovering for p in parts if p.recovering), None),
                                 last_failure=next((p.last_failure for p in parts if p.last_failure), None),
                                 world_size=self.world.config.parallel_config.world_size,
                                 healthy=self.dead_error is None and all(p.healthy for p in parts),
                                 error=self.dead_error)

    def _heartbeat(self) -> EngineHeartbeat:
        config = self.config
        strategy = self.world.config.parallel_config.strategy
        return EngineHeartbeat(name=config.te_name, role=EngineRole(self.role), group=self.group,
                               input_addr=self.link.listen_addr, kv_events_addr=self.kv_events.addr,
                               kv_event_seq=self.kv_events.seq,
                               model=config.model_config.served_model_name or config.model_config.model,
                               max_model_len=self.max_model_len, block_size=config.cache_config.block_size,
                               attn_tp=strategy.attn_tp, attn_dp=strategy.attn_dp, stats=self._stats(),
                               timestamp=time.time(), pid=os.getpid(), startup=self.startup)


def _group_config(config: EngineConfig) -> EngineConfig:
    """A group master's config: the groups publish no prefix-cache events of their own (the routers see the TE
    as one), and only the shell rebalances experts on a schedule."""
    return config.replace(kv_events_endpoint="", eplb_interval_s=None)
