"""The engine-client <-> master protocol: requests in, token deltas out, stats and operator commands.

  client -> master : AddRequest, AbortRequests, ReleaseKV, StatsQuery, AdminRequest, Shutdown
  master -> client : EngineReady, EngineOutputs (a batch of RequestDelta), EngineStats, EngineError, AdminReply
                     (a TE serving job executors answers each at the `reply_to` address its request named)
  decode master -> prefill master : ReleaseKV (the decode TE has the KV blocks: the prefill TE frees them)

Finish reasons, error types and admin operations are string enums (their values are the words the API
shows); operator commands' results are tagged structs.
"""
from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import field

from meshserve.utils.faults import Fault
from meshserve.wire.base import Message
from meshserve.wire.eplb import PlacementData
from meshserve.wire.kv import KVTransferParams, LinkStatus, merge_links
from meshserve.wire.sampling_params import SamplingParams
from meshserve.wire.worker import SampleLogprobs


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorType(enum.StrEnum):
    """The errors a master reports by class name when it refuses a request at admission (the caller raises
    the same class: meshserve.wire.errors.ADMISSION_ERRORS)."""

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


class Tenancy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Whose request it is, as far as sharing goes (docs/caching.md#tenant-isolation).

    `tenant` names the sender (an opaque hash of its API key, or its client address; never a key): the
    master schedules tenants fairly against each other. `cache_salt` names the prefix-cache namespace:
    cached KV blocks (the local prefix cache, the memory pool, a router's prompt tree) are shared only
    between requests of equal salts. The HTTP frontend derives it from the tenant's namespace (its own, or
    the group an operator shares) and the request's own `cache_salt`; "" is the one unsalted namespace of a
    single-tenant engine.
    """

    tenant: str = ""
    cache_salt: str = ""


NO_TENANCY = Tenancy()


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
    tenancy: Tenancy = NO_TENANCY  # the sender (fair scheduling) and the prefix-cache namespace (cache isolation)


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
    microbatched_steps: int = 0  # steps run as two overlapped micro-batches (--microbatches 2)
    recovering: str | None = None  # why the ranks are being restarted now (None: serving)
    last_failure: str | None = None  # what the last recovery was for
    last_failure_silent_s: float = 0.0  # a hung rank: how long it was silent when found (the detection time)
    gc_marked_steps: int = 0  # steps after which every rank collected garbage (gc_collect_every_steps)
    requests_received: int = 0  # requests the TE took in since it started (a TE shell places by it)
    healthy: bool = True
    error: str | None = None

    @classmethod
    def merge(cls, parts: Sequence[EngineStats], **fields: Any) -> EngineStats:
        """Several DP groups' or TEs' stats as one: counts added up, KV usage weighted by each part's blocks,
        the speculative columns added position by position, dropped frames added per socket, links merged
        (`merge_links`: one status per link, the worst); healthy only if every part is. `fields` set what
        the parts cannot say (a TE's own failure counts, its health)."""
        num_blocks = sum(p.num_kv_blocks for p in parts)
        width = max((len(p.spec_drafted) for p in parts), default=0)

        def columns(rows: list[list[int]]) -> list[int]:
            return [sum(row[i] for row in rows if i < len(row)) for i in range(width)]

        dropped: collections.Counter = collections.Counter()
        for p in parts:
            dropped.update(p.dropped_frames)
        merged = {name: sum(getattr(p, name) for p in parts) for name in _ADDED_UP}
        merged.update(
            kv_usage=sum(p.kv_usage * p.num_kv_blocks for p in parts) / max(1, num_blocks),
            spec_drafted=columns([p.spec_drafted for p in parts]),
            spec_accepted=columns([p.spec_accepted for p in parts]),
            dropped_frames=dict(dropped), links=merge_links(link for p in parts for link in p.links),
            last_failure_silent_s=max((p.last_failure_silent_s for p in parts), default=0.0),
            healthy=all(p.healthy for p in parts))
        merged.update(fields)
        return cls(**merged)


# the EngineStats fields that add up over DP groups and TEs
_ADDED_UP = ("num_running", "num_waiting", "num_kv_blocks", "prefix_cache_queries", "prefix_cache_hits",
             "num_preemptions", "pool_hit_tokens", "waiting_tokens", "running_tokens", "kv_transfer_holds", "kv_pulled",
             "kv_pull_recomputed", "spec_verify_steps", "spec_tokens", "num_rollbacks", "num_recoveries",
             "num_migrated", "world_size", "microbatched_steps", "gc_marked_steps", "requests_received")



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
    round: int = 0  # the round of the move under way (a move of primaries takes several), of `rounds`
    rounds: int = 0


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
