"""One TE on virtual time, run by the code a TE's master runs (meshserve/core): the DP waiting queue with its DP
balancer (one collaborative placement per step), each DP group's scheduler and KV cache manager, the speculation
controller, and on a decode TE the P/D connector's pull protocol. Only the ranks are not there: a step takes the
profile's time (meshserve/sim/profile.py, or the op model) for the work each group's scheduler chose, and produces
a made-up token for every request that reaches the end of its known tokens, as the benchmarks' null ranks do
(meshserve/worker/null_runner.py, whose code it runs). A verification accepts each draft with the settings'
MTP acceptance (given the drafts before it were accepted), and a KV pull lands after the profile's transfer time.

A step is scheduled, timed and applied before the next; the master's pipelining (step n + 1 scheduled while step n
runs) shows in when a new request is first seen (meshserve/sim/cluster.py).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from meshserve.config import EngineConfig, KVTransferConfig, PoolConfig, SchedulerConfig, SpeculativeConfig
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.kv_connector.pd import PDConnector, PDEndpoint, accept_kv_transfer
from meshserve.core.kv_connector.pool import PoolConnector
from meshserve.core.request import Request
from meshserve.core.scheduler import Scheduler
from meshserve.core.spec_controller import StepSpeculation
from meshserve.core.waiting_queue import DPWaitingQueue
from meshserve.pool.fetch_cost import FetchCostModel
from meshserve.sim.kv_pool import SimPool
from meshserve.sim.live_eplb import LiveEplb, LiveEplbSettings
from meshserve.sim.profile import GroupWork
from meshserve.sim.trace import TraceRequest
from meshserve.wire.client import RequestDelta
from meshserve.wire.kv import (
    KVConnectorReport,
    KVPullDone,
    KVRegion,
    KVTransferParams,
    KVTransferRole,
    PoolFetchDone,
)
from meshserve.wire.sampling_params import SamplingParams
from meshserve.wire.worker import ModelRunnerOutput, SchedulerOutput
from meshserve.worker.null_runner import NullRunner

PROMPT_VOCAB = 32_000  # the made-up prompts' token ids (distinct prompts: no prefix shared by chance)
PROMPT_HEAD = 16  # tokens drawn per prompt: a whole KV block at the default block size
_FILLER: list[int] = []  # the rest of every prompt, drawn once (seeded)


def draw_prompt(rng: random.Random, length: int) -> list[int]:
    """A made-up prompt of `length` token ids (the simulation's, and the real run's it is compared with): its first
    block drawn at random, so no two prompts share a cached prefix, then a fixed filler (drawing every token would
    cost more than serving the request in a large simulation)."""
    head = [rng.randrange(100, PROMPT_VOCAB) for _ in range(min(length, PROMPT_HEAD))]
    return head + _filler(length - len(head))


def _filler(length: int) -> list[int]:
    while len(_FILLER) < length:
        _FILLER.extend(random.Random(len(_FILLER)).randrange(100, PROMPT_VOCAB) for _ in range(4096))
    return _FILLER[:length]


@dataclass(frozen=True)
class SimTESettings:
    dp: int = 1  # DP groups, stepping in lockstep
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    num_kv_blocks: int = 4096  # per DP group
    block_size: int = 16
    max_waiting: int = 100_000
    # 2: the master schedules step n + 1 while step n runs (its default, `async_scheduling`); 1: one at a time
    pipeline_depth: int = 2
    num_draft_tokens: int = 0  # MTP drafts per decode and step (0: no speculative decoding)
    mtp_acceptance: float = 0.0  # the chance a draft is accepted when the drafts before it were
    speculative_max_batch: int = 0  # the speculation controller's setting (meshserve te --speculative-max-batch)
    # the TE's part in P/D, as `meshserve te --role` sets it: "producer" (prefill: it computes a prompt and its
    # first token, then holds the KV for a decode TE), "consumer" (decode: a request arrives with its first token
    # and the P/D connector pulls its prompt's KV), "none" (colocated)
    kv_transfer: str = "none"
    prefix_caching: bool = True  # off: no block is hashed (a trace without shared prefixes gains nothing from it)
    live_eplb: LiveEplbSettings | None = None  # an op model's expert placement moved while serving (sim/live_eplb.py)
    kv_pool_latency_s: float | None = None  # the memory pool's round trip (sim/kv_pool.py); None: no pool

    def __post_init__(self) -> None:
        if self.pipeline_depth not in (1, 2):
            raise ValueError(f"pipeline_depth must be 1 or 2, got {self.pipeline_depth!r}")
        if not 0.0 <= self.mtp_acceptance <= 1.0:
            raise ValueError(f"mtp_acceptance must be in [0, 1], got {self.mtp_acceptance!r}")
        if self.kv_transfer not in ("none", "producer", "consumer"):
            raise ValueError(f"kv_transfer must be none, producer or consumer, got {self.kv_transfer!r}")
        if not 0 <= self.num_draft_tokens <= 8:
            raise ValueError(f"num_draft_tokens must be 0 to 8, got {self.num_draft_tokens!r}")
        for name in ("dp", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "block_size",
                     "max_waiting"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


class SimTE:
    def __init__(self, settings: SimTESettings, profile, seed: int = 0, name: str = "te",
                 send_release: Callable[[str, list[str]], None] | None = None, pool: SimPool | None = None) -> None:
        """`profile`: a `StepProfile` or an `OpStepModel` (what a step costs, and a KV pull). `send_release`: a
        decode TE's ReleaseKV to the prefill TE (its input address, the requests) once it pulled their KV. `pool`:
        the memory pool the deployment's TEs share (one of its own without)."""
        self.settings, self.profile, self.name = settings, profile, name
        self.now = 0.0  # the virtual clock, as this TE last saw it
        config = SchedulerConfig(max_num_seqs=settings.max_num_seqs,
                                 max_num_batched_tokens=settings.max_num_batched_tokens,
                                 max_model_len=settings.max_model_len, max_waiting=settings.max_waiting)
        self.kv_transfer = KVTransferConfig(kv_transfer=settings.kv_transfer)
        self.schedulers = []
        self.pool, self.fetch_cost = None, None
        if settings.kv_pool_latency_s is not None:
            self.pool, self.fetch_cost = pool or SimPool(), _fetch_cost(profile, settings)
        for group in range(settings.dp):
            kv_manager = KVCacheManager(settings.num_kv_blocks, settings.block_size, settings.prefix_caching)
            connectors = [] if settings.kv_transfer == "none" else [PDConnector(
                self.kv_transfer, kv_manager, _endpoint(name, group, settings.dp), send_release or _no_release,
                clock=self.clock, wall_clock=self.clock)]
            if self.pool is not None:  # the connector the engine runs, one per DP group, sharing the cost model
                connectors.append(PoolConnector(PoolConfig(), self.pool, "simulated", settings.block_size, 1,
                                                self.fetch_cost))
            self.schedulers.append(Scheduler(config, kv_manager, connectors, settings.num_draft_tokens))
        self.queue = DPWaitingQueue(self.schedulers, settings.max_waiting, settings.block_size)
        speculative = SpeculativeConfig(speculative="mtp" if settings.num_draft_tokens else "none",
                                        num_speculative_tokens=max(1, settings.num_draft_tokens),
                                        speculative_max_batch=settings.speculative_max_batch)
        self.speculation = StepSpeculation(speculative)
        # the null ranks' token bookkeeping, one driver per group
        engine = EngineConfig.from_kwargs("simulated", num_kv_blocks=settings.num_kv_blocks)
        self.ranks = [NullRunner(engine, SimpleNamespace(dp_rank=group, is_driver=True))
                      for group in range(settings.dp)]
        self._rng = random.Random(seed)
        live = settings.live_eplb
        self.eplb = None if live is None else LiveEplb(profile, live, self.clock, settings.dp, seed)
        self._pulls: list[tuple[float, int, str]] = []  # KV pulls in flight: (lands at, group, request)
        self._fetches: list[tuple[float, int, str, int]] = []  # pool fetches: (lands at, group, request, blocks)
        self.num_steps = 0
        self.last_work: list[GroupWork] = []

    def clock(self) -> float:
        return self.now

    @property
    def step_timer(self):
        """What priced the last step: the profile, or under live EPLB the op model of the placement in use."""
        return self.profile if self.eplb is None else self.eplb.current_model()

    def draw_prompt(self, request: TraceRequest) -> list[int]:
        """`request`'s prompt: its shared prefix's tokens, if it has one, then tokens of its own."""
        own = draw_prompt(self._rng, request.prompt_len - request.prefix_len)
        return (shared_prefix(request.prefix_id, request.prefix_len) + own) if request.prefix_len else own

    def admit(self, req_id: str, request: TraceRequest, now: float, prompt: list[int] | None = None,
              handoff: KVTransferParams | None = None, first_token: int = 100) -> None:
        """A request of the trace arrives (with its `prompt`, else one drawn here). A decode TE takes the prefill
        TE's `handoff` with the `first_token`; without one the prompt's KV waits on a prefill TE that is not
        simulated."""
        self.now = max(self.now, now)
        prompt = self.draw_prompt(request) if prompt is None else prompt
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        req = Request(req_id, prompt, params, arrival_time=now)
        block_size = self.settings.block_size
        if self.settings.kv_transfer == "producer":
            accept_kv_transfer(self.kv_transfer, block_size, req, KVTransferParams(role=KVTransferRole.PRODUCER), [])
        elif self.settings.kv_transfer == "consumer":
            if handoff is None:
                handoff = KVTransferParams(role=KVTransferRole.CONSUMER, engine="prefill", engine_addr="prefill",
                                           regions=[_region("prefill")], num_tokens=request.prompt_len,
                                           block_ids=list(range(-(-request.prompt_len // block_size))))
            accept_kv_transfer(self.kv_transfer, block_size, req, handoff, [first_token])
        self.queue.admit(req)

    def release(self, req_ids: list[str]) -> None:
        """A prefill TE's ReleaseKV: the decode TE has the requests' KV (or never will)."""
        for scheduler in self.schedulers:
            for connector in scheduler.connectors:
                for req_id in req_ids:
                    connector.release(req_id)

    def num_holds(self) -> int:
        """KV blocks a prefill TE still holds for decode TEs, in requests."""
        return sum(len(c.holds) for s in self.schedulers for c in s.connectors)

    def has_work(self) -> bool:
        return bool(self.queue.pending) or any(s.has_unfinished_requests() for s in self.schedulers)

    def step(self, now: float = 0.0) -> tuple[float, list[RequestDelta]]:
        """One lockstep step of every group, starting at `now`: how long it takes, and the requests' new tokens
        and endings (a prefill TE's hand-offs carry `kv_transfer_params`)."""
        self.now = max(self.now, now)
        self._land_transfers(now)
        self.queue.place()
        self.speculation.decide(self.schedulers)
        scheduled = [scheduler.schedule() for scheduler in self.schedulers]
        plans = [_plan(scheduler, out) for scheduler, out in zip(self.schedulers, scheduled)]
        self.last_work = [_work(plan) for plan in plans]
        transfers = [pull[0] for pull in self._pulls] + [fetch[0] for fetch in self._fetches]
        if transfers and all(out.is_empty for out in scheduled):  # nothing to run until a pull or fetch lands
            seconds = max(0.0, min(transfers) - now)
            self.last_work = []  # a wait, not a step the profile prices
        elif self.eplb is not None:
            seconds = self.eplb.step_seconds(now, self.last_work)
        else:
            seconds = self.profile.step_seconds(self.last_work)
        deltas: list[RequestDelta] = []
        for group, (scheduler, ranks, out, plan) in enumerate(zip(self.schedulers, self.ranks, scheduled, plans)):
            result = ranks.execute_rolling_back(out)
            self._verify(plan, result)
            result.execute_seconds = seconds
            self.speculation.observe(out, result)
            deltas += scheduler.update_from_output(out, result)
            self._start_transfers(group, scheduler, now + seconds)
        self.queue.on_deltas(deltas)
        self.num_steps += 1
        return seconds, deltas

    def _verify(self, plan: list[_Scheduled], result: ModelRunnerOutput) -> None:
        """Each verified draft is accepted with the MTP acceptance while the ones before it were."""
        for item in plan:
            tokens = result.sampled.get(item.request.req_id)
            if not item.drafts or not tokens:
                continue
            accepted = 0
            while accepted < item.drafts and self._rng.random() < self.settings.mtp_acceptance:
                accepted += 1
            result.sampled[item.request.req_id] = tokens * (1 + accepted)
            result.num_drafts[item.request.req_id] = item.drafts

    def _start_transfers(self, group: int, scheduler: Scheduler, start: float) -> None:
        """What a step's scheduling ordered of the connectors, as the step ends: P/D pulls and pool fetches start
        and land a transfer's time later; the blocks it stored are in the pool."""
        meta = scheduler.build_connector_meta()
        if meta is None:
            return
        for pull in meta.kv_pulls:
            tokens = len(pull.dst_block_ids) * self.settings.block_size
            self._pulls.append((start + self.profile.kv_pull_seconds(tokens), group, pull.req_id))
        for fetch in meta.pool_fetches:
            blocks = len(fetch.blocks)
            self._fetches.append((start + self.fetch_cost.fetch_seconds(blocks), group, fetch.req_id, blocks))
        if meta.pool_stores:
            self.pool.store(block.key for block in meta.pool_stores)

    def _land_transfers(self, now: float) -> None:
        landed = [pull for pull in self._pulls if pull[0] <= now]
        fetched = [fetch for fetch in self._fetches if fetch[0] <= now]
        self._pulls = [pull for pull in self._pulls if pull[0] > now]
        self._fetches = [fetch for fetch in self._fetches if fetch[0] > now]
        for group in {group for _, group, _ in landed} | {group for _, group, _, _ in fetched}:
            report = KVConnectorReport(rank=group, dp_rank=group,
                                       kv_pulls=[KVPullDone(req_id) for _, g, req_id in landed if g == group],
                                       pool_fetches=[PoolFetchDone(req_id, blocks)
                                                     for _, g, req_id, blocks in fetched if g == group])
            self.schedulers[group].update_connector_output(report)

    def pool_hit_tokens(self) -> int:
        """Prompt tokens this TE fetched from the pool instead of computing them."""
        return sum(c.num_hit_tokens for s in self.schedulers for c in s.connectors if isinstance(c, PoolConnector))


def check_pool_timer(profile) -> None:
    """Refuse a step timer that cannot time the memory pool's fetches (ValueError)."""
    if not hasattr(profile, "kv_bytes_per_token"):
        raise ValueError("the memory pool is simulated with an op model (--hardware): a profile fitted on this "
                         "machine has no KV link")


def _fetch_cost(profile, settings: SimTESettings) -> FetchCostModel:
    """The served fetch-or-compute model for the step timer's KV (its bytes per token, over its KV link)."""
    check_pool_timer(profile)
    return FetchCostModel(block_bytes=round(profile.kv_bytes_per_token() * settings.block_size),
                          block_size=settings.block_size, latency_s=settings.kv_pool_latency_s,
                          bandwidth_bytes_per_s=profile.kv_link_bytes_per_s())


_PREFIXES: dict[int, list[int]] = {}


def shared_prefix(prefix_id: int, length: int) -> list[int]:
    """Shared prefix `prefix_id`'s first `length` tokens: the same in every request (and simulation) naming it."""
    tokens = _PREFIXES.get(prefix_id, [])
    if len(tokens) < length:
        rng = random.Random(f"prefix-{prefix_id}")
        tokens = _PREFIXES[prefix_id] = [rng.randrange(100, PROMPT_VOCAB) for _ in range(length)]
    return tokens[:length]


def _region(te: str) -> KVRegion:
    return KVRegion(engine=f"{te}-rank-0", region="kv", layers=[], host_id=te)


def _endpoint(te: str, group: int, dp: int) -> PDEndpoint:
    return PDEndpoint(engine=te, engine_addr=te, dp_rank=group, attn_tp=1, attn_dp=dp, regions=[_region(te)])


def _no_release(engine_addr: str, req_ids: list[str]) -> None:
    """ReleaseKV to the prefill TE: no prefill TE holds blocks in a decode-only simulation."""


@dataclass(frozen=True)
class _Scheduled:
    request: Request
    num_tokens: int
    computed_before: int
    drafts: int


def _plan(scheduler: Scheduler, out: SchedulerOutput) -> list[_Scheduled]:
    """What a group's step holds, request by request: its tokens, the tokens computed before, the drafts it
    verifies (the scheduler books a verification's first token only)."""
    before = {data.req_id: data.num_computed_tokens for data in (*out.new_reqs, *out.cached_reqs)}
    plan = []
    for req_id, num_tokens in out.num_scheduled_tokens.items():
        request = scheduler.get_request(req_id)
        drafts = before[req_id] + num_tokens - request.num_computed_tokens
        plan.append(_Scheduled(request, num_tokens, before[req_id], drafts))
    return plan


def _work(plan: list[_Scheduled]) -> GroupWork:
    """What a group's step computes: a decode row per request that only adds its last known token (attending to
    what came before) and the drafts it verifies, the rest prompt (or recomputed) tokens."""
    decode_rows = prefill_tokens = context = drafts = sampling = 0
    pairs = 0.0
    for item in plan:
        if item.num_tokens - item.drafts == 1 and item.computed_before >= item.request.num_tokens - 1:
            decode_rows += 1
            drafts += item.drafts
            context += item.computed_before
        else:
            prefill_tokens += item.num_tokens
            pairs += item.num_tokens * (item.computed_before + item.num_tokens / 2)
            sampling += item.computed_before + item.num_tokens >= item.request.num_tokens  # its last chunk
    return GroupWork(decode_rows, prefill_tokens, context, pairs, drafts, sampling)
