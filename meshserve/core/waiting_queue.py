"""The DP waiting queue: requests no DP group has taken yet, and where each placed one went.

With one DP group a request goes straight to its scheduler. With several, requests wait in one shared
queue (priority, then the tenants taking turns, FCFS within one: `fair_queue`) and the DP balancer places a
batch of them each step (`dp_balancer`,
xdeepserve §4.3: one collaborative placement per step); `owner` remembers each placed request's group
until it finishes, so an abort reaches the right scheduler.
"""
from __future__ import annotations

from meshserve.core.dp_balancer import DEFAULT_EXPECTED_OUTPUT_TOKENS, PendingRequest, place_batch
from meshserve.core.fair_queue import FairWaitingQueue
from meshserve.core.request import Request
from meshserve.core.scheduler import Scheduler
from meshserve.wire.client import FinishReason, RequestDelta
from meshserve.wire.errors import QueueFullError


def may_hit(scheduler: Scheduler, request: Request, first_block: tuple[int, ...] | None) -> bool:
    """Whether `scheduler.match_cached_blocks(request)` may find anything: the request's named context cache is
    pinned there, or its first full block (`first_block`, None for a prompt without one before its last token)
    leads a cached prefix of its namespace. One lookup, for the DP balancer, which asks every group."""
    if request.context_cache_id is not None and request.context_cache_id in scheduler.context_caches:
        return True
    return first_block is not None and scheduler.kv_manager.holds_first_block(first_block,
                                                                              request.tenancy.cache_salt)


class DPWaitingQueue:
    def __init__(self, schedulers: list[Scheduler], max_waiting: int, block_size: int) -> None:
        self.schedulers = schedulers  # one per DP group
        self.max_waiting = max_waiting
        self.block_size = block_size
        self._queue = FairWaitingQueue()  # requests no group has taken (DP > 1 only)
        self._seq = 0
        self._keys: dict[str, tuple] = {}  # a waiting request's queue key: priority, then arrival
        self.owner: dict[str, int] = {}  # a placed request's DP group
        self._tenant_of: dict[str, str] = {}  # a placed request's tenant: charged for its tokens (fair_queue)

    def admit(self, request: Request) -> None:
        """Into the one group's scheduler, or into the queue; QueueFullError or RequestTooLongError when it
        cannot wait, ValueError for a request id in use."""
        if len(self.schedulers) == 1:
            self.schedulers[0].add_request(request)
        else:
            self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if request.req_id in self.owner or request.req_id in self._keys:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if len(self._queue) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        self.schedulers[0].check_fits(request)  # every group has the same limits
        self._seq += 1
        self._keys[request.req_id] = request.queue_key = (request.priority, 1, request.arrival_time, self._seq)
        self._queue.add(request)

    @property
    def pending(self) -> list[Request]:
        """The waiting requests in the order they are placed (do not mutate)."""
        return self._queue.ordered()

    def can_pin(self, num_blocks: int) -> bool:
        """Whether some DP group may pin `num_blocks` more blocks for a named context cache."""
        return any(s.can_pin(num_blocks) for s in self.schedulers)

    def place(self) -> None:
        """Hand waiting requests to DP groups (xdeepserve §4.3: one collaborative placement per step)."""
        if not len(self._queue):
            return
        loads = [s.dp_load(DEFAULT_EXPECTED_OUTPUT_TOKENS) for s in self.schedulers]
        items = [PendingRequest(key=r, num_prompt_tokens=r.num_prompt_tokens,
                                expected_output_tokens=r.sampling_params.max_tokens or DEFAULT_EXPECTED_OUTPUT_TOKENS)
                 for r in self.pending]

        def prefix_hits(item: PendingRequest) -> list[int]:
            # a named context cache's pinned blocks count as a hit in the one group holding them, so the
            # balancer prefers that group; when it is much busier the request goes elsewhere and computes
            # the prefix there (a miss: the same output, no reuse). Only the groups that may hold a prefix of the
            # request are matched: with hundreds of groups the full match of each would cost the master
            # milliseconds per request
            request = item.key
            tokens = request.all_token_ids
            first = tuple(tokens[:self.block_size]) if len(tokens) > self.block_size else None
            return [len(s.match_cached_blocks(request)) * s.block_size if may_hit(s, request, first) else 0
                    for s in self.schedulers]

        placed = place_batch(items, self.block_size, loads, prefix_hits)
        if not placed:
            return
        for item, group in placed:
            request = item.key
            self._queue.take(request)  # its tenant is charged before the group's scheduler re-keys it
            self.schedulers[group].add_request(request)
            self.owner[request.req_id] = group
            self._tenant_of[request.req_id] = request.tenancy.tenant
            self._keys.pop(request.req_id, None)

    def abort(self, req_ids: list[str]) -> None:
        """Take the requests out of the queue or out of the group that has them."""
        aborted = set(req_ids)
        for request in [r for r in self.pending if r.req_id in aborted]:
            self._queue.remove(request)
        for req_id in req_ids:
            self._keys.pop(req_id, None)
            self._tenant_of.pop(req_id, None)
            group = self.owner.pop(req_id, None) if len(self.schedulers) > 1 else 0
            if group is not None:
                self.schedulers[group].abort_requests([req_id])

    def on_deltas(self, deltas: list[RequestDelta]) -> None:
        """Tenants are charged for the tokens their placed requests generated (while others wait); a request that
        finished (or was handed to decode) belongs to no group any more."""
        if len(self.schedulers) > 1:
            for delta in deltas:
                tenant = self._tenant_of.get(delta.req_id)
                if tenant is not None:
                    self._queue.charge_output(tenant, len(delta.new_token_ids))
                if delta.finish_reason is not None or delta.kv_transfer_params is not None:
                    self.owner.pop(delta.req_id, None)
                    self._tenant_of.pop(delta.req_id, None)

    def fail_all(self, error: str) -> list[RequestDelta]:
        """An error delta for every request still waiting; the queue is left empty and owns nothing."""
        deltas = [RequestDelta(req_id=r.req_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error,
                               num_prompt_tokens=r.num_prompt_tokens) for r in self.pending]
        self._queue = FairWaitingQueue()
        self._keys.clear()
        self.owner.clear()
        self._tenant_of.clear()
        return deltas

    def unfinished(self) -> list[Request]:
        """Every request of the groups and of the queue that has not finished."""
        return [r for s in self.schedulers for r in s.unfinished_requests()] + list(self.pending)
