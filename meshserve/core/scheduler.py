"""Iteration-level continuous batching over the Relational Tensor Cache.

Each `schedule()` builds one step under a token budget: running requests first
(a decode costs one token, an unfinished chunked prefill takes what the budget
leaves), then waiting requests in priority order, the tenants taking turns within a
priority and FCFS within a tenant (`fair_queue`), with their prefix-cache hits
skipped. When blocks run out the lowest-priority,
latest-arrived running request is preempted by recompute.

Overlapped scheduling (deepserve §4.2, asynchronous execution): a step's
progress is booked when it is scheduled, and a step that reaches the end of a
request's known tokens owes it one sampled token, counted as a placeholder. The
next `schedule()` may already feed that placeholder to the worker as the next
decode input (the worker knows the sampled id); `update_from_output` swaps the
placeholder for the real token.

Speculative decoding (MTP): a decode may also verify up to k drafts its worker
proposed after the previous step; it is scheduled for 1 + j tokens, with KV
slots for the drafts the MTP layers write after it, and it books one token;
the worker reports the accepted drafts with the sampled token, and the KV of
the accepted ones counts as computed. Drafts live in the worker; the scheduler
only learns how far each sequence advanced. Slots of rejected drafts stay in
the request's table and are written again next step; they return with it.
Verifications overlap like plain decodes: while one is in flight the next is
scheduled from the position it books (no draft accepted), with KV slots for
all of its drafts accepted, and the worker lays the step out at the position it
knows; a request within reach of its last token waits for the outcome instead.

Remote KV (the memory pool, a prefill TE's hand-off) comes through KV connectors
(`meshserve.core.kv_connector`): a waiting request whose tokens a connector can load
waits in WAITING_FOR_REMOTE_KV with its blocks allocated while the ranks load them
in the background, and runs from what arrived.

Works on token ids and block ids only; the worker owns every tensor.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from meshserve.config import SchedulerConfig
from meshserve.core.context_cache_pins import ContextCachePin, ContextCachePins
from meshserve.core.dp_balancer import DPGroupLoad
from meshserve.core.fair_queue import FairWaitingQueue
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.kv_connector.base import FinishedLoad, KVConnectorScheduler
from meshserve.core.request import Request, RequestStatus
from meshserve.core.step_plan import BookedProgress, StepPlan
from meshserve.wire.client import EngineStats, RequestDelta
from meshserve.wire.errors import QueueFullError, RequestTooLongError
from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport, KVTransferParams
from meshserve.wire.worker import CachedRequestData, ModelRunnerOutput, NewRequestData, SampleLogprobs, SchedulerOutput

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _victim_key(req: Request) -> tuple:
    """Larger = preempted first: lowest priority (largest value), then latest arrival."""
    return (req.priority, req.arrival_time, req.arrival_seq)


class Scheduler:
    """One DP group's scheduler. `config.max_model_len` must be resolved (the model's limit when unset);
    `connectors` are asked in order for the remote KV of waiting requests; `num_speculative_tokens` drafts per
    decode are verified when speculative decoding is on (the master switches `speculating` per step)."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 connectors: Sequence[KVConnectorScheduler] = (), num_speculative_tokens: int = 0) -> None:
        if config.max_model_len is None:
            raise ValueError("the scheduler needs max_model_len (the model's limit when the setting is unset)")
        self.config = config
        self.max_model_len = config.max_model_len
        self.kv_manager = kv_manager
        self.block_size = kv_manager.block_size
        self.connectors = list(connectors)
        self.num_speculative_tokens = num_speculative_tokens
        self.speculating = num_speculative_tokens > 0  # this step drafts and verifies (the master decides)
        # without drafting, the MTP layer still fills its cache (the master turns this off with drafting for
        # batches where speculation does not pay)
        self.mtp_catch_up = num_speculative_tokens > 0
        self._spec_drafted = [0] * num_speculative_tokens  # per draft position: verified, accepted
        self._spec_accepted = [0] * num_speculative_tokens
        self._spec_verify_steps = 0
        self._spec_tokens = 0
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._running: list[Request] = []
        self._waiting = FairWaitingQueue()  # by priority; tenants take turns within one (fair_queue.py)
        self._add_seq = 0
        self._front_seq = 0  # preempted requests go to the front of their priority class
        self._step_id = 0
        # per in-flight step: what it booked for each of its requests
        self._step_progress: dict[int, dict[str, BookedProgress]] = {}
        self._worker_must_drop: list[str] = []
        self.num_preemptions = 0
        # requests whose blocks a connector is loading (WAITING_FOR_REMOTE_KV), aborted ones included until the
        # load ends: the ranks write into their blocks until then
        self._num_loading = 0
        self.pins = ContextCachePins(kv_manager)  # explicit context caching (deepserve MatchByID)

    # ------------------------------------------------------------ queue
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting or self._num_loading)

    def get_request(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def unfinished_requests(self) -> list[Request]:
        """Every request not finished here (running, waiting, loading remote KV), oldest first: what moves on
        when the ranks are recovered."""
        return sorted((r for r in self._requests.values() if not r.status.is_finished), key=lambda r: r.arrival_time)

    def add_request(self, req: Request) -> None:
        if req.req_id in self._requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        if req.status is not RequestStatus.WAITING or req.ever_scheduled:
            raise ValueError(f"request {req.req_id!r} has already been scheduled; add a fresh Request")
        if len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self.check_fits(req)
        req.arrival_seq = self._add_seq
        req.queue_key = (req.priority, 1, req.arrival_time, self._add_seq)
        self._add_seq += 1
        self._requests[req.req_id] = req
        self._waiting.add(req)

    def check_fits(self, req: Request) -> None:
        """Raise RequestTooLongError when `req` could never run here (also asked before a request is queued)."""
        cfg = self.config
        prompt = req.num_prompt_tokens
        max_tokens = req.sampling_params.max_tokens
        min_new = max_tokens if max_tokens is not None else 1
        if prompt + min_new > self.max_model_len:
            wanted = f"max_tokens {max_tokens}" if max_tokens is not None else "at least 1 new token"
            raise RequestTooLongError(
                f"prompt of {prompt} tokens plus {wanted} exceeds the maximum context length "
                f"of {self.max_model_len} tokens"
            )
        # the last sampled token never needs KV
        blocks_needed = _cdiv(prompt + min_new - 1, self.block_size)
        if blocks_needed > self.kv_manager.num_blocks:
            raise RequestTooLongError(
                f"prompt of {prompt} tokens plus {min_new} new tokens needs {blocks_needed} KV blocks of "
                f"{self.block_size} tokens, but the KV cache has only {self.kv_manager.num_blocks} blocks"
            )
        if not cfg.enable_chunked_prefill and prompt > cfg.max_num_batched_tokens:
            raise RequestTooLongError(
                f"prompt of {prompt} tokens exceeds max_num_batched_tokens ({cfg.max_num_batched_tokens}) "
                f"and chunked prefill is disabled"
            )

    def _max_total_tokens(self, req: Request) -> int:
        """Length at which the request finishes with "length"."""
        # the KV cache bounds requests without max_tokens: every token but the last needs a KV slot
        cap = min(self.max_model_len, self.kv_manager.num_blocks * self.block_size + 1)
        if req.sampling_params.max_tokens is not None:
            cap = min(cap, req.num_prompt_tokens + req.sampling_params.max_tokens)
        return cap

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        preempted_now: set[str] = set()
        self._schedule_running(plan, preempted_now)
        self._schedule_waiting(plan, preempted_now)
        return self._finalize(plan)

    def _schedule_running(self, plan: StepPlan, preempted_now: set[str]) -> None:
        # in victim order, so a victim is always the current request or one not yet scheduled
        self._running.sort(key=_victim_key)
        for req in list(self._running):
            if plan.budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier request of this loop
            if req.num_tokens_with_placeholders >= self._max_total_tokens(req):
                continue  # every token it may produce is already scheduled
            if req.is_kv_producer and req.num_tokens_with_placeholders > req.num_prompt_tokens:
                continue  # a prefill TE samples the first token only; the decode TE goes on
            num_new = min(req.num_tokens_with_placeholders - req.num_computed_tokens, plan.budget)
            if num_new <= 0:
                continue
            if req.num_unverified_drafts and (req.num_tokens_with_placeholders + req.num_unverified_drafts
                                              + 1 + self.num_speculative_tokens > self._max_total_tokens(req)):
                continue  # it may end in the verification in flight: the outcome decides what comes next
            num_drafts = self._num_drafts(req, num_new, plan.budget)
            num_tokens = req.num_computed_tokens + num_new + num_drafts
            # the worker lays this step out up to `num_unverified_drafts` positions further than booked
            num_slots = num_tokens + req.num_unverified_drafts + self._draft_slots(req, num_tokens)
            if not self._allocate(req, num_slots, plan, preempted_now):
                self._preempt(req, plan, preempted_now)
                continue
            plan.add(req, num_new + num_drafts, num_drafts)

    def _num_drafts(self, req: Request, num_new: int, budget: int) -> int:
        """Drafts a decode verifies this step: up to k, within the token budget and the tokens it may still
        produce (1 + j tokens come out of a step that verifies j)."""
        if not self.speculating or num_new != 1 or req.is_kv_producer:
            return 0
        room = self._max_total_tokens(req) - req.num_tokens_with_placeholders - 1
        return max(0, min(self.num_speculative_tokens, room, budget - 1))

    def _draft_slots(self, req: Request, num_tokens: int) -> int:
        """KV slots past `num_tokens` the MTP layers write when a step reaching the end of req's known tokens
        drafts k > 1 tokens (each draft after the first runs the MTP layer one position further)."""
        if not self.speculating or num_tokens < req.num_tokens_with_placeholders:
            return 0
        return max(0, min(self.num_speculative_tokens - 1, self.max_model_len - num_tokens))

    def _schedule_waiting(self, plan: StepPlan, preempted_now: set[str]) -> None:
        # by priority, the tenants taking turns within one (fair_queue.py); the order counts each request as
        # taken, so it holds for the whole step until a preemption puts victims back
        order = self._waiting.ordered()
        index = 0  # the requests before it wait for a connector's lookup: the ones behind them go first
        while (index < len(order) and plan.budget > 0
               and len(self._running) + self._num_loading < self.config.max_num_seqs):
            req = order[index]
            if req.req_id in preempted_now:
                break  # it just lost its blocks; resuming it in the same step would thrash
            hit_blocks = self.match_cached_blocks(req)
            match = self._remote_match(req, len(hit_blocks) * self.block_size)
            if match is None:
                index += 1
                continue
            num_preempted = len(preempted_now)
            num_external, connector = match
            if connector is not None:
                if not self._start_load(req, hit_blocks, num_external, connector, plan, preempted_now):
                    break  # no free blocks: the load waits (backpressure), nothing is dropped
            elif not self._start_compute(req, hit_blocks, plan, preempted_now):
                break
            index += 1
            if len(preempted_now) > num_preempted:
                order, index = self._waiting.ordered(), 0  # a victim may now stand before the skipped requests

    def _remote_match(self, req: Request, num_local_tokens: int) -> tuple[int, KVConnectorScheduler | None] | None:
        """The tokens past the local hit the first connector that has them loads, and that connector;
        (0, None): none has any; None: a lookup is still in flight."""
        for connector in self.connectors:
            num_external = connector.get_num_new_matched_tokens(req, num_local_tokens)
            if num_external is None:
                return None
            if num_external > 0:
                return num_external, connector
        return 0, None

    def _start_compute(self, req: Request, hit_blocks: list[int], plan: StepPlan, preempted_now: set[str]) -> bool:
        """Schedule a waiting request's prompt (past its prefix-cache hit) into this step; False when it
        does not fit yet."""
        num_local = len(hit_blocks)
        num_hit = num_local * self.block_size
        remaining = req.num_tokens - num_hit
        # a resumed request longer than the whole budget is chunked regardless, or it would starve
        may_chunk = self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens
        if remaining > plan.budget and not may_chunk:
            return False
        num_new = min(remaining, plan.budget)
        num_slots = num_hit + num_new + self._draft_slots(req, num_hit + num_new)
        if not self._take_blocks(req, hit_blocks, num_slots, plan, preempted_now):
            return False
        req.num_computed_tokens = req.num_kv_ready_tokens = num_hit
        req.num_inserted_blocks = num_local
        if not req.ever_scheduled:
            req.num_cached_tokens = num_hit
            req.ever_scheduled = True
        req.status = RequestStatus.RUNNING
        self._running.append(req)
        plan.add(req, num_new)
        return True

    def _take_blocks(self, req: Request, hit_blocks: list[int], num_tokens: int, plan: StepPlan,
                     preempted_now: set[str], may_preempt: bool = True) -> bool:
        """Take a waiting request's cached blocks and grow its table to `num_tokens`, and move it off the
        waiting queue; False (nothing taken) when the blocks cannot be had."""
        self.kv_manager.acquire(hit_blocks)
        req.block_ids = list(hit_blocks)
        if not self._allocate(req, num_tokens, plan, preempted_now, may_preempt):
            self.kv_manager.free(req.block_ids)
            req.block_ids = []
            return False
        if self.kv_manager.enable_prefix_caching:
            self.kv_manager.record_prefix_lookup(req.num_tokens, len(hit_blocks) * self.block_size)
        self._waiting.take(req)  # its tenant is charged its tokens (fair_queue.py)
        return True

    # ------------------------------------------------------------ remote KV (KV connectors)
    def _start_load(self, req: Request, hit_blocks: list[int], num_external: int, connector: KVConnectorScheduler,
                    plan: StepPlan, preempted_now: set[str]) -> bool:
        """Allocate the blocks `connector` loads `num_external` tokens into and have it order the load; the
        request waits (WAITING_FOR_REMOTE_KV) while the ranks load in the background and the TE keeps stepping
        its other requests. False when the blocks cannot be had yet."""
        num_local = len(hit_blocks) * self.block_size
        num_tokens = num_local + num_external
        if num_tokens >= req.num_prompt_tokens:  # a whole prompt arrives: the tokens after it are computed next
            num_tokens = req.num_tokens
        if not self._take_blocks(req, hit_blocks, num_tokens, plan, preempted_now, connector.may_preempt):
            return False
        req.num_computed_tokens = req.num_kv_ready_tokens = num_local
        req.num_external_tokens = num_external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._num_loading += 1
        connector.update_state_after_alloc(req, num_local, num_external)
        return True

    def update_connector_output(self, report: KVConnectorReport) -> None:
        """One rank's report of its connectors' background work: the requests whose loads every rank of
        this DP group has finished run from the KV that arrived (the rest of the prompt is computed)."""
        for connector in self.connectors:
            for load in connector.update_connector_output(report):
                self._finish_load(load)

    def _finish_load(self, load: FinishedLoad) -> None:
        req = load.req
        self._num_loading -= 1
        if req.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            # aborted while loading: the abort answered the caller; the ranks wrote into its blocks until now
            self.kv_manager.free(req.block_ids)
            req.block_ids = []
            return
        num_local = req.num_computed_tokens
        num_ready = num_local + max(0, min(load.num_loaded_tokens, req.num_external_tokens))
        req.num_external_tokens = 0
        if load.num_cached_tokens is not None:
            req.num_cached_tokens = load.num_cached_tokens
        elif not req.ever_scheduled:
            req.num_cached_tokens = num_ready
        req.ever_scheduled = True
        req.num_computed_tokens = req.num_kv_ready_tokens = num_ready
        req.num_inserted_blocks = num_local // self.block_size
        self._cache_full_blocks(req, num_ready)  # the loaded blocks are local prefix-cache hits from now on
        req.status = RequestStatus.RUNNING
        self._running.append(req)

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """The connectors' orders not yet sent (loads, stores), for this step's batch; None: nothing."""
        meta = KVConnectorMetadata()
        for connector in self.connectors:
            connector.build_connector_meta(meta)
        return None if meta.is_empty else meta

    def _connectors_finished(self, req: Request) -> KVTransferParams | None:
        """Tell the connectors `req` leaves; params when one of them took over its blocks."""
        params = None
        for connector in self.connectors:
            params = connector.request_finished(req) or params
        return params

    def _allocate(self, req: Request, num_tokens: int, plan: StepPlan, preempted_now: set[str],
                  may_preempt: bool = True) -> bool:
        """Grow req's block table to hold num_tokens, preempting lower-ranked running requests
        while blocks are short (if it may). False when req itself ranks lowest (nothing is allocated)."""
        need = _cdiv(num_tokens, self.block_size) - len(req.block_ids)
        while need > 0:
            blocks = self.kv_manager.alloc_blocks(need)
            if blocks is not None:
                req.block_ids.extend(blocks)
                return True
            candidates = [r for r in self._running if r is not req]
            victim = max(candidates, key=_victim_key, default=None)
            if not may_preempt or victim is None or _victim_key(victim) < _victim_key(req):
                return False
            self._preempt(victim, plan, preempted_now)
        return True

    def _preempt(self, req: Request, plan: StepPlan, preempted_now: set[str]) -> None:
        plan.withdraw(req)
        self._release(req, cache=True)
        self._running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        preempted_now.add(req.req_id)
        self._front_seq -= 1
        req.queue_key = (req.priority, 0, self._front_seq, req.arrival_seq)
        self._waiting.add(req)
        logger.debug("preempted %s (%d tokens) to free KV blocks", req.req_id, req.num_tokens)

    def _release(self, req: Request, cache: bool) -> None:
        """Give back req's blocks (computed full blocks to the prefix cache first) and forget
        its progress; the worker is told to drop it."""
        if cache:
            self._cache_full_blocks(req, req.num_kv_ready_tokens)
        if req.block_ids:
            self.kv_manager.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_kv_ready_tokens = 0
        req.num_inserted_blocks = 0
        req.num_output_placeholders = 0
        req.pending_sample_steps.clear()
        req.num_unverified_drafts = 0
        req.num_blocks_sent = 0
        if req.in_worker:
            self._worker_must_drop.append(req.req_id)
            req.in_worker = False

    def _finalize(self, plan: StepPlan) -> SchedulerOutput:
        out = SchedulerOutput(step_id=self._step_id,
                              num_draft_tokens=self.num_speculative_tokens if self.speculating else 0,
                              mtp_catch_up=self.mtp_catch_up or self.speculating)
        if not plan.entries:
            return out  # the drop list waits for a step that reaches the worker
        progress: dict[str, BookedProgress] = {}
        for req_id, entry in plan.entries.items():
            req = entry.req
            if req.in_worker:
                out.cached_reqs.append(CachedRequestData(
                    req_id=req_id,
                    new_block_ids=req.block_ids[req.num_blocks_sent:],
                    num_computed_tokens=entry.num_computed_before,
                ))
            else:
                out.new_reqs.append(NewRequestData(
                    req_id=req_id,
                    token_ids=list(req.all_token_ids),
                    sampling_params=req.sampling_params,
                    block_ids=list(req.block_ids),
                    num_computed_tokens=entry.num_computed_before,
                    num_prompt_tokens=req.num_prompt_tokens,
                ))
                req.in_worker = True
            req.num_blocks_sent = len(req.block_ids)
            # a verification books its first token; the accepted drafts count when the output says which
            req.num_computed_tokens = entry.num_computed_before + entry.num_tokens - entry.num_drafts
            req.num_unverified_drafts += entry.num_drafts
            if req.num_computed_tokens == req.num_tokens_with_placeholders:
                req.num_output_placeholders += 1
                req.pending_sample_steps.append(self._step_id)
            out.num_scheduled_tokens[req_id] = entry.num_tokens
            progress[req_id] = BookedProgress(req.num_preemptions, req.num_computed_tokens, entry.num_drafts)
        out.finished_req_ids = self._worker_must_drop
        self._worker_must_drop = []
        self._step_progress[self._step_id] = progress
        return out

    # ------------------------------------------------------------ outputs
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestDelta]:
        progress = self._step_progress.pop(sched.step_id, {})
        for connector in self.connectors:  # the prefill rate a fetch-vs-recompute decision weighs
            connector.observe_step(sched.total_num_scheduled_tokens, out.execute_seconds)
        deltas: list[RequestDelta] = []
        for req_id, booked in progress.items():
            req = self._requests.get(req_id)
            if req is None or req.status is not RequestStatus.RUNNING or req.num_preemptions != booked.incarnation:
                continue  # finished, aborted or preempted while the step was in flight
            req.num_unverified_drafts -= booked.num_drafts
            kv_ready = booked.num_kv_ready
            if req_id in out.failed:  # its settings made the worker fail it; the step's others go on
                deltas.append(self._finish(req, RequestStatus.FINISHED_ERROR, error=out.failed[req_id]))
                continue
            req.num_kv_ready_tokens = max(req.num_kv_ready_tokens, kv_ready)
            if req.context_cache_ttl_s is not None:
                self.pins.pin(req)  # before the token: a request that finishes now frees its blocks
            if req.pending_sample_steps and req.pending_sample_steps[0] == sched.step_id:
                req.pending_sample_steps.popleft()
                req.num_output_placeholders -= 1
                tokens = out.sampled.get(req_id)
                num_drafts = out.num_drafts.get(req_id, 0)
                if not tokens or len(tokens) > num_drafts + 1 or num_drafts > sched.num_scheduled_tokens[req_id] - 1:
                    got = f"{tokens} after {num_drafts} drafts" if tokens else "no token"
                    message = f"the worker returned {got} for request {req_id} in step {sched.step_id}"
                    deltas.append(self._finish(req, RequestStatus.FINISHED_ERROR, error=message))
                    continue
                if num_drafts:
                    self._count_spec(num_drafts, len(tokens))
                    # the accepted drafts' KV was computed by this step, as the first token's was
                    req.num_computed_tokens += len(tokens) - 1
                    req.num_kv_ready_tokens = max(req.num_kv_ready_tokens, kv_ready + len(tokens) - 1)
                    self._shift_later_steps(req_id, len(tokens) - 1)
                deltas.append(self._accept_tokens(req, tokens, out.logprobs.get(req_id)))
                self._waiting.charge_output(req.tenancy.tenant, len(deltas[-1].new_token_ids))
            if not req.is_finished:
                self._cache_full_blocks(req, req.num_kv_ready_tokens)
        return deltas

    def _shift_later_steps(self, req_id: str, num_accepted: int) -> None:
        """The steps scheduled after a verification ran `num_accepted` positions further than they booked."""
        for progress in self._step_progress.values():
            booked = progress.get(req_id)
            if booked is not None:
                booked.num_kv_ready += num_accepted

    def _count_spec(self, num_drafts: int, num_tokens: int) -> None:
        self._spec_verify_steps += 1
        self._spec_tokens += num_tokens
        for position in range(num_drafts):
            self._spec_drafted[position] += 1
            self._spec_accepted[position] += position < num_tokens - 1

    def _accept_tokens(self, req: Request, tokens: list[int], logprobs: list[SampleLogprobs] | None) -> RequestDelta:
        """Append a step's tokens in order until one finishes the request; the ones after it are dropped."""
        delta = self._accept_token(req, tokens[0], logprobs[0] if logprobs else None)
        for i in range(1, len(tokens)):
            if req.is_finished:
                break
            more = self._accept_token(req, tokens[i], logprobs[i] if logprobs else None)
            delta.new_token_ids.extend(more.new_token_ids)
            if more.new_logprobs:
                delta.new_logprobs = (delta.new_logprobs or []) + more.new_logprobs
            delta.finish_reason, delta.stop_reason = more.finish_reason, more.stop_reason
            delta.kv_transfer_params = more.kv_transfer_params
        return delta

    def _accept_token(self, req: Request, token: int, logprobs: SampleLogprobs | None) -> RequestDelta:
        req.append_output_token(token)
        params = req.sampling_params
        status = None
        may_stop = len(req.output_token_ids) >= params.min_tokens
        if may_stop and not params.ignore_eos and token in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif may_stop and token in params.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_tokens >= self._max_total_tokens(req):
            status = RequestStatus.FINISHED_LENGTH
        delta = RequestDelta(
            req_id=req.req_id,
            new_token_ids=[token],
            new_logprobs=[logprobs] if logprobs is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )
        if status is None and req.is_kv_producer:
            status = RequestStatus.TRANSFERRED  # a decode TE goes on from the first token (xdeepserve §5.1 step 3)
        if status is not None:
            if status is RequestStatus.FINISHED_STOPPED:
                req.stop_reason = token
            finish = self._finish(req, status)
            delta.finish_reason = finish.finish_reason
            delta.stop_reason = finish.stop_reason
            delta.kv_transfer_params = finish.kv_transfer_params
        return delta

    def _cache_full_blocks(self, req: Request, num_kv_ready: int) -> None:
        """Offer the full blocks whose KV is computed (and whose token ids are known) to the prefix cache
        and to the connectors (the memory pool stores them)."""
        num_full = min(num_kv_ready, req.num_tokens) // self.block_size
        if self.kv_manager.enable_prefix_caching and num_full > req.num_inserted_blocks:
            self.kv_manager.insert_prefix(req.all_token_ids, req.block_ids, num_full, req.tenancy.cache_salt)
            req.num_inserted_blocks = num_full
        for connector in self.connectors:
            connector.on_blocks_ready(req, num_full)

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None) -> RequestDelta:
        """Take `req` out (finished here, or TRANSFERRED to a decode TE with a connector holding its blocks)."""
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        if status is not RequestStatus.FINISHED_ERROR:
            self._cache_full_blocks(req, req.num_kv_ready_tokens)
        req.status = status
        req.error = error
        params = self._connectors_finished(req)
        if params is not None:
            req.block_ids = []  # a connector holds them now
        self._release(req, cache=False)
        del self._requests[req.req_id]
        return RequestDelta(
            req_id=req.req_id,
            new_token_ids=[],
            finish_reason=status.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=error,
            kv_transfer_params=params,
        )

    def abort_requests(self, req_ids: Iterable[str]) -> list[RequestDelta]:
        """Finish the given requests with "abort" and free their blocks; unknown ids are ignored."""
        deltas = []
        for req_id in req_ids:
            for connector in self.connectors:  # a prefill TE's hold: the job is gone, nobody will pull it
                connector.release(req_id)
            req = self._requests.get(req_id)
            if req is None:
                continue
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KV:  # its blocks are freed once the load ends
                deltas.append(self._finish_loading(req, RequestStatus.FINISHED_ABORTED))
            else:
                deltas.append(self._finish(req, RequestStatus.FINISHED_ABORTED))
        return deltas

    def _finish_loading(self, req: Request, status: RequestStatus, error: str | None = None) -> RequestDelta:
        req.status = status
        req.error = error
        self._connectors_finished(req)
        del self._requests[req.req_id]
        return RequestDelta(req_id=req.req_id, new_token_ids=[], finish_reason=status.finish_reason,
                            num_prompt_tokens=req.num_prompt_tokens, error=error)

    def fail_all(self, message: str) -> list[RequestDelta]:
        """Finish every request with "error" (the worker failed)."""
        deltas = [
            self._finish(req, RequestStatus.FINISHED_ERROR, error=message)
            for req in list(self._running) + list(self._waiting)
        ]
        loading = [req for req in self._requests.values() if req.status is RequestStatus.WAITING_FOR_REMOTE_KV]
        deltas += [self._finish_loading(req, RequestStatus.FINISHED_ERROR, error=message) for req in loading]
        self._step_progress.clear()
        return deltas

    def dp_load(self, default_output_tokens: int) -> DPGroupLoad:
        """This scheduler's load as the DP balancer sees it (requests without max_tokens are
        expected to produce `default_output_tokens`)."""
        bs = self.block_size
        reserved = pending = 0
        for req in self._requests.values():
            expected = req.num_prompt_tokens + (req.sampling_params.max_tokens or default_output_tokens)
            reserved += max(0, _cdiv(min(expected, self.max_model_len), bs) - len(req.block_ids))
            pending += max(0, req.num_prompt_tokens - req.num_computed_tokens)
        return DPGroupLoad(num_requests=len(self._requests), max_num_seqs=self.config.max_num_seqs,
                           num_blocks=self.kv_manager.num_blocks,
                           num_used_blocks=self.kv_manager.num_blocks - self.kv_manager.num_available_blocks,
                           reserved_blocks=reserved, pending_prefill_tokens=pending)

    # ------------------------------------------------------------ explicit context caching (MatchByID)
    def match_cached_blocks(self, req: Request) -> list[int]:
        """The leading blocks whose KV this request can reuse (no reference taken): those of its named context
        cache first, then whatever the prefix cache holds beyond them. At least the last token is computed: its
        logits give the next token."""
        tokens = req.all_token_ids
        limit = len(tokens) - 1
        prefix: list[int] = []
        if self.kv_manager.enable_prefix_caching:
            prefix = self.kv_manager.match_by_prefix(tokens, max_tokens=limit, record=False,
                                                     cache_salt=req.tenancy.cache_salt)
        pinned = self.pins.match(req.context_cache_id, tokens, limit)
        # a block's KV depends only on the tokens up to it, so pinned and tree blocks of equal tokens mix freely
        hit = pinned + prefix[len(pinned):]
        if self.num_speculative_tokens and hit:
            # ... except the MTP layer's entry at a block's last position, made from the token after the block:
            # the last hit block is computed again, so that entry is this request's
            hit = hit[:-1]
        return hit

    @property
    def context_caches(self) -> dict[str, ContextCachePin]:
        return self.pins.pins

    @property
    def num_pinned_blocks(self) -> int:
        return self.pins.num_pinned_blocks

    def can_pin(self, num_blocks: int) -> bool:
        """Whether named context caches may pin `num_blocks` more blocks here."""
        return self.pins.can_pin(num_blocks)

    def drop_context_cache(self, cache_id: str) -> bool:
        """Unpin a named cache (deleted or expired), and stop a request still creating it from pinning;
        False when this scheduler knew nothing of it."""
        known = self.pins.forget(cache_id)
        known = self.kv_manager.unregister_id(cache_id) or known
        for req in self._requests.values():
            if req.context_cache_id == cache_id and req.context_cache_ttl_s is not None:
                req.context_cache_ttl_s = None
                known = True
        return known

    def expire_context_caches(self, now: float | None = None) -> list[str]:
        """Unpin the named caches whose ttl has passed."""
        expired = self.pins.expired(time.monotonic() if now is None else now)
        for cache_id in expired:
            self.drop_context_cache(cache_id)
        return expired

    def stats(self) -> EngineStats:
        waiting_tokens = sum(r.num_tokens for r in self._waiting)
        waiting_tokens += sum(max(0, r.num_tokens - r.num_computed_tokens) for r in self._running)
        stats = EngineStats(
            num_running=len(self._running) + self._num_loading,
            num_waiting=len(self._waiting),
            waiting_tokens=waiting_tokens,
            running_tokens=sum(r.num_tokens for r in self._running),
            kv_usage=self.kv_manager.usage,
            num_kv_blocks=self.kv_manager.num_blocks,
            prefix_cache_queries=self.kv_manager.prefix_queries,
            prefix_cache_hits=self.kv_manager.prefix_hits,
            num_preemptions=self.num_preemptions,
            spec_drafted=list(self._spec_drafted),
            spec_accepted=list(self._spec_accepted),
            spec_verify_steps=self._spec_verify_steps,
            spec_tokens=self._spec_tokens,
        )
        for connector in self.connectors:
            connector.fill_stats(stats)
        return stats
