"""The autoscaler's policy: how many TEs each pool should run, from its TEs' load, the SLOs and the job
executors' demand.

A pool is one role of one TE group, keyed "GROUP/ROLE" ("main/colocated", "pd/prefill", "pd/decode"): the
prefill and decode pools of a group scale on their own (cloudmatrix-infer's dynamic P/D ratio). The cluster
manager feeds the policy each job executor's demand report as it arrives (`observe_demand`) and, every
`interval_s`, asks for a target per pool (`decide`) given the pools' signals: their TEs' loads from
heartbeats and how many start; each pool's min and max are the policy's `bounds`. Signals are judged
over a sliding window of `window_s`:

- up (at most one step per `scale_up_cooldown_s`): waiting or running requests or waiting prompt tokens per TE
  above target, KV usage above `kv_usage_high`, or the TTFT SLO (prefill and colocated pools) or TPOT SLO (decode
  and colocated pools) missed by more than `max_violation_rate` of the window's requests;
- from zero, at once and ignoring cool-down: a job executor holds a request and the pool has no TE;
- down (hysteresis): the load would fit fewer TEs, continuously for `down_stable_s`, whose highest target over
  that time is taken, and not within `scale_down_cooldown_s` of any change;
- to zero: a pool of min 0 that saw no request and ran nothing for `idle_to_zero_s`.

Steps are bounded and targets clamped to [min, max]. Pure logic: no sockets, no processes, no clock of its
own (every call takes `now`); it owns a Prometheus registry the manager serves.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from meshserve.config import ConfigError
from meshserve.router.routing import ANY_POOL
from meshserve.wire.cluster import GroupDemand, JobExecutorReport

logger = logging.getLogger(__name__)

_HELD_FRESH_S = 5.0  # a job executor's held count is its latest report's; older than this (it died), ignored


def _setting(default: float, low: float, high: float | None = None, low_open: bool = False):
    return field(default=default, metadata={"low": low, "high": high, "low_open": low_open})


@dataclass(frozen=True)
class AutoscalerSettings:
    """The `autoscaler:` mapping of a deployment file; every field is optional (defaults of the orders of
    magnitude Ray Serve's autoscaler and Dynamo's planner use, for one engine per TE).

    interval_s: how often the manager asks the policy for targets.
    window_s: the sliding window over which load, SLO samples and arrivals are judged.
    ttft_slo_s: the time to first token a request should get, counted from its arrival at the job executor.
    tpot_slo_s: the mean time per output token after the first that a request should get.
    max_violation_rate: the fraction of the window's requests that may miss an SLO before the pool scales up;
        a pool scales down only while the rate is below half of it.
    min_slo_samples: fewer requests than this in the window do not judge an SLO.
    queue_per_te: waiting (not yet scheduled) requests per TE above which the pool scales up.
    waiting_tokens_per_te: waiting prompt tokens per TE above which the pool scales up.
    kv_usage_high: the mean KV-cache usage of the pool's TEs above which it scales up; a scale-down keeps the
        KV its TEs hold below it on the TEs that remain.
    running_per_te: running requests one TE should carry: above it (window mean) the pool scales up, and a
        scale-down keeps at most this many per TE left.
    scale_up_cooldown_s: the least time between two scale-ups of a pool (new TEs take a while to serve).
    scale_down_cooldown_s: the least time between any change of a pool and a scale-down.
    down_stable_s: how long the load must fit fewer TEs before the pool scales down (hysteresis); the highest
        target over that time is taken.
    idle_to_zero_s: a pool of min 0 that saw no request and ran nothing for this long scales to zero.
    max_step_up: the most TEs one scale-up adds.
    max_step_down: the most TEs one scale-down removes (idle-to-zero removes them all).
    """

    interval_s: float = _setting(2.0, 0.0, low_open=True)
    window_s: float = _setting(30.0, 0.0, low_open=True)
    ttft_slo_s: float = _setting(2.0, 0.0, low_open=True)
    tpot_slo_s: float = _setting(0.1, 0.0, low_open=True)
    max_violation_rate: float = _setting(0.1, 0.0, 1.0)
    min_slo_samples: int = _setting(10, 1)
    queue_per_te: float = _setting(2.0, 0.0, low_open=True)
    waiting_tokens_per_te: int = _setting(16384, 1)
    kv_usage_high: float = _setting(0.85, 0.0, 1.0, low_open=True)
    running_per_te: float = _setting(16.0, 0.0, low_open=True)
    scale_up_cooldown_s: float = _setting(30.0, 0.0)
    scale_down_cooldown_s: float = _setting(120.0, 0.0)
    down_stable_s: float = _setting(120.0, 0.0)
    idle_to_zero_s: float = _setting(300.0, 0.0)
    max_step_up: int = _setting(2, 1)
    max_step_down: int = _setting(1, 1)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_setting(f, getattr(self, f.name), "autoscaler")

    @classmethod
    def from_dict(cls, data: Any, where: str = "autoscaler") -> AutoscalerSettings:
        """Settings from a deployment file's `autoscaler:` mapping (None: every default)."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a mapping of autoscaler settings, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in fields)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(fields)})")
        for name, value in data.items():
            _check_setting(fields[name], value, where)
        return cls(**{name: float(value) if fields[name].type == "float" else value for name, value in data.items()})


def _check_setting(f: dataclasses.Field, value: Any, where: str) -> None:
    integer = f.type == "int"  # annotations are strings here (postponed evaluation)
    low, high, low_open = f.metadata["low"], f.metadata["high"], f.metadata["low_open"]
    if high is not None:
        expected = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    else:
        expected = f"{'>' if low_open else '>='} {low:g}"
    expected = f"{'an integer' if integer else 'a number'} {expected}"
    ok = (not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
          and math.isfinite(value) and (value > low if low_open else value >= low)
          and (high is None or value <= high))
    if not ok:
        raise ConfigError(f"{where}: {f.name} must be {expected}, got {value!r}")


# ---------------------------------------------------------------------- inputs and outputs
class SupportsLoad(Protocol):
    """A TE's load as its heartbeat says it: `EngineStats` or the router's `TELoad`."""

    num_running: int
    num_waiting: int
    waiting_tokens: int
    kv_usage: float


@dataclass(frozen=True)
class PoolSignals:
    """What the manager knows of one pool's TEs at a tick."""

    loads: Sequence[SupportsLoad] = ()  # one per TE serving now (registered, not draining), from its heartbeats
    running: int = 0  # TEs serving (len(loads))
    starting: int = 0  # TEs launched that do not serve yet


@dataclass(frozen=True)
class _PoolState:
    """One pool at a tick: its signals with its key and bounds."""

    key: str  # GROUP/ROLE
    min_count: int
    max_count: int
    loads: Sequence[SupportsLoad]
    starting: int

    @property
    def current(self) -> int:
        return len(self.loads) + self.starting

    @property
    def role(self) -> str:
        return self.key.rpartition("/")[2]


@dataclass(frozen=True)
class ScaleDecision:
    """The pool's target after a tick; `direction` says whether this tick changed it ("up", "down", "")."""

    key: str
    current: int  # TEs serving or starting
    target: int
    reason: str  # why the target is what it is (the last change's reason while it holds)
    direction: str = ""
    # the change's reason kind: min max held queue running waiting_tokens kv_usage ttft_slo tpot_slo load idle
    kind: str = ""


@dataclass(frozen=True)
class _LoadSample:
    """One tick's load of a pool: totals over its serving TEs."""

    tes: int
    running: int
    waiting: int
    waiting_tokens: int
    kv_sum: float  # KV usage summed over the TEs, in TEs' worth of cache

    @classmethod
    def of(cls, loads: Sequence[SupportsLoad]) -> _LoadSample:
        return cls(len(loads), sum(x.num_running for x in loads), sum(x.num_waiting for x in loads),
                   sum(x.waiting_tokens for x in loads), sum(x.kv_usage for x in loads))


@dataclass(frozen=True)
class _Signals:
    """A pool's signals over the window: means of the load samples, SLO violation rates."""

    running: float = 0.0
    waiting: float = 0.0
    waiting_tokens: float = 0.0
    kv_sum: float = 0.0
    kv_mean: float = 0.0  # per TE, over the samples that had TEs
    slo: tuple[tuple[str, float, int, float], ...] = ()  # (name, violation rate, samples, SLO) per judged SLO


@dataclass
class _Pool:
    """The policy's memory of one pool."""

    last_active: float  # the last time it had a request, held or running
    target: int | None = None
    reason: str = ""
    last_up: float = -math.inf
    last_change: float = -math.inf
    down_since: float | None = None  # the load has fit fewer TEs since then
    down_peak: int = 0  # the highest lower target since then
    loads: deque[tuple[float, _LoadSample]] = field(default_factory=deque)
    ttft: deque[tuple[float, float]] = field(default_factory=deque)
    tpot: deque[tuple[float, float]] = field(default_factory=deque)
    arrivals: deque[tuple[float, int]] = field(default_factory=deque)

    def prune(self, horizon: float) -> None:
        for window in (self.loads, self.ttft, self.tpot, self.arrivals):
            while window and window[0][0] < horizon:
                window.popleft()


# ---------------------------------------------------------------------- the policy
class Autoscaler:
    """Targets per pool from the pools' signals (`decide`) and the job executors' demand (`observe_demand`).
    `bounds`: pool key -> (min, max) TEs; a pool without bounds keeps the TEs it has. Call it from one thread."""

    def __init__(self, settings: AutoscalerSettings | None = None,
                 bounds: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.settings = settings or AutoscalerSettings()
        self.bounds: dict[str, tuple[int, int]] = dict(bounds or {})
        self._pools: dict[str, _Pool] = {}
        self._held: dict[tuple[str, str], tuple[float, int, float]] = {}  # (JE, pool) -> (seen, held, oldest s)
        self.registry = CollectorRegistry()
        self._decisions = Counter("meshserve_autoscaler_decisions", "Scaling decisions that changed a pool's target.",
                                  ["pool", "direction", "reason"], registry=self.registry)
        self._target = Gauge("meshserve_autoscaler_target_tes", "TEs the pool should run.", ["pool"],
                             registry=self.registry)
        self._current = Gauge("meshserve_autoscaler_current_tes", "TEs of the pool serving or starting.", ["pool"],
                              registry=self.registry)
        self._queue = Gauge("meshserve_autoscaler_queue", "Waiting requests on the pool's TEs (window mean).",
                            ["pool"], registry=self.registry)
        self._kv = Gauge("meshserve_autoscaler_kv_usage_ratio", "Mean KV-cache usage of the pool's TEs (window mean).",
                         ["pool"], registry=self.registry)
        self._violations = Gauge("meshserve_autoscaler_slo_violation_ratio",
                                 "Fraction of the window's requests that missed the SLO.", ["pool", "slo"],
                                 registry=self.registry)
        self._held_gauge = Gauge("meshserve_autoscaler_held_requests",
                                 "Requests job executors hold for the pool (it has no TE).", ["pool"],
                                 registry=self.registry)

    # ------------------------------------------------------------------ inputs
    def observe(self, report: JobExecutorReport, now: float) -> None:
        """A job executor's report."""
        self.observe_demand(report.name, report.groups, now)

    def observe_demand(self, je_name: str, groups: Iterable[GroupDemand], now: float) -> None:
        """A job executor's demand per pool since its previous report, and what it holds now."""
        self.forget(je_name)
        for demand in groups:
            pool = self._pool(demand.group, now)
            if demand.held:
                self._held[(je_name, demand.group)] = (now, demand.held, demand.held_oldest_s)
            if demand.held or demand.arrivals:
                pool.last_active = now
            if demand.arrivals:
                pool.arrivals.append((now, demand.arrivals))
            pool.ttft.extend((now, s) for s in demand.ttft_s)
            pool.tpot.extend((now, s) for s in demand.tpot_s)

    def forget(self, je_name: str) -> None:
        """A job executor is gone: what it held is no demand any more."""
        for key in [k for k in self._held if k[0] == je_name]:
            del self._held[key]

    # ------------------------------------------------------------------ decisions
    def decide(self, now: float, signals: Mapping[str, PoolSignals]) -> list[ScaleDecision]:
        """Each pool's target now. A decision whose direction is set changed the target (and is logged)."""
        decisions = []
        for key, sig in signals.items():
            current = len(sig.loads) + sig.starting
            low, high = self.bounds.get(key, (current, current))
            state = _PoolState(key, low, high, sig.loads, sig.starting)
            pool = self._pool(state.key, now)
            pool.prune(now - self.settings.window_s)
            sample = _LoadSample.of(state.loads)
            pool.loads.append((now, sample))
            held, oldest = self._held_for(state, now)
            # a TE still starting has had no chance to serve, and a held request is demand: neither is idle
            if sample.running or sample.waiting or sig.starting or held:
                pool.last_active = now
            window = self._signals(state, pool)
            decision = self._decide_pool(state, pool, window, held, oldest, now)
            self._export(state, decision, window, held)
            decisions.append(decision)
        return decisions

    def _pool(self, key: str, now: float) -> _Pool:
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(last_active=now)
        return pool

    def _held_for(self, state: _PoolState, now: float) -> tuple[int, float]:
        """Requests held for the pool: those the JEs attribute to it, and, while it has no TE, those they hold
        for any pool (a JE that has never seen a TE cannot tell which pool would serve them)."""
        held, oldest = 0, 0.0
        for (je, key), (seen, count, wait) in list(self._held.items()):
            if now - seen > _HELD_FRESH_S:
                del self._held[(je, key)]
            elif key == state.key or (key == ANY_POOL and state.current == 0):
                held, oldest = held + count, max(oldest, wait)
        return held, oldest

    def _signals(self, state: _PoolState, pool: _Pool) -> _Signals:
        samples = [s for _, s in pool.loads]
        n = len(samples)
        with_tes = [s for s in samples if s.tes]
        slos = []
        s = self.settings
        for name, window, limit, roles in (("ttft", pool.ttft, s.ttft_slo_s, ("colocated", "prefill")),
                                           ("tpot", pool.tpot, s.tpot_slo_s, ("colocated", "decode"))):
            if state.role in roles and window:
                slos.append((name, sum(1 for _, v in window if v > limit) / len(window), len(window), limit))
        return _Signals(
            running=sum(x.running for x in samples) / n, waiting=sum(x.waiting for x in samples) / n,
            waiting_tokens=sum(x.waiting_tokens for x in samples) / n, kv_sum=sum(x.kv_sum for x in samples) / n,
            kv_mean=sum(x.kv_sum / x.tes for x in with_tes) / len(with_tes) if with_tes else 0.0, slo=tuple(slos))

    def _decide_pool(self, state: _PoolState, pool: _Pool, sig: _Signals, held: int, oldest: float,
                     now: float) -> ScaleDecision:
        s = self.settings
        lo, hi = state.min_count, state.max_count
        if pool.target is None:  # first sight: what runs (outside the bounds: clamped below, with a reason)
            pool.target = state.current
        base = pool.target

        def change(target: int, kind: str, reason: str) -> ScaleDecision:
            return self._change(state, pool, target, kind, reason, now)

        if base < lo:
            return change(lo, "min", f"{base} TEs < min {lo}")
        if base > hi:
            return change(hi, "max", f"{base} TEs > max {hi}")
        if base == 0 and held:  # ignores cool-down: a request is waiting for this pool
            return change(min(max(1, lo), hi), "held",
                          f"held request and no TE: scale from zero now ({held} held, oldest {oldest:.1f} s)")
        if base == 0:
            return self._steady(state, pool)
        up = self._up_need(state, sig, base)
        if up is not None and now - pool.last_up >= s.scale_up_cooldown_s and base < hi:
            need, kind, reason = up
            return change(min(need, base + s.max_step_up, hi), kind, reason)
        if up is not None:
            pool.down_since = None  # under pressure: nothing to take away
            return self._steady(state, pool)
        idle = now - pool.last_active
        if lo == 0 and not held and idle >= s.idle_to_zero_s:
            return change(0, "idle", f"idle {idle:.0f} s: scale to zero")
        return self._maybe_down(state, pool, sig, base, now)

    def _up_need(self, state: _PoolState, sig: _Signals, n: int) -> tuple[int, str, str] | None:
        """The TEs the pool's load asks for when that is more than `n`: (need, kind, reason)."""
        s = self.settings
        needs = []  # the signals are window means: rounded to whole numbers, "4 running > 4" read as a wrong call
        tes = f"{n} TE" if n == 1 else f"{n} TEs"
        if sig.waiting > s.queue_per_te * n:
            needs.append((math.ceil(sig.waiting / s.queue_per_te), "queue",
                          f"queue {round(sig.waiting, 2):g} > {s.queue_per_te:g} per TE x {tes}"))
        if sig.running > s.running_per_te * n:  # busier than a TE should be: add TEs before latency shows it
            needs.append((math.ceil(sig.running / s.running_per_te), "running",
                          f"{round(sig.running, 2):g} running > {s.running_per_te:g} per TE x {tes}"))
        per_te = s.waiting_tokens_per_te
        if sig.waiting_tokens > per_te * n:
            needs.append((math.ceil(sig.waiting_tokens / per_te), "waiting_tokens",
                          f"{sig.waiting_tokens:.0f} waiting prompt tokens > {per_te} per TE x {tes}"))
        if sig.kv_mean > s.kv_usage_high:
            needs.append((max(n + 1, math.ceil(n * sig.kv_mean / s.kv_usage_high)), "kv_usage",
                          f"KV usage {sig.kv_mean:.0%} > {s.kv_usage_high:.0%} over {tes}"))
        for name, rate, count, limit in sig.slo:
            if count >= s.min_slo_samples and rate > s.max_violation_rate:
                needs.append((max(n + 1, math.ceil(n * (1 + rate))), f"{name}_slo",
                              f"{name.upper()} SLO {limit:g} s violated by {rate:.0%} of {count} requests "
                              f"over {s.window_s:.0f} s"))
        if not needs:
            return None
        return max(needs, key=lambda x: x[0])

    def _maybe_down(self, state: _PoolState, pool: _Pool, sig: _Signals, base: int, now: float) -> ScaleDecision:
        """Scale down once the load has fit fewer TEs for down_stable_s, to the highest such count since."""
        s = self.settings
        if any(rate > s.max_violation_rate / 2 and count >= s.min_slo_samples for _, rate, count, _ in sig.slo):
            pool.down_since = None
            return self._steady(state, pool)
        fits = max(math.ceil(sig.waiting / s.queue_per_te), math.ceil(sig.waiting_tokens / s.waiting_tokens_per_te),
                   math.ceil(sig.kv_sum / s.kv_usage_high - 1e-9), math.ceil(sig.running / s.running_per_te - 1e-9),
                   state.min_count, 1)
        if fits >= base:
            pool.down_since = None
            return self._steady(state, pool)
        if pool.down_since is None:
            pool.down_since, pool.down_peak = now, fits
        pool.down_peak = max(pool.down_peak, fits)
        stable = now - pool.down_since
        if stable < s.down_stable_s or now - pool.last_change < s.scale_down_cooldown_s:
            return self._steady(state, pool)
        target = max(pool.down_peak, base - s.max_step_down)
        return self._change(state, pool, target, "load", (
            f"load fits {pool.down_peak} TE(s) for {stable:.0f} s: {sig.running:.1f} running "
            f"(target {s.running_per_te:g} per TE), queue {sig.waiting:.1f}, KV usage {sig.kv_mean:.0%}"), now)

    def _steady(self, state: _PoolState, pool: _Pool) -> ScaleDecision:
        return ScaleDecision(state.key, state.current, pool.target, pool.reason)

    def _change(self, state: _PoolState, pool: _Pool, target: int, kind: str, reason: str, now: float) -> ScaleDecision:
        if target == pool.target:
            return self._steady(state, pool)
        direction = "up" if target > pool.target else "down"
        logger.info("pool %s: %d -> %d TEs (%s)", state.key, pool.target, target, reason)
        self._decisions.labels(state.key, direction, kind).inc()
        if direction == "up":
            pool.last_up = now
        pool.target, pool.reason, pool.last_change, pool.down_since = target, reason, now, None
        return ScaleDecision(state.key, state.current, target, reason, direction, kind)

    def _export(self, state: _PoolState, decision: ScaleDecision, sig: _Signals, held: int) -> None:
        key = state.key
        self._target.labels(key).set(decision.target)
        self._current.labels(key).set(state.current)
        self._queue.labels(key).set(sig.waiting)
        self._kv.labels(key).set(sig.kv_mean)
        self._held_gauge.labels(key).set(held)
        for name, rate, _, _ in sig.slo:
            self._violations.labels(key, name).set(rate)
