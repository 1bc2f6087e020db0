"""Admission before expansion: what a request costs is checked before any engine request is built.

A completion request fans out into prompts x n engine requests (choices), each holding up to its prompt plus
`max_tokens` tokens of KV. A small body can ask for a very large fan-out (a thousand short prompts, n = 128),
so the cost is checked in steps, each before the work it guards:

1. after parsing, the number of choices against the per-request limit (400) and against the room the engine's
   waiting queue has left (503 `queue_full`), before anything is tokenized;
2. after tokenizing, the tokens (choices x (prompt + max_tokens)) against the per-request token limit (400);
3. the choices are then reserved as waiting until their first output arrives (or the request ends): the
   reservations of every running request together stay within the queue's size, so a burst of allowed
   requests is refused here, in milliseconds, instead of being built and refused one by one by the master.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.entrypoints.openai.errors import bad_request
from meshserve.wire.errors import QueueFullError


@dataclass(frozen=True)
class AdmissionLimits:
    """`max_choices` and `max_tokens` bound one request; `max_waiting` (None: unbounded) bounds the choices
    of every request together that wait for their first output."""

    max_choices: int
    max_tokens: int
    max_waiting: int | None


class WaitingChoices:
    """One request's choices counted as waiting in the gate until each sees its first output."""

    def __init__(self, gate: AdmissionGate, count: int) -> None:
        self._gate = gate
        self._count = count

    def started(self, count: int = 1) -> None:
        """`count` choices produced their first output: they left the engine's waiting queue."""
        count = min(count, self._count)
        self._count -= count
        self._gate.waiting -= count

    def release(self) -> None:
        """The request ended: whatever still counted as waiting stops counting (safe to call twice)."""
        self.started(self._count)


class AdmissionGate:
    """The per-request limits and the room left in the engine's waiting queue, for one server."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.waiting = 0  # choices of running requests that have not produced an output yet

    def check_choices(self, num_prompts: int, n: int) -> None:
        """400 for more choices than one request may ask for, 503 when the queue has no room for them now."""
        choices = num_prompts * n
        limit = self.limits.max_choices
        if choices > limit:
            raise bad_request(f"This request asks for {choices} choices ({num_prompts} prompt(s) x n={n}); this "
                              f"server allows at most {limit} per request. Split it into smaller requests.",
                              param="n", code="too_many_choices")
        self._check_room(choices)

    def check_tokens(self, prompt_lens: list[int], max_tokens: list[int], n: int) -> None:
        """400 when the choices together could hold more tokens (prompt + max_tokens each) than allowed."""
        tokens = n * sum(p + m for p, m in zip(prompt_lens, max_tokens))
        limit = self.limits.max_tokens
        if tokens > limit:
            raise bad_request(f"This request could hold {tokens} tokens (n x (prompt + max_tokens), summed over "
                              f"its prompts); this server allows at most {limit} per request. Lower max_tokens, n "
                              "or the number of prompts.", param="max_tokens", code="request_tokens_exceeded")

    def reserve(self, choices: int) -> WaitingChoices:
        """Count `choices` as waiting (503 `queue_full` without room); the caller releases them."""
        self._check_room(choices)
        self.waiting += choices
        return WaitingChoices(self, choices)

    def _check_room(self, choices: int) -> None:
        limit = self.limits.max_waiting
        if limit is None:
            return
        if choices > limit:
            raise bad_request(f"This request asks for {choices} choices; the engine's waiting queue holds at most "
                              f"{limit}, so it can never be admitted.", param="n", code="too_many_choices")
        if self.waiting + choices > limit:
            raise QueueFullError(f"{self.waiting} choices already wait for the engine and this request adds "
                                 f"{choices}")
