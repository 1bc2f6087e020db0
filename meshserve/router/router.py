"""The job executor (JE): turns each request into tasks on the deployment's TEs (deepserve §3, §5).

It lives in the frontend process and offers the API server the same interface as a single engine
(`AsyncEngineClient`). Each request (each of its `n` choices) becomes a job; the router picks either
one colocated TE or a prefill TE and a decode TE. Disaggregated jobs follow xdeepserve §5.1: the
prefill TE computes the prompt and the first token and holds the KV blocks; the JE then sends the job
to the decode TE with the blocks' addresses; the decode TE pulls them when it has room and decodes.
Every TE sends a job's tokens straight to this frontend's output socket (output short-circuiting):
the JE only forwards a handed-off job once, it never relays tokens.

Failures: a TE that stops heartbeating, says it is leaving, or reports a fatal error is dropped; its
jobs that have not produced a token yet are routed again, and decode jobs move to another decode TE
with the tokens so far (that TE pulls the prompt's KV if the prefill TE still holds it, else computes
it). A colocated job that was already streaming fails with a clear error.

A reader thread receives everything (outputs, heartbeats, KV events) and hands it to the event loop;
all job state lives on the loop's thread. Every socket is authenticated (CurveZMQ with the cluster
secret), and a frame that does not decode, or a message whose handling fails, is logged, counted and
dropped: nothing a peer sends stops the reader. The JE is healthy only while its reader runs and a
request of some kind can be routed (`health()` says which kinds can, and what the others miss).

Scaling (the cluster manager): with `hold_s` > 0 a job no TE can take is held, not refused, until a TE that
can take it registers (its pool was scaled to zero and comes back), then dispatched in arrival order; after
`hold_s` it fails as an unroutable one does (503). Such a JE with `manager_addrs` stays healthy with no TE: the
manager scales from zero when it reports held jobs. Every `_REPORT_INTERVAL_S` the JE reports to each manager
who it is, its routable TEs and per pool ("GROUP/ROLE") its demand since the last report: jobs held and routed,
TTFT from the job's arrival here (the prefill or colocated pool's) and TPOT (the decode or colocated pool's).
A TE that says it is draining (a scale-down) gets nothing new but finishes the jobs it has.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import msgspec
import zmq

from meshserve.engine.client_core import ClientCore, ReplyCallback, admission_error
from meshserve.engine.detokenizer import load_tokenizer
from meshserve.engine.outputs import RequestOutput
from meshserve.models.generation_config import eos_token_ids
from meshserve.router.engine_registry import EngineRecord, EngineRegistry
from meshserve.router.prompt_tree import GlobalPromptTree
from meshserve.router.routing import (
    ANY_POOL,
    REQUEST_ROUTING_POLICY,
    LoadTracker,
    NoRouteError,
    RouteDecision,
    RouteHealth,
    RoutingPolicy,
    pool_key,
    route_health,
)
from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.client import (
    AbortRequests,
    AddRequest,
    AdminOp,
    AdminReply,
    AdminRequest,
    ContextCacheDeleted,
    EngineError,
    EngineOutputs,
    EngineStats,
    KVSnapshot,
    ReleaseKV,
    RequestDelta,
)
from meshserve.wire.cluster import GroupDemand, JobExecutorReport
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.heartbeat import EngineHeartbeat
from meshserve.wire.kv import KVCacheEvents, KVTransferParams, KVTransferRole
from meshserve.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_TICK_S = 0.2  # liveness and KV-sync checks
_MAX_REGISTRATION_BYTES = 1 << 20  # a heartbeat is a few hundred bytes; a peer sending more is cut off
_REPORT_INTERVAL_S = 0.5  # JobExecutorReport to the cluster managers
_MAX_SAMPLES = 256  # TTFT / TPOT samples per pool and report (a report stays a few kB)


class RouteUnavailableError(EngineDeadError):
    """No TE (or P/D pair) can take the request now (HTTP 503)."""


def _configured_max_model_len(model: str) -> int:
    """The model's context length from its config.json (0 when unknown): what a JE that has not seen a TE yet
    admits requests by, while it holds them for a TE the manager starts."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


@dataclass
class _Job:
    """One engine-level request (one choice of a caller request) and where it runs now."""

    child_id: str
    parent_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    priority: int
    arrival_time: float
    policy: str | None
    attempt: int = 0
    engine_id: str = ""  # the id the TEs know this attempt by
    stage: str = "colocated"  # colocated | prefill | decode
    te: str = ""  # the TE running the current stage
    decode_te: str = ""  # a disaggregated job's chosen decode TE
    group: str = ""  # ... and its TE group (a replacement decode TE must serve the same model)
    kv_params: KVTransferParams | None = None  # the prefill TE's hand-off, kept for a decode TE that fails
    token_ids: list[int] = field(default_factory=list)  # tokens received so far
    context_cache_id: str | None = None  # a named context cache leading the prompt
    context_cache_ttl_s: float | None = None  # set: this job creates that cache
    held_since: float | None = None  # time.monotonic() when it started waiting for a TE; None: not held
    hold_limit_s: float = 0.0  # ... and how long it may wait
    first_token_time: float = 0.0  # time.time() of its first token


@dataclass
class _PoolDemand:
    """What one pool saw of this JE's jobs since the last report."""

    arrivals: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    def sample(self, samples: list[float], value: float) -> None:
        if len(samples) < _MAX_SAMPLES:
            samples.append(value)


class Router:
    def __init__(self, model: str, served_model_name: str | None = None, host: str = "127.0.0.1",
                 register_port: int = 0, policy: str = "round_robin", heatmap=None, predictor=None,
                 heartbeat_timeout_s: float = 5.0, max_attempts: int = 3, manager_addrs: Sequence[str] = (),
                 hold_s: float = 0.0, name: str = "", http_addr: str = "", migrate_deadline_s: float = 60.0) -> None:
        """`manager_addrs`: cluster managers to report to; `hold_s`: how long a job may wait for a TE that can
        take it (0: refused at once); `name`, `http_addr`: who this JE is in its reports; `migrate_deadline_s`:
        how long a job whose TE failed may wait for another (or the restarted one) before it fails."""
        self.model_name = served_model_name or os.path.basename(os.path.normpath(model))
        self.tokenizer = load_tokenizer(model)
        self.eos_token_ids = eos_token_ids(model)
        self.core = ClientCore(self.tokenizer, self._send_aborts)  # touched on the loop's thread only
        self.loads = LoadTracker()
        self.tree: GlobalPromptTree | None = None  # built at the first TE's registration (its block size)
        self._heatmap, self._predictor = heatmap, predictor
        self.routing = RoutingPolicy(policy)
        self.max_attempts = max_attempts
        self.ctx = zmq.Context()
        self.outputs = cluster_auth.server(self.ctx.socket(zmq.PULL))  # every TE's outputs for jobs from here
        self.outputs.setsockopt(zmq.RCVHWM, 0)
        out_port = self.outputs.bind_to_random_port(f"tcp://{host}")
        self.output_addr = f"tcp://{host}:{out_port}"
        self.registrations = cluster_auth.server(self.ctx.socket(zmq.PULL))  # TEs' heartbeats
        self.registrations.setsockopt(zmq.MAXMSGSIZE, _MAX_REGISTRATION_BYTES)
        if register_port:
            self.registrations.bind(f"tcp://{host}:{register_port}")
            self.register_addr = f"tcp://{host}:{register_port}"
        else:
            self.register_addr = f"tcp://{host}:{self.registrations.bind_to_random_port(f'tcp://{host}')}"
        self.registry = EngineRegistry(self.ctx, None, self.loads, timeout_s=heartbeat_timeout_s)
        self._jobs: dict[str, _Job] = {}  # engine id -> job
        # named context caches: id -> (the TE whose KV cache pins its blocks, expiry on time.monotonic)
        self._cache_homes: dict[str, tuple[str, float]] = {}
        self._job_of_child: dict[str, _Job] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()
        self._reader_error: str | None = None  # why the reader thread ended, when it ended on its own
        self._last_tick = 0.0
        self.bad_frames = 0  # frames dropped: undecodable, or their handling failed
        self.hold_s = hold_s
        self.migrate_deadline_s = migrate_deadline_s
        self.migrated = 0  # jobs moved off a failed TE
        self._held: deque[_Job] = deque()  # jobs waiting for a TE, oldest first (some may be aborted since)
        self.name = name or f"je-{os.getpid()}-{self.register_addr.rpartition(':')[2]}"
        self.http_addr = http_addr
        self._demand: dict[str, _PoolDemand] = {}  # pool key -> since the last report
        self._last_report = 0.0
        self._config_max_model_len = _configured_max_model_len(model) if hold_s > 0 else 0
        self._managers = []  # PUSH, one per manager; used on the loop's thread only
        for addr in manager_addrs:
            sock = cluster_auth.client(self.ctx.socket(zmq.PUSH), addr)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)  # a manager that is away misses reports; the next one says it all
            sock.connect(addr)
            self._managers.append(sock)

    # ------------------------------------------------------------------ lifecycle
    def _ensure_started(self) -> None:
        """Deliver messages to the running event loop (a JE used from a new loop moves its reader there)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._reader is not None:
            self._stop.set()
            self._reader.join(5)
            self._stop = threading.Event()
        self._loop = loop
        self._reader = threading.Thread(target=self._read_forever, args=(self._stop,), name="meshserve-je-reader",
                                        daemon=True)
        self._reader.start()

    async def start(self) -> None:
        self._ensure_started()

    async def wait_for_tes(self, roles: dict[str, int], timeout_s: float) -> None:
        """Wait until at least `roles[role]` TEs of each role are registered; TimeoutError names the missing."""
        self._ensure_started()
        deadline = time.monotonic() + timeout_s
        while True:
            have = {role: sum(1 for r in self.registry.live() if r.role == role) for role in roles}
            missing = {role: n - have[role] for role, n in roles.items() if have[role] < n}
            if not missing:
                return
            if time.monotonic() > deadline:
                wanted = ", ".join(f"{n} {role}" for role, n in missing.items())
                raise TimeoutError(f"TEs not registered after {timeout_s:.0f} s: missing {wanted}")
            await asyncio.sleep(0.1)

    def wait_for_tes_blocking(self, roles: dict[str, int], timeout_s: float, alive=None) -> None:
        """Before serving: take heartbeats until at least `roles[role]` TEs of each role are registered.
        `alive()` (optional) raises when a TE being started has died. TimeoutError names what is missing."""
        if self._loop is not None:
            raise RuntimeError("wait_for_tes_blocking is for start-up, before the event loop uses the JE")
        deadline = time.monotonic() + timeout_s
        next_log = time.monotonic() + 10
        while True:
            have = {role: sum(1 for r in self.registry.live() if r.role == role) for role in roles}
            missing = {role: n - have[role] for role, n in roles.items() if have[role] < n}
            if not missing:
                return
            now = time.monotonic()
            if now > deadline:
                wanted = ", ".join(f"{n} {role}" for role, n in missing.items())
                raise TimeoutError(f"TEs not registered after {timeout_s:.0f} s: missing {wanted}")
            if now > next_log:
                next_log = now + 10
                logger.info("waiting for TEs: %s", ", ".join(f"{n} {role}" for role, n in missing.items()))
            if alive is not None:
                alive()
            if self.registrations.poll(100):
                while self.registrations.poll(0):
                    item = self._decode(self.registrations.recv(), "registration")
                    if isinstance(item, EngineHeartbeat):
                        self._guarded(self._on_heartbeat, item, time.monotonic())

    def shutdown(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(5)
        self.registry.close()
        for sock in self._managers:
            sock.close(0)
        self.outputs.close(0)
        self.registrations.close(0)
        self.ctx.term()

    def _read_forever(self, stop: threading.Event) -> None:
        try:
            self._read_until(stop)
        except BaseException as exc:  # noqa: BLE001 - recorded: health must say the reader is gone
            self._reader_error = f"{type(exc).__name__}: {exc}"
            logger.exception("job executor reader stopped; /health answers 503 from now on")

    def _read_until(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        for sock in (self.outputs, self.registrations, self.registry.kv_events):
            poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            try:
                self.registry.apply_subscription_changes()
                ready = dict(poller.poll(int(_TICK_S * 1000)))
            except zmq.ContextTerminated:
                return
            items = []
            for sock, source in ((self.registrations, "registration"), (self.outputs, "output"),
                                 (self.registry.kv_events, "KV event")):
                if sock in ready:
                    while sock.poll(0):
                        item = self._decode(sock.recv(), source)
                        if item is not None:
                            items.append(item)
            if not self._post(self._on_items, items):
                return

    def _decode(self, frame: bytes, source: str):
        """A message, or None for a frame that is not one (logged and counted, never fatal)."""
        try:
            return codec.decode(frame)
        except Exception as exc:  # noqa: BLE001 - whatever a peer sends, the reader goes on
            self._count_bad_frame(f"dropped a {len(frame)}-byte {source} frame that does not decode: {exc}")
            return None

    def _count_bad_frame(self, why: str, exc_info: bool = False) -> None:
        self.bad_frames += 1
        if self.bad_frames in (1, 10, 100) or self.bad_frames % 1000 == 0:  # a flood gets a few lines
            logger.warning("%s (%d bad frame(s) so far)", why, self.bad_frames, exc_info=exc_info)

    def _guarded(self, handler, *args) -> None:
        try:
            handler(*args)
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop the others
            what = type(args[0]).__name__ if args else handler.__name__
            self._count_bad_frame(f"dropped a {what} whose handling failed: {type(exc).__name__}: {exc}",
                                  exc_info=True)

    def _post(self, handler, item) -> bool:
        try:
            self._loop.call_soon_threadsafe(handler, item)
        except RuntimeError:  # the loop closed
            return False
        return True

    # ------------------------------------------------------------------ on the loop thread
    def _on_items(self, items: list) -> None:
        now = time.monotonic()
        for item in items:
            self._guarded(self._on_item, item, now)
        if now - self._last_tick >= _TICK_S:
            self._last_tick = now
            self._guarded(self._tick, now)

    def _on_item(self, item, now: float) -> None:
        handler = self._ITEM_HANDLERS.get(type(item))
        if handler is not None:  # EngineStats: stats come with heartbeats
            handler(self, item, now)

    def _on_outputs(self, item: EngineOutputs, now: float) -> None:
        for delta in item.deltas:
            self._guarded(self._on_delta, delta)

    def _on_kv_events(self, item: KVCacheEvents, now: float) -> None:
        if not self.registry.on_kv_events(item.engine, item):
            self._request_snapshot(self.registry.get(item.engine))

    def _on_admin_reply(self, item: AdminReply, now: float) -> None:
        self.core.replies.on_reply(item)

    def _on_engine_error(self, item: EngineError, now: float) -> None:
        record = self.registry.get(item.engine)
        if record is not None:
            self._drop_te(record, f"it failed: {item.message}")

    def _tick(self, now: float) -> None:
        """Drop the TEs whose heartbeats stopped; ask for the KV snapshots the prompt tree lacks; dispatch or
        fail held jobs; report to the cluster managers."""
        for record in self.registry.expired(now):
            self._drop_te(record, f"no heartbeat for {self.registry.timeout_s:.0f} s")
        for record in self.registry.live():
            if self.registry.needs_snapshot(record, now):
                self._request_snapshot(record)
        if self._held:
            self._serve_held(now)
        if self._managers and now - self._last_report >= _REPORT_INTERVAL_S:
            self._last_report = now
            self._send_report(now)

    def _on_heartbeat(self, hb: EngineHeartbeat, now: float) -> None:
        if self.tree is None and not hb.leaving:
            self.tree = GlobalPromptTree(hb.block_size)
            self.registry.tree = self.tree
            self.routing = RoutingPolicy(self.routing.policy, tree=self.tree, heatmap=self._heatmap,
                                         predictor=self._predictor)
        if hb.leaving or not hb.stats.healthy:  # a failed TE that still heartbeats is not taken back
            record = self.registry.get(hb.name)
            if record is not None:
                self._drop_te(record, "it is shutting down" if hb.leaving else
                              f"it reports a failure: {hb.stats.error or 'unhealthy'}")
            return
        known = self.registry.get(hb.name)
        if known is not None and known.heartbeat.input_addr != hb.input_addr:
            self._drop_te(known, "it restarted")  # same name, new process: its jobs move (or wait for it)
            known = None
        was_recovering = known is not None and known.heartbeat.stats.recovering is not None
        record, new = self.registry.on_heartbeat(hb, now)
        if hb.stats.recovering is not None and not was_recovering and not new:
            self._move_off_recovering(record, hb.stats.recovering)
        if new:
            self._request_snapshot(record)
            if self._managers:  # the manager times a scale-up until every JE routes to the new TE: say so now
                self._last_report = now
                self._send_report(now)
        if self._held and not record.draining:
            self._serve_held(now)

    _ITEM_HANDLERS: ClassVar[dict[type, Callable]] = {
        EngineOutputs: _on_outputs, EngineHeartbeat: _on_heartbeat, KVCacheEvents: _on_kv_events,
        AdminReply: _on_admin_reply, EngineError: _on_engine_error}

    def _request_snapshot(self, record: EngineRecord | None) -> None:
        if record is None or self.tree is None or record.snapshot_query is not None:
            return
        query_id = self.core.replies.open(ReplyCallback(functools.partial(self._on_snapshot, record.name)))
        record.snapshot_query = query_id
        self._send(record, AdminRequest(query_id=query_id, op=AdminOp.KV_SNAPSHOT,
                                            reply_to=self.output_addr))

    def _on_snapshot(self, te: str, reply: AdminReply) -> None:
        """A TE's KV snapshot, for the prompt tree (a TE dropped since, or asked again since, is ignored)."""
        record = self.registry.get(te)
        if record is not None and record.snapshot_query == reply.query_id:
            if reply.ok and isinstance(reply.data, KVSnapshot):
                self.registry.load_snapshot(record, reply.data)
            else:
                record.snapshot_query = None

    def _send(self, record: EngineRecord, item) -> None:
        try:
            record.sock.send(codec.encode(item), zmq.NOBLOCK)
        except zmq.ZMQError:
            self._drop_te(record, "its input queue is full or closed")

    # ------------------------------------------------------------------ jobs
    def _dispatch(self, job: _Job, exclude: set[str] = frozenset()) -> None:
        """Route the job's first stage and send it; raises NoRouteError."""
        views = [v for v in self.registry.views() if v.name not in exclude]
        decision = self._cache_home_route(job, views) or self.routing.route(
            job.prompt_token_ids, views, policy=job.policy, max_tokens=job.params.max_tokens)
        job.attempt += 1
        self._jobs.pop(job.engine_id, None)
        job.engine_id = f"{job.child_id}@{job.attempt}"
        self._jobs[job.engine_id] = job
        if decision.kind == "colocated":
            job.stage, job.te, job.decode_te = "colocated", decision.te, ""
            kv_transfer = None
        else:
            job.stage, job.te, job.decode_te = "prefill", decision.prefill, decision.decode
            job.group = self.registry.get(decision.prefill).heartbeat.group
            kv_transfer = KVTransferParams(role=KVTransferRole.PRODUCER)
        if job.attempt == 1:  # an arrival for each pool the job occupies (a retry is not a new one)
            for te in decision.tes:
                self._pool_demand(te).arrivals += 1
        self.loads.on_dispatch(job.te, len(job.prompt_token_ids), job.engine_id)
        self._send(self.registry.get(job.te), AddRequest(
            req_id=job.engine_id, prompt_token_ids=job.prompt_token_ids, sampling_params=job.params,
            arrival_time=job.arrival_time, priority=job.priority, eos_token_ids=self.eos_token_ids,
            reply_to=self.output_addr, kv_transfer=kv_transfer, context_cache_id=job.context_cache_id,
            context_cache_ttl_s=job.context_cache_ttl_s))
        if job.context_cache_ttl_s is not None:  # the TE that computes the prompt pins the cache's blocks
            self._cache_homes[job.context_cache_id] = (job.te, time.monotonic() + job.context_cache_ttl_s)

    def _cache_home_route(self, job: _Job, views: list) -> RouteDecision | None:
        """A job using a named context cache goes to the TE that pinned its blocks while that TE is alive;
        elsewhere it would only compute the prefix again (same output, no reuse)."""
        now = time.monotonic()
        for cache_id in [c for c, (_, expiry) in self._cache_homes.items() if expiry <= now]:
            del self._cache_homes[cache_id]
        if job.context_cache_id is None or job.context_cache_ttl_s is not None:
            return None
        home = self._cache_homes.get(job.context_cache_id)
        if home is None:
            return None
        return self.routing.route_to(home[0], views, f"context cache {job.context_cache_id} is pinned there")

    def _dispatch_decode(self, job: _Job, exclude: set[str] = frozenset(), recompute: bool = False) -> None:
        """Send a handed-off job to its decode TE (another one of its group if that one is gone). With
        `recompute` the decode TE computes the prompt and the tokens so far itself: after a decode TE
        failed, the prefill TE may have released the blocks already."""
        record = self.registry.get(job.decode_te)
        if record is None or job.decode_te in exclude or record.draining:
            candidates = [v for v in self.registry.views() if v.role == "decode" and v.name not in exclude
                          and v.group == job.group]
            if not candidates and (record is None or job.decode_te in exclude):
                raise NoRouteError("no decode TE is left for a job whose prefill is done")
            if candidates:  # else its draining decode TE still takes the job it was chosen for
                job.decode_te = min(candidates, key=lambda v: (v.load.kv_usage, v.load.num_running)).name
                record = self.registry.get(job.decode_te)
        job.stage, job.te = "decode", job.decode_te
        # its KV link from the prefill TE went down since the job was routed: a pull would only fail
        recompute = recompute or self.registry.link_down(job.decode_te, job.kv_params.engine)
        if recompute:
            self._release_prefill_hold(job)
        self.loads.on_dispatch(job.te, 0, job.engine_id)
        self._send(record, AddRequest(
            req_id=job.engine_id, prompt_token_ids=job.prompt_token_ids, sampling_params=job.params,
            arrival_time=job.arrival_time, priority=job.priority, eos_token_ids=self.eos_token_ids,
            reply_to=self.output_addr,
            kv_transfer=msgspec.structs.replace(job.kv_params, recompute=recompute),
            output_token_ids=list(job.token_ids)))

    def _release_prefill_hold(self, job: _Job) -> None:
        """Nobody will pull the job's KV from its prefill TE: have it free the blocks now rather than when
        its hold expires (a repeated release is harmless)."""
        record = self.registry.get(job.kv_params.engine)
        if record is not None:
            self._send(record, ReleaseKV(req_ids=[job.engine_id]))

    def _on_delta(self, delta: RequestDelta) -> None:
        job = self._jobs.get(delta.req_id)
        if job is None:
            return  # an earlier attempt, or a job already finished or aborted
        error = admission_error(delta) if not job.token_ids else None  # a decode TE's refusal is the job's error
        if error is not None:
            self._finish_job(job)
            self.core.fail_request(job.child_id, error)
            return
        if delta.new_token_ids and not job.token_ids:
            job.first_token_time = time.time()
            demand = self._pool_demand(job.te)
            demand.sample(demand.ttft_s, job.first_token_time - job.arrival_time)
        job.token_ids.extend(delta.new_token_ids)
        self.core.apply_delta(msgspec.structs.replace(delta, req_id=job.child_id, kv_transfer_params=None), time.time())
        if delta.finish_reason in ("stop", "length") and len(job.token_ids) > 1 and job.stage != "prefill":
            demand = self._pool_demand(job.te)
            demand.sample(demand.tpot_s, (time.time() - job.first_token_time) / (len(job.token_ids) - 1))
        if delta.finish_reason is not None:
            if delta.finish_reason == "error" and job.stage == "decode":
                self._release_prefill_hold(job)  # the decode TE may have failed it before pulling
            self._finish_job(job)
        elif delta.kv_transfer_params is not None and job.child_id in self._job_of_child:
            self.loads.on_finished(job.te, job.engine_id)
            job.kv_params = delta.kv_transfer_params
            self._on_hand_off(job)

    def _on_hand_off(self, job: _Job) -> None:
        """The prefill TE holds the job's KV and sent its first token: send the job on to its decode TE
        (xdeepserve §5.1 step 4). One method, so a test can hold a hand-off back to break the transfer."""
        try:
            self._dispatch_decode(job)
        except NoRouteError as exc:
            self._fail_job(job, str(exc))

    def _finish_job(self, job: _Job) -> None:
        self._jobs.pop(job.engine_id, None)
        self._job_of_child.pop(job.child_id, None)
        self.loads.on_finished(job.te, job.engine_id)

    def _fail_job(self, job: _Job, error: str) -> None:
        self._on_delta(RequestDelta(req_id=job.engine_id, new_token_ids=[], finish_reason="error",
                                        error=error, num_prompt_tokens=len(job.prompt_token_ids)))

    # ------------------------------------------------------------------ held jobs, demand, reports
    def _hold(self, job: _Job, why: str, limit_s: float | None = None) -> None:
        """Keep a job no TE can take until one can (its pool is scaled from zero, or a dead TE is restarted), at
        most `limit_s` (default hold_s)."""
        if job.held_since is None:
            job.held_since = time.monotonic()
        job.hold_limit_s = self.hold_s if limit_s is None else limit_s
        if not self._held:
            logger.info("holding requests until a TE can take them (at most %g s): %s", job.hold_limit_s, why)
        self._held.append(job)

    def _serve_held(self, now: float) -> None:
        """Dispatch the held jobs a TE can take now, oldest first; fail those held for hold_s."""
        held, self._held = self._held, deque()
        can_route = bool(self.registry.routable())
        for job in held:
            if self._job_of_child.get(job.child_id) is not job:
                continue  # aborted, or failed with its request's other jobs
            try:
                if not can_route:
                    raise NoRouteError("no TE takes requests")
                if job.token_ids:
                    self._dispatch_resume(job)
                else:
                    self._dispatch(job)
            except NoRouteError as exc:
                if now - job.held_since < job.hold_limit_s:
                    self._held.append(job)
                else:
                    self.core.fail_request(job.child_id, RouteUnavailableError(
                        f"no TE could take the request within {job.hold_limit_s:g} s: {exc}"))
                continue
            logger.info("request %s went to TE %s after waiting %.1f s for one", job.child_id, job.te,
                        now - job.held_since)
            job.held_since = None

    def _live_held(self) -> list[_Job]:
        return [j for j in self._held if self._job_of_child.get(j.child_id) is j]

    def _waiting_for_pools(self) -> list[str]:
        """The pools a held job waits for: those of the groups seen that have no TE taking requests now, or
        ANY_POOL when this JE cannot tell (it has never seen a TE)."""
        seen = {pool_key(r.heartbeat.group, r.role) for r in self.registry.tes.values()}
        serving = {pool_key(r.heartbeat.group, r.role) for r in self.registry.routable()}
        return sorted(seen - serving) or [ANY_POOL]

    def _pool_demand(self, te: str) -> _PoolDemand:
        record = self.registry.tes.get(te)  # a TE dropped since still names its pool
        key = pool_key(record.heartbeat.group, record.role) if record is not None else ANY_POOL
        return self._demand.setdefault(key, _PoolDemand())

    def report(self, now: float) -> JobExecutorReport:
        """This JE to the cluster managers: its routable TEs and per pool its demand since the last report."""
        demand, self._demand = self._demand, {}
        held = self._live_held()
        oldest = max((now - j.held_since for j in held), default=0.0)
        waiting_for = self._waiting_for_pools() if held else []
        keys = sorted(set(demand) | set(waiting_for)
                      | {pool_key(r.heartbeat.group, r.role) for r in self.registry.tes.values()})
        groups = []
        for key in keys:
            d = demand.get(key, _PoolDemand())
            waits = key in waiting_for
            groups.append(GroupDemand(group=key, held=len(held) if waits else 0,
                                          held_oldest_s=oldest if waits else 0.0, arrivals=d.arrivals,
                                          ttft_s=d.ttft_s, tpot_s=d.tpot_s))
        return JobExecutorReport(name=self.name, http_addr=self.http_addr, register_addr=self.register_addr,
                                     pid=os.getpid(), te_names=sorted(r.name for r in self.registry.routable()),
                                     groups=groups, timestamp=time.time())

    def _send_report(self, now: float) -> None:
        frame = codec.encode(self.report(now))
        for sock in self._managers:
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the manager is away or behind: the next report says what it needs

    def _drop_te(self, record: EngineRecord, why: str) -> None:
        """Drop a TE and move its jobs (request migration): those without tokens are routed again; those that
        streamed tokens continue on another TE from their prompt plus those tokens (token recomputation; a
        handed-off job on another decode TE of its group, which pulls the prompt's KV when it can); a job no TE
        can take now waits for one (the cluster manager restarts the dead TE) up to `migrate_deadline_s`."""
        self.registry.drop(record, why)
        for job in [j for j in self._jobs.values() if j.te == record.name]:
            self._migrate(job, record.name, why)

    def _move_off_recovering(self, record: EngineRecord, why: str) -> None:
        """A TE restarting its ranks keeps its jobs and continues them when it is back; a job another TE can
        take now moves there instead (sooner), and the recovering TE is told to drop its copy."""
        moved = []
        for job in [j for j in self._jobs.values() if j.te == record.name]:
            old_id, stage = job.engine_id, job.stage
            try:
                if job.token_ids:
                    self._dispatch_resume(job, exclude={record.name})
                else:
                    self._dispatch(job, exclude={record.name})
            except NoRouteError:
                continue  # it stays: the TE continues it after its recovery
            if stage == "decode":
                self._release_prefill_hold(job)
            self.loads.on_finished(record.name, old_id)
            moved.append(old_id)
            self.migrated += 1
        if moved:
            logger.warning("moved %d request(s) off TE %s while it recovers (%s)", len(moved), record.name, why)
            self._send(record, AbortRequests(req_ids=moved))

    def _migrate(self, job: _Job, dead_te: str, why: str) -> None:
        try:
            if job.stage == "decode":
                try:
                    self._dispatch_decode(job, exclude={dead_te}, recompute=True)
                except NoRouteError:
                    self._release_prefill_hold(job)  # nobody will pull the prompt's KV now
                    self._dispatch_resume(job, exclude={dead_te})
            elif job.token_ids:
                self._dispatch_resume(job, exclude={dead_te})
            elif job.attempt < self.max_attempts:
                self._dispatch(job, exclude={dead_te})
            else:
                raise RouteUnavailableError(f"TE {dead_te} failed while serving the request ({why}), "
                                            f"and {job.attempt} TEs have tried it")
        except RouteUnavailableError as exc:
            self._fail_job(job, str(exc))
            return
        except NoRouteError as exc:
            self._finish_job(job)  # off the dead TE; held until another can take it
            self._job_of_child[job.child_id] = job
            job.te = job.decode_te = ""
            job.stage = "colocated"
            self._hold(job, f"TE {dead_te} failed ({why}) and {exc}", self.migrate_deadline_s)
            return
        self.migrated += 1
        logger.warning("request %s moved off TE %s to %s with %d token(s) so far", job.child_id, dead_te, job.te,
                       len(job.token_ids))

    def _dispatch_resume(self, job: _Job, exclude: set[str] = frozenset()) -> None:
        """Continue a job that streamed tokens on a TE that computes its prompt plus those tokens and goes on
        (a colocated TE, or a decode TE, which then computes the prompt itself); raises NoRouteError."""
        candidates = [v for v in self.registry.views() if v.name not in exclude and v.role in ("colocated", "decode")
                      and (not job.group or v.group == job.group or v.role == "colocated")]
        if not candidates:
            raise NoRouteError("no colocated or decode TE can continue the request")
        target = min(candidates, key=lambda v: (v.load.kv_usage, v.load.num_running, v.load.waiting_tokens))
        job.attempt += 1
        self._jobs.pop(job.engine_id, None)
        job.engine_id = f"{job.child_id}@{job.attempt}"
        self._jobs[job.engine_id] = job
        job.stage, job.te, job.decode_te = "colocated", target.name, ""
        self.loads.on_dispatch(job.te, len(job.prompt_token_ids) + len(job.token_ids), job.engine_id)
        self._send(self.registry.get(job.te), AddRequest(
            req_id=job.engine_id, prompt_token_ids=job.prompt_token_ids, sampling_params=job.params,
            arrival_time=job.arrival_time, priority=job.priority, eos_token_ids=self.eos_token_ids,
            reply_to=self.output_addr, output_token_ids=list(job.token_ids)))

    def _send_aborts(self, child_ids: list[str]) -> None:
        for child_id in child_ids:
            job = self._job_of_child.get(child_id)
            if job is None:
                continue
            self._finish_job(job)
            targets = {job.te, job.decode_te} - {""}
            if job.kv_params is not None:  # the prefill TE may still hold the blocks
                targets.add(job.kv_params.engine)
            for name in targets:
                record = self.registry.get(name)
                if record is not None:
                    self._send(record, AbortRequests(req_ids=[job.engine_id]))

    # ------------------------------------------------------------------ API (AsyncEngineClient's interface)
    @property
    def max_model_len(self) -> int:
        """The live TEs' context length; with none live, the last TEs' (or, when holding jobs for TEs not seen
        yet, the model's own), so requests are admitted while their pool scales from zero."""
        lens = [r.heartbeat.max_model_len for r in self.registry.live()]
        if not lens and self.hold_s > 0:
            lens = [r.heartbeat.max_model_len for r in self.registry.tes.values()] or [self._config_max_model_len]
        return min(lens) if lens else 0

    @property
    def scales_from_zero(self) -> bool:
        """A cluster manager starts TEs when this JE reports jobs it holds: having none is not being dead."""
        return bool(self._managers) and self.hold_s > 0

    @property
    def healthy(self) -> bool:
        return self.dead_error is None

    @property
    def dead_error(self) -> str | None:
        """Why no request can be served now: the reader thread died, or no kind of request can be routed."""
        if self._reader_error is not None:
            return f"the job executor's reader thread stopped ({self._reader_error})"
        routes = self.route_health()
        if routes.routable or self.scales_from_zero:
            return None
        return "no request can be routed: " + "; ".join(routes.missing)

    def route_health(self) -> RouteHealth:
        """Which kinds of request can be routed now; a TE past its heartbeat timeout counts as gone."""
        expired = {r.name for r in self.registry.expired(time.monotonic())}
        views = [v for v in self.registry.views() if v.name not in expired]
        known = {r.heartbeat.group: r.role for r in self.registry.tes.values()}
        return route_health(views, known)

    def health(self) -> dict:
        """The body of the deployment's /health: ok or not, per kind of request what can be routed, and
        what is missing."""
        reader = "ok" if self._reader_error is None else f"stopped: {self._reader_error}"
        routes = self.route_health()
        ok = self._reader_error is None and (routes.routable or self.scales_from_zero)
        detail = {"status": "ok" if ok else "unavailable", "reader": reader, **routes.to_dict(),
                  "bad_frames": self.bad_frames, "held": len(self._live_held())}
        if ok and not routes.routable:
            detail["scaling"] = "from zero: requests are held until the cluster manager starts a TE"
        return detail

    async def generate(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, context_cache_id: str | None = None,
                       context_cache_ttl_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """As AsyncEngineClient.generate; a job of a named context cache goes to the TE holding it."""
        self._ensure_started()
        policy = REQUEST_ROUTING_POLICY.get()

        def submit(children, now: float) -> None:
            for child_id, child_params in children:
                job = _Job(child_id, request_id, child_params, list(prompt_token_ids), priority, now, policy,
                           context_cache_id=context_cache_id, context_cache_ttl_s=context_cache_ttl_s)
                self._job_of_child[child_id] = job
                try:
                    self._dispatch(job)
                except NoRouteError as exc:
                    if self.hold_s <= 0:  # the request is aborted as it ends
                        raise RouteUnavailableError(str(exc)) from None
                    self._hold(job, str(exc))  # dispatched when a TE can take it, or failed after hold_s

        async with contextlib.aclosing(self.core.stream(request_id, prompt, prompt_token_ids, params, submit)) as outs:
            async for out in outs:
                yield out

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def get_stats(self) -> EngineStats:
        self._ensure_started()
        live = self.registry.live()
        if not live:
            return EngineStats(healthy=False, error=self.dead_error)
        # a TE's own failure counts and health stay its own (te_stats); the sum says what the deployment holds
        return EngineStats.merge([r.heartbeat.stats for r in live], num_rollbacks=0, num_recoveries=0, num_migrated=0,
                                 world_size=0, dropped_frames={}, last_failure_silent_s=0.0, healthy=True)

    def te_stats(self) -> dict[str, dict]:
        """Each live TE's role, group and last reported stats (for benchmarks and the status endpoint)."""
        return {r.name: {"role": r.role, "group": r.heartbeat.group, **msgspec.structs.asdict(r.heartbeat.stats)}
                for r in self.registry.live()}

    async def admin(self, op: str, args: dict | None = None, timeout_s: float = 30.0) -> AdminReply:
        """An operator command to one TE: `args["te"]` names it (optional when there is only one)."""
        self._ensure_started()
        args = dict(args or {})
        live = self.registry.live()
        if op == "context_cache.delete" and "te" not in args:  # the TE that pinned it
            home = self._cache_homes.pop(str(args.get("id")), None)
            if home is None or self.registry.get(home[0]) is None:  # its TE is gone, and its pins with it
                return AdminReply(query_id=0, data=ContextCacheDeleted(id=str(args.get("id")), deleted=False))
            args["te"] = home[0]
        name = args.pop("te", None) or (live[0].name if len(live) == 1 else None)
        record = self.registry.get(name) if name else None
        if record is None:
            return AdminReply(query_id=0, ok=False, error=(
                f"name the TE with te=NAME; live TEs: {', '.join(sorted(r.name for r in live)) or 'none'}"))
        try:
            request = AdminRequest.of(0, op, args, reply_to=self.output_addr)
        except ValueError as exc:
            return AdminReply(query_id=0, ok=False, error=str(exc))
        fut = asyncio.get_running_loop().create_future()
        request.query_id = query_id = self.core.replies.open(fut)
        self._send(record, request)
        try:
            return await asyncio.wait_for(fut, timeout=timeout_s)
        except TimeoutError:
            self.core.replies.forget(query_id)
            return AdminReply(query_id=query_id, ok=False,
                                  error=f"TE {name} did not answer {op} in {timeout_s:.0f} s")
