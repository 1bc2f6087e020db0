"""The engine's master process: per DP group a scheduler + KV cache manager, driving the worker ranks.

It never touches tensors (it does not even import torch). Each loop turn it takes
client messages, collects finished steps from the workers and schedules new
ones; it also places requests on DP groups and drives expert-placement
reconfigurations (`eplb_controller`). Remote KV (the memory pool, prefill -> decode)
moves through the KV connectors (`meshserve.core.kv_connector`): the master builds
them and forwards their reports. With `async_scheduling` up to two steps are in flight:
step n+1 is prepared and queued while step n runs, so the workers never wait on the
scheduler (deepserve §4.2, asynchronous execution).
"""
from __future__ import annotations

import bisect
import functools
import logging
import os
import signal
import subprocess
import time
import traceback
from collections import deque
from typing import Protocol

import msgspec
import zmq

from meshserve.config import EngineConfig
from meshserve.core.client_links import ClientLink, RouterLinks
from meshserve.core.dp_balancer import DEFAULT_EXPECTED_OUTPUT_TOKENS, PendingRequest, place_batch
from meshserve.core.eplb_controller import EplbController, EplbError
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.kv_connector import KVConnectors
from meshserve.core.rank_health import RECOVERY_WINDOW_S, RankHealth, RecoveryState
from meshserve.core.remote_ranks import RemoteRanks, enable_heartbeats
from meshserve.core.request import Request
from meshserve.core.scheduler import Scheduler
from meshserve.core.spec_controller import SpeculationController
from meshserve.models.generation_config import max_position_embeddings
from meshserve.moe.placement import engine_shape, load_placement_file
from meshserve.utils import cluster_auth, faults
from meshserve.utils.processes import free_tcp_port, launch, stop_process
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.client import (
    AbortRequests,
    AddRequest,
    AdminOp,
    AdminReply,
    AdminRequest,
    ContextCacheDeleted,
    ContextCacheInfo,
    ContextCacheListing,
    EngineError,
    EngineOutputs,
    EngineReady,
    EngineStats,
    EplbStatus,
    ExpertLoad,
    FinishReason,
    KVSnapshot,
    ReleaseKV,
    RequestDelta,
    StatsQuery,
    StatsResult,
    error_type_of,
)
from meshserve.wire.codec import MAX_INBOX_BYTES, RefusedFrame
from meshserve.wire.errors import InvalidRequestError, QueueFullError, RequestTooLongError
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole, StartupTimeline
from meshserve.wire.kv import (
    AllBlocksCleared,
    KVCacheEvents,
    KVConnectorMetadata,
    KVConnectorReport,
    KVTransferRole,
)
from meshserve.wire.receive import drop_frame, dropped_frames, recv_message
from meshserve.wire.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, SamplingParamsError
from meshserve.wire.worker import (
    InjectFault,
    ModelRunnerOutput,
    SchedulerOutput,
    StepBatch,
    WorkerEvent,
    WorkerEventKind,
    WorkerFailure,
    WorkerHandshake,
    WorkerPing,
    WorkerPong,
    WorkerReady,
)

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle master checks that its peers are alive
_INBOX, _RESULTS = "te-inbox", "worker-results"  # the master's receiving sockets, as dropped frames name them
_MAX_REQUEST_ID_CHARS = 256
_MAX_ID_LIST = 1024  # eos and stop token ids of one request
_RESULT_TYPES = (ModelRunnerOutput, WorkerFailure, WorkerEvent, KVConnectorReport, WorkerPong)
_DEAD_GRACE_S = 2.0  # on a failed TE the other ranks may hang in a collective: stop them sooner
_WARMUP_ID = "meshserve-warmup"  # the dummy request a TE runs before it registers (answers go nowhere)
_WARMUP_TIMEOUT_S = 120.0
_DRAIN_TIMEOUT_S = 300.0  # a draining TE leaves after this even with requests left (their JEs move them)


def check_token_ids(token_ids: list[int], vocab_size: int, what: str) -> None:
    """InvalidRequestError unless every id is in the vocabulary [0, vocab_size)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(f"{what} token id {bad} is outside the vocabulary [0, {vocab_size})")


class SpareWorker(Protocol):
    """A worker process started ahead of time (a pre-warmed TE's, `meshserve.cluster.warm`): torch imported,
    native kernels loaded, waiting to be told which rank of which TE it is."""

    proc: subprocess.Popen

    def assign(self, handshake: WorkerHandshake) -> None: ...

    def release(self) -> None: ...


class WorkerGroup:
    """The worker processes of one engine (one per rank) and the sockets to reach them.

    The master starts ranks 0..num_local_ranks-1 itself; the others run on other hosts and
    join through `RemoteRanks`. With remote ranks every socket is TCP on `master_addr`;
    otherwise IPC in the TE's private directory.
    """

    def __init__(self, ctx: zmq.Context, config: EngineConfig, ipc_dir: str, log_level: int,
                 spare_workers: list[SpareWorker] = ()) -> None:
        parallel = config.parallel_config
        self.world_size = parallel.world_size
        num_local = parallel.num_local_ranks
        self._tcp_host = parallel.master_addr if num_local < self.world_size else None
        self._ipc_dir = ipc_dir
        self.works: list[zmq.Socket] = []
        self.results = ctx.socket(zmq.PULL)
        result_addr = self._bind(self.results, "results")
        # the ranks meet in torch.distributed; rank 0's store listens here (MASTER_ADDR:MASTER_PORT)
        dist_init = (f"tcp://{parallel.master_addr}:{parallel.master_port or free_tcp_port(parallel.master_addr)}"
                     if self.world_size > 1 else None)
        work_addrs = []
        for rank in range(self.world_size):
            work = ctx.socket(zmq.PUSH)
            work.setsockopt(zmq.LINGER, 0)
            if rank >= num_local:
                enable_heartbeats(work)
                work.setsockopt(zmq.LINGER, 1000)  # let Shutdown reach the other host
                work.setsockopt(zmq.SNDTIMEO, 1000)  # a rank that is gone must not block the master
            work_addrs.append(self._bind(work, f"work-{rank}"))
            self.works.append(work)
        self.remote = (RemoteRanks(ctx, config, self.works, work_addrs, result_addr, dist_init)
                       if num_local < self.world_size else None)
        self._unreachable: list[int] = []  # remote ranks whose work socket had no connection to send on
        self.early_results: list = []  # what ready ranks sent while others were still starting
        # a pre-warmed TE's spare worker processes take the first ranks; the others start as new processes
        spares = list(spare_workers)
        self.procs = []
        for rank in range(num_local):
            if spares:
                spare = spares.pop(0)
                spare.assign(WorkerHandshake(rank=rank, config=config, work_addr=work_addrs[rank],
                                                 result_addr=result_addr, dist_init_method=dist_init))
                self.procs.append(spare.proc)
            else:
                self.procs.append(launch("worker", rank=rank, config=config.to_dict(), work_addr=work_addrs[rank],
                                         result_addr=result_addr, dist_init_method=dist_init, log_level=log_level))
        for spare in spares:  # more spares than this TE's ranks
            spare.release()

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        if self._tcp_host is None:
            addr = f"ipc://{self._ipc_dir}/{name}"
            sock.bind(addr)
            return addr
        cluster_auth.server(sock)  # remote ranks must hold the cluster secret
        port = sock.bind_to_random_port(f"tcp://{self._tcp_host}")
        return f"tcp://{self._tcp_host}:{port}"

    def send(self, item) -> None:
        data = codec.encode(item)
        for rank, work in enumerate(self.works):
            try:
                work.send(data)
            except zmq.Again:  # only remote ranks' sockets time out: no connection left to send on
                self._unreachable.append(rank)

    def wait_ready(self, timeout_s: float, on_wait=None) -> list[WorkerReady]:
        """Every rank's WorkerReady, in rank order; `on_wait()` runs between polls (a recovering master
        keeps heartbeating)."""
        deadline = time.monotonic() + timeout_s
        ready: dict[int, WorkerReady] = {}
        while time.monotonic() < deadline:
            if on_wait is not None:
                on_wait()
            if self.results.poll(200):
                item = recv_message(self.results, _RESULTS)
                if isinstance(item, WorkerReady):
                    ready[item.rank] = item
                    if len(ready) == self.world_size:
                        return [ready[rank] for rank in range(self.world_size)]
                elif isinstance(item, WorkerFailure):
                    raise RuntimeError(f"worker {item.rank} failed to start: {item.message}{self._not_joined()}")
                elif item is not None:  # a ready rank's background news (its weight server): handled after start
                    self.early_results.append(item)
            gone = self._gone_rank(starting=True)
            if gone is not None:
                raise RuntimeError(gone[1])
        if self.remote is not None and self.remote.missing():
            raise RuntimeError(f"remote worker rank(s) {self.remote.missing()} did not join within "
                               f"{timeout_s:.0f}s; start each on its host with "
                               f"`meshserve worker --engine {self.remote.endpoint} --rank R`")
        missing = sorted(set(range(self.world_size)) - set(ready))
        raise RuntimeError(f"worker(s) {missing} not ready after {timeout_s:.0f}s")

    def _not_joined(self) -> str:
        missing = self.remote.missing() if self.remote is not None else []
        return f" (remote rank(s) {missing} never joined)" if missing else ""

    def failure(self) -> str | None:
        """Answer remote ranks knocking, then say which rank is gone, if one is."""
        gone = self._gone_rank()
        return None if gone is None else gone[1]

    def explain(self, report: WorkerFailure) -> str:
        """A rank's failure report, led by another rank's death when one is seen: a rank that
        fails inside a collective is often only the echo of a peer that died."""
        text = f"worker {report.rank} failed: {report.message}"
        gone = self._gone_rank()
        return text if gone is None or gone[0] == report.rank else f"{gone[1]}; then {text}"

    def dead_ranks(self) -> list[int]:
        """The ranks whose process has ended (or whose remote connection is lost)."""
        dead = [rank for rank, p in enumerate(self.procs) if p.poll() is not None]
        if self.remote is not None:
            lost = self.remote.lost_rank()
            if lost is not None:
                dead.append(lost)
        return sorted(set(dead))

    def _gone_rank(self, starting: bool = False) -> tuple[int, str] | None:
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                return rank, (f"worker {rank} exited during start-up (exit code {p.returncode})" if starting
                              else f"worker {rank} died (exit code {p.returncode})")
        if self.remote is None:
            return None
        self.remote.answer_handshakes()
        lost = self.remote.lost_rank()
        if lost is None and self._unreachable:
            lost = self._unreachable[0]
        if lost is not None:
            return lost, (f"remote worker {lost} disconnected during start-up" if starting
                          else f"remote worker {lost} disconnected (its process or host is gone)")
        return None

    def shutdown(self, grace_s: float = 10.0) -> None:
        for work in self.works:
            try:
                work.send(codec.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for p in self.procs:
            stop_process(p, grace_s=grace_s)
        if self.remote is not None:
            self.remote.close()
        for work in self.works:
            work.close()  # remote ranks' sockets linger a moment to deliver Shutdown
        self.results.close(0)


class EngineCore:
    """Scheduler(s) of one TE: one scheduler and KV cache per DP group, in lockstep steps.

    With several DP groups, requests wait in one shared queue until the DP balancer
    places them (`dp_balancer`); each step every group's scheduler contributes its part
    (possibly empty) to one `StepBatch`, since all ranks meet at every MoE layer.
    """

    def __init__(self, config: EngineConfig, ctx: zmq.Context, link: ClientLink | RouterLinks, ipc_dir: str,
                 log_level: int = logging.INFO, role: str = "colocated", group: str = "",
                 watch_parent: bool = True, startup: StartupTimeline | None = None,
                 spare_workers: list[SpareWorker] = ()) -> None:
        self.config = config
        self.ctx = ctx
        self.link = link
        self.inbox = link.inbox
        self.role, self.group = role, group or role
        self.watch_parent = watch_parent
        self.reply_of: dict[str, str] = {}  # request id -> where its outputs go (TE serving job executors)
        self.parent = os.getppid()
        strategy = config.parallel_config.strategy
        self.dp_size = strategy.attn_dp
        self.startup = startup or StartupTimeline(process_start=time.time())
        self.draining_since: float | None = None
        self.ipc_dir, self.log_level = ipc_dir, log_level
        self.base_config = config  # the configured layout; `config` is a shrunk one while ranks are missing
        self.dead_error: str | None = None
        self.running = True
        self.health = RankHealth(config.parallel_config.hang_timeout_s)
        self.recovery = RecoveryState(config.parallel_config.max_recoveries)
        self._deferred: list = []  # client messages that came while the ranks were recovered
        self.num_rollbacks = 0  # steps the ranks rolled back and ran again (a transient collective error)
        self._rollbacks_of_rank: dict[int, int] = {}  # ROLLED_BACK events per rank (num_rollbacks: the most)
        self.kv_events = None
        self.kv_events_addr = ""  # where routers subscribe: the endpoint as bound
        self._kv_event_seq = 0
        if config.cache_config.kv_events_endpoint:
            self.kv_events = self.ctx.socket(zmq.PUB)
            self.kv_events.setsockopt(zmq.LINGER, 0)
            # cached prompts are users' data
            cluster_auth.server(self.kv_events, config.cache_config.kv_events_endpoint)
            self.kv_events.bind(config.cache_config.kv_events_endpoint)
            # a wildcard port ("tcp://host:*") is chosen by the bind itself, so no other process can take
            # it between choosing and binding
            self.kv_events_addr = self.kv_events.getsockopt_string(zmq.LAST_ENDPOINT)
        self.spec_config = config.speculative_config
        self.spec_controller = SpeculationController(self.spec_config.speculative_max_batch)
        self.kv_connectors: KVConnectors | None = None
        ready = self._start_workers(config, spare_workers)
        self.vocab_size = min(r.vocab_size for r in ready)  # every token id a request names must be below it
        self.max_model_len = config.scheduler_config.max_model_len or max_position_embeddings(config.model_config.model)
        self._build_state(config, ready)
        num_blocks = sum(kv_manager.num_blocks for kv_manager in self.kv_managers)
        if isinstance(link, ClientLink):
            self._send(EngineReady(num_kv_blocks=num_blocks, block_size=config.cache_config.block_size,
                                       kv_bytes_per_token=ready[0].kv_bytes_per_token,
                                       max_model_len=self.max_model_len, vocab_size=self.vocab_size))
        logger.info("engine ready: %s, %d DP group(s), %d KV blocks, max_model_len %d, pipeline depth %d",
                    config.parallel_config.strategy, self.dp_size, num_blocks, self.max_model_len,
                    self.pipeline_depth)

    def _start_workers(self, config: EngineConfig, spare_workers: list[SpareWorker] = (),
                       on_wait=None) -> list[WorkerReady]:
        """Start the ranks of `config`'s layout and wait until each is ready (their WorkerReady, in rank order)."""
        ipc_dir = self.ipc_dir
        if self.recovery.total:  # the last ranks' sockets may not have let go of their names yet
            ipc_dir = os.path.join(self.ipc_dir, f"recovery-{self.recovery.total}")
            os.makedirs(ipc_dir, exist_ok=True)
        self.workers = WorkerGroup(self.ctx, config, ipc_dir, self.log_level, spare_workers)
        try:
            ready = self.workers.wait_ready(config.parallel_config.startup_timeout_s, on_wait)
        except BaseException:
            self.workers.shutdown(grace_s=_DEAD_GRACE_S)  # ranks still waiting for the others give up
            raise
        self._note_load(ready)
        self.health.reset(len(ready))
        return ready

    def _build_state(self, config: EngineConfig, ready: list[WorkerReady]) -> None:
        """Schedulers, KV cache bookkeeping and connectors for the ranks just started (empty: no request yet)."""
        self.config = config
        strategy = config.parallel_config.strategy
        self.dp_size = strategy.attn_dp
        self.kv_managers: list[KVCacheManager] = []
        for group in range(self.dp_size):
            ranks = ready[group * strategy.attn_tp:(group + 1) * strategy.attn_tp]
            self.kv_managers.append(KVCacheManager(min(r.num_kv_blocks for r in ranks), config.cache_config.block_size,
                                                   enable_prefix_caching=config.cache_config.enable_prefix_caching))
        # remote KV (memory pool, prefill -> decode) comes through KV connectors, one set per DP group
        if self.kv_connectors is not None:
            self.kv_connectors.close()
        self.kv_connectors = KVConnectors(config, ready, self.kv_managers, self.link.listen_addr, self.link.send_to)
        scheduler_config = msgspec.structs.replace(config.scheduler_config, max_model_len=self.max_model_len)
        self.schedulers = [Scheduler(scheduler_config, kv_manager, self.kv_connectors.per_group[group],
                                     num_speculative_tokens=self.spec_config.num_draft_tokens)
                           for group, kv_manager in enumerate(self.kv_managers)]
        # requests no DP group has taken yet (DP > 1 only), in queue order; and where each placed one went
        self.pending: list[Request] = []
        self._pending_seq = 0
        self._pending_keys: dict[str, tuple] = {}  # queue order: priority, then arrival
        self.owner: dict[str, int] = {}
        # step n + 1 is scheduled while step n runs (verifications included, see _may_schedule)
        self.pipeline_depth = 2 if config.scheduler_config.async_scheduling else 1
        self.in_flight: list[deque[SchedulerOutput]] = [deque() for _ in range(self.dp_size)]
        self.eplb = self._make_eplb_controller(ready[0])
        for item in self.workers.early_results:
            self._take_result(item)

    def _note_load(self, ready: list[WorkerReady]) -> None:
        """The TE-Load step from its ranks' reports, and where new TEs of this layout can fork weights from."""
        loaded = [r for r in ready if r.load_end]
        if loaded:
            self.startup.load_start = min(r.load_start for r in loaded)
            self.startup.load_end = max(r.load_end for r in loaded)
            self.startup.load_source = "+".join(sorted({r.load_source for r in loaded if r.load_source}))
            self.startup.load_bytes = sum(r.load_bytes for r in loaded)
        # each rank's weight server, as its snapshot becomes whole (WorkerReady or a later WEIGHTS_SERVED event)
        self._weight_servers = {r.rank: r.weights_addr for r in ready if r.weights_addr}
        self.weights_addrs = [r.weights_addr for r in ready] if all(r.weights_addr for r in ready) else []

    def _make_eplb_controller(self, ready: WorkerReady) -> EplbController:
        strategy = self.config.parallel_config.strategy
        eplb = self.config.eplb_config
        shape = None
        if ready.moe_layers and ready.num_logical_experts:
            shape = engine_shape(ready.num_logical_experts, strategy.moe_ep, eplb.eplb_redundant_experts)
        initial = load_placement_file(eplb.eplb_placement) if eplb.eplb_placement else None
        return EplbController(shape, ready.moe_layers, strategy.world_size, eplb.eplb_slice_s,
                              eplb.eplb_interval_s, initial=initial)

    def _send(self, item, reply_to: str = "") -> None:
        self.link.send(item, reply_to)

    def _send_deltas(self, deltas: list[RequestDelta]) -> None:
        if not deltas:
            return
        by_client: dict[str, list[RequestDelta]] = {}
        for delta in deltas:
            reply_to = self.reply_of.get(delta.req_id, "")
            if delta.finish_reason is not None or delta.kv_transfer_params is not None:
                self.reply_of.pop(delta.req_id, None)
            by_client.setdefault(reply_to, []).append(delta)
        now = time.time()
        for reply_to, batch in by_client.items():
            batch = [delta for delta in batch if delta.req_id != _WARMUP_ID]
            if batch:
                self._send(EngineOutputs(deltas=batch, timestamp=now), reply_to)

    # ------------------------------------------------------------------ client messages
    def _on_client(self, item) -> None:
        """One message from the inbox; whatever it holds, the loop goes on."""
        handler = self._CLIENT_HANDLERS.get(type(item))
        if handler is None:
            drop_frame(_INBOX, f"a {type(item).__name__} is not a message for a TE")
            return
        try:
            handler(self, item)
        except Exception as exc:  # noqa: BLE001 - one message must never end the TE
            logger.exception("handling a %s failed", type(item).__name__)
            if isinstance(item, AddRequest):
                self._reject(item, exc)

    def _answer_refused(self, refused: RefusedFrame) -> None:
        """A request whose frame failed its checks (e.g. sampling params out of range) fails alone, answered."""
        logger.warning("refused a request: %s", refused)
        self._send(refused.answer, refused.reply_to)

    def _on_abort(self, item: AbortRequests) -> None:
        self._abort(item.req_ids)

    def _on_release_kv(self, item: ReleaseKV) -> None:
        self.kv_connectors.release(item.req_ids)

    def _on_stats_query(self, item: StatsQuery) -> None:
        self._send(self._stats(), item.reply_to)

    def _on_admin(self, item: AdminRequest) -> None:
        try:
            reply = self._admin(item)
        except Exception as exc:  # noqa: BLE001 - a failing operator command is refused, never fatal
            logger.exception("admin operation %r failed", item.op)
            reply = AdminReply(query_id=item.query_id, ok=False, error=f"{item.op} failed: {exc}")
        if item.reply_to or isinstance(self.link, ClientLink):  # a TE's sender that names no address wants none
            self._send(reply, item.reply_to)

    def _on_shutdown(self, item: Shutdown) -> None:
        self.running = False

    def _admin(self, item: AdminRequest) -> AdminReply:
        try:
            data = self._ADMIN_OPS[item.op](self, item)
        except EplbError as exc:
            return AdminReply(query_id=item.query_id, ok=False, error=str(exc))
        return AdminReply(query_id=item.query_id, data=data)

    def _admin_eplb_load(self, item: AdminRequest) -> ExpertLoad:
        return self.eplb.load()

    def _admin_eplb_status(self, item: AdminRequest) -> EplbStatus:
        return self.eplb.status()

    def _admin_eplb_rebalance(self, item: AdminRequest) -> EplbStatus:
        if self.dead_error is not None:
            raise EplbError(f"engine is dead: {self.dead_error}")
        self.eplb.rebalance(item.placement)
        return self.eplb.status()

    def _admin_stats(self, item: AdminRequest) -> StatsResult:
        return StatsResult(self._stats())

    def _admin_kv_snapshot(self, item: AdminRequest) -> KVSnapshot:
        """A router rebuilding its view of this TE's prefix caches."""
        return KVSnapshot(seq=self._kv_event_seq,
                              blocks={g: kv_manager.snapshot() for g, kv_manager in enumerate(self.kv_managers)})

    def _admin_context_cache_delete(self, item: AdminRequest) -> ContextCacheDeleted:
        """Unpin a named context cache's blocks."""
        if item.cache_id is None:
            raise EplbError("context_cache.delete needs a cache id")
        deleted = [s.drop_context_cache(item.cache_id) for s in self.schedulers]
        return ContextCacheDeleted(id=item.cache_id, deleted=any(deleted))

    def _admin_context_cache_list(self, item: AdminRequest) -> ContextCacheListing:
        now = time.monotonic()
        return ContextCacheListing(caches={
            cache_id: ContextCacheInfo(dp_rank=g, num_tokens=len(pin.token_ids),
                                           expires_in_s=max(0.0, pin.deadline - now))
            for g, s in enumerate(self.schedulers) for cache_id, pin in s.context_caches.items()})

    def _admin_drain(self, item: AdminRequest) -> StatsResult:
        """A scale-down: take nothing new, finish what runs (and what prefill holds for decode), then leave."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            logger.info("draining: finishing %d running and %d waiting request(s), then leaving",
                        sum(s.num_running for s in self.schedulers), len(self.pending) +
                        sum(s.num_waiting for s in self.schedulers))
        return StatsResult(self._stats())

    def _drained(self) -> bool:
        if self.draining_since is None:
            return False
        if time.monotonic() - self.draining_since > _DRAIN_TIMEOUT_S:
            logger.warning("draining for %.0f s: leaving with requests left", _DRAIN_TIMEOUT_S)
            return True
        stats = self._stats()
        return not (self._has_work() or self.pending or self._steps_in_flight() or stats.kv_transfer_holds)

    def _admin_fault_inject(self, item: AdminRequest) -> StatsResult:
        """Arm a fault (tests and benchmarks): the master's own here, the others on every rank."""
        if item.fault.kind in faults.MASTER_KINDS:
            faults.arm(item.fault)
        else:
            self.workers.send(InjectFault(fault=item.fault))
        return StatsResult(self._stats())

    _ADMIN_OPS = {AdminOp.EPLB_LOAD: _admin_eplb_load, AdminOp.EPLB_STATUS: _admin_eplb_status,
                  AdminOp.EPLB_REBALANCE: _admin_eplb_rebalance, AdminOp.STATS: _admin_stats,
                  AdminOp.KV_SNAPSHOT: _admin_kv_snapshot,
                  AdminOp.CONTEXT_CACHE_DELETE: _admin_context_cache_delete,
                  AdminOp.CONTEXT_CACHE_LIST: _admin_context_cache_list, AdminOp.DRAIN: _admin_drain,
                  AdminOp.FAULT_INJECT: _admin_fault_inject}

    def _reject(self, item: AddRequest, error: Exception) -> None:
        """Refuse one request: its caller gets an error delta naming the error's class."""
        if item.reply_to:
            self.reply_of[item.req_id] = item.reply_to
        self._send_deltas([RequestDelta(req_id=item.req_id, new_token_ids=[],
                                            finish_reason=FinishReason.ERROR,
                                            error=str(error), error_type=error_type_of(error),
                                            num_prompt_tokens=len(item.prompt_token_ids))])

    def _check_add_request(self, item: AddRequest) -> SamplingParams:
        """The request's sampling settings, once every field is within what this model takes
        (InvalidRequestError or SamplingParamsError otherwise): a bad request is refused here, alone."""
        if not item.req_id or len(item.req_id) > _MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"a request id must have 1 to {_MAX_REQUEST_ID_CHARS} characters")
        if not item.prompt_token_ids:
            raise InvalidRequestError("the prompt has no tokens")
        if len(item.eos_token_ids) > _MAX_ID_LIST:
            raise InvalidRequestError(f"more than {_MAX_ID_LIST} eos token ids")
        for what, token_ids in (("prompt", item.prompt_token_ids), ("eos", item.eos_token_ids),
                                ("output", item.output_token_ids)):
            check_token_ids(token_ids, self.vocab_size, what)
        if not INT64_MIN <= item.priority <= INT64_MAX:
            raise InvalidRequestError(f"priority must fit in a signed 64-bit integer, got {item.priority}")
        params = item.sampling_params  # its own checks ran when the frame was decoded
        if len(params.stop_token_ids) > _MAX_ID_LIST:
            raise SamplingParamsError(f"more than {_MAX_ID_LIST} stop token ids", param="stop_token_ids")
        params.verify(self.vocab_size)
        return params

    def _add_request(self, item: AddRequest) -> None:
        if self.dead_error is not None:
            self._reject(item, RuntimeError(f"engine is dead: {self.dead_error}"))
            return
        try:
            params = self._check_add_request(item)
        except ValueError as exc:  # InvalidRequestError, SamplingParamsError
            self._reject(item, exc)
            return
        if item.reply_to:
            self.reply_of[item.req_id] = item.reply_to
        reject = functools.partial(self._reject, item)
        try:
            request = Request(req_id=item.req_id, prompt_token_ids=item.prompt_token_ids,
                              sampling_params=params, arrival_time=item.arrival_time, priority=item.priority,
                              eos_token_ids=item.eos_token_ids)
            self._set_context_cache(request, item)
            if request.context_cache_ttl_s is not None and not any(
                    s.can_pin(request.num_prompt_tokens // self.config.cache_config.block_size)
                    for s in self.schedulers):
                raise QueueFullError("named context caches already pin the share of the KV cache they may hold; "
                                     "delete some or wait for them to expire")
            if item.kv_transfer is not None:
                self._set_kv_transfer(request, item)
            elif item.output_token_ids:  # a request moved here from a failed TE: it goes on from these tokens
                self._resume(request, item.output_token_ids)
            self._admit(request)
        except (QueueFullError, RequestTooLongError, ValueError) as exc:
            reject(exc)

    @staticmethod
    def _set_context_cache(request: Request, item: AddRequest) -> None:
        """Explicit context caching (deepserve MatchByID): a ttl makes the request create the named cache."""
        if item.context_cache_ttl_s is not None:
            if not item.context_cache_id:
                raise ValueError("context_cache_ttl_s needs a context_cache_id to pin the prompt under")
            if not item.context_cache_ttl_s > 0:
                raise ValueError(f"context_cache_ttl_s must be positive, got {item.context_cache_ttl_s}")
        request.context_cache_id = item.context_cache_id or None
        request.context_cache_ttl_s = item.context_cache_ttl_s

    def _resume(self, request: Request, output_token_ids: list[int]) -> None:
        """Token recomputation: the prompt and the tokens already streamed are computed here, and the request
        goes on from its next token (the client has the others)."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and len(output_token_ids) >= max_tokens:
            raise InvalidRequestError(f"{len(output_token_ids)} output tokens already reach max_tokens {max_tokens}")
        for token in output_token_ids:
            request.append_output_token(int(token))
        self.recovery.migrated += 1

    def _set_kv_transfer(self, request: Request, item: AddRequest) -> None:
        """A disaggregated request: a producer here computes the prompt and the first token only; a consumer
        pulls the prompt's KV from the prefill TE its params name and decodes from its first token."""
        self.kv_connectors.accept(request, item.kv_transfer, item.output_token_ids)

    def _admit(self, request: Request) -> None:
        if self.dp_size == 1:
            self.schedulers[0].add_request(request)
        else:
            self._enqueue(request)

    _CLIENT_HANDLERS = {AddRequest: _add_request, AbortRequests: _on_abort, ReleaseKV: _on_release_kv,
                        StatsQuery: _on_stats_query, AdminRequest: _on_admin, Shutdown: _on_shutdown}

    def _enqueue(self, request: Request) -> None:
        if request.req_id in self.owner or request.req_id in self._pending_keys:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if len(self.pending) >= self.config.scheduler_config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.scheduler_config.max_waiting} requests)")
        self.schedulers[0].check_fits(request)  # every group has the same limits
        self._pending_seq += 1
        self._pending_keys[request.req_id] = (request.priority, request.arrival_time, self._pending_seq)
        bisect.insort(self.pending, request, key=lambda r: self._pending_keys[r.req_id])

    def _abort(self, req_ids: list[str]) -> None:
        self.kv_connectors.release(req_ids)  # a prefill TE's held blocks, whichever DP group holds them
        aborted = set(req_ids)
        self.pending = [r for r in self.pending if r.req_id not in aborted]
        for req_id in req_ids:
            self._pending_keys.pop(req_id, None)
            group = self.owner.pop(req_id, None) if self.dp_size > 1 else 0
            if group is not None:
                self.schedulers[group].abort_requests([req_id])

    def _place_pending(self) -> None:
        """Hand waiting requests to DP groups (xdeepserve §4.3: one collaborative placement per step)."""
        if not self.pending:
            return
        loads = [s.dp_load(DEFAULT_EXPECTED_OUTPUT_TOKENS) for s in self.schedulers]
        items = [PendingRequest(key=r, num_prompt_tokens=r.num_prompt_tokens,
                                expected_output_tokens=r.sampling_params.max_tokens or DEFAULT_EXPECTED_OUTPUT_TOKENS)
                 for r in self.pending]

        def prefix_hits(item: PendingRequest) -> list[int]:
            # a named context cache's pinned blocks count as a hit in the one group holding them, so the
            # balancer prefers that group; when it is much busier the request goes elsewhere and computes
            # the prefix there (a miss: the same output, no reuse)
            return [len(s.match_cached_blocks(item.key)) * s.block_size for s in self.schedulers]

        placed = place_batch(items, self.config.cache_config.block_size, loads, prefix_hits)
        if not placed:
            return
        taken = set()
        for item, group in placed:
            request = item.key
            self.schedulers[group].add_request(request)
            self.owner[request.req_id] = group
            self._pending_keys.pop(request.req_id, None)
            taken.add(request.req_id)
        self.pending = [r for r in self.pending if r.req_id not in taken]

    # ------------------------------------------------------------------ workers
    def _take_result(self, item) -> None:
        """One message from the workers: a frame that is not one is dropped; a failure to handle
        a real one is the engine's fault (its state may be half updated): the engine fails, the
        master lives on to say so."""
        if item is None:
            return
        if not isinstance(item, _RESULT_TYPES):
            drop_frame(_RESULTS, f"a {type(item).__name__} is not an worker's message")
            return
        if isinstance(item, ModelRunnerOutput) and not self._expected_output(item):
            return
        try:
            self._on_result(item)
        except Exception as exc:  # noqa: BLE001 - reported through the engine's health, not a dead master
            logger.exception("handling a %s failed", type(item).__name__)
            self._fail(f"the master failed on an worker's {type(item).__name__}: {exc}")

    def _expected_output(self, item: ModelRunnerOutput) -> bool:
        """Whether a step output names a DP group with a step in flight (else it is dropped)."""
        if not 0 <= item.dp_rank < self.dp_size or (self.dead_error is None and not self.in_flight[item.dp_rank]):
            drop_frame(_RESULTS, f"step output of DP group {item.dp_rank} with no step in flight")
            return False
        return True

    def _on_result(self, item) -> None:
        if isinstance(item, WorkerFailure):
            self._on_rank_failure(self.workers.explain(item), self.workers.dead_ranks())
        elif isinstance(item, WorkerPong):
            self.health.on_pong(item.rank, item.seq, time.monotonic())
        elif self.dead_error is None:
            self._RESULT_HANDLERS[type(item)](self, item)

    def _on_worker_event(self, event: WorkerEvent) -> None:
        """A rank finished an expert-placement phase (or failed it), its weight server is ready, or it rolled a
        step back after a transient error."""
        if event.kind == WorkerEventKind.ROLLED_BACK:
            # every rank rolls the same step back and reports it: the TE's count is the most any rank reported
            count = self._rollbacks_of_rank[event.rank] = self._rollbacks_of_rank.get(event.rank, 0) + 1
            if count > self.num_rollbacks:
                self.num_rollbacks = count
                logger.warning("a step was rolled back and run again (rank %d: %s)", event.rank, event.detail)
            return
        if event.kind == WorkerEventKind.WEIGHTS_SERVED:
            self._weight_servers[event.rank] = event.detail
            if len(self._weight_servers) == self.workers.world_size:  # new TEs may fork from this one now
                self.weights_addrs = [self._weight_servers[rank] for rank in range(self.workers.world_size)]
            return
        self.eplb.on_event(event.rank, event.kind, event.detail)

    def _on_step_output(self, item: ModelRunnerOutput) -> None:
        if item.expert_load is not None:
            self.eplb.on_counts(item.expert_load)
        group = item.dp_rank
        sched = self.in_flight[group].popleft()
        if item.step_id != sched.step_id:
            self._fail(f"DP group {group} returned step {item.step_id}, expected {sched.step_id}")
            return
        self._observe_speculation(sched, item)
        deltas = self.schedulers[group].update_from_output(sched, item)
        if self.dp_size > 1:
            for delta in deltas:
                if delta.finish_reason is not None or delta.kv_transfer_params is not None:
                    self.owner.pop(delta.req_id, None)
        self._send_deltas(deltas)
        self._publish_kv_events(group)

    def _on_kv_connector_report(self, report: KVConnectorReport) -> None:
        """A rank's KV connectors finished background work (pool fetches, KV pulls)."""
        if not 0 <= report.dp_rank < self.dp_size:
            drop_frame(_RESULTS, f"KV connector report of DP group {report.dp_rank}")
            return
        self.schedulers[report.dp_rank].update_connector_output(report)

    _RESULT_HANDLERS = {ModelRunnerOutput: _on_step_output, WorkerEvent: _on_worker_event,
                        KVConnectorReport: _on_kv_connector_report}

    def _heartbeat(self) -> EngineHeartbeat:
        strategy = self.config.parallel_config.strategy
        return EngineHeartbeat(name=self.config.te_name, role=EngineRole(self.role), group=self.group,
                               input_addr=self.link.listen_addr, kv_events_addr=self.kv_events_addr,
                               model=self.config.model_config.served_model_name or self.config.model_config.model,
                               max_model_len=self.max_model_len, block_size=self.config.cache_config.block_size,
                               attn_tp=strategy.attn_tp, attn_dp=strategy.attn_dp, stats=self._stats(),
                               kv_event_seq=self._kv_event_seq, timestamp=time.time(),
                               draining=self.draining_since is not None, pid=os.getpid(), startup=self.startup,
                               weights_addrs=self.weights_addrs)

    def _publish_kv_events(self, group: int) -> None:
        events = self.kv_managers[group].drain_events()
        if not events or self.kv_events is None:
            return
        self._kv_event_seq += 1
        batch = KVCacheEvents(seq=self._kv_event_seq, timestamp=time.time(), dp_rank=group,
                                  engine=self.config.te_name, events=events)
        self.kv_events.send(codec.encode(batch))

    def _fail(self, error: str) -> None:
        if self.dead_error is not None:
            return
        logger.error("engine failed: %s", error)
        self.dead_error = error
        for queue in self.in_flight:
            queue.clear()
        # the error first: clients fail everything at once; the per-request deltas then only confirm it
        self.link.broadcast(EngineError(message=error, fatal=True, engine=self.config.te_name))
        deltas = [RequestDelta(req_id=r.req_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error,
                                   num_prompt_tokens=r.num_prompt_tokens) for r in self.pending]
        self.pending = []
        self._pending_keys.clear()
        self.owner.clear()
        for scheduler in self.schedulers:
            deltas.extend(scheduler.fail_all(error))
        self._send_deltas(deltas)
        # a dead engine serves nothing: its process ends, and its owner (the engine client, the cluster
        # manager) starts a new one while the clients move the requests on
        self.running = False

    def _steps_in_flight(self) -> int:
        return max(len(queue) for queue in self.in_flight)

    def _may_schedule(self) -> bool:
        """Room in the pipeline. A verification in flight does not hold the next step back: the scheduler books
        it as if no draft were accepted and leaves the worker slots for all of them (see scheduler.py)."""
        return self._steps_in_flight() < self.pipeline_depth

    def _has_work(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    def _schedule(self) -> None:
        if self.dp_size > 1 and self.dead_error is None:
            self._place_pending()
        while self.dead_error is None and self._may_schedule() and self._has_work():
            self._decide_speculation()
            scheds = [s.schedule() for s in self.schedulers]
            if all(sched.is_empty for sched in scheds):
                break
            # blocks freed while scheduling are stored before this step's forward can overwrite them
            eplb = self.eplb.step_control(time.time())
            if faults.fire(faults.FaultKind.KILL_MASTER):
                os.kill(os.getpid(), signal.SIGKILL)
            self.workers.send(StepBatch(per_dp=scheds, eplb=eplb.eplb, report_load=eplb.report_load,
                                              kv_connector=self._connector_metadata()))
            for queue, sched in zip(self.in_flight, scheds):
                queue.append(sched)
        metadata = self._connector_metadata() if self.dead_error is None else {}
        if self.dead_error is None and (self.eplb.has_pending_control or metadata):
            # no step carried it: send the control on its own (ranks apply it without a forward)
            eplb = self.eplb.idle_control()
            self.workers.send(StepBatch(per_dp=[], eplb=eplb.eplb, kv_connector=metadata))

    def _decide_speculation(self) -> None:
        """Whether this step drafts (spec_controller.py). One decision for all DP groups: the MTP layers'
        MoE collectives run in lockstep."""
        if not self.spec_config.enabled:
            return
        speculating, catch_up = self.spec_controller.decide(max(s.num_running for s in self.schedulers))
        for scheduler in self.schedulers:
            scheduler.speculating, scheduler.mtp_catch_up = speculating, catch_up

    def _observe_speculation(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Feed a decode-only step's throughput to the controller (prefill work would blur it)."""
        if not self.spec_config.enabled or sched.new_reqs or not sched.num_scheduled_tokens:
            return
        if sched.total_num_scheduled_tokens > len(sched.num_scheduled_tokens) * (1 + self.spec_config.num_draft_tokens):
            return
        self.spec_controller.observe(len(sched.num_scheduled_tokens), sched.num_draft_tokens > 0, bool(out.num_drafts),
                                     sum(len(tokens) for tokens in out.sampled.values()), out.execute_seconds)

    def _connector_metadata(self) -> dict[int, KVConnectorMetadata]:
        """Each DP group's KV connector work not yet sent (loads, stores)."""
        metadata = {group: s.build_connector_meta() for group, s in enumerate(self.schedulers)}
        return {group: meta for group, meta in metadata.items() if meta is not None}

    def _stats(self) -> EngineStats:
        parts = [s.stats() for s in self.schedulers]
        return EngineStats.merge(
            parts,
            num_waiting=sum(p.num_waiting for p in parts) + len(self.pending),
            waiting_tokens=sum(p.waiting_tokens for p in parts) + sum(r.num_tokens for r in self.pending),
            dropped_frames=dropped_frames(),
            num_rollbacks=self.num_rollbacks,
            num_recoveries=self.recovery.total,
            num_migrated=self.recovery.migrated,
            world_size=self.workers.world_size,
            recovering=self.recovery.in_progress,
            last_failure=self.recovery.last_failure,
            last_failure_silent_s=self.recovery.last_failure_silent_s,
            healthy=self.dead_error is None,
            error=self.dead_error,
        )

    # ------------------------------------------------------------------ loop
    def warm_up(self) -> None:
        """Run one dummy request through every step of serving (first-call costs: kernel set-up, allocator,
        lazy imports), so the first real request is as fast as the next; nothing is sent anywhere."""
        t0 = time.monotonic()
        self._admit(Request(req_id=_WARMUP_ID, prompt_token_ids=[0, 1, 2, 3],
                            sampling_params=SamplingParams(temperature=0.0, max_tokens=2), arrival_time=time.time()))
        while self.dead_error is None and (self._has_work() or self.pending or self._steps_in_flight()):
            if time.monotonic() - t0 > _WARMUP_TIMEOUT_S:
                raise RuntimeError(f"the warm-up request did not finish in {_WARMUP_TIMEOUT_S:.0f} s")
            self._schedule()
            if self.workers.results.poll(50):
                while self.workers.results.poll(0):
                    self._take_result(recv_message(self.workers.results, _RESULTS))
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
            self.startup.ready = time.time()
            self.link.tick(self.startup.ready, self._heartbeat)  # register now, not after the first idle poll
            while self.running:
                if results is not self.workers.results:  # the ranks were recovered: a new results socket
                    poller.unregister(results)
                    results = self.workers.results
                    poller.register(results, zmq.POLLIN)
                self._schedule()
                stalled = not self._steps_in_flight() and (self._has_work() or bool(self.pending))
                # a connector's lookup answers on another thread, not on these sockets: look again soon
                timeout_ms = 2 if self.kv_connectors.busy else 50 if stalled else _IDLE_POLL_MS
                events = dict(poller.poll(timeout_ms))
                if results in events:
                    while self.workers.results.poll(0):
                        self._take_result(recv_message(self.workers.results, _RESULTS))
                if self.inbox in events:
                    while self.inbox.poll(0):
                        item = recv_message(self.inbox, _INBOX, MAX_INBOX_BYTES, self._answer_refused)
                        if item is not None:
                            self._on_client(item)
                self._check_peers()
                if self._drained():
                    logger.info("drained: leaving")
                    self.running = False
                now = time.time()
                self.eplb.tick(now)
                self.link.tick(now, self._heartbeat)
                self.kv_connectors.expire()
                for scheduler in self.schedulers:
                    for cache_id in scheduler.expire_context_caches():
                        logger.info("context cache %s expired; its blocks are unpinned", cache_id)
        finally:
            logger.info("shutting down")
            self.link.say_goodbye(self._heartbeat())
            self.workers.shutdown(grace_s=10.0 if self.dead_error is None else _DEAD_GRACE_S)
            self.link.close()
            if self.kv_events is not None:
                self.kv_events.close(0)
            self.kv_connectors.close()
            self.ctx.term()

    def _check_peers(self) -> None:
        if self.watch_parent and os.getppid() != self.parent:
            logger.warning("client is gone; shutting down")
            self.running = False
            return
        failure = self.workers.failure()
        if failure is not None and self.dead_error is None:
            self._on_rank_failure(failure, self.workers.dead_ranks())
            return
        self._check_rank_health()

    # ------------------------------------------------------------------ fault tolerance (xdeepserve §6)
    def _check_rank_health(self) -> None:
        """Ping the ranks (they answer between steps); recover them when one stays silent too long."""
        if self.dead_error is not None:
            return
        now = time.monotonic()
        seq = self.health.ping_due(now)
        if seq is not None:
            self.workers.send(WorkerPing(seq=seq))
        hung = self.health.hung(now)
        if hung:
            silent = max(self.health.silent_for(now))
            self.recovery.note_failure("hung", silent)
            self._on_rank_failure(f"rank(s) {hung} hung: no answer to health pings for {silent:.1f} s "
                                  f"(hang timeout {self.health.hang_timeout_s:g} s)", [], hung=True)
            return
        shrunk = self.recovery.shrunk_since
        if shrunk is not None and now - shrunk >= self.base_config.parallel_config.regrow_after_s:
            self._recover(f"growing back to {self.base_config.parallel_config.world_size} ranks", removed=[])

    def _on_rank_failure(self, error: str, dead_ranks: list[int], hung: bool = False) -> None:
        """A rank died, hung or gave up on a step: recover the ranks (the policy `on_rank_failure` says how),
        or fail the engine when the policy says so or too many recoveries came too fast."""
        if self.dead_error is not None or self.recovery.in_progress is not None:
            return
        policy = self.base_config.parallel_config.on_rank_failure
        if policy == "fail":
            self._fail(error)
            return
        if not self.recovery.allow(time.monotonic()):
            self._fail(f"{error} (and {self.recovery.max_recoveries} recoveries within "
                       f"{RECOVERY_WINDOW_S:.0f} s before it: giving up)")
            return
        removed: list[int] = []
        if policy == "shrink" and not hung and not dead_ranks:  # a survivor's report may come before the death
            deadline = time.monotonic() + _DEAD_GRACE_S
            while not dead_ranks and time.monotonic() < deadline:
                time.sleep(0.05)
                dead_ranks = self.workers.dead_ranks()
        if policy == "shrink" and not hung and dead_ranks:
            removed = dead_ranks  # ranks of the layout served now (it may be shrunk already)
        self._recover(error, removed)

    def _recover(self, reason: str, removed: list[int]) -> None:
        """Restart the ranks (on the layout left without `removed`, or the full one) and let every request
        continue from its tokens so far: nothing accepted is lost, a greedy request produces the same text."""
        now = time.monotonic()
        self.recovery.record(now)
        self.recovery.in_progress = reason
        self.recovery.note_failure(reason, self.recovery.last_failure_silent_s if "hung" in reason else 0.0)
        # faults armed from the environment fire in the ranks started with it, not again in their successors
        os.environ.pop(faults.ENV, None)
        requests = self._unfinished_requests()
        logger.warning("recovering the ranks (%s); %d request(s) continue from their tokens so far", reason,
                       len(requests))
        self.workers.shutdown(grace_s=_DEAD_GRACE_S)  # survivors may be stuck in a collective with the dead one
        config = self.base_config
        if removed:  # go on without them now; grow back to the full layout after regrow_after_s
            try:
                config = self._shrunk_config(removed)
            except ValueError as exc:
                logger.warning("cannot go on without rank(s) %s (%s): restarting all ranks", removed, exc)
                removed = []
        try:
            ready = self._start_workers(config, on_wait=self._heartbeat_while_recovering)
        except Exception as exc:  # noqa: BLE001 - the engine fails; its owner restarts it, clients move on
            self.recovery.in_progress = None
            self._fail(f"{reason}; restarting the ranks failed: {exc}")
            for item in self._deferred:
                if isinstance(item, AddRequest):
                    self._reject(item, RuntimeError(f"engine is dead: {self.dead_error}"))
            self._deferred = []
            return
        old_dp_size = self.dp_size
        self._build_state(config, ready)
        self._publish_cleared(max(old_dp_size, self.dp_size))
        shrunk = config.parallel_config.world_size < self.base_config.parallel_config.world_size
        self.recovery.shrunk_since = time.monotonic() if shrunk else None
        for request in requests:
            self._continue(request)
        self.recovery.in_progress = None
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            self._on_client(item)
        logger.warning("recovered in %.1f s on %d rank(s): %d request(s) continue", time.monotonic() - now,
                       len(ready), len(requests))

    def _publish_cleared(self, num_groups: int) -> None:
        """The new ranks' KV caches start empty: routers forget what this TE had cached."""
        if self.kv_events is None:
            return
        for group in range(num_groups):
            self._kv_event_seq += 1
            self.kv_events.send(codec.encode(KVCacheEvents(
                seq=self._kv_event_seq, timestamp=time.time(), dp_rank=group, engine=self.config.te_name,
                events=[AllBlocksCleared()])))

    def _heartbeat_while_recovering(self) -> None:
        """While the new ranks start: heartbeats go on (saying `recovering`) and stats queries are answered; every
        other message waits for the new ranks."""
        self.link.tick(time.time(), self._heartbeat)
        while self.inbox.poll(0):
            item = recv_message(self.inbox, _INBOX, MAX_INBOX_BYTES, self._answer_refused)
            if isinstance(item, StatsQuery):
                self._on_client(item)
            elif item is not None:
                self._deferred.append(item)

    def _shrunk_config(self, removed: list[int]) -> EngineConfig:
        """The layout on the ranks left: fewer DP groups and EP ranks, every expert kept on them, the placement
        planned from the one served now and its recorded load (`shrink_layout`); ValueError when it cannot."""
        from meshserve.core.shrink_layout import shrink_layout

        placement = self.eplb.placement
        record = self.eplb.record() if placement is not None else None
        return shrink_layout(self.config, placement, record, removed).config

    def _unfinished_requests(self) -> list[Request]:
        requests = [r for s in self.schedulers for r in s.unfinished_requests()] + list(self.pending)
        return sorted((r for r in requests if r.req_id != _WARMUP_ID), key=lambda r: r.arrival_time)

    def _continue(self, old: Request) -> None:
        """Admit a request again after a recovery, with the tokens it produced (token recomputation)."""
        request = Request(req_id=old.req_id, prompt_token_ids=old.prompt_token_ids,
                          sampling_params=old.sampling_params, arrival_time=old.arrival_time,
                          priority=old.priority, eos_token_ids=old.eos_token_ids)
        for token in old.output_token_ids:
            request.append_output_token(token)
        if old.kv_transfer is not None and old.kv_transfer.role is KVTransferRole.PRODUCER:
            request.kv_transfer = old.kv_transfer  # computes the prompt again and hands it off again
        # a decode request whose KV pull was under way computes its prompt here instead
        self.recovery.migrated += 1
        try:
            self._admit(request)
        except (QueueFullError, RequestTooLongError, ValueError) as exc:
            self._send_deltas([RequestDelta(req_id=old.req_id, new_token_ids=[],
                                                finish_reason=FinishReason.ERROR,
                                                error=f"could not continue after a recovery: {exc}",
                                                num_prompt_tokens=old.num_prompt_tokens)])


def run_master(config: dict, input_addr: str, output_addr: str, ipc_dir: str,
               log_level: int = logging.INFO) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s master %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the parent stops us in order instead
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig.from_dict(config)
    ctx = zmq.Context()
    try:
        core = EngineCore(config, ctx, ClientLink(ctx, input_addr, output_addr), ipc_dir, log_level)
    except Exception as exc:
        logger.error("start-up failed: %s", traceback.format_exc())
        ctx = zmq.Context.instance()
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 2000)
        cluster_auth.client(out, output_addr)
        out.connect(output_addr)
        out.send(codec.encode(EngineError(message=f"engine start-up failed: {exc}", fatal=True)))
        out.close()
        raise SystemExit(1) from exc
    core.run()
    if core.dead_error is not None:  # the engine client starts a new engine
        raise SystemExit(1)
