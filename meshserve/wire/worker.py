"""The master <-> worker protocol: one step for every DP group, its output, and a rank's life.

  master -> worker : StepBatch (one SchedulerOutput per DP group), WorkerPing, InjectFault, Shutdown
  worker -> master : ModelRunnerOutput, WorkerReady, WorkerFailure, WorkerEvent, WorkerPong, KVConnectorReport
  worker <-> master: WorkerHandshake (a rank on another host joining the TE; a spare worker told its rank)
"""
from __future__ import annotations

import enum

from msgspec import field

from meshserve.config import EngineConfig
from meshserve.utils.faults import Fault
from meshserve.wire.base import Message
from meshserve.wire.eplb import EplbCommand
from meshserve.wire.kv import KVConnectorMetadata, KVRegion
from meshserve.wire.sampling_params import SamplingParams


class WorkerEventKind(enum.StrEnum):
    EPLB_PREFETCHED = "eplb_prefetched"  # this rank read the changing slots' weights
    EPLB_LOADED = "eplb_loaded"  # ... and copied them into the slots
    EPLB_FAILED = "eplb_failed"  # a phase failed on this rank (`detail`: why)
    WEIGHTS_SERVED = "weights_served"  # this rank's weight server has its snapshot (`detail`: its address)
    ROLLED_BACK = "rolled_back"  # a transient error: this rank rolled its step back and runs it again (`detail`: why)


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
    # 2: every rank runs this step as two overlapped micro-batches (the same count on all: their collectives pair up)
    microbatches: int = 1
    collect_garbage: bool = False  # every rank runs a garbage collection pass right after this step


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
    rank_start: float = 0.0  # wall clock when this rank's process entered its code
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
    the engine config and the rank's addresses, or with `error` when it cannot take that rank
    (`retry`: not yet, the rank's previous process is gone and the master is about to take a new one),
    or with `redirect`: ask there instead (a TE with self-contained DP groups sends each rank on to the
    master of its group)."""

    rank: int
    config: EngineConfig | None = None
    work_addr: str = ""
    result_addr: str = ""
    dist_init_method: str | None = None
    error: str | None = None
    retry: bool = False
    redirect: str = ""
