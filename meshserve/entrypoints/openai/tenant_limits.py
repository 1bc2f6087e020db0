"""Per-tenant limits: what one client address or one tenant may hold of a shared API server, and the 429s.

A tenant is a request's `Principal.owner`: the API key's hash, or `client:<address>` without keys. Three
limits (`TenantLimits`), each answered with 429 OpenAI error JSON and a `Retry-After` header:

- connections per client address (`ConnectionLimiter`), counted when a connection opens, before any key is
  known; the connections one address holds beyond its share no longer count against the server's global cap,
  so one client's many connections do not lock out the others;
- requests running at once per tenant;
- tokens per minute per tenant, a token bucket (capacity: `token_burst_s` of the budget, a minute by
  default as OpenAI's limits have it, refilled continuously). A
  request reserves its worst case on admission (its prompt estimated from the body's bytes, plus
  prompts x n x max_tokens) and, when it ends, gets back what it did not use (the prompt and generated tokens
  its outputs counted). A request that needs more than the bucket holds waits until it is full, so no request
  is refused for good; the bucket may then go below zero, and the tenant waits that much longer.

`TenantGate` is the hook the request guard calls; the `Ticket` it hands out frees the request's slot and
settles its tokens however the request ends, and is the current ticket (`current_ticket`) while the
request runs, so the metrics' request trackers can count the tokens against it.
"""
from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from meshserve.entrypoints.openai.errors import APIError
from meshserve.entrypoints.openai.server_options import TenantLimits

BYTES_PER_TOKEN = 4  # a prompt's estimate from the body: English text runs about 4 bytes a token
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/context_caches"})
_CONCURRENCY_RETRY_AFTER_S = 1.0
_CURRENT_TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("meshserve_ticket", default=None)


class TenantObserver(Protocol):
    """Where the gate reports what it admits, refuses and counts (the per-tenant metrics)."""

    def count_request(self, tenant: str) -> None: ...

    def count_rejected(self, tenant: str, reason: str) -> None: ...

    def count_tokens(self, tenant: str, prompt_tokens: int, generation_tokens: int) -> None: ...


class _NoObserver:
    def count_request(self, tenant: str) -> None:
        pass

    def count_rejected(self, tenant: str, reason: str) -> None:
        pass

    def count_tokens(self, tenant: str, prompt_tokens: int, generation_tokens: int) -> None:
        pass


def rate_limited(what: str, retry_after_s: float) -> APIError:
    """OpenAI's 429: error type `rate_limit_exceeded`, and when to retry (whole seconds, at least 1)."""
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, f"Rate limit reached for {what}. Retry after {seconds} s.",
                    code="rate_limit_exceeded", headers={"retry-after": str(seconds)})


class TokenBucket:
    """`burst_s` seconds of `tokens_per_minute`, refilled at `tokens_per_minute / 60` a second; takes may drive
    it below zero (a debt)."""

    def __init__(self, tokens_per_minute: int, now: float, burst_s: float = 60.0) -> None:
        self.rate_per_s = tokens_per_minute / 60.0
        self.capacity = max(1, round(self.rate_per_s * burst_s))
        self.level = float(self.capacity)
        self._updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._updated) * self.rate_per_s)
        self._updated = now

    def try_take(self, amount: int, now: float) -> float | None:
        """Take `amount` if the bucket holds it (or is full, for a larger amount); else the seconds to wait."""
        self.refill(now)
        needed = min(amount, self.capacity)
        if self.level >= needed:
            self.level -= amount
            return None
        return (needed - self.level) / self.rate_per_s

    def give_back(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)

    def is_full(self, now: float) -> bool:
        self.refill(now)
        return self.level >= self.capacity


class ConnectionLimiter:
    """Open connections per client address; those beyond an address's share are not admitted (and counted
    with `on_refused(address)`)."""

    def __init__(self, per_client: int, on_refused: Callable[[str], None] = lambda address: None) -> None:
        self.per_client = per_client
        self.on_refused = on_refused
        self._open: dict[str, int] = {}
        self.admitted_total = 0

    def try_open(self, address: str) -> bool:
        held = self._open.get(address, 0)
        if held >= self.per_client:
            self.on_refused(address)
            return False
        self._open[address] = held + 1
        self.admitted_total += 1
        return True

    def close(self, address: str) -> None:
        held = self._open.get(address, 0) - 1
        if held > 0:
            self._open[address] = held
        else:
            self._open.pop(address, None)
        self.admitted_total -= 1

    def held(self, address: str) -> int:
        return self._open.get(address, 0)


@dataclass
class Ticket:
    """One admitted request: its reserved tokens, the tokens its outputs counted, and its running slot."""

    tenant: str
    reserved: int
    _on_release: Callable[[Ticket], None] = field(repr=False)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    _released: bool = False
    _token: contextvars.Token | None = field(default=None, repr=False)

    def add_usage(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens

    @property
    def used(self) -> int:
        return self.prompt_tokens + self.generation_tokens

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._on_release(self)

    def __enter__(self) -> Ticket:
        self._token = _CURRENT_TICKET.set(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _CURRENT_TICKET.reset(self._token)
        self.release()


def current_ticket() -> Ticket | None:
    """The ticket of the request running in this task (None outside a limited request)."""
    return _CURRENT_TICKET.get()


class TenantLimiter:
    """Running requests and token buckets per tenant; entries of idle tenants are dropped."""

    def __init__(self, limits: TenantLimits, clock: Callable[[], float] = time.monotonic,
                 on_settled: Callable[[Ticket], None] = lambda ticket: None) -> None:
        self.limits = limits
        self.clock = clock
        self.on_settled = on_settled
        self._running: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}

    def admit(self, tenant: str, cost: int) -> Ticket:
        """A ticket for one request costing up to `cost` tokens; `TenantLimitExceeded` when over a limit."""
        running = self._running.get(tenant, 0)
        if running >= self.limits.max_requests_per_tenant:
            raise TenantLimitExceeded("requests_per_tenant", _CONCURRENCY_RETRY_AFTER_S,
                                      f"concurrent requests ({self.limits.max_requests_per_tenant} at once)")
        reserved = self._reserve(tenant, cost)
        self._running[tenant] = running + 1
        return Ticket(tenant, reserved, self._release)

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def bucket(self, tenant: str) -> TokenBucket | None:
        return self._buckets.get(tenant)

    def _reserve(self, tenant: str, cost: int) -> int:
        budget = self.limits.tokens_per_minute_per_tenant
        if budget is None or cost <= 0:
            return 0
        now = self.clock()
        bucket = self._buckets.get(tenant) or self._buckets.setdefault(
            tenant, TokenBucket(budget, now, self.limits.token_burst_s))
        wait_s = bucket.try_take(cost, now)
        if wait_s is not None:
            raise TenantLimitExceeded("tokens_per_minute", wait_s, f"tokens per minute ({budget})")
        return cost

    def _release(self, ticket: Ticket) -> None:
        running = self._running.get(ticket.tenant, 0) - 1
        if running > 0:
            self._running[ticket.tenant] = running
        else:
            self._running.pop(ticket.tenant, None)
        bucket = self._buckets.get(ticket.tenant)
        if bucket is not None:
            now = self.clock()
            bucket.give_back(ticket.reserved - ticket.used, now)  # negative: it used more than it reserved
            if running <= 0 and bucket.is_full(now):
                del self._buckets[ticket.tenant]  # a full bucket is what a new tenant gets anyway
        self.on_settled(ticket)


class TenantLimitExceeded(Exception):
    """A tenant is over one of its limits: which (`reason`, a metrics label), and when to retry."""

    def __init__(self, reason: str, retry_after_s: float, what: str) -> None:
        super().__init__(what)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.what = what


class _CostFields(msgspec.Struct):
    """The fields of a generation request that bound its tokens; the rest of the body is skipped."""

    prompt: msgspec.Raw = msgspec.Raw(b"")  # msgspec takes no union with Raw
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None


def _prompt_count(prompt: msgspec.Raw) -> int:
    """How many prompts a `prompt` field holds: a list of strings or of token lists is a batch."""
    raw = bytes(prompt).lstrip()
    if not raw.startswith(b"["):
        return 1
    items = msgspec.json.decode(raw, type=list[msgspec.Raw])  # raw slices: no value is built
    if items and bytes(items[0]).lstrip()[:1] in (b"[", b'"'):
        return len(items)
    return 1


def request_cost(body: bytes, default_max_tokens: int) -> int:
    """The most tokens a generation request can use: its prompt estimated from the body's size plus
    prompts x n x max_tokens (`default_max_tokens` where it names none). A body that does not parse costs
    its size only: the handler refuses it."""
    prompt_estimate = math.ceil(len(body) / BYTES_PER_TOKEN)
    try:
        fields = msgspec.json.decode(body, type=_CostFields)
        prompts = _prompt_count(fields.prompt)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return prompt_estimate
    max_tokens = fields.max_completion_tokens or fields.max_tokens or default_max_tokens
    return prompt_estimate + prompts * max(fields.n or 1, 1) * max(max_tokens, 0)


def connection_limiter(limits: TenantLimits, observer: TenantObserver | None = None) -> ConnectionLimiter:
    """A server's per-client connection limiter, its refusals counted as the tenant's."""
    observer = observer or _NoObserver()
    return ConnectionLimiter(limits.max_connections_per_client,
                             on_refused=lambda address: observer.count_rejected(address, "connections_per_client"))


class TenantGate:
    """The request guard's hook: admits a `/v1` request of a tenant or raises its 429."""

    def __init__(self, limits: TenantLimits, default_max_tokens: int, observer: TenantObserver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.observer = observer or _NoObserver()
        self.limiter = TenantLimiter(limits, clock, on_settled=self._count_tokens)
        self.default_max_tokens = default_max_tokens

    def admit(self, tenant: str, is_admin: bool, method: str, path: str, body: bytes) -> Ticket | None:
        """The request's ticket, None for a request no limit covers (not under /v1, or the admin's)."""
        if is_admin or not path.startswith("/v1/"):
            return None
        is_generation = method == "POST" and path.rstrip("/") in _GENERATION_PATHS
        cost = request_cost(body, self.default_max_tokens) if is_generation else 0
        try:
            ticket = self.limiter.admit(tenant, cost)
        except TenantLimitExceeded as exc:
            self.observer.count_rejected(tenant, exc.reason)
            raise rate_limited(exc.what, exc.retry_after_s) from None
        self.observer.count_request(tenant)
        return ticket

    def _count_tokens(self, ticket: Ticket) -> None:
        if ticket.used:
            self.observer.count_tokens(ticket.tenant, ticket.prompt_tokens, ticket.generation_tokens)
