"""The waiting queue of one scheduler, fair between tenants within a priority.

Requests wait in priority order (lower first; preempted requests at the front of their priority, as they
were). Within a priority the tenants (`Request.tenancy.tenant`: an API key's fingerprint, a client address)
take turns by the tokens they were served, after the Virtual Token Counter of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI 2024, §4.1), itself start-time fair queuing (Goyal, Vin and Cheng,
SIGCOMM 1996) with tokens as the cost: each tenant has a counter of the tokens of its requests the scheduler
took; the next request is the oldest of the tenant with the smallest counter. A tenant that starts waiting is
lifted to the smallest counter of the tenants already waiting, so an idle tenant banks no credit and a new
one cannot crowd out the others either. One tenant's 500 queued requests then cost another tenant's single
request at most one turn; within a tenant the order is FCFS, as with one tenant it always was.

A tenant is charged as VTC charges it: the tokens a request computes when it leaves the queue (prompt, plus
output so far for a resumed one), then each token it generates while others wait, at `OUTPUT_TOKEN_WEIGHT`
(the paper's w_p = 1, w_q = 2), so a tenant of long answers takes its turns less often than one of short
ones. The counters are forgotten whenever the queue empties. Not thread-safe: the scheduler's loop owns it.
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator

from meshserve.core.request import Request

OUTPUT_TOKEN_WEIGHT = 2.0  # a generated token costs as much as two prompt tokens (VTC's w_q / w_p)


def _fifo_key(req: Request) -> tuple:
    return req.queue_key


class FairWaitingQueue:
    def __init__(self) -> None:
        self._requests: list[Request] = []  # by queue_key: priority, front (preempted) or not, arrival
        self._served: dict[str, float] = {}  # tenant -> tokens of its requests taken since the queue was empty
        self._waiting_per_tenant: dict[str, int] = {}
        self._order: list[Request] | None = None  # `ordered()` until the queue or a counter changes

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __contains__(self, req: Request) -> bool:
        return req in self._requests

    def add(self, req: Request) -> None:
        """Queue `req` (its `queue_key` set); a tenant that starts waiting gets the smallest waiting counter."""
        tenant = req.tenancy.tenant
        if not self._waiting_per_tenant.get(tenant):
            active = [self._served.get(t, 0.0) for t, n in self._waiting_per_tenant.items() if n]
            if active:
                self._served[tenant] = max(self._served.get(tenant, 0.0), min(active))
        self._waiting_per_tenant[tenant] = self._waiting_per_tenant.get(tenant, 0) + 1
        bisect.insort(self._requests, req, key=_fifo_key)
        self._order = None

    def remove(self, req: Request) -> None:
        """Take `req` out without serving it (an abort, an error)."""
        self._requests.remove(req)
        self._order = None
        tenant = req.tenancy.tenant
        self._waiting_per_tenant[tenant] -= 1
        if not self._waiting_per_tenant[tenant]:
            del self._waiting_per_tenant[tenant]
        if not self._requests:
            self._served.clear()

    def take(self, req: Request) -> None:
        """`req` leaves the queue to run: its tenant is charged its tokens to compute."""
        tenant = req.tenancy.tenant
        self._served[tenant] = self._served.get(tenant, 0.0) + _cost(req)
        self.remove(req)

    def charge_output(self, tenant: str, num_tokens: int) -> None:
        """A running request of `tenant` generated `num_tokens`. Counted only while someone waits: the counters
        order the waiting tenants and are forgotten when nobody does."""
        if not self._requests or num_tokens <= 0:
            return
        self._served[tenant] = self._served.get(tenant, 0.0) + OUTPUT_TOKEN_WEIGHT * num_tokens
        if self._waiting_per_tenant.get(tenant):  # its place among the waiting tenants moved
            self._order = None

    def ordered(self) -> list[Request]:
        """Every waiting request in the order the scheduler should try them: by priority, preempted ones first
        within theirs, then the tenants' requests interleaved by their counters (as if each were taken in turn).
        Kept until the next change; do not mutate it."""
        if self._order is not None:
            return self._order
        out: list[Request] = []
        start = 0
        while start < len(self._requests):
            priority = self._requests[start].queue_key[0]
            end = start
            while end < len(self._requests) and self._requests[end].queue_key[0] == priority:
                end += 1
            out += self._fair_order(self._requests[start:end])
            start = end
        self._order = out
        return out

    def _fair_order(self, same_priority: list[Request]) -> list[Request]:
        """One priority's requests: preempted first (their own order), then the tenants' FIFOs merged by counter."""
        fresh = [r for r in same_priority if r.queue_key[1] != 0]
        out = [r for r in same_priority if r.queue_key[1] == 0]
        fifos: dict[str, list[Request]] = {}
        for req in fresh:  # queue order: each tenant's list is FCFS
            fifos.setdefault(req.tenancy.tenant, []).append(req)
        # (counter, first request's queue key, tenant, position): the smallest counter goes; ties by arrival
        heap = [(self._served.get(t, 0.0), reqs[0].queue_key, t, 0) for t, reqs in fifos.items()]
        heapq.heapify(heap)
        while heap:
            counter, _, tenant, pos = heapq.heappop(heap)
            req = fifos[tenant][pos]
            out.append(req)
            if pos + 1 < len(fifos[tenant]):
                nxt = fifos[tenant][pos + 1]
                heapq.heappush(heap, (counter + _cost(req), nxt.queue_key, tenant, pos + 1))
        return out


def _cost(req: Request) -> int:
    """Tokens the request computes when it starts (a prefix-cache hit is not known yet: the whole sequence)."""
    return max(1, req.num_tokens - req.num_computed_tokens)
