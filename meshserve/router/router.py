"""The job executor (JE): turns each request into tasks on the deployment's TEs (deepserve §3, §5).

It lives in the frontend process and offers the API server the same interface as a single engine
(`AsyncEngineClient`). Each request (each of its `n` choices) becomes a job (`jobs`); the router picks either
one colocated TE or a prefill TE and a decode TE (`dispatch`). Disaggregated jobs follow xdeepserve §5.1: the
prefill TE computes the prompt and the first token and holds the KV blocks; the JE then sends the job to the
decode TE with the blocks' addresses; the decode TE pulls them when it has room and decodes. Every TE sends a
job's tokens straight to this frontend's output socket (output short-circuiting): the JE only forwards a
handed-off job once, it never relays tokens.

Failures: a TE that stops heartbeating, says it is leaving, or reports a fatal error is dropped and its jobs
move to other TEs from their tokens so far (`migration`); a TE recovering its ranks keeps the jobs no other TE
can take now.

A reader thread receives everything (outputs, heartbeats, KV events) and hands it to the event loop
(`reader`); all job state lives on the loop's thread. A frame that does not decode, or a message whose
handling fails, is logged, counted and dropped. The JE is healthy only while its reader runs and a request of
some kind can be routed (`health()` says which kinds can, and what the others miss).

Scaling (the cluster manager): with `hold_s` > 0 a job no TE can take is held, not refused, until a TE that
can take it registers (`held_jobs`). Such a JE with `manager_addrs` stays healthy with no TE: the manager
scales from zero when the JE reports held jobs (`manager_reports`, with per-pool demand from `demand`). A TE
that says it is draining (a scale-down) gets nothing new but finishes the jobs it has. Jobs of a named
context cache go to the TE holding it (`cache_homes`); operator commands go to one TE (`admin`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import ClassVar

import msgspec
import zmq

from meshserve.config.router import RouterConfig
from meshserve.engine.client_core import ClientCore, admission_error
from meshserve.engine.detokenizer import load_tokenizer
from meshserve.engine.outputs import RequestOutput
from meshserve.models.generation_config import eos_token_ids
from meshserve.router.admin import TEAdmin
from meshserve.router.cache_homes import CacheHomes
from meshserve.router.demand import DemandLog
from meshserve.router.dispatch import Dispatcher
from meshserve.router.engine_registry import EngineRecord, EngineRegistry
from meshserve.router.held_jobs import HeldJobs
from meshserve.router.jobs import Job, JobTable, RouteUnavailableError
from meshserve.router.manager_reports import JobExecutorIdentity, ManagerReporter
from meshserve.router.migration import Migration
from meshserve.router.prompt_tree import GlobalPromptTree
from meshserve.router.reader import TICK_S, FrameReader
from meshserve.router.routing import (
    REQUEST_ROUTING_POLICY,
    LoadTracker,
    NoRouteError,
    RouteHealth,
    RoutingPolicy,
    SupportsHeatmapValue,
    SupportsPredictTokens,
    route_health,
)
from meshserve.router.te_links import TELinkEvent
from meshserve.wire.client import (
    NO_TENANCY,
    AdminReply,
    EngineError,
    EngineOutputs,
    EngineStats,
    RequestDelta,
    Tenancy,
)
from meshserve.wire.cluster import JobExecutorReport
from meshserve.wire.heartbeat import EngineHeartbeat
from meshserve.wire.kv import KVCacheEvents
from meshserve.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _configured_max_model_len(model: str) -> int:
    """The model's context length from its config.json (0 when unknown): what a JE that has not seen a TE yet
    admits requests by, while it holds them for a TE the manager starts."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


class Router:
    def __init__(self, config: RouterConfig, heatmap: SupportsHeatmapValue | None = None,
                 predictor: SupportsPredictTokens | None = None) -> None:
        """`heatmap`, `predictor`: what pd_aware and combined routing decide by (meshserve.router.routing)."""
        self.config = config
        self.model_name = config.served_model_name or os.path.basename(os.path.normpath(config.model))
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(config.model)
        self._heatmap, self._predictor = heatmap, predictor
        self.loads = LoadTracker()
        self.ctx = zmq.Context()
        # the prompt tree joins at the first TE's registration (its block size)
        self.registry = EngineRegistry(self.ctx, None, self.loads, timeout_s=config.heartbeat_timeout_s)
        self.reader = FrameReader(self.ctx, config.host, config.register_port, self.registry, self._on_items)
        self.output_addr, self.register_addr = self.reader.output_addr, self.reader.register_addr
        self.name = config.name or f"je-{os.getpid()}-{self.register_addr.rpartition(':')[2]}"
        self.jobs = JobTable(self.loads)
        self.cache_homes = CacheHomes()
        self.demand = DemandLog(self.registry)
        self.dispatcher = Dispatcher(self.registry, self.jobs, RoutingPolicy(config.routing), self.cache_homes,
                                     self.demand, self.eos_token_ids, self.output_addr, on_send_failed=self._drop_te)
        self.core = ClientCore(self.tokenizer, self.dispatcher.abort)  # touched on the loop's thread only
        self.held = HeldJobs(self.jobs, self.registry, self.dispatcher, self.core.fail_request, config.hold_s)
        self.migration = Migration(self.registry, self.jobs, self.dispatcher, self.held, self._fail_job,
                                   config.max_attempts, config.migrate_deadline_s)
        identity = JobExecutorIdentity(self.name, config.http_addr, self.register_addr)
        self.reporter = ManagerReporter(self.ctx, config.manager_addrs, config.report_interval_s, identity,
                                        self.registry, self.demand, self.held)
        self.te_admin = TEAdmin(self.registry, self.core.replies, self.dispatcher.send, self.output_addr,
                                self.cache_homes)
        self._last_tick = 0.0
        self._config_max_model_len = _configured_max_model_len(config.model) if config.hold_s > 0 else 0

    @property
    def routing(self) -> RoutingPolicy:
        return self.dispatcher.routing

    @property
    def tree(self) -> GlobalPromptTree | None:
        """The global prompt tree (None until the first TE registers)."""
        return self.registry.tree

    @property
    def bad_frames(self) -> int:
        """Frames dropped: undecodable, or their handling failed."""
        return self.reader.bad_frames

    @property
    def migrated(self) -> int:
        """Jobs moved off a failed or recovering TE."""
        return self.migration.migrated

    # ------------------------------------------------------------------ lifecycle
    def _ensure_started(self) -> None:
        """Deliver messages to the running event loop (a JE used from a new loop moves its reader there)."""
        self.reader.attach(asyncio.get_running_loop())

    async def start(self) -> None:
        self._ensure_started()

    def wait_for_tes_blocking(self, roles: dict[str, int], timeout_s: float,
                              alive: Callable[[], None] | None = None) -> None:
        """Before serving: take heartbeats until at least `roles[role]` TEs of each role are registered.
        `alive()` (optional) raises when a TE being started has died. TimeoutError names what is missing."""
        if self.reader.loop is not None:
            raise RuntimeError("wait_for_tes_blocking is for start-up, before the event loop uses the JE")
        deadline = time.monotonic() + timeout_s
        next_log = time.monotonic() + 10
        while True:
            have = {role: sum(1 for r in self.registry.live() if r.role == role) for role in roles}
            missing = ", ".join(f"{n - have[role]} {role}" for role, n in roles.items() if have[role] < n)
            if not missing:
                return
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"TEs not registered after {timeout_s:.0f} s: missing {missing}")
            if now > next_log:
                next_log = now + 10
                logger.info("waiting for TEs: %s", missing)
            if alive is not None:
                alive()
            self.reader.take_heartbeats(100, self._on_heartbeat)

    def shutdown(self) -> None:
        self.reader.close()
        self.registry.close()
        self.reporter.close()
        self.ctx.term()

    # ------------------------------------------------------------------ on the loop thread
    def _on_items(self, items: list) -> None:
        now = time.monotonic()
        for item in items:
            self.reader.guarded(self._on_item, item, now)
        if now - self._last_tick >= TICK_S:
            self._last_tick = now
            self.reader.guarded(self._tick, now)

    def _on_item(self, item, now: float) -> None:
        handler = self._ITEM_HANDLERS.get(type(item))
        if handler is not None:  # EngineStats: stats come with heartbeats
            handler(self, item, now)

    def _on_outputs(self, item: EngineOutputs, now: float) -> None:
        for delta in item.deltas:
            self.reader.guarded(self._on_delta, delta)

    def _on_kv_events(self, item: KVCacheEvents, now: float) -> None:
        if not self.registry.on_kv_events(item.engine, item):
            self.te_admin.request_snapshot(self.registry.get(item.engine))

    def _on_admin_reply(self, item: AdminReply, now: float) -> None:
        self.core.replies.on_reply(item)

    def _on_engine_error(self, item: EngineError, now: float) -> None:
        record = self.registry.get(item.engine)
        if record is not None:
            self._drop_te(record, f"it failed: {item.message}")

    def _on_link_event(self, item: TELinkEvent, now: float) -> None:
        record = self.registry.on_link_event(item)
        if record is not None and record.link_up and self.held.pending:
            self.held.serve(now)

    def _tick(self, now: float) -> None:
        """Drop the TEs whose heartbeats stopped; ask for the KV snapshots the prompt tree lacks; dispatch or
        fail held jobs; report to the cluster managers."""
        for record in self.registry.expired(now):
            self._drop_te(record, f"no heartbeat for {self.registry.timeout_s:.0f} s")
        for record in self.registry.live():
            if self.registry.needs_snapshot(record, now):
                self.te_admin.request_snapshot(record)
        if self.held.pending:
            self.held.serve(now)
        self.reporter.on_tick(now)

    def _on_heartbeat(self, hb: EngineHeartbeat, now: float) -> None:
        if self.registry.tree is None and not hb.leaving:
            self._start_prompt_tree(hb.block_size)
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
            self.migration.move_off_recovering(record, hb.stats.recovering)
        if new:
            self.te_admin.request_snapshot(record)
            self.reporter.send(now)  # the manager times a scale-up until every JE routes to the new TE: say so now
        if self.held.pending and not record.draining:
            self.held.serve(now)

    def _start_prompt_tree(self, block_size: int) -> None:
        """The global prompt tree, in blocks of the TEs' size, and the routing policies that use it."""
        tree = GlobalPromptTree(block_size)
        self.registry.tree = tree
        self.dispatcher.routing = RoutingPolicy(self.routing.policy, tree=tree, heatmap=self._heatmap,
                                                predictor=self._predictor)

    _ITEM_HANDLERS: ClassVar[dict[type, Callable]] = {
        EngineOutputs: _on_outputs, EngineHeartbeat: _on_heartbeat, KVCacheEvents: _on_kv_events,
        AdminReply: _on_admin_reply, EngineError: _on_engine_error, TELinkEvent: _on_link_event}

    def _drop_te(self, record: EngineRecord, why: str) -> None:
        self.migration.drop_te(record, why)

    # ------------------------------------------------------------------ jobs' progress
    def _on_delta(self, delta: RequestDelta) -> None:
        job = self.jobs.get(delta.req_id)
        if job is None:
            return  # an earlier attempt, or a job already finished or aborted
        error = admission_error(delta) if not job.token_ids else None  # a decode TE's refusal is the job's error
        if error is not None:
            self.jobs.finish(job)
            self.core.fail_request(job.child_id, error)
            return
        if delta.new_token_ids and not job.token_ids:
            job.first_token_time = time.time()
            self.demand.of_te(job.te).add_ttft(job.first_token_time - job.arrival_time)
        job.token_ids.extend(delta.new_token_ids)
        self.core.apply_delta(msgspec.structs.replace(delta, req_id=job.child_id, kv_transfer_params=None), time.time())
        if delta.finish_reason in ("stop", "length") and len(job.token_ids) > 1 and job.stage != "prefill":
            self.demand.of_te(job.te).add_tpot((time.time() - job.first_token_time) / (len(job.token_ids) - 1))
        if delta.finish_reason is not None:
            if delta.finish_reason == "error" and job.stage == "decode":
                self.dispatcher.release_prefill_hold(job)  # the decode TE may have failed it before pulling
            self.jobs.finish(job)
        elif delta.kv_transfer_params is not None and self.jobs.tracks(job.child_id):
            self.loads.on_finished(job.te, job.engine_id)
            job.kv_params = delta.kv_transfer_params
            self._on_hand_off(job)

    def _on_hand_off(self, job: Job) -> None:
        """The prefill TE holds the job's KV and sent its first token: send the job on to its decode TE
        (xdeepserve §5.1 step 4). One method, so a test can hold a hand-off back to break the transfer."""
        try:
            self.dispatcher.dispatch_decode(job)
        except NoRouteError as exc:
            self._fail_job(job, str(exc))

    def _fail_job(self, job: Job, error: str) -> None:
        self._on_delta(RequestDelta(req_id=job.engine_id, new_token_ids=[], finish_reason="error",
                                    error=error, num_prompt_tokens=len(job.prompt_token_ids)))

    # ------------------------------------------------------------------ API (AsyncEngineClient's interface)
    @property
    def max_model_len(self) -> int:
        """The live TEs' context length; with none live, the last TEs' (or, when holding jobs for TEs not seen
        yet, the model's own), so requests are admitted while their pool scales from zero."""
        lens = [r.heartbeat.max_model_len for r in self.registry.live()]
        if not lens and self.config.hold_s > 0:
            lens = [r.heartbeat.max_model_len for r in self.registry.tes.values()] or [self._config_max_model_len]
        return min(lens) if lens else 0

    @property
    def scales_from_zero(self) -> bool:
        """A cluster manager starts TEs when this JE reports jobs it holds: having none is not being dead."""
        return self.reporter.enabled and self.config.hold_s > 0

    @property
    def healthy(self) -> bool:
        return self.dead_error is None

    @property
    def dead_error(self) -> str | None:
        """Why no request can be served now: the reader thread died, or no kind of request can be routed."""
        if self.reader.error is not None:
            return f"the job executor's reader thread stopped ({self.reader.error})"
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
        error = self.reader.error
        routes = self.route_health()
        ok = error is None and (routes.routable or self.scales_from_zero)
        detail = {"status": "ok" if ok else "unavailable", "reader": "ok" if error is None else f"stopped: {error}",
                  **routes.to_dict(), "bad_frames": self.bad_frames, "held": len(self.held.live())}
        if ok and not routes.routable:
            detail["scaling"] = "from zero: requests are held until the cluster manager starts a TE"
        return detail

    async def generate(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, context_cache_id: str | None = None,
                       context_cache_ttl_s: float | None = None,
                       tenancy: Tenancy = NO_TENANCY) -> AsyncIterator[RequestOutput]:
        """As AsyncEngineClient.generate; a job of a named context cache goes to the TE holding it. Every leg
        of every job (prefill, decode, a retry or resume) carries `tenancy`."""
        self._ensure_started()
        policy = REQUEST_ROUTING_POLICY.get()

        def submit(children, now: float) -> None:
            for child_id, child_params in children:
                job = Job(child_id, request_id, child_params, list(prompt_token_ids), priority, now, policy,
                          context_cache_id=context_cache_id, context_cache_ttl_s=context_cache_ttl_s, tenancy=tenancy)
                self.jobs.track(job)
                try:
                    self.dispatcher.dispatch(job)
                except NoRouteError as exc:
                    if self.config.hold_s <= 0:  # the request is aborted as it ends
                        raise RouteUnavailableError(str(exc)) from None
                    self.held.hold(job, str(exc))  # dispatched when a TE can take it, or failed after hold_s

        async with contextlib.aclosing(self.core.stream(request_id, prompt, prompt_token_ids, params, submit,
                                                        tenancy)) as outs:
            async for out in outs:
                yield out

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def get_stats(self) -> EngineStats:
        self._ensure_started()
        live = self.registry.live()
        if not live:
            return EngineStats(healthy=False, error=self.dead_error)
        # a TE's own failure counts and health stay in its heartbeat; the sum says what the deployment holds
        return EngineStats.merge([r.heartbeat.stats for r in live], num_rollbacks=0, num_recoveries=0, num_migrated=0,
                                 world_size=0, dropped_frames={}, last_failure_silent_s=0.0, healthy=True)

    async def admin(self, op: str, args: dict | None = None, timeout_s: float = 30.0) -> AdminReply:
        """An operator command to one TE: `args["te"]` names it (optional when there is only one)."""
        self._ensure_started()
        return await self.te_admin.ask(op, args, timeout_s)

    def report(self, now: float) -> JobExecutorReport:
        """This JE to the cluster managers: its routable TEs and per pool its demand since the last report."""
        return self.reporter.report(now)
