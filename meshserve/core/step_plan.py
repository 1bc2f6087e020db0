"""The scheduler's step under construction (`StepPlan`) and what a scheduled step books for each request
(`BookedProgress`), checked when the step's output comes back."""
from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.core.request import Request


@dataclass
class ScheduledRequest:
    req: Request
    num_tokens: int
    num_computed_before: int
    num_drafts: int = 0  # of num_tokens, drafts to verify (speculative decoding)


@dataclass
class BookedProgress:
    """What a scheduled step books for one request, checked when its output comes back."""

    incarnation: int  # the request's preemption count then: a preempted request's output is stale
    num_kv_ready: int  # positions whose KV the step leaves computed (shifted by verifications before it)
    num_drafts: int


@dataclass
class StepPlan:
    """The step being built; entries can be withdrawn when their request is preempted."""

    budget: int
    entries: dict[str, ScheduledRequest] = field(default_factory=dict)

    def add(self, req: Request, num_tokens: int, num_drafts: int = 0) -> None:
        self.entries[req.req_id] = ScheduledRequest(req, num_tokens, req.num_computed_tokens, num_drafts)
        self.budget -= num_tokens

    def withdraw(self, req: Request) -> None:
        entry = self.entries.pop(req.req_id, None)
        if entry is not None:
            self.budget += entry.num_tokens
