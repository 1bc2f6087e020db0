"""Sending jobs to TEs: route a job's first stage, hand a prefilled job to its decode TE, continue a job from
its tokens elsewhere, release a prefill TE's held KV, and abort (deepserve §5; xdeepserve §5.1).

A job routes as one colocated TE or a prefill TE plus a decode TE of the same group. A disaggregated job's
prefill TE computes the prompt and the first token and holds the KV blocks; the JE then sends the job to the
decode TE with the blocks' addresses and the decode TE pulls them. Each send is non-blocking: a TE whose
input queue is full or closed is reported to the owner, who drops it and moves its jobs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import zmq

from meshserve.router.cache_homes import CacheHomes
from meshserve.router.demand import DemandLog
from meshserve.router.engine_registry import EngineRecord, EngineRegistry
from meshserve.router.jobs import Job, JobTable
from meshserve.router.routing import NoRouteError, RoutingPolicy
from meshserve.wire import codec
from meshserve.wire.client import AbortRequests, AddRequest, ReleaseKV
from meshserve.wire.kv import KVTransferParams, KVTransferRole

OnSendFailed = Callable[[EngineRecord, str], None]  # (the TE, why): drop it and move its jobs


class Dispatcher:
    def __init__(self, registry: EngineRegistry, jobs: JobTable, routing: RoutingPolicy, cache_homes: CacheHomes,
                 demand: DemandLog, eos_token_ids: Sequence[int], reply_to: str, on_send_failed: OnSendFailed) -> None:
        """`reply_to`: where every TE sends the jobs' outputs (this JE's output socket)."""
        self.registry, self.jobs, self.loads = registry, jobs, jobs.loads
        self.routing = routing  # replaced once the prompt tree exists (the first TE's block size)
        self.cache_homes, self.demand = cache_homes, demand
        self.eos_token_ids, self.reply_to = list(eos_token_ids), reply_to
        self.on_send_failed = on_send_failed

    def send(self, record: EngineRecord, item) -> None:
        try:
            record.sock.send(codec.encode(item), zmq.NOBLOCK)
        except zmq.ZMQError:
            self.on_send_failed(record, "its input queue is full or closed")

    def dispatch(self, job: Job, exclude: set[str] = frozenset()) -> None:
        """Route the job's first stage and send it; raises NoRouteError."""
        views = [v for v in self.registry.views() if v.name not in exclude]
        decision = self.cache_homes.route(job, views, self.routing) or self.routing.route(
            job.prompt_token_ids, views, policy=job.policy, max_tokens=job.params.max_tokens,
            cache_salt=job.tenancy.cache_salt)
        self.jobs.new_attempt(job)
        if decision.kind == "colocated":
            job.stage, job.te, job.decode_te = "colocated", decision.te, ""
            kv_transfer = None
        else:
            job.stage, job.te, job.decode_te = "prefill", decision.prefill, decision.decode
            job.group = self.registry.get(decision.prefill).heartbeat.group
            kv_transfer = KVTransferParams(role=KVTransferRole.PRODUCER)
        if job.attempt == 1:  # an arrival for each pool the job occupies (a retry is not a new one)
            for te in decision.tes:
                self.demand.of_te(te).arrivals += 1
        self.loads.on_dispatch(job.te, len(job.prompt_token_ids), job.engine_id)
        self.send(self.registry.get(job.te), AddRequest(
            req_id=job.engine_id, prompt_token_ids=job.prompt_token_ids, sampling_params=job.params,
            arrival_time=job.arrival_time, priority=job.priority, eos_token_ids=self.eos_token_ids,
            reply_to=self.reply_to, kv_transfer=kv_transfer, context_cache_id=job.context_cache_id,
            context_cache_ttl_s=job.context_cache_ttl_s, tenancy=job.tenancy))
        if job.context_cache_ttl_s is not None:  # the TE that computes the prompt pins the cache's blocks
            self.cache_homes.pin(job.context_cache_id, job.te, job.context_cache_ttl_s)

    def dispatch_decode(self, job: Job, exclude: set[str] = frozenset(), recompute: bool = False) -> None:
        """Send a handed-off job to its decode TE (another one of its group if that one is gone). With
        `recompute` the decode TE computes the prompt and the tokens so far itself: after a decode TE
        failed, the prefill TE may have released the blocks already."""
        record = self._decode_te(job, exclude)
        job.stage, job.te = "decode", job.decode_te
        # its KV link from the prefill TE went down since the job was routed: a pull would only fail
        recompute = recompute or self.registry.link_down(job.decode_te, job.kv_params.engine)
        if recompute:
            self.release_prefill_hold(job)
        self.loads.on_dispatch(job.te, 0, job.engine_id)
        self.send(record, AddRequest(
            req_id=job.engine_id, prompt_token_ids=job.prompt_token_ids, sampling_params=job.params,
            arrival_time=job.arrival_time, priority=job.priority, eos_token_ids=self.eos_token_ids,
            reply_to=self.reply_to, kv_transfer=msgspec.structs.replace(job.kv_params, recompute=recompute),
            output_token_ids=list(job.token_ids), tenancy=job.tenancy))

    def _decode_te(self, job: Job, exclude: set[str]) -> EngineRecord:
        """The job's decode TE, or the least loaded other one of its group when that one is gone, excluded or
        draining (a draining one still takes the job it was chosen for when it is the only one)."""
        record = self.registry.get(job.decode_te)
        if record is None or job.decode_te in exclude or record.draining:
            candidates = [v for v in self.registry.views() if v.role == "decode" and v.name not in exclude
                          and v.group == job.group]
            if not candidates and (record is None or job.decode_te in exclude):
                raise NoRouteError("no decode TE is left for a job whose prefill is done")
            if candidates:
                job.decode_te = min(candidates, key=lambda v: (v.load.kv_usage, v.load.num_running)).name
                record = self.registry.get(job.decode_te)
        return record

    def dispatch_resume(self, job: Job, exclude: set[str] = frozenset()) -> None:
        """Continue a job that streamed tokens on a TE that computes its prompt plus those tokens and goes on
        (a colocated TE, or a decode TE, which then computes the prompt itself); raises NoRouteError."""
        candidates = [v for v in self.registry.views() if v.name not in exclude and v.role in ("colocated", "decode")
                      and (not job.group or v.group == job.group or v.role == "colocated")]
        if not candidates:
            raise NoRouteError("no colocated or decode TE can continue the request")
        target = min(candidates, key=lambda v: (v.load.kv_usage, v.load.num_running, v.load.waiting_tokens))
        self.jobs.new_attempt(job)
        job.stage, job.te, job.decode_te = "colocated", target.name, ""
        self.loads.on_dispatch(job.te, len(job.prompt_token_ids) + len(job.token_ids), job.engine_id)
        self.send(self.registry.get(job.te), AddRequest(
            req_id=job.engine_id, prompt_token_ids=job.prompt_token_ids, sampling_params=job.params,
            arrival_time=job.arrival_time, priority=job.priority, eos_token_ids=self.eos_token_ids,
            reply_to=self.reply_to, output_token_ids=list(job.token_ids), tenancy=job.tenancy))

    def release_prefill_hold(self, job: Job) -> None:
        """Nobody will pull the job's KV from its prefill TE: have it free the blocks now rather than when
        its hold expires (a repeated release is harmless)."""
        record = self.registry.get(job.kv_params.engine)
        if record is not None:
            self.send(record, ReleaseKV(req_ids=[job.engine_id]))

    def abort(self, child_ids: list[str]) -> None:
        """The callers gave these jobs up: forget them and tell every TE that may hold them (the prefill TE
        may still hold a handed-off job's blocks)."""
        for child_id in child_ids:
            job = self.jobs.of_child(child_id)
            if job is None:
                continue
            self.jobs.finish(job)
            targets = {job.te, job.decode_te} - {""}
            if job.kv_params is not None:
                targets.add(job.kv_params.engine)
            for name in targets:
                record = self.registry.get(name)
                if record is not None:
                    self.send(record, AbortRequests(req_ids=[job.engine_id]))
