"""Link states of a decode TE's KV transfer paths (xdeepserve §6.1 link probing).

A KV pull runs beside the master's loop, so a stalled one never shows in the heartbeats. Its causes are
told apart with two kinds of evidence about each (decode TE, prefill TE) link:
- the decode ranks' probes (`meshserve.transfer.probe`): a tiny dummy transfer over the pull's path, on a
  thread of its own; a broken link or a dead prefill rank fails them;
- the pulls themselves, as this TE's master sees them: ordered, finished (how long, whether they failed),
  or waiting for free blocks.

The state of a link, per DP group (`LinkMonitor`), then per TE (`merge_links`, the worst group's):
- down: some rank's probes of some rank of the prefill TE failed `down_after` times in a row (a link-level
  fault blocks all transmission); it stays down until a probe passes again;
- saturated: probes pass, but a pull has been in flight or waited for blocks longer than `stall_s`, or one
  took that long within `slow_window_s`, or the last probe's round trip exceeded `slow_probe_s`
  (decode-side backpressure delays the dummy data but delivers it);
- ok otherwise.
A busy decode TE is therefore never reported down: only failed probes make a link down, and probes have a
thread and a connection of their own. Routing pairs no prefill TE with a decode TE whose link to it is
down (`meshserve.router.routing`); a saturated link is still used.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from meshserve.wire.kv import LinkState, LinkStatus

logger = logging.getLogger(__name__)

DOWN_AFTER = 2  # consecutive failed probes of one rank pair that make a link down
STALL_S = 2.0  # a pull in flight, or waiting for blocks, this long: the link is saturated
SLOW_PROBE_S = 0.5  # a probe that passes this slowly: saturated
SLOW_WINDOW_S = 10.0  # a slow pull keeps its link saturated this long
FORGET_S = 30.0  # a link nothing was heard of this long is forgotten (its peer was unlinked, or is gone)


@dataclass
class _RankPair:
    """One decode rank's probes of one prefill rank."""

    consecutive_failures: int = 0
    rtt_s: float = 0.0


@dataclass
class _Link:
    pairs: dict[str, _RankPair] = field(default_factory=dict)
    state: LinkState = LinkState.OK
    since: float = field(default_factory=time.time)
    last_heard: float = 0.0  # monotonic: the last probe or pull
    last_slow: float | None = None  # monotonic: the last slow pull's end
    probes: int = 0
    probe_failures: int = 0
    pulls: int = 0
    pull_failures: int = 0
    slow_pulls: int = 0
    last_error: str | None = None


class LinkMonitor:
    """The links of one DP group of a decode TE, by prefill TE name. Called from the master's loop only."""

    def __init__(self, decode: str, down_after: int = DOWN_AFTER, stall_s: float = STALL_S,
                 slow_probe_s: float = SLOW_PROBE_S, slow_window_s: float = SLOW_WINDOW_S,
                 forget_s: float = FORGET_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.decode = decode
        self.down_after = down_after
        self.stall_s = stall_s
        self.slow_probe_s = slow_probe_s
        self.slow_window_s = slow_window_s
        self.forget_s = forget_s
        self.clock = clock
        self._links: dict[str, _Link] = {}

    def _link(self, prefill: str, now: float) -> _Link:
        link = self._links.get(prefill)
        if link is None:
            link = self._links[prefill] = _Link()
        link.last_heard = now
        return link

    def note(self, prefill: str) -> None:
        """A pull from `prefill` is ordered or waits for blocks: the link is known from now on."""
        self._link(prefill, self.clock())

    def on_probe(self, prefill: str, pair: str, ok: bool, rtt_s: float, error: str | None = None) -> None:
        """A probe of one of `prefill`'s ranks by one of this group's ranks (`pair` names the two)."""
        link = self._link(prefill, self.clock())
        probes = link.pairs.setdefault(pair, _RankPair())
        link.probes += 1
        probes.rtt_s = rtt_s
        if ok:
            probes.consecutive_failures = 0
            return
        probes.consecutive_failures += 1
        link.probe_failures += 1
        link.last_error = error

    def on_pull(self, prefill: str, seconds: float, error: str | None = None) -> None:
        """A pull from `prefill` ended (every rank of the group reported), `seconds` after it was ordered."""
        now = self.clock()
        link = self._link(prefill, now)
        link.pulls += 1
        if error is not None:
            link.pull_failures += 1
            link.last_error = error
        elif seconds > self.stall_s:
            link.slow_pulls += 1
            link.last_slow = now

    def state(self, prefill: str, stalled_s: float = 0.0) -> LinkState:
        """The link's state now; `stalled_s`: how long its oldest pull has been in flight or waiting."""
        link = self._links.get(prefill)
        if link is None:
            return LinkState.OK
        return self._classify(link, stalled_s, self.clock())

    def _classify(self, link: _Link, stalled_s: float, now: float) -> LinkState:
        if any(p.consecutive_failures >= self.down_after for p in link.pairs.values()):
            return LinkState.DOWN
        slow_pull = link.last_slow is not None and now - link.last_slow <= self.slow_window_s
        slow_probe = any(p.consecutive_failures == 0 and p.rtt_s > self.slow_probe_s for p in link.pairs.values())
        return LinkState.SATURATED if stalled_s > self.stall_s or slow_pull or slow_probe else LinkState.OK

    def statuses(self, stalled: Mapping[str, float] | None = None) -> list[LinkStatus]:
        """Every link's status now; `stalled`: per prefill TE, how long its oldest pull has been in flight or
        waiting for blocks. Links not heard of for `forget_s` are dropped first."""
        now = self.clock()
        stalled = stalled or {}
        for prefill in [p for p, link in self._links.items()
                        if now - link.last_heard > self.forget_s and p not in stalled]:
            del self._links[prefill]
        out = []
        for prefill, link in sorted(self._links.items()):
            state = self._classify(link, stalled.get(prefill, 0.0), now)
            if state is not link.state:
                log = logger.warning if state is LinkState.DOWN or link.state is LinkState.DOWN else logger.info
                log("KV link %s <- %s: %s -> %s%s", self.decode, prefill, link.state, state,
                    f" ({link.last_error})" if state is LinkState.DOWN and link.last_error else "")
                link.state, link.since = state, time.time()
            pairs = link.pairs.values()
            out.append(LinkStatus(
                decode=self.decode, prefill=prefill, state=state, since=link.since,
                rtt_s=max((p.rtt_s for p in pairs), default=0.0),
                consecutive_failures=max((p.consecutive_failures for p in pairs), default=0),
                probes=link.probes, probe_failures=link.probe_failures, pulls=link.pulls,
                pull_failures=link.pull_failures, slow_pulls=link.slow_pulls, last_error=link.last_error))
        return out


