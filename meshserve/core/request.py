"""A request's state in the master: its tokens, its progress through the KV cache, its status."""
from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Sequence

from meshserve.wire.client import NO_TENANCY, AddRequest
from meshserve.wire.kv import KVTransferParams, KVTransferRole
from meshserve.wire.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # its blocks are allocated and a KV connector is loading their KV in the background (a pull from a
    # prefill TE, a populate from the memory pool); it runs once the load ends
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; recomputed when resumed
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    # prefill TE: the prompt is computed and the first token sampled; a decode TE takes the request on
    TRANSFERRED = "transferred"

    @property
    def is_finished(self) -> bool:
        """Finished on this engine (a transferred request goes on in a decode TE)."""
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.TRANSFERRED: None,  # finished here, not for the caller
}


class Request:
    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(req_id, str) or not req_id:
            raise ValueError(f"req_id must be a non-empty string, got {req_id!r}")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {req_id}: the prompt must contain at least one token")
        if any(not isinstance(t, int) or t < 0 for t in prompt_token_ids):
            raise ValueError(f"request {req_id}: prompt token ids must be non-negative integers")
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority  # lower runs first
        self.eos_token_ids = list(eos_token_ids or [])

        self.output_token_ids: list[int] = []
        self._all_token_ids = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None  # the token id that stopped it
        self.error: str | None = None

        # KV-cache progress (scheduler bookkeeping)
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0  # advanced when a step is scheduled
        self.num_cached_tokens = 0  # prefix-cache hit on the first schedule
        # tokens sampled by scheduled steps whose output has not come back yet
        self.num_output_placeholders = 0
        self.pending_sample_steps: deque[int] = deque()  # step ids that owe this request a token
        # drafts of scheduled verifications whose output has not come back: the worker may be up to this many
        # positions past `num_computed_tokens` (speculative decoding with overlapped steps)
        self.num_unverified_drafts = 0
        self.num_kv_ready_tokens = 0  # KV computed by steps that have returned
        self.num_inserted_blocks = 0  # full blocks already offered to the prefix cache
        self.num_blocks_sent = 0  # block ids the worker has been told about
        self.in_worker = False  # the worker holds this request's token state
        self.num_preemptions = 0
        self.ever_scheduled = False
        # tokens past `num_computed_tokens` a KV connector is loading (WAITING_FOR_REMOTE_KV)
        self.num_external_tokens = 0
        # disaggregated prefill/decode: a producer's role; a consumer's hand-off until its KV is pulled
        self.kv_transfer: KVTransferParams | None = None
        # explicit context caching: the named cache whose pinned blocks lead this prompt; with a ttl, this
        # request creates it (its prompt's full blocks are pinned once computed, and the ttl is cleared)
        self.context_cache_id: str | None = None
        self.context_cache_ttl_s: float | None = None
        # its sender (fair scheduling between tenants) and prefix-cache namespace (the blocks it may share)
        self.tenancy = NO_TENANCY
        self.arrival_seq = 0  # order of admission: breaks ties between equal arrival times
        self.queue_key: tuple = ()  # position in the waiting queue

    @classmethod
    def from_message(cls, msg: AddRequest) -> Request:
        req = cls(
            req_id=msg.req_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling_params=msg.sampling_params,
            arrival_time=msg.arrival_time,
            priority=msg.priority,
            eos_token_ids=msg.eos_token_ids,
        )
        req.context_cache_id = msg.context_cache_id
        req.context_cache_ttl_s = msg.context_cache_ttl_s
        req.tenancy = msg.tenancy
        return req

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the outputs known so far (not the placeholders). Do not mutate."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_kv_producer(self) -> bool:
        """A prefill TE's request: it samples the first token, then a decode TE takes it on."""
        return self.kv_transfer is not None and self.kv_transfer.role is KVTransferRole.PRODUCER

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"outputs={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
