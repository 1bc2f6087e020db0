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
  master  -> executor : StepBatch (one SchedulerOutput per DP group), Shutdown
  executor-> master   : ModelRunnerOutput, WorkerReady, WorkerFailure, WorkerEvent
  executor<-> master  : WorkerHandshake (a rank on another host joining the TE)
  master  -> routers  : KVCacheEvents (PUB socket at EngineConfig.kv_events_endpoint)
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import msgspec
import zmq
from msgspec import field

logger = logging.getLogger(__name__)


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every message: a frame naming a field the receiver's struct lacks is refused."""


# ---------------------------------------------------------------- master -> executor
class NewRequestData(Message):
    """A request the executor has not seen, or one resumed after preemption."""

    req_id: str
    token_ids: list[int]  # prompt (+ outputs so far when resumed after preemption)
    sampling_params: dict[str, Any]  # SamplingParams.to_dict()
    block_ids: list[int]
    num_computed_tokens: int  # already in the cache (prefix-cache hit, or fetched from the pool)
    num_prompt_tokens: int  # the original prompt length (penalties use output tokens only)


class CachedRequestData(Message):
    """A request the executor already holds; it continues from its own token state."""

    req_id: str
    new_block_ids: list[int]  # appended to the request's block table
    num_computed_tokens: int


class SchedulerOutput(Message):
    step_id: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # requests the executor must forget (finished, aborted or preempted) before this step
    finished_req_ids: list[str] = field(default_factory=list)

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
    # between-step commands every rank applies before the step, e.g. {"report_load": True},
    # {"eplb": {"phase": "prefetch", "placement": {...}}} (expert placement reconfiguration), or
    # {"pool_store": {dp_rank: [[block_id, key], ...]}} (full blocks to copy to the memory pool)
    control: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- executor -> master
class ModelRunnerOutput(Message):
    step_id: int
    dp_rank: int = 0  # the DP group whose driver rank reports this step
    # tokens per logical expert of each MoE layer since the last report ([layer][expert]), when asked
    expert_load: list[list[int]] | None = None
    # one entry per request that produced a token this step (its prefill completed or it decoded)
    sampled: dict[str, int] = field(default_factory=dict)
    # req_id -> [chosen_logprob, [[token, logprob], ...top alternatives]] when requested
    logprobs: dict[str, list] = field(default_factory=dict)
    # req_id -> why that request failed on the executor (e.g. its sampler raised); the step's other
    # requests are unharmed, and the executor no longer runs the failed ones
    failed: dict[str, str] = field(default_factory=dict)
    execute_seconds: float = 0.0


class WorkerReady(Message):
    rank: int
    num_kv_blocks: int
    kv_bytes_per_token: int
    # this rank's KV cache as the transfer engine exposes it (RegionDescriptor.to_dict()), P/D TEs only
    kv_region: dict[str, Any] | None = None
    moe_layers: list[int] = field(default_factory=list)  # decoder-layer indices of the MoE layers
    num_logical_experts: int = 0  # routed experts per MoE layer
    vocab_size: int = 0  # token ids the model takes and samples: [0, vocab_size)


# background work a rank reports (WorkerEvent.kind) besides expert-placement phases
PULLED, PULL_FAILED = "kv_pulled", "kv_pull_failed"
POOL_FETCHED = "pool_fetched"


class WorkerEvent(Message):
    """Something an executor finished in the background (e.g. "eplb_prefetched", "eplb_loaded", "eplb_failed")."""

    rank: int
    kind: str
    detail: str = ""


class WorkerFailure(Message):
    rank: int
    message: str


class WorkerHandshake(Message):
    """A rank on another host joining a TE: it sends only its `rank`; the master answers with
    the engine config and the rank's addresses, or with `error` when it cannot take that rank."""

    rank: int
    config: dict[str, Any] | None = None  # EngineConfig.to_dict()
    work_addr: str = ""
    result_addr: str = ""
    dist_init_method: str | None = None
    error: str | None = None


# ---------------------------------------------------------------- client <-> master
class AddRequest(Message):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    arrival_time: float
    priority: int = 0  # lower runs first; FCFS within a priority
    eos_token_ids: list[int] = field(default_factory=list)
    reply_to: str = ""  # a TE serving job executors sends this request's outputs here (output short-circuiting)
    # disaggregated prefill/decode: {"role": "producer"} on the prefill TE (compute the prompt, sample the first
    # token, hold the KV blocks for a decode TE); on the decode TE {"role": "consumer", **the prefill TE's
    # kv_transfer_params} (pull the blocks, then decode)
    kv_transfer: dict[str, Any] | None = None
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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it, if any
    new_logprobs: list | None = None  # per new token: [chosen_logprob, [[token, logprob], ...]]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    error_type: str | None = None  # exception class name for errors the caller maps (e.g. QueueFullError)
    # a prefill TE's hand-off: where the request's KV blocks wait for the decode TE (`kv_transfer` producer)
    kv_transfer_params: dict[str, Any] | None = None


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
    # bad frames the TE's master dropped, per receiving socket (e.g. "te-inbox", "executor-results")
    dropped_frames: dict[str, int] = field(default_factory=dict)
    healthy: bool = True
    error: str | None = None


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


class KVCacheEvents(Message):
    """Prefix-cache changes of one TE, published for routers that keep a global prompt tree.

    Each event is a dict: {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
    "block_size"} | {"type": "BlockRemoved", "block_hashes"} | {"type": "AllBlocksCleared"}.
    """

    seq: int  # increases by one per batch, so a subscriber can detect a gap and resync
    timestamp: float
    events: list[dict[str, Any]] = field(default_factory=list)
    dp_rank: int = 0  # the DP group whose cache changed (each DP group has its own KV pool)
    engine: str = ""  # the TE's name (EngineConfig.te_name)


class AdminRequest(Message):
    """An operator command to the master (e.g. "eplb.load", "eplb.status", "eplb.rebalance")."""

    query_id: int
    op: str
    args: dict[str, Any] = field(default_factory=dict)
    reply_to: str = ""


class AdminReply(Message):
    query_id: int
    ok: bool = True
    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class Shutdown(Message):
    pass


class EngineHeartbeat(Message):
    """A TE announcing itself to a job executor, repeated every heartbeat interval: its registration
    (addresses, role, layout) and its current load. A JE that misses several heartbeats drops the TE."""

    name: str
    role: str  # "colocated" | "prefill" | "decode"
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


_MESSAGE_TYPES = {
    cls.__name__: cls
    for cls in (
        NewRequestData, CachedRequestData, SchedulerOutput, StepBatch, ModelRunnerOutput, WorkerReady, WorkerFailure,
        WorkerHandshake,
        AddRequest, AbortRequests, RequestDelta, EngineOutputs, StatsQuery, EngineStats, EngineReady, EngineError,
        KVCacheEvents, Shutdown, WorkerEvent, AdminRequest, AdminReply, ReleaseKV, EngineHeartbeat,
    )
}


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_DECODERS = {name: msgspec.msgpack.Decoder(cls) for name, cls in _MESSAGE_TYPES.items()}


def encode(msg: Message) -> bytes:
    return _ENCODER.encode((type(msg).__name__, msg))


# ---------------------------------------------------------------- decoding and validation
class MessageError(ValueError):
    """A frame that is not a valid message: its receiver logs it, counts it and drops it."""


# the largest frame any internal socket takes: far above the largest legitimate message (a step
# whose new requests carry long prompts, a prefix-cache snapshot), far below what hurts the host
MAX_MESSAGE_BYTES = 256 * 2**20
# a TE's input socket takes requests from other hosts: one prompt of a million tokens still fits
MAX_INBOX_BYTES = 64 * 2**20


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message in `data`; MessageError for an oversized, malformed or unknown frame, or for fields
    unknown to or of the wrong type for the struct it names (nested messages included)."""
    if len(data) > max_bytes:
        raise MessageError(f"a frame of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        name, fields = _ENVELOPE.decode(data)
    except msgspec.ValidationError:
        raise MessageError("not a [message type, fields] pair") from None
    except Exception as exc:  # noqa: BLE001 - bad bytes must only ever be a MessageError
        raise MessageError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    decoder = _DECODERS.get(name)
    if decoder is None:
        raise MessageError(f"unknown message type {name[:64]!r}")
    try:
        return decoder.decode(fields)
    except msgspec.ValidationError as exc:
        raise MessageError(f"bad {name}: {exc}") from None
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


def recv_message(sock: zmq.Socket, socket_name: str, max_bytes: int = MAX_MESSAGE_BYTES) -> Any | None:
    """Receive one frame and decode it; a bad frame is dropped (logged, counted) and gives None."""
    data = sock.recv()
    try:
        return decode(data, max_bytes)
    except MessageError as exc:
        drop_frame(socket_name, exc)
        return None
