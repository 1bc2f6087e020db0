"""Messages across the engine's process boundaries, encoded with msgpack.

One msgspec struct per message; `encode` / `decode` turn them into msgpack
frames `[type name, fields]` (no pickle crosses a process boundary). `decode`
checks a frame against the struct it names (size, known type, known fields,
field types, nested messages included) and raises `MessageError` otherwise;
receivers drop such a frame with one log line and a count (`drop_frame`,
`dropped_frames`) and go on.

Boundaries:
  client  -> master   : AddRequest, AbortRequests, Shutdown, StatsQuery, AdminRequest, ReleaseKV
  master  -> client   : EngineReady, EngineOutputs (a batch of RequestDelta), EngineStats, EngineError, AdminReply
                        (a TE serving job executors answers each at the `reply_to` address its request named)
  master  -> JEs      : EngineHeartbeat (a TE's registration and load, repeated; `meshserve te --register`)
  decode master -> prefill master : ReleaseKV (the decode TE has the KV blocks: the prefill TE frees them)
  master  -> worker : StepBatch (one SchedulerOutput per DP group), Shutdown
  worker-> master   : ModelRunnerOutput, WorkerReady, WorkerFailure, WorkerEvent, KVConnectorReport
  worker<-> master  : WorkerHandshake (a rank on another host joining the TE)
  master  -> routers  : KVCacheEvents (PUB socket at EngineConfig.kv_events_endpoint)
  master  -> cluster manager : EngineHeartbeat (the manager is one more `--register` address; with its start-up
                        timeline, draining state and weight servers)
  JE      -> cluster manager : JobExecutorReport (routable TEs, per pool demand: held jobs, arrivals, TTFT, TPOT)
  warm TE <-> cluster manager : WarmReady (a pre-warmed process is ready), WarmAssign (become this TE)
  warm TE -> spare worker     : WorkerHandshake (the rank it becomes), Shutdown
  CLI     <-> cluster manager : ClusterQuery -> ClusterStatus (`meshserve status`, `cluster scale`, `cluster down`)

Kinds, finish reasons, errors and roles are string enums (their values are the words the API shows);
sampling settings travel as `SamplingParams` itself; operator commands and their results, expert
placement phases and prefix-cache events as typed structs.
"""
from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
from msgspec import field

from meshserve.config import EngineConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.utils.faults import Fault
from meshserve.utils.framing import FrameCodec

logger = logging.getLogger(__name__)


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every message: a frame naming a field the receiver's struct lacks is refused."""


# ---------------------------------------------------------------- enums
class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorType(enum.StrEnum):
    """The errors a master reports by class name when it refuses a request at admission (the caller raises
    the same class: meshserve.core.errors.ADMISSION_ERRORS)."""

    QUEUE_FULL = "QueueFullError"
    REQUEST_TOO_LONG = "RequestTooLongError"
    INVALID_REQUEST = "InvalidRequestError"
    SAMPLING_PARAMS = "SamplingParamsError"


def error_type_of(error: BaseException) -> ErrorType | None:
    """The admission error type of `error`; None for any other error (the caller sees a failed request)."""
    try:
        return ErrorType(type(error).__name__)
    except ValueError:
        return None


class EngineRole(enum.StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


class WorkerEventKind(enum.StrEnum):
    EPLB_PREFETCHED = "eplb_prefetched"  # this rank read the changing slots' weights
    EPLB_LOADED = "eplb_loaded"  # ... and copied them into the slots
    EPLB_FAILED = "eplb_failed"  # a phase failed on this rank (`detail`: why)
    WEIGHTS_SERVED = "weights_served"  # this rank's weight server has its snapshot (`detail`: its address)
    ROLLED_BACK = "rolled_back"  # a transient error: this rank rolled its step back and runs it again (`detail`: why)


class EplbPhase(enum.StrEnum):
    """The steps of a live expert-placement reconfiguration (meshserve.core.eplb_controller)."""

    PREFETCH = "prefetch"  # read the changing slots' weights in the background
    DISABLE_AND_LOAD = "disable_and_load"  # stop routing to those slots and copy the weights in
    ENABLE = "enable"  # switch to the new placement
    ABORT = "abort"  # a rank failed a phase: every rank drops the reconfiguration


class AdminOp(enum.StrEnum):
    EPLB_LOAD = "eplb.load"
    EPLB_STATUS = "eplb.status"
    EPLB_REBALANCE = "eplb.rebalance"
    STATS = "stats"
    KV_SNAPSHOT = "kv.snapshot"  # a router rebuilding its view of a TE's prefix caches
    CONTEXT_CACHE_DELETE = "context_cache.delete"  # unpin a named context cache's blocks
    CONTEXT_CACHE_LIST = "context_cache.list"
    DRAIN = "drain"  # finish the requests it has, take no new ones, then leave (a scale-down)
    FAULT_INJECT = "fault.inject"  # arm a fault (tests and benchmarks only: `meshserve.utils.faults`)


# ---------------------------------------------------------------- expert placement
class PlacementData(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """An expert placement as it crosses a process: `ExpertPlacement.to_dict()` typed (JSON keys)."""

    format: str
    num_logical: int
    num_ranks: int
    redundant_per_rank: int
    layers: dict[str, list[int]]  # layer index -> the logical expert in each physical slot
    slots_per_rank: int | None = None  # uneven placements only
    replicas: dict[str, list[list[int]]] | None = None  # derived from `layers`: the slots of each expert

    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)


class EplbCommand(msgspec.Struct, forbid_unknown_fields=True):
    """One reconfiguration phase every rank applies at the same step boundary."""

    phase: EplbPhase
    placement: PlacementData | None = None  # the placement to move to (PREFETCH only)


# ---------------------------------------------------------------- KV connectors (remote KV: memory pool, P/D)
class KVTransferRole(enum.StrEnum):
    PRODUCER = "producer"  # a prefill TE: compute the prompt, sample the first token, hold the KV for a decode TE
    CONSUMER = "consumer"  # a decode TE: pull the prompt's KV from the prefill TE, then decode


class KVRegionLayer(Message):
    shape: list[int]
    dtype: str


class KVShmSegment(Message):
    shm_name: str
    shape: list[int]
    dtype: str


class KVRegion(Message):
    """One rank's KV cache as its transfer engine exposes it (`transfer.RegionDescriptor`, typed)."""

    engine: str
    region: str
    layers: list[KVRegionLayer]
    host_id: str
    tcp_address: tuple[str, int] | None = None
    shm: list[KVShmSegment] | None = None  # per layer, when the cache lives in shared memory
    device: str = "cpu"
    device_id: str | None = None  # which GPU holds it (its UUID)


class KVTransferParams(Message):
    """A request's part in disaggregated prefill/decode (xdeepserve §5.1).

    To a prefill TE: `role` PRODUCER only. A prefill TE's hand-off (RequestDelta) describes where the prompt's
    KV blocks wait, with role CONSUMER: the router forwards it to the decode TE as it is (`recompute`: the blocks
    may be gone, compute the prompt instead).
    """

    role: KVTransferRole
    engine: str = ""  # the prefill TE's name (its transfer engines' peer name)
    engine_addr: str = ""  # its input address: ReleaseKV goes there
    dp_rank: int = 0  # the DP group holding the blocks
    attn_tp: int = 1
    attn_dp: int = 1
    regions: list[KVRegion] = field(default_factory=list)  # that DP group's ranks' KV caches, by attention-TP rank
    block_ids: list[int] = field(default_factory=list)  # the prompt's blocks there, in order
    num_tokens: int = 0  # prompt tokens whose KV the blocks hold
    num_cached_tokens: int = 0  # of which the prefill TE found in its prefix cache
    hold_s: float = 0.0  # how long the prefill TE holds the blocks, and until when (wall clock: another host)
    hold_expires_at: float | None = None
    recompute: bool = False


class PoolBlock(Message, array_like=True):
    block_id: int
    key: str  # the block's pool key (meshserve.pool.context_keys; each rank adds its rank_key part)


class PoolFetch(Message):
    """Populate `blocks` of one request from the memory pool (deepserve RTC populate)."""

    req_id: str
    blocks: list[PoolBlock]


class KVPull(Message):
    """Pull one request's prompt blocks from a prefill TE."""

    req_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    # the prefill rank each attention-TP rank of this DP group reads from (meshserve.core.pd_mapping)
    sources: list[KVRegion]


class KVConnectorMetadata(Message):
    """One DP group's remote-KV work of a step boundary: every rank of the group starts it before the step."""

    pool_stores: list[PoolBlock] = field(default_factory=list)  # full blocks to copy to the memory pool
    pool_fetches: list[PoolFetch] = field(default_factory=list)
    kv_pulls: list[KVPull] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.pool_stores or self.pool_fetches or self.kv_pulls)


class PoolFetchDone(Message, array_like=True):
    req_id: str
    num_blocks: int  # the leading ordered blocks this rank wrote (fewer: the pool lost the next one)


class KVPullDone(Message):
    req_id: str
    error: str | None = None  # why the pull failed; None: the blocks are in


class LinkProbe(Message):
    """One link probe of a decode rank (xdeepserve §6.1): a tiny dummy transfer from a prefill rank's transfer
    engine (`peer`, its name there), timed."""

    peer: str
    ok: bool
    rtt_s: float  # the round trip (a failure: how long until it failed)
    error: str | None = None


class KVConnectorReport(Message):
    """What one rank's connectors finished in the background since its last report."""

    rank: int
    dp_rank: int
    pool_fetches: list[PoolFetchDone] = field(default_factory=list)
    kv_pulls: list[KVPullDone] = field(default_factory=list)
    link_probes: list[LinkProbe] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.pool_fetches or self.kv_pulls or self.link_probes)


class LinkState(enum.StrEnum):
    """A decode TE's KV transfer path from one prefill TE (`meshserve.core.link_monitor`)."""

    OK = "ok"
    SATURATED = "saturated"  # probes pass, pulls are slow or wait for blocks: the decode side is busy
    DOWN = "down"  # probes fail: nothing goes through; routing pairs neither TE with the other


class LinkStatus(Message):
    """One decode TE -> prefill TE link as the decode TE sees it (its pulls and its ranks' probes)."""

    decode: str  # the TE reporting it
    prefill: str  # the TE its ranks pull from
    state: LinkState = LinkState.OK
    since: float = 0.0  # when it entered that state (wall clock)
    rtt_s: float = 0.0  # the last probe's round trip (the slowest rank's)
    consecutive_failures: int = 0  # probes failed in a row (the rank with the most)
    probes: int = 0
    probe_failures: int = 0
    pulls: int = 0
    pull_failures: int = 0
    slow_pulls: int = 0  # pulls that took longer than the stall threshold
    last_error: str | None = None


# ---------------------------------------------------------------- master -> worker
class NewRequestData(Message):
    """A request the worker has not seen, or one resumed after preemption."""

    req_id: str
    token_ids: list[int]  # prompt (+ outputs so far when resumed after preemption)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # already in the cache (prefix-cache hit, or fetched from the pool)
    num_prompt_tokens: int  # the original prompt length (penalties use output tokens only)


class CachedRequestData(Message):
    """A request the worker already holds; it continues from its own token state."""

    req_id: str
    new_block_ids: list[int]  # appended to the request's block table
    num_computed_tokens: int


class SchedulerOutput(Message):
    step_id: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # requests the worker must forget (finished, aborted or preempted) before this step
    finished_req_ids: list[str] = field(default_factory=list)
    # speculative decoding: drafts the MTP layers propose after this step for every request that produced a token
    # (0: none this step). A decode scheduled for 1 + j tokens verifies up to j of its drafts.
    num_draft_tokens: int = 0
    # the MTP layer fills its KV for the positions this step makes final even without drafting (false only where
    # speculation is off for large batches, whose cost it would add to)
    mtp_catch_up: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class StepBatch(Message):
    """One lockstep step of every rank: DP group g runs `per_dp[g]` (empty when it has no work;
    its ranks still join the step's MoE collectives)."""

    per_dp: list[SchedulerOutput] = field(default_factory=list)  # empty: a control-only batch, no forward
    # between-step commands every rank applies before the step
    eplb: EplbCommand | None = None  # a phase of an expert-placement reconfiguration
    report_load: bool = False  # the driver ranks report their tokens per expert with this step's output
    # DP group -> its KV connectors' work (pool stores and fetches, KV pulls); groups without any are absent
    kv_connector: dict[int, KVConnectorMetadata] = field(default_factory=dict)


# ---------------------------------------------------------------- worker -> master
class SampleLogprobs(Message, array_like=True):
    """Log-probabilities at one sampled position, on the model's raw distribution: the chosen token's, and the
    requested number of top alternatives as (token id, logprob), most likely first."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class ModelRunnerOutput(Message):
    step_id: int
    dp_rank: int = 0  # the DP group whose driver rank reports this step
    # tokens per logical expert of each MoE layer since the last report ([layer][expert]), when asked
    expert_load: list[list[int]] | None = None
    # one entry per request that produced tokens this step (its prefill completed or it decoded): one token, or
    # under speculative decoding its accepted drafts followed by one token sampled from the main model
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> each produced token's logprobs, for requests that asked for them
    logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
    # req_id -> drafts verified this step (speculative decoding; len(sampled) - 1 of them were accepted)
    num_drafts: dict[str, int] = field(default_factory=dict)
    # req_id -> why that request failed on the worker (e.g. its sampler raised); the step's other
    # requests are unharmed, and the worker no longer runs the failed ones
    failed: dict[str, str] = field(default_factory=dict)
    execute_seconds: float = 0.0


class WorkerReady(Message):
    rank: int
    num_kv_blocks: int
    kv_bytes_per_token: int
    kv_region: KVRegion | None = None  # this rank's KV cache as its transfer engine exposes it, P/D TEs only
    moe_layers: list[int] = field(default_factory=list)  # decoder-layer indices of the MoE layers
    num_logical_experts: int = 0  # routed experts per MoE layer
    vocab_size: int = 0  # token ids the model takes and samples: [0, vocab_size)
    # how this rank got its weights (wall-clock times): "disk", "page-cache", "pool" or "fork", and the bytes read
    load_start: float = 0.0
    load_end: float = 0.0
    load_source: str = ""
    load_bytes: int = 0
    weights_addr: str = ""  # this rank's weight server (`serve_weights`): new TEs of the same layout fork from it


class WorkerEvent(Message):
    """Something an worker finished in the background (an expert-placement phase, ...)."""

    rank: int
    kind: WorkerEventKind
    detail: str = ""  # EPLB_FAILED: the error


class WorkerFailure(Message):
    rank: int
    message: str


# ---------------------------------------------------------------- health and faults (xdeepserve §6)
class WorkerPing(Message):
    """master -> every rank, behind the queued steps: a rank answers from its loop, between steps, so a rank
    stuck in a kernel or a collective stays silent."""

    seq: int


class WorkerPong(Message):
    rank: int
    seq: int


class InjectFault(Message):
    """master -> every rank: arm a fault there (`meshserve.utils.faults`; tests and benchmarks only)."""

    fault: Fault


class WorkerHandshake(Message):
    """A rank on another host joining a TE: it sends only its `rank`; the master answers with
    the engine config and the rank's addresses, or with `error` when it cannot take that rank."""

    rank: int
    config: EngineConfig | None = None
    work_addr: str = ""
    result_addr: str = ""
    dist_init_method: str | None = None
    error: str | None = None


# ---------------------------------------------------------------- client <-> master
class AddRequest(Message):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower runs first; FCFS within a priority
    eos_token_ids: list[int] = field(default_factory=list)
    reply_to: str = ""  # a TE serving job executors sends this request's outputs here (output short-circuiting)
    kv_transfer: KVTransferParams | None = None  # disaggregated prefill/decode: this TE's part
    output_token_ids: list[int] = field(default_factory=list)  # tokens already generated elsewhere (decode TE)
    # explicit context caching (deepserve MatchByID): with a ttl this request creates the named cache (its prompt's
    # full blocks stay pinned under the id until the ttl ends or it is deleted); without, it reuses the cache's blocks
    context_cache_id: str | None = None
    context_cache_ttl_s: float | None = None


class AbortRequests(Message):
    req_ids: list[str]


class ReleaseKV(Message):
    """The KV blocks held for these requests' decode may be freed (pulled, or never to be pulled)."""

    req_ids: list[str]


class RequestDelta(Message):
    """New tokens of one request since the last message."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    new_logprobs: list[SampleLogprobs] | None = None  # per new token, when requested
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    error_type: ErrorType | None = None  # an admission error the caller raises as its own class
    # a prefill TE's hand-off: where the request's KV blocks wait for the decode TE (`kv_transfer` producer)
    kv_transfer_params: KVTransferParams | None = None


class EngineOutputs(Message):
    deltas: list[RequestDelta] = field(default_factory=list)
    timestamp: float = 0.0


class StatsQuery(Message):
    reply_to: str = ""


class EngineStats(Message):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    pool_hit_tokens: int = 0  # prompt tokens fetched from the memory pool instead of computed
    waiting_tokens: int = 0  # prompt tokens admitted and not yet computed (load for routing)
    running_tokens: int = 0  # tokens in the KV cache of running requests
    kv_transfer_holds: int = 0  # requests whose KV blocks wait for a decode TE to pull them
    kv_pulled: int = 0  # requests whose prompt KV came from a prefill TE
    kv_pull_recomputed: int = 0  # ... of which the pull failed and the prompt was computed here instead
    # speculative decoding, since start: per draft position, drafts verified and drafts accepted; decode steps
    # (one per request and step) that verified drafts, and the tokens those steps produced
    spec_drafted: list[int] = field(default_factory=list)
    spec_accepted: list[int] = field(default_factory=list)
    spec_verify_steps: int = 0
    spec_tokens: int = 0
    # bad frames the TE's master dropped, per receiving socket (e.g. "te-inbox", "worker-results")
    dropped_frames: dict[str, int] = field(default_factory=dict)
    # link probing (xdeepserve §6.1): a decode TE's KV transfer paths from the prefill TEs it pulls from
    links: list[LinkStatus] = field(default_factory=list)
    # fault tolerance (xdeepserve §6): steps rolled back and run again, recoveries of the worker ranks (a rank
    # died or hung), requests moved to other DP groups or continued after a recovery from their tokens so far
    num_rollbacks: int = 0
    num_recoveries: int = 0
    num_migrated: int = 0
    world_size: int = 0  # ranks serving now (fewer than configured while shrunk after a rank died)
    recovering: str | None = None  # why the ranks are being restarted now (None: serving)
    last_failure: str | None = None  # what the last recovery was for
    last_failure_silent_s: float = 0.0  # a hung rank: how long it was silent when found (the detection time)
    healthy: bool = True
    error: str | None = None


def spec_totals(parts: list[EngineStats]) -> dict[str, object]:
    """The speculative-decoding counters of several schedulers or engines, summed (as EngineStats fields)."""
    width = max((len(p.spec_drafted) for p in parts), default=0)

    def column_sums(rows: list[list[int]]) -> list[int]:
        return [sum(row[i] for row in rows if i < len(row)) for i in range(width)]

    return {"spec_drafted": column_sums([p.spec_drafted for p in parts]),
            "spec_accepted": column_sums([p.spec_accepted for p in parts]),
            "spec_verify_steps": sum(p.spec_verify_steps for p in parts),
            "spec_tokens": sum(p.spec_tokens for p in parts)}


class EngineReady(Message):
    num_kv_blocks: int
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    vocab_size: int = 0  # token ids the model takes: [0, vocab_size)


class EngineError(Message):
    message: str
    fatal: bool = True
    engine: str = ""  # the TE's name (EngineConfig.te_name)


class KVCacheEvent(msgspec.Struct, tag_field="type", tag=True, forbid_unknown_fields=True):
    """A prefix-cache change of one DP group's KV cache manager; "type" names the kind on the wire."""


class BlockStored(KVCacheEvent):
    """Full blocks that joined the prefix tree, as one chain under `parent_block_hash`."""

    block_hashes: list[int]
    parent_block_hash: int | None  # None: the chain starts at the root
    token_ids: list[int]  # len(block_hashes) * block_size tokens, in order
    block_size: int


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]


class AllBlocksCleared(KVCacheEvent):
    pass


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVCacheEvents(Message):
    """Prefix-cache changes of one TE, published for routers that keep a global prompt tree."""

    seq: int  # increases by one per batch, so a subscriber can detect a gap and resync
    timestamp: float
    events: list[CacheEvent] = field(default_factory=list)
    dp_rank: int = 0  # the DP group whose cache changed (each DP group has its own KV pool)
    engine: str = ""  # the TE's name (EngineConfig.te_name)


class AdminRequest(Message):
    """An operator command to the master; the arguments an operation takes are fields of their own."""

    query_id: int
    op: AdminOp
    placement: PlacementData | None = None  # EPLB_REBALANCE: the placement to move to (None: plan one)
    cache_id: str | None = None  # CONTEXT_CACHE_DELETE: the cache to unpin
    fault: Fault | None = None  # FAULT_INJECT: the fault to arm
    reply_to: str = ""

    @classmethod
    def of(cls, query_id: int, op: str, args: dict | None = None, reply_to: str = "") -> AdminRequest:
        """The command an operator's `(op, {"placement": ..., "id": ...})` call names; ValueError for an
        unknown operation or argument, msgspec.ValidationError (a ValueError) for a malformed placement."""
        try:
            op = AdminOp(op)
        except ValueError:
            raise ValueError(f"unknown admin operation {op!r}") from None
        args = dict(args or {})
        unknown = set(args) - {"placement", "id", "fault"}
        if unknown:
            raise ValueError(f"{op} takes no argument(s) {', '.join(sorted(map(str, unknown)))}")
        placement = args.get("placement")
        cache_id = args.get("id")
        fault = args.get("fault")
        if op is AdminOp.FAULT_INJECT and fault is None:
            raise ValueError("fault.inject needs a fault: {\"kind\": ..., ...}")
        return cls(query_id=query_id, op=op, reply_to=reply_to,
                   placement=None if placement is None else msgspec.convert(placement, PlacementData),
                   cache_id=None if cache_id is None else str(cache_id),
                   fault=None if fault is None else msgspec.convert(fault, Fault))


# ---------------------------------------------------------------- admin results (AdminReply.data)
class AdminResult(msgspec.Struct, tag_field="result", tag=True, forbid_unknown_fields=True):
    """The result of one admin operation; "result" names its kind on the wire."""

    def to_json(self) -> dict:
        """The result as the HTTP API shows it."""
        data = msgspec.to_builtins(self)
        data.pop("result", None)
        return data


class ExpertLoad(AdminResult):
    """EPLB_LOAD: tokens per logical expert of each MoE layer, per time slice (ExpertLoadRecord.to_dict())."""

    format: str
    num_logical: int
    moe_layers: list[int]
    slice_seconds: float
    slice_start_times: list[float]
    counts: list[list[list[int]]]  # [slice][layer][expert]


class EplbStatus(AdminResult):
    """EPLB_STATUS / EPLB_REBALANCE: the placement in use and the reconfiguration's state."""

    enabled: bool
    phase: str  # "idle", or where a reconfiguration stands ("prefetching", "loading", ...)
    num_reconfigurations: int
    last_error: str | None
    last_started_at: float | None  # unix times of the last reconfiguration
    last_finished_at: float | None
    num_slices: int
    slice_seconds: float
    interval_seconds: float | None
    placement: PlacementData | None


class StatsResult(AdminResult):
    """STATS: the TE's counters."""

    stats: EngineStats

    def to_json(self) -> dict:
        return msgspec.to_builtins(self.stats)


CachedBlock = tuple[int, int | None, list[int]]  # block hash, parent block hash (None at the root), token ids


class KVSnapshot(AdminResult):
    """KV_SNAPSHOT: every cached block of each DP group, parents first, as of KVCacheEvents batch `seq`."""

    seq: int
    blocks: dict[int, list[CachedBlock]]


class ContextCacheDeleted(AdminResult):
    id: str
    deleted: bool  # False: no DP group pinned it (expired, or never created)


class ContextCacheInfo(msgspec.Struct, forbid_unknown_fields=True):
    dp_rank: int
    num_tokens: int
    expires_in_s: float


class ContextCacheListing(AdminResult):
    caches: dict[str, ContextCacheInfo]

    def to_json(self) -> dict:
        return msgspec.to_builtins(self.caches)


AdminData = ExpertLoad | EplbStatus | StatsResult | KVSnapshot | ContextCacheDeleted | ContextCacheListing


class AdminReply(Message):
    query_id: int
    ok: bool = True
    data: AdminData | None = None
    error: str | None = None

    def to_json(self) -> dict:
        """The result as the HTTP API shows it ({} without one)."""
        return self.data.to_json() if self.data is not None else {}


class Shutdown(Message):
    pass


class StartupTimeline(Message):
    """When a TE went through its start-up steps (wall-clock `time.time()`; 0: not reached), so the cluster
    manager can time each scale-up step by step (deepserve §6: TE-Pre-Load, TE-Load, TE-Post-Load)."""

    process_start: float = 0.0  # the process started, or a pre-warmed one was handed this TE
    load_start: float = 0.0  # the first rank began reading weights (process start up to here: TE-Pre-Load)
    load_end: float = 0.0  # the last rank holds its weights (TE-Load)
    ready: float = 0.0  # KV cache allocated and the warm-up request answered: it can serve (TE-Post-Load)
    load_source: str = ""  # disk | page-cache | pool | fork
    load_bytes: int = 0  # weight bytes all ranks read
    prewarmed: bool = False  # the TE ran in a pre-warmed process


class EngineHeartbeat(Message):
    """A TE announcing itself to a job executor, repeated every heartbeat interval: its registration
    (addresses, role, layout) and its current load. A JE that misses several heartbeats drops the TE."""

    name: str
    role: EngineRole
    group: str  # the deployment's TE group
    input_addr: str  # where the JE sends AddRequest / AbortRequests / StatsQuery / AdminRequest
    kv_events_addr: str  # the TE's KVCacheEvents PUB socket
    model: str
    max_model_len: int
    block_size: int
    attn_tp: int
    attn_dp: int
    stats: EngineStats = field(default_factory=EngineStats)
    kv_event_seq: int = 0  # the last KVCacheEvents seq published (a subscriber that lags behind resyncs)
    timestamp: float = 0.0
    leaving: bool = False  # the TE is shutting down: route nothing new to it
    draining: bool = False  # the TE finishes what it runs and then leaves: route nothing new to it
    pid: int = 0  # the master's process id
    startup: StartupTimeline | None = None
    weights_addrs: list[str] = field(default_factory=list)  # per rank: its weight server, for forks


# ---------------------------------------------------------------- the cluster manager (meshserve.cluster)
class GroupDemand(Message):
    """What one job executor saw of one TE group since its last report (the autoscaler's request signals)."""

    group: str
    held: int = 0  # jobs waiting for the group to have a TE (it scaled to zero): held, not rejected
    held_oldest_s: float = 0.0  # how long the oldest held job has waited
    arrivals: int = 0  # jobs routed to the group
    ttft_s: list[float] = field(default_factory=list)  # time to first token of jobs that got one (bounded)
    tpot_s: list[float] = field(default_factory=list)  # mean time per output token of jobs that finished (bounded)


class JobExecutorReport(Message):
    """A job executor to the cluster manager, every report interval: who it is, the TEs it routes to, demand."""

    name: str
    http_addr: str  # http://HOST:PORT
    register_addr: str  # where TEs register with it
    pid: int
    te_names: list[str] = field(default_factory=list)  # TEs registered and routable (not draining)
    groups: list[GroupDemand] = field(default_factory=list)
    timestamp: float = 0.0


class WarmReady(Message):
    """A pre-warmed TE process to the cluster manager: imports, native kernels and spare worker processes are
    ready; it becomes a TE when it gets a `WarmAssign` at `assign_addr`."""

    name: str
    pid: int
    assign_addr: str
    num_workers: int  # spare worker processes it holds (a TE of more ranks starts the rest)
    host: str = ""


class WarmAssign(Message):
    """Become this TE (what `meshserve te` would run): settings, role, group and JEs to register with."""

    config: EngineConfig
    role: EngineRole
    group: str
    listen: str
    register: list[str]
    assigned_at: float = 0.0  # when the manager handed it over (the step's start)


class ClusterQuery(Message):
    """`meshserve status` / `cluster down` / `cluster scale` / `cluster capacity` to the manager's control socket."""

    op: str = "status"  # status | down | scale | capacity
    pool: str = ""  # scale: the pool ("GROUP/ROLE")
    target: int = 0  # scale: TEs it should run; capacity: the devices (ranks) usable now


class TEStatus(Message):
    name: str
    group: str
    role: str
    state: str  # starting | ready | draining | dead
    pid: int = 0
    host: str = ""
    source: str = ""  # how it started: cold | prewarmed | fork (+ its weight source)
    restarts: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    uptime_s: float = 0.0


class GroupStatus(Message):
    group: str
    role: str
    current: int
    target: int
    min_count: int
    max_count: int
    reason: str = ""  # the last scaling decision's reason


class JEStatus(Message):
    name: str
    http_addr: str
    pid: int = 0
    state: str = ""  # ready | starting | dead


class ClusterStatus(Message):
    name: str
    backend: str
    manager_pid: int
    tes: list[TEStatus] = field(default_factory=list)
    groups: list[GroupStatus] = field(default_factory=list)
    jes: list[JEStatus] = field(default_factory=list)
    warm: int = 0  # pre-warmed TE processes idle
    events: list[str] = field(default_factory=list)  # the latest scaling and healing decisions, newest last
    ok: bool = True
    error: str | None = None


_MESSAGE_TYPES = {
    cls.__name__: cls
    for cls in (
        NewRequestData, CachedRequestData, SchedulerOutput, StepBatch, ModelRunnerOutput, WorkerReady, WorkerFailure,
        WorkerHandshake,
        AddRequest, AbortRequests, RequestDelta, EngineOutputs, StatsQuery, EngineStats, EngineReady, EngineError,
        KVCacheEvents, Shutdown, WorkerEvent, AdminRequest, AdminReply, ReleaseKV, EngineHeartbeat,
        KVConnectorReport, StartupTimeline, GroupDemand, JobExecutorReport, WarmReady, WarmAssign, ClusterQuery,
        TEStatus, GroupStatus, JEStatus, ClusterStatus, WorkerPing, WorkerPong, InjectFault,
    )
}


def encode(msg: Message) -> bytes:
    return _CODEC.encode(msg)


# ---------------------------------------------------------------- decoding and validation
class MessageError(ValueError):
    """A frame that is not a valid message: its receiver logs it, counts it and drops it."""


_CODEC = FrameCodec(_MESSAGE_TYPES.values(), MessageError, "message")


# the largest frame any internal socket takes: far above the largest legitimate message (a step
# whose new requests carry long prompts, a prefix-cache snapshot), far below what hurts the host
MAX_MESSAGE_BYTES = 256 * 2**20
# a TE's input socket takes requests from other hosts: one prompt of a million tokens still fits
MAX_INBOX_BYTES = 64 * 2**20


class RefusedFrame(MessageError):
    """A request frame that fails its checks but still says who asked and where to answer (`answer`,
    `reply_to`): its receiver answers it with this error, so a bad request fails alone and is never lost
    unanswered (e.g. sampling params out of range, an unknown admin operation)."""

    def __init__(self, reason: str, answer: Message, reply_to: str) -> None:
        super().__init__(reason)
        self.answer = answer
        self.reply_to = reply_to


class _RequestHeader(msgspec.Struct):
    """The part of an AddRequest an error answer needs (other fields are ignored)."""

    req_id: str
    reply_to: str = ""


class _AdminHeader(msgspec.Struct):
    query_id: int
    reply_to: str = ""


# what an admin request's malformed field means to the operator
_ADMIN_FIELD_ERRORS = {"op": f"unknown admin operation (one of {', '.join(AdminOp)})",
                       "placement": "not a meshserve expert placement",
                       "cache_id": "context_cache.delete needs a cache id (a string)"}


def _refused_request(header: _RequestHeader, reason: str) -> Message:
    error_type = ErrorType.SAMPLING_PARAMS if "`$.sampling_params" in reason else ErrorType.INVALID_REQUEST
    return EngineOutputs(deltas=[RequestDelta(req_id=header.req_id, new_token_ids=[],
                                              finish_reason=FinishReason.ERROR, error=f"bad request: {reason}",
                                              error_type=error_type)], timestamp=time.time())


def _refused_admin(header: _AdminHeader, reason: str) -> Message:
    bad_field = reason.rpartition("at `$.")[2].split(".")[0].split("`")[0]
    meaning = _ADMIN_FIELD_ERRORS.get(bad_field, "bad admin request")
    return AdminReply(query_id=header.query_id, ok=False, error=f"{meaning}: {reason}")


_ANSWERABLE = {"AddRequest": (msgspec.msgpack.Decoder(_RequestHeader), _refused_request),
               "AdminRequest": (msgspec.msgpack.Decoder(_AdminHeader), _refused_admin)}


def _refusal(name: str, fields: msgspec.Raw, reason: str) -> MessageError:
    """A RefusedFrame when the frame still names who to answer; a plain MessageError otherwise."""
    answerable = _ANSWERABLE.get(name)
    if answerable is None:
        return MessageError(f"bad {name}: {reason}")
    header_decoder, make_answer = answerable
    try:
        header = header_decoder.decode(fields)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return MessageError(f"bad {name}: {reason}")
    return RefusedFrame(f"bad {name}: {reason}", make_answer(header, reason), header.reply_to)


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message in `data`; MessageError for an oversized, malformed or unknown frame, or for fields
    unknown to or of the wrong type for the struct it names (nested messages included); RefusedFrame
    (a MessageError) for a request that can still be answered."""
    if len(data) > max_bytes:
        raise MessageError(f"a frame of {len(data)} bytes exceeds the limit of {max_bytes}")
    name, fields = _CODEC.open(data)
    try:
        return _CODEC.decode_fields(name, fields)
    except msgspec.ValidationError as exc:
        raise _refusal(name, fields, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise MessageError(f"not msgpack: {exc}") from None


# ---------------------------------------------------------------- dropped frames
_dropped_lock = threading.Lock()
_dropped: collections.Counter = collections.Counter()


def drop_frame(socket_name: str, error: Exception | str) -> None:
    """Count a frame a receiver dropped and say why (the first ten per socket, then every thousandth,
    so a flood of bad frames cannot flood the log)."""
    with _dropped_lock:
        _dropped[socket_name] += 1
        count = _dropped[socket_name]
    if count <= 10 or count % 1000 == 0:
        logger.warning("dropped a bad frame on %s (%d so far): %s", socket_name, count, error)


def dropped_frames() -> dict[str, int]:
    """Frames this process dropped, per receiving socket."""
    with _dropped_lock:
        return dict(_dropped)


def recv_message(sock: zmq.Socket, socket_name: str, max_bytes: int = MAX_MESSAGE_BYTES,
                 on_refused: Callable[[RefusedFrame], None] | None = None) -> Message | None:
    """Receive one frame and decode it; a bad frame is dropped (logged, counted) and gives None, unless
    it is a request that can be answered and `on_refused` answers it."""
    data = sock.recv()
    try:
        return decode(data, max_bytes)
    except RefusedFrame as exc:
        if on_refused is None:
            drop_frame(socket_name, exc)
        else:
            on_refused(exc)
        return None
    except MessageError as exc:
        drop_frame(socket_name, exc)
        return None
