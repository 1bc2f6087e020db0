"""A deployment on virtual time: TEs (colocated, prefill, decode; meshserve/sim/te.py) behind a job executor that
routes with the JE's own policy and load view (meshserve/router/routing.py: `RoutingPolicy`, `LoadTracker`), hands
each prefilled request to the decode TE its route named, and passes the decode TE's ReleaseKV back to the prefill
TE (the P/D connector's hold and pull, xdeepserve §5.1).

Events, in time order:
- an arrival is routed at once, on the JE's view of the loads: each TE's heartbeat every `HEARTBEAT_INTERVAL_S`
  (the master's) plus what the JE sent it since;
- a TE with work steps back to back, each step taking its profile's time; what a step produced is seen when it
  ends (and reaches the client `delivery_ms` later);
- with the master's pipelining (`pipeline_depth` 2, its default: step n + 1 is scheduled as step n starts) a busy
  TE's next step holds only the requests that had reached it when the step before began; an idle TE takes a
  request at once;
- the host work of the requests a busy TE took (its profile's, by the gap since the request before each at the
  JE) lengthens the step after the one that took them;
- TEs whose profile shares one host's cores (calibrated on this machine with `--shared-tes`, or `--pd`) slow each
  other: a step that starts while k other TEs step or start (loading and warming up), or pre-warmed processes start
  (the autoscaler's), takes the profile's time times `StepProfile.shared_cores_factor(k)` (a step that holds prompt
  tokens: its prompt table, which stretches its outputs' delivery too; `share_cores=False`: each TE on cores of its
  own).

Each request's first and last token times give TTFT and TPOT as the benchmarks report them (`meshserve bench
serve`): TTFT from arrival to the first token, TPOT the mean gap between its later tokens. Garbage is collected on
the master's schedule, and a line of progress is logged every few seconds of wall time.
"""
from __future__ import annotations

import heapq
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from meshserve.core.client_links import HEARTBEAT_INTERVAL_S
from meshserve.core.engine_report import load_stats
from meshserve.router.prompt_tree import GlobalPromptTree
from meshserve.router.routing import LoadTracker, RoutingPolicy, TELoad, TEView, pool_key
from meshserve.sim.kv_pool import SimPool
from meshserve.sim.te import SimTE, SimTESettings
from meshserve.sim.trace import TraceRequest
from meshserve.utils import report
from meshserve.utils.gc_pauses import StepCollector
from meshserve.wire.client import RequestDelta
from meshserve.wire.kv import KVCacheEvents

if TYPE_CHECKING:
    from meshserve.sim.scaling import SimScaler

PROGRESS_EVERY_S = 5.0
GC_EVERY_STEPS = 200  # the master's garbage-collection schedule (`gc_collect_every_steps`' default)
ROLE_KV_TRANSFER = {"colocated": "none", "prefill": "producer", "decode": "consumer"}
# what happens first at one instant: a step's outputs, TEs ready, the loads heard, the autoscaler's tick, arrivals
# routed, then steps start
_STEP_END, _READY, _HEARTBEAT, _SCALE, _ARRIVAL, _START = range(6)
TREE_POLICIES = ("locality", "combined")  # the routing policies that read the global prompt tree


@dataclass(frozen=True)
class TESpec:
    name: str
    role: str  # colocated | prefill | decode
    settings: SimTESettings
    profile: object  # a StepProfile or an OpStepModel
    group: str = "group-0"  # prefill and decode TEs pair within a group

    def __post_init__(self) -> None:
        if self.role not in ROLE_KV_TRANSFER:
            raise ValueError(f"TE {self.name}: role must be one of {', '.join(ROLE_KV_TRANSFER)}, got {self.role!r}")


ROLE_LETTERS = {"c": "colocated", "p": "prefill", "d": "decode"}


def deployment_specs(text: str, settings: SimTESettings, profile) -> list[TESpec]:
    """The TEs `text` names, every one with `settings` and `profile`: counts of colocated (c), prefill (p) and
    decode (d) TEs joined by '+', e.g. "2c", "1p+1d", "2p+1d+1c" (named c0, c1, p0, d0, ...; one TE group)."""
    specs = []
    for part in text.split("+"):
        count, letter = part.strip()[:-1], part.strip()[-1:]
        if letter not in ROLE_LETTERS or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--tes {text!r}: each part is a count and c (colocated), p (prefill) or d (decode), "
                             f"e.g. 1p+1d")
        role = ROLE_LETTERS[letter]
        start = sum(spec.role == role for spec in specs)
        specs += [TESpec(f"{letter}{start + i}", role, settings, profile) for i in range(int(count))]
    roles = {spec.role for spec in specs}
    if ("prefill" in roles) != ("decode" in roles):
        raise ValueError(f"--tes {text!r}: prefill TEs need decode TEs to hand their requests to, and the reverse")
    return specs


@dataclass
class _Served:
    arrival_s: float
    prompt: list[int] | None = None  # kept until the decode TE took it (P/D)
    entry_te: str = ""
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    finished: bool = False
    decode_te: str | None = None  # P/D: where its hand-off goes
    host_work_s: float = 0.0  # its host work, charged to the steps of a busy TE it joins


@dataclass
class _Member:
    spec: TESpec
    te: SimTE
    # (reached it at, admit, its host work)
    inbox: list[tuple[float, Callable[[float], None], float]] = field(default_factory=list)
    stepping: bool = False  # a step (or its start) is scheduled
    last_start: float = 0.0
    step_ends: float = 0.0  # when its step under way ends
    steps: list[float] = field(default_factory=list)
    state: str = "serving"  # starting (not routable yet) | serving | draining (finishes its requests) | gone
    since: float = 0.0  # when it entered its state
    joined: float = 0.0
    host_work_s: float = 0.0  # the host work of the requests that joined its running work at the last start
    delivery_stretch: float = 1.0  # its step under way delivers its outputs this much slower (a prompt's, shared)
    kv_event_seq: int = 0  # the last batch of prefix-cache events it published

    @property
    def pool(self) -> str:
        return pool_key(self.spec.group, self.spec.role)

    @property
    def drained(self) -> bool:
        return not (self.te.has_work() or self.inbox or self.stepping or self.te.num_holds())


class SimCluster:
    def __init__(self, specs: Sequence[TESpec], policy: str = "load", seed: int = 0,
                 built: dict[str, SimTE] | None = None, scaler: SimScaler | None = None, share_cores: bool = True
                 ) -> None:
        """`built`: TEs made by the caller, by name (the others are made from their specs). `scaler`: the cluster
        manager's autoscaling (meshserve/sim/scaling.py); without one the TEs stay as they are. `share_cores`:
        TEs whose profile names a host share its cores (False: each has cores of its own)."""
        names = [spec.name for spec in specs]
        if not specs or len(set(names)) != len(names):
            raise ValueError("a simulated deployment needs at least one TE, each with its own name")
        self.now = 0.0
        self._last_arrival_s = float("-inf")
        self.seed = seed
        self._events: list[tuple] = []  # (at, kind, sequence, payload), a heap
        self._seq = 0
        self.scaler = scaler
        self.share_cores = share_cores
        self._slowdown_sum, self._slowed_steps = 0.0, 0  # the steps' shared-cores factors, and the steps above 1
        # the prompt tree a locality-aware job executor keeps from the TEs' prefix-cache events (replayed here at
        # the end of the step that made them, as the router receives them)
        self.tree = GlobalPromptTree(specs[0].settings.block_size) if policy in TREE_POLICIES else None
        self.routing = RoutingPolicy(policy, tree=self.tree)
        self.loads = LoadTracker(clock=lambda: self.now)
        self.routes: Counter[str] = Counter()  # decision kind -> requests
        self.served: dict[str, _Served] = {}
        self.breakdown: dict[str, float] = {}  # seconds by part of a step, summed over steps (an op model's)
        # the memory pool every TE with one shares (a TE built by the caller brings its own)
        self.pool = SimPool() if any(spec.settings.kv_pool_latency_s is not None for spec in specs) else None
        self.members: dict[str, _Member] = {}
        for spec in specs:
            self.add(spec, (built or {}).get(spec.name))

    # ------------------------------------------------------------ membership (the cluster manager's part)
    def add(self, spec: TESpec, te: SimTE | None = None, ready_in: float | None = None) -> _Member:
        """A TE joins: serving at once, or (`ready_in` seconds) once it has started."""
        te = te or SimTE(replace(spec.settings, kv_transfer=ROLE_KV_TRANSFER[spec.role]), spec.profile,
                         seed=self.seed + len(self.members), name=spec.name, send_release=self._release,
                         pool=self.pool)
        member = self.members[spec.name] = _Member(spec, te, since=self.now, joined=self.now)
        if ready_in is not None:
            member.state = "starting"
            self._push(self.now + ready_in, _READY, spec.name)
        return member

    def drain(self, name: str) -> None:
        """A TE takes no new request, finishes its own and leaves (a starting one leaves at once)."""
        member = self.members[name]
        member.state, member.since = ("gone" if member.state == "starting" else "draining"), self.now
        self._leave_if_drained(member)

    def _leave_if_drained(self, member: _Member) -> None:
        if member.state == "draining" and member.drained:
            member.state, member.since = "gone", self.now
            self.loads.forget(member.spec.name)
            if self.tree is not None:
                self.tree.remove_te(member.spec.name)

    def serving(self) -> list[_Member]:
        return [m for m in self.members.values() if m.state == "serving"]

    # ------------------------------------------------------------ the run
    def run(self, trace: Sequence[TraceRequest], progress: bool = True,
            slo: tuple[float | None, float | None] = (None, None), idle_before_s: float = 0.0) -> dict:
        """Serve `trace`; `slo`: a (TTFT, TPOT) objective in seconds, either None, whose attainment is reported;
        `idle_before_s`: the deployment served nothing this long before the trace's start, as its heartbeats and
        autoscaler saw (a deployment that idled before its load came)."""
        started = time.perf_counter()
        self._trace = trace
        for index, request in enumerate(trace):
            self._push(request.arrival_s, _ARRIVAL, index)
        self._push(-idle_before_s, _HEARTBEAT, None)
        if self.scaler is not None:
            self._push(self.scaler.interval_s - idle_before_s, _SCALE, None)
        collector = StepCollector(GC_EVERY_STEPS)  # automatic passes would walk every simulated request's objects
        collector.start()
        try:
            events = self._loop(collector, progress)
        finally:
            collector.stop()
        steps = [s for member in self.members.values() for s in member.steps]
        metrics = _metrics(list(self.served.values()), steps, self.now, events, time.perf_counter() - started, slo)
        metrics["routes"] = dict(self.routes)
        metrics["tes"] = {name: {"role": m.spec.role, "steps": len(m.steps), "state": m.state,
                                 "mean_step_ms": 1e3 * statistics.fmean(m.steps) if m.steps else 0.0,
                                 "seconds": (m.since if m.state == "gone" else self.now) - m.joined}
                          for name, m in self.members.items()}
        for name, m in self.members.items():
            if m.te.eplb is not None:  # live EPLB: its moves and the imbalance each placement gave
                metrics["tes"][name]["eplb"] = m.te.eplb.summary()
            if m.te.pool is not None:
                metrics["tes"][name]["pool_hit_tokens"] = m.te.pool_hit_tokens()
        if self.pool is not None:
            metrics["pool_hit_tokens"] = sum(m.te.pool_hit_tokens() for m in self.members.values())
        te_seconds: Counter[str] = Counter()
        for m in self.members.values():
            te_seconds[m.pool] += metrics["tes"][m.spec.name]["seconds"]
        metrics["te_seconds"] = dict(te_seconds)  # per pool: TEs held (starting, serving, draining) x seconds
        if self.scaler is not None:
            metrics["scaling"] = [{"at_s": at, "serving": pools} for at, pools in self.scaler.timeline]
        if self._slowed_steps:
            metrics["shared_cores_slowdown_mean"] = self._slowdown_sum / len(steps)
        if self.breakdown:
            metrics["step_breakdown_ms"] = {part: 1e3 * total / len(steps) for part, total in self.breakdown.items()}
        return metrics

    def _loop(self, collector: StepCollector, progress: bool) -> int:
        events, last_log = 0, time.perf_counter()
        while self._events:
            at, kind, _, payload = heapq.heappop(self._events)
            if kind in (_HEARTBEAT, _SCALE):
                if any(event[1] not in (_HEARTBEAT, _SCALE) for event in self._events):  # while anything is left
                    self.now = at
                    if kind == _HEARTBEAT:
                        self._heartbeat()
                    else:
                        self._scale()
                continue
            self.now = at
            if kind == _READY:
                self._ready(self.members[payload])
            elif kind == _ARRIVAL:
                events += 1
                self._arrive(payload)
            elif kind == _START:
                self._start(self.members[payload])
            else:
                events += 1
                self._step_end(*payload)
                if collector.due():
                    collector.collect()
            if progress and time.perf_counter() - last_log > PROGRESS_EVERY_S:
                last_log = time.perf_counter()
                done = sum(r.finished for r in self.served.values())
                steps = sum(m.te.num_steps for m in self.members.values())
                print(f"[simulate] {done}/{len(self._trace)} requests done, {steps} steps, virtual {self.now:.1f} s",
                      file=sys.stderr, flush=True)
        return events

    def _push(self, at: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, kind, self._seq, payload))

    # ------------------------------------------------------------ the job executor
    def _views(self) -> list[TEView]:
        return [TEView(m.spec.name, m.spec.role, m.spec.group, self.loads.load_of(m.spec.name))
                for m in self.serving()]

    def _heartbeat(self) -> None:
        for member in self.members.values():
            if member.state in ("serving", "draining"):
                self.loads.report(member.spec.name, self.load_of(member))
        self._push(self.now + HEARTBEAT_INTERVAL_S, _HEARTBEAT, None)

    @staticmethod
    def load_of(member: _Member) -> TELoad:
        """What the TE's heartbeat says of its load."""
        return TELoad.from_stats(load_stats(member.te.schedulers, member.te.queue.pending))

    def _scale(self) -> None:
        self.scaler.tick(self)
        self._push(self.now + self.scaler.interval_s, _SCALE, None)

    def _ready(self, member: _Member) -> None:
        if member.state == "starting":
            member.state, member.since = "serving", self.now
            self.loads.report(member.spec.name, self.load_of(member))
            if self.scaler is not None:
                self.scaler.on_ready(self.now)

    def _arrive(self, index: int) -> None:
        request, req_id = self._trace[index], f"sim-{index}"
        # the prompt's token ids, drawn by the first TE (a lone TE draws the prompts it would draw itself)
        prompt = next(iter(self.members.values())).te.draw_prompt(request)
        if len(self.members) == 1:  # a lone TE takes every request (a lone decode TE: from unsimulated prefill)
            entry, decode, kind = next(iter(self.members)), None, "direct"
        else:
            decision = self.routing.route(prompt, self._views(), max_tokens=request.output_len)
            entry = decision.te if decision.kind == "colocated" else decision.prefill
            decode, kind = decision.decode, decision.kind
        self.routes[kind] += 1
        served = self.served[req_id] = _Served(request.arrival_s, prompt=prompt if decode else None)
        served.entry_te, served.decode_te = entry, decode
        member = self.members[entry]
        host_work = getattr(member.te.profile, "request_host_seconds", None)
        served.host_work_s = host_work(self.now - self._last_arrival_s) if host_work else 0.0
        self._last_arrival_s = self.now
        if self.scaler is not None:
            self.scaler.on_route([entry] + ([decode] if decode else []), self)
        self.loads.on_dispatch(entry, request.prompt_len, req_id)
        self._deliver(member, lambda now: member.te.admit(req_id, request, now, prompt), served.host_work_s)

    def _hand_off(self, delta: RequestDelta) -> None:
        """A prefill TE sampled a request's first token and holds its KV: send it to its decode TE."""
        served = self.served[delta.req_id]
        request = self._trace[int(delta.req_id.removeprefix("sim-"))]
        decode = self.members[served.decode_te]
        if decode.state != "serving":  # it left since the route: the group's least loaded decode TE takes it
            decode = min((m for m in self.serving() if m.spec.role == "decode" and m.spec.group == decode.spec.group),
                         key=lambda m: (self.load_of(m).kv_usage, self.load_of(m).num_running), default=decode)
            served.decode_te = decode.spec.name
        self.loads.on_dispatch(served.decode_te, 0, delta.req_id)

        def admit(now: float) -> None:
            decode.te.admit(delta.req_id, request, now, served.prompt, handoff=delta.kv_transfer_params,
                            first_token=delta.new_token_ids[-1])
            served.prompt = None
        self._deliver(decode, admit, served.host_work_s)

    def _release(self, engine_addr: str, req_ids: list[str]) -> None:
        """A decode TE's ReleaseKV to the prefill TE it pulled from."""
        member = self.members[engine_addr]
        member.te.release(req_ids)
        self._leave_if_drained(member)

    # ------------------------------------------------------------ the TEs
    def _deliver(self, member: _Member, admit: Callable[[float], None], host_work_s: float) -> None:
        """`admit` (a request whose host work is `host_work_s`) reaches `member` now."""
        member.inbox.append((self.now, admit, host_work_s))
        if not member.stepping:
            member.stepping = True
            self._push(self.now, _START, member.spec.name)

    def _start(self, member: _Member) -> None:
        te = member.te
        pipelined = te.settings.pipeline_depth == 2 and te.has_work()
        horizon = member.last_start if pipelined else self.now
        busy = te.has_work()
        waiting, joined_host_work = [], 0.0
        for reached, admit, host_work_s in member.inbox:
            if reached <= horizon:
                admit(self.now)
                joined_host_work += host_work_s
            else:
                waiting.append((reached, admit, host_work_s))
        member.inbox = waiting
        if not te.has_work():  # (an idle TE took everything that reached it)
            member.stepping = False
            member.host_work_s = 0.0  # done while the cores had nothing else to do
            self._leave_if_drained(member)
            return
        seconds, deltas = te.step(self.now)
        prompt = any(work.prefill_tokens for work in te.last_work)
        slowdown = self._shared_cores_factor(member, prompt)
        seconds *= slowdown
        # a prompt's stretch, where the profile has one of its own, holds its delivery too
        member.delivery_stretch = slowdown if prompt and getattr(te.profile, "prompt_stretch_beside_tes", ()) else 1.0
        wake = getattr(te.profile, "wake_seconds", None)
        if wake is not None:  # a TE that idled since its last step (or since the start) wakes slower
            seconds += wake(max(0.0, self.now - member.step_ends))
        # the host work of requests that joined running work takes the cores from the steps around them: charged to
        # the step after the one that admits them (their intake before it is their delivery, as for a lone request)
        seconds += member.host_work_s
        member.host_work_s = joined_host_work if busy else 0.0
        self._slowdown_sum += slowdown
        self._slowed_steps += slowdown > 1.0
        member.last_start, member.step_ends = self.now, self.now + seconds
        member.steps.append(seconds)
        timed_parts = getattr(te.step_timer, "breakdown", None)
        if timed_parts is not None and te.last_work:
            for part, part_seconds in timed_parts(te.last_work).items():
                self.breakdown[part] = self.breakdown.get(part, 0.0) + part_seconds
        cache_events = [scheduler.kv_manager.drain_events() for scheduler in te.schedulers]
        self._push(self.now + seconds, _STEP_END, (member.spec.name, deltas, cache_events))

    def _shared_cores_factor(self, member: _Member, prompt: bool = False) -> float:
        """How much longer `member`'s step takes on cores it shares with the other TEs whose step is under way, and
        those starting and the pre-warmed processes starting, each weighed in stepping TEs as the profile says
        (`prompt`: the step holds prompt tokens)."""
        profile = member.te.profile
        if not self.share_cores or not getattr(profile, "stretch_beside_tes", ()):
            return 1.0
        busy = 0.0
        for other in self.members.values():
            if other is not member and other.step_ends > self.now:
                busy += 1.0
            elif other.state == "starting":
                busy += profile.starting_te_weight
        if self.scaler is not None:
            busy += profile.prewarm_weight * self.scaler.warming(self.now)
        return profile.shared_cores_factor(busy, prompt)

    def _step_end(self, name: str, deltas: list[RequestDelta], cache_events: list[list]) -> None:
        member = self.members[name]
        if self.tree is not None:
            for group, events in enumerate(cache_events):
                if events:  # one numbered batch per DP group with changes, as the TE's publisher sends them
                    member.kv_event_seq += 1
                    self.tree.apply(name, KVCacheEvents(seq=member.kv_event_seq, timestamp=self.now, events=events,
                                                        dp_rank=group, engine=name))
        seen = self.now + 1e-3 * member.te.profile.delivery_ms * member.delivery_stretch
        for delta in deltas:
            served = self.served[delta.req_id]
            if delta.new_token_ids:
                if served.first_token_s is None and self.scaler is not None:
                    self.scaler.on_first_token(served.entry_te, seen - served.arrival_s, self)
                served.first_token_s = seen if served.first_token_s is None else served.first_token_s
                served.last_token_s = seen
                served.num_tokens += len(delta.new_token_ids)
            if delta.kv_transfer_params is not None and member.spec.role == "prefill":
                self._hand_off(delta)
            elif delta.finish_reason is not None:
                served.finished = True
                self.loads.on_finished(name, delta.req_id)
                if self.scaler is not None and served.num_tokens > 1:
                    tpot = (served.last_token_s - served.first_token_s) / (served.num_tokens - 1)
                    self.scaler.on_finished(name, tpot, self)
        self._push(self.now, _START, name)


def _metrics(served: list[_Served], step_seconds: list[float], end_s: float, events: int, wall_s: float,
             slo: tuple[float | None, float | None] = (None, None)) -> dict:
    ttft = [r.first_token_s - r.arrival_s for r in served if r.first_token_s is not None]
    tpot = [(r.last_token_s - r.first_token_s) / (r.num_tokens - 1) for r in served if r.num_tokens > 1]
    tokens = sum(r.num_tokens for r in served)
    span = end_s - min(r.arrival_s for r in served) if served else 0.0
    slo_ttft, slo_tpot = slo
    met = sum(r.finished and r.first_token_s is not None
              and (slo_ttft is None or r.first_token_s - r.arrival_s <= slo_ttft)
              and (slo_tpot is None or r.num_tokens < 2
                   or (r.last_token_s - r.first_token_s) / (r.num_tokens - 1) <= slo_tpot) for r in served)
    return {
        "slo_attainment": met / len(served) if served and slo != (None, None) else None,
        "requests": len(served),
        "completed": sum(r.finished for r in served),
        "output_tokens": tokens,
        "virtual_s": end_s,
        "output_tokens_per_s": tokens / span if span > 0 else 0.0,
        "ttft_s": report.summarize(ttft) if ttft else None,
        "tpot_s": report.summarize(tpot) if tpot else None,
        "steps": len(step_seconds),
        "mean_step_ms": 1e3 * statistics.fmean(step_seconds) if step_seconds else 0.0,
        "ttfts": ttft,
        "tpots": tpot,
        "events": events,
        "wall_s": wall_s,
        "events_per_s": events / wall_s if wall_s > 0 else 0.0,
    }
