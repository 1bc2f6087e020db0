"""The JE's routing policies: which TE(s) serve a request (deepserve §5, Algorithm 1).

A request goes to a *unit*: one colocated TE, or a prefill TE plus a decode TE
of the same group (the group is what the KV transfer channels connect). The
policies, by name:

- round_robin: cycle over units; a P/D group counts as max(#prefill, #decode)
  units, so every TE gets about the same share, and its prefill and decode TEs
  are cycled independently;
- load: the unit with the least `load_score`: a colocated TE's, or for a P/D
  pair the larger of its prefill TE's and its group's least loaded decode TE's;
- locality (§5.2): the entry TE caching the longest prefix of the prompt per the
  global prompt tree; ties go to the least loaded;
- pd_aware (§5.3): colocated or disaggregated by the heatmap at (prompt length,
  predicted decode length; max_tokens without a predictor), then the least loaded
  unit of that type; without a heatmap, disaggregated when the prompt is at least
  as long as the expected output, the study's main finding;
- combined (§5.4): the type as pd_aware, then locality when the candidates' load
  is balanced, else the least loaded.

The decode TE of a pair is always the least loaded decode TE of the prefill TE's
group, by KV usage first (decode holds a request's KV for its whole life), then
requests.

Links (xdeepserve §6.1): a decode TE reports which prefill TEs its link to is
down (link probing, `meshserve.core.link_monitor`); no prefill TE is paired with
such a decode TE, and a prefill TE no decode TE can pull from takes no request
(another pair or a colocated TE does, else NoRouteError) until a link is back.

Pure logic, no I/O and no torch: the frontend routes without the model stack.
A RoutingPolicy keeps round-robin counters; call it from one thread (the JE's loop).
"""
from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol, get_args

from meshserve.config.router import RoutingPolicyName
from meshserve.router.prompt_tree import GlobalPromptTree
from meshserve.wire.client import EngineStats

POLICIES: tuple[str, ...] = get_args(RoutingPolicyName)  # one list of names for the settings and the router
ROLES = ("colocated", "prefill", "decode")
# the scaling unit of the cluster manager: one role of one TE group, "GROUP/ROLE"; ANY_POOL stands for
# whichever pool would serve (a job executor that has never seen a TE cannot tell)
ANY_POOL = "*"


def pool_key(group: str, role: str) -> str:
    return f"{group}/{role}"

# load_score weights, in prompt-token equivalents (see load_score)
RUNNING_TOKEN_WEIGHT = 0.1
REQUEST_TOKENS = 32.0
KV_PRESSURE_TOKENS = 8192.0

# decode length assumed for the pd_aware fallback when neither a predictor nor max_tokens says
DEFAULT_DECODE_TOKENS = 256


# a per-request policy (the API sets it from the X-Meshserve-Routing header); None: the deployment's
REQUEST_ROUTING_POLICY: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshserve_routing", default=None)
ROUTING_HEADER = "x-meshserve-routing"


class NoRouteError(RuntimeError):
    """No healthy TE, or P/D pair, can take the request (the API answers 503)."""


@dataclass
class TELoad:
    num_running: int = 0
    num_waiting: int = 0
    waiting_tokens: int = 0  # prompt tokens queued and not yet prefilled
    running_tokens: int = 0  # context tokens of the running requests
    kv_usage: float = 0.0  # fraction of the KV cache in use

    @classmethod
    def from_stats(cls, stats: EngineStats) -> TELoad:
        """The load a TE's heartbeat stats show."""
        return cls(num_running=stats.num_running, num_waiting=stats.num_waiting, waiting_tokens=stats.waiting_tokens,
                   running_tokens=stats.running_tokens, kv_usage=stats.kv_usage)


@dataclass
class TEView:
    name: str
    role: str  # "colocated" | "prefill" | "decode"
    group: str  # prefill and decode TEs pair within a group
    load: TELoad
    healthy: bool = True
    down_links: frozenset[str] = frozenset()  # a decode TE: the prefill TEs whose link to it is down

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"TE {self.name}: role must be one of {', '.join(ROLES)}, got {self.role!r}")


@dataclass(frozen=True)
class RouteDecision:
    kind: Literal["colocated", "disaggregated"]
    te: str | None  # the colocated TE
    prefill: str | None
    decode: str | None
    policy: str
    reason: str

    @property
    def tes(self) -> list[str]:
        """Every TE the request will occupy."""
        return [self.te] if self.kind == "colocated" else [self.prefill, self.decode]


class SupportsPredictTokens(Protocol):
    def predict_tokens(self, prompt_token_ids: Sequence[int], max_tokens: int) -> int:
        """Expected number of generated tokens."""


class SupportsHeatmapValue(Protocol):
    def value(self, prefill_tokens: int, decode_tokens: int) -> float:
        """> 0 where disaggregated serving beats colocated, < 0 where colocated wins."""


def load_score(load: TELoad) -> float:
    """How long a new request would wait on a TE, in prompt-token equivalents.

    Queued prompt tokens count fully (they are prefilled before or with the new one);
    running context counts RUNNING_TOKEN_WEIGHT per token (a decode step reads it all, but
    costs far less per token than prefill); each request adds REQUEST_TOKENS (a heartbeat
    may carry counts only); KV usage adds KV_PRESSURE_TOKENS * usage^2, small while the cache
    has room and steep near full, where new requests wait or preempt others."""
    return (load.waiting_tokens + RUNNING_TOKEN_WEIGHT * load.running_tokens
            + REQUEST_TOKENS * (load.num_running + load.num_waiting)
            + KV_PRESSURE_TOKENS * load.kv_usage ** 2)


def _decode_key(view: TEView) -> tuple[float, int, float]:
    load = view.load
    return (load.kv_usage, load.num_running + load.num_waiting, load_score(load))


def _pairable(prefill: str, decodes: Sequence[TEView]) -> list[TEView]:
    """The decode TEs that can pull from `prefill`: those whose link to it is not down."""
    return [d for d in decodes if prefill not in d.down_links]


@dataclass
class _Candidates:
    """The healthy TEs that can serve, by type."""

    colocated: list[TEView]
    prefill: list[TEView]  # only those with a healthy decode TE in their group whose link to them is up
    decode_by_group: dict[str, list[TEView]]
    prefill_by_group: dict[str, list[TEView]]

    def decodes(self, prefill: TEView) -> list[TEView]:
        """The decode TEs a prefill TE can be paired with."""
        return _pairable(prefill.name, self.decode_by_group[prefill.group])

    @classmethod
    def of(cls, tes: Sequence[TEView]) -> _Candidates:
        healthy = [t for t in tes if t.healthy]
        decode_by_group: dict[str, list[TEView]] = {}
        for t in healthy:
            if t.role == "decode":
                decode_by_group.setdefault(t.group, []).append(t)
        prefill = [t for t in healthy if t.role == "prefill" and _pairable(t.name, decode_by_group.get(t.group, []))]
        prefill_by_group: dict[str, list[TEView]] = {}
        for t in prefill:
            prefill_by_group.setdefault(t.group, []).append(t)
        colocated = [t for t in healthy if t.role == "colocated"]
        if not colocated and not prefill:
            raise NoRouteError(_no_route_message(tes))
        return cls(colocated, prefill, {g: d for g, d in decode_by_group.items() if g in prefill_by_group},
                   prefill_by_group)


@dataclass(frozen=True)
class RouteHealth:
    """What can be routed now: the healthy colocated TEs and, per P/D group, its healthy prefill and
    decode TEs (a pair needs one of each); `missing` names, per kind or group, the part that is not there."""

    colocated: list[str]
    pd_groups: dict[str, dict[str, list[str]]]  # group -> {"prefill": [...], "decode": [...]}
    missing: list[str]

    @property
    def routable(self) -> bool:
        return bool(self.colocated) or any(g["prefill"] and g["decode"] for g in self.pd_groups.values())

    def to_dict(self) -> dict:
        return {"colocated": {"routable": bool(self.colocated), "tes": self.colocated},
                "disaggregated": {"routable": any(g["prefill"] and g["decode"] for g in self.pd_groups.values()),
                                  "groups": self.pd_groups},
                "missing": self.missing}


def route_health(tes: Sequence[TEView], known_groups: dict[str, str] | None = None) -> RouteHealth:
    """`tes`: the live TEs; `known_groups`: group -> role of every TE ever registered, so a group that
    lost all its TEs of one role (or all of them) is reported as missing that part."""
    healthy = [t for t in tes if t.healthy]
    known = dict(known_groups or {})
    for t in tes:
        known.setdefault(t.group, t.role)
    colocated = sorted(t.name for t in healthy if t.role == "colocated")
    decodes = [t for t in healthy if t.role == "decode"]
    # a prefill TE counts when a decode TE of its group can pull from it (its link is not down); with no decode
    # TE at all it is live all the same (what is missing is the decode TE)
    pd_groups = {}
    for group, role in sorted(known.items()):
        if role == "colocated":
            continue
        group_decodes = [d for d in decodes if d.group == group]
        pd_groups[group] = {"prefill": sorted(t.name for t in healthy if t.group == group and t.role == "prefill"
                                              and (not group_decodes or _pairable(t.name, group_decodes))),
                            "decode": sorted(d.name for d in group_decodes)}
    cut_off = {t.group for t in healthy if t.role == "prefill" and t.group in pd_groups
               and not pd_groups[t.group]["prefill"] and pd_groups[t.group]["decode"]}
    missing = [f"group {group}: no live {' and no live '.join(r for r in ('prefill', 'decode') if not tes_[r])} TE"
               if group not in cut_off else f"group {group}: the KV links of every live prefill TE are down"
               for group, tes_ in pd_groups.items() if not (tes_["prefill"] and tes_["decode"])]
    if not colocated and any(role == "colocated" for role in known.values()):
        missing.insert(0, "no live colocated TE")
    if not known:
        missing.append("no TE is registered")
    return RouteHealth(colocated, pd_groups, missing)


def _no_route_message(tes: Sequence[TEView]) -> str:
    if not tes:
        return "no TE is registered"
    unhealthy = sorted(t.name for t in tes if not t.healthy)
    parts = ["no healthy colocated TE and no group with both a healthy prefill and a healthy decode TE"]
    if unhealthy:
        parts.append(f"unhealthy: {', '.join(unhealthy)}")
    down = sorted(f"{p} -> {t.name}" for t in tes if t.healthy and t.role == "decode" for p in t.down_links)
    if down:
        parts.append(f"KV links down: {', '.join(down)}")
    return "; ".join(parts)


class RoutingPolicy:
    def __init__(self, policy: str = "round_robin", tree: GlobalPromptTree | None = None,
                 heatmap: SupportsHeatmapValue | None = None, predictor: SupportsPredictTokens | None = None,
                 balance_threshold: float = 0.25, balance_floor: float = 1024.0,
                 score: Callable[[TELoad], float] = load_score) -> None:
        """`balance_threshold`, `balance_floor`: combined treats load as balanced when the spread of
        the candidates' scores is at most balance_threshold * max(highest score, balance_floor);
        the floor keeps a nearly idle cluster (a request or two apart) counted as balanced."""
        self.policy = _check_policy(policy)
        self.tree = tree
        self.heatmap = heatmap
        self.predictor = predictor
        self.balance_threshold = balance_threshold
        self.balance_floor = balance_floor
        self.score = score
        self._rr_next = 0
        self._rr_prefill: dict[str, int] = {}
        self._rr_decode: dict[str, int] = {}

    def route(self, prompt_token_ids: Sequence[int], tes: Sequence[TEView], policy: str | None = None,
              max_tokens: int | None = None, cache_salt: str = "") -> RouteDecision:
        """The unit for one request; `policy` overrides the router's for this request.

        `max_tokens` is the request's output limit as the JE resolved it; None leaves the predictor
        out and assumes DEFAULT_DECODE_TOKENS. `cache_salt` is the request's prefix-cache namespace: locality
        sees only the prefixes cached under it (another tenant's cached prompt never attracts the request)."""
        name = self.policy if policy is None else _check_policy(policy)
        cands = _Candidates.of(tes)
        if name == "round_robin":
            return self._round_robin(cands)
        if name == "load":
            return self._least_load(cands, cands.colocated + cands.prefill, name, "")
        if name == "locality":
            return self._locality(cands, cands.colocated + cands.prefill, prompt_token_ids, name, "", cache_salt)
        entries, why = self._pd_type(cands, prompt_token_ids, max_tokens)
        if name == "pd_aware":
            return self._least_load(cands, entries, name, why)
        scores = [self._unit_score(cands, t) for t in entries]
        spread, top = max(scores) - min(scores), max(scores)
        if spread <= self.balance_threshold * max(top, self.balance_floor):
            return self._locality(cands, entries, prompt_token_ids, name,
                                  f"{why}; load balanced (spread {spread:.0f})", cache_salt)
        return self._least_load(cands, entries, name, f"{why}; load unbalanced (spread {spread:.0f})")

    def route_to(self, name: str, tes: Sequence[TEView], reason: str) -> RouteDecision | None:
        """The unit entered at TE `name` (a colocated TE, or a prefill TE with its group's least loaded
        decode TE), or None when that TE cannot take requests now."""
        try:
            cands = _Candidates.of(tes)
        except NoRouteError:
            return None
        entry = next((t for t in cands.colocated + cands.prefill if t.name == name), None)
        return None if entry is None else self._decide(cands, entry, "pinned", reason)

    # ------------------------------------------------------------ policies
    def _round_robin(self, cands: _Candidates) -> RouteDecision:
        units: list[TEView | str] = list(cands.colocated)  # a str: one slot of that P/D group
        for group, prefills in cands.prefill_by_group.items():
            units += [group] * max(len(prefills), len(cands.decode_by_group[group]))
        slot = self._rr_next % len(units)
        self._rr_next += 1
        unit = units[slot]
        reason = f"slot {slot} of {len(units)}"
        if isinstance(unit, TEView):
            return _colocated(unit, "round_robin", reason)
        prefills = cands.prefill_by_group[unit]
        p = self._rr_prefill.get(unit, 0)
        d = self._rr_decode.get(unit, 0)
        self._rr_prefill[unit], self._rr_decode[unit] = p + 1, d + 1
        prefill = prefills[p % len(prefills)]
        decodes = cands.decodes(prefill)
        return RouteDecision("disaggregated", None, prefill.name, decodes[d % len(decodes)].name, "round_robin",
                             reason)

    def _unit_score(self, cands: _Candidates, entry: TEView) -> float:
        """A colocated TE's load; for a prefill TE, the busier of it and its group's best decode TE
        (a prefill TE empties fast, while its decode TE may be the bottleneck of the pair)."""
        score = self.score(entry.load)
        if entry.role == "prefill":
            score = max(score, min(self.score(d.load) for d in cands.decodes(entry)))
        return score

    def _least_load(self, cands: _Candidates, entries: list[TEView], policy: str, why: str) -> RouteDecision:
        # ties (prefill TEs whose shared decode TE is the busier half of every pair) go to the least loaded entry,
        # not always to the first
        best = min(entries, key=lambda t: (self._unit_score(cands, t), self.score(t.load)))
        return self._decide(cands, best, policy, _join(why, f"least load ({self._unit_score(cands, best):.0f})"))

    def _locality(self, cands: _Candidates, entries: list[TEView], prompt: Sequence[int], policy: str,
                  why: str, cache_salt: str = "") -> RouteDecision:
        if self.tree is None:
            return self._least_load(cands, entries, policy, _join(why, "no prompt tree"))
        cached = self.tree.match(prompt, cache_salt)
        best = min(entries, key=lambda t: (-cached.get(t.name, 0), self._unit_score(cands, t)))
        hit = cached.get(best.name, 0)
        return self._decide(cands, best, policy, _join(why, f"longest cached prefix ({hit} tokens)"))

    def _pd_type(self, cands: _Candidates, prompt: Sequence[int], max_tokens: int | None) -> tuple[list[TEView], str]:
        """The entry TEs of the type the request suits: colocated TEs or prefill TEs."""
        if not cands.prefill:
            return cands.colocated, "only colocated TEs"
        if not cands.colocated:
            return cands.prefill, "only P/D pairs"
        prefill_len = len(prompt)
        if self.predictor is not None and max_tokens is not None:
            decode_len = min(self.predictor.predict_tokens(prompt, max_tokens), max_tokens)  # it cannot generate more
        else:
            decode_len = max_tokens if max_tokens is not None else DEFAULT_DECODE_TOKENS
        if self.heatmap is not None:  # without a predictor, max_tokens stands for the decode length
            value = self.heatmap.value(prefill_len, decode_len)
            disaggregate = value > 0
            why = f"heatmap {value:+.2f} at prefill {prefill_len}, decode {decode_len}"
        else:
            # without the study, its main finding: long prompts with short outputs gain from
            # disaggregation, so disaggregate when the prompt is at least as long as the output
            disaggregate = prefill_len >= decode_len
            why = f"prefill {prefill_len} {'>=' if disaggregate else '<'} decode {decode_len}"
        return (cands.prefill, why + " -> disaggregated") if disaggregate else (cands.colocated, why + " -> colocated")

    def _decide(self, cands: _Candidates, entry: TEView, policy: str, reason: str) -> RouteDecision:
        if entry.role == "colocated":
            return _colocated(entry, policy, reason)
        decode = min(cands.decodes(entry), key=_decode_key)
        return RouteDecision("disaggregated", None, entry.name, decode.name, policy, reason)


def _colocated(view: TEView, policy: str, reason: str) -> RouteDecision:
    return RouteDecision("colocated", view.name, None, None, policy, reason)


def _join(why: str, more: str) -> str:
    return f"{why}; {more}" if why else more


def _check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; valid: {', '.join(POLICIES)}")
    return policy


# ---------------------------------------------------------------- load between heartbeats
@dataclass
class _Dispatch:
    prompt_tokens: int
    at: float


class LoadTracker:
    """The JE's view of each TE's load: the last heartbeat plus what the JE sent since.

    A heartbeat (`report`) replaces a TE's base load and drops the JE's optimistic additions
    made before the heartbeat was taken, since the TE's numbers already count them; later
    additions stay until the next heartbeat. So a burst between heartbeats spreads out
    instead of all going to the TE that looked idle. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._base: dict[str, TELoad] = {}
        self._pending: dict[str, dict[str | int, _Dispatch]] = {}  # te -> request id (or serial) -> addition
        self._serial = 0

    def report(self, te: str, load: TELoad, at: float | None = None) -> None:
        """A heartbeat from `te`, taken at `at` (this tracker's clock; default now)."""
        at = self._clock() if at is None else at
        with self._lock:
            self._base[te] = replace(load)
            pending = self._pending.get(te, {})
            for key in [k for k, d in pending.items() if d.at <= at]:
                del pending[key]

    def on_dispatch(self, te: str, prompt_tokens: int, req_id: str | None = None) -> None:
        """The JE sent a request to `te`: count it as waiting there until a heartbeat does."""
        with self._lock:
            if req_id is None:
                self._serial += 1
                key: str | int = self._serial
            else:
                key = req_id
            self._pending.setdefault(te, {})[key] = _Dispatch(prompt_tokens, self._clock())

    def on_finished(self, te: str, req_id: str | None = None, num_tokens: int = 0) -> None:
        """A request `te` served is done (or left it). If no heartbeat has counted it yet, its
        addition goes; otherwise one request and `num_tokens` of its context leave the base
        until the next heartbeat."""
        with self._lock:
            pending = self._pending.get(te, {})
            if req_id is not None and req_id in pending:
                del pending[req_id]
                return
            base = self._base.get(te)
            if base is None:
                return
            if base.num_running > 0:
                base.num_running -= 1
                base.running_tokens = max(0, base.running_tokens - num_tokens)
            elif base.num_waiting > 0:
                base.num_waiting -= 1
                base.waiting_tokens = max(0, base.waiting_tokens - num_tokens)

    def forget(self, te: str) -> None:
        """Drop a TE that left."""
        with self._lock:
            self._base.pop(te, None)
            self._pending.pop(te, None)

    def load_of(self, te: str) -> TELoad:
        """The last heartbeat's load plus the requests sent since (as waiting)."""
        with self._lock:
            load = replace(self._base.get(te, TELoad()))
            for d in self._pending.get(te, {}).values():
                load.num_waiting += 1
                load.waiting_tokens += d.prompt_tokens
            return load
