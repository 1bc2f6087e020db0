"""The job executor's view of its TEs: who is there (heartbeats), how loaded, and what each one caches.

A TE announces itself with `EngineHeartbeat`s (`meshserve te --register`); the first one registers it and
the JE connects to its input and KV-event addresses. A TE whose heartbeats stop for `timeout_s`, that
says it is leaving, or that reports a fatal error is dropped; one that says it is draining (a scale-down:
it finishes its requests, then leaves) keeps its record and its streams, but routing no longer sees it.
Each TE's prefix-cache events feed the global prompt tree; a gap in their sequence (or a heartbeat
announcing events the JE never got: a subscriber connecting late misses the first ones) makes the JE ask
the TE for a snapshot, so the tree never keeps a prefix the TE has evicted for longer than that round trip.
A decode TE's heartbeat also says which prefill TEs its KV links are down from (link probing); routing
pairs neither with the other until the link is back. A TE whose link from the JE is down (its process died:
te_links.py) is not routable from that moment, though only the heartbeat timeout drops it.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

import zmq

from meshserve.router.prompt_tree import GlobalPromptTree
from meshserve.router.routing import LoadTracker, TELoad, TEView
from meshserve.router.te_links import TELinkEvent, TELinkWatch
from meshserve.utils import cluster_auth
from meshserve.wire.client import KVSnapshot
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole
from meshserve.wire.kv import KVCacheEvents, down_prefills

logger = logging.getLogger(__name__)


@dataclass
class EngineRecord:
    name: str
    heartbeat: EngineHeartbeat
    sock: zmq.Socket  # PUSH to the TE's input address
    last_seen: float
    alive: bool = True
    # KV-event sync: None while a snapshot is awaited (events are buffered meanwhile)
    synced: bool = False
    snapshot_query: int | None = None
    buffered: list[KVCacheEvents] = field(default_factory=list)
    registered_at: float = field(default_factory=time.time)  # wall clock, as link states' `since`
    lagging_since: float | None = None
    link_up: bool = True  # the JE's socket to it is connected (te_links.py)

    @property
    def role(self) -> EngineRole:
        return self.heartbeat.role

    @property
    def draining(self) -> bool:
        """It finishes its requests before leaving (a scale-down): it keeps streaming but takes nothing new."""
        return self.heartbeat.draining

    @property
    def view_load(self) -> TELoad:
        return TELoad.from_stats(self.heartbeat.stats)


class EngineRegistry:
    def __init__(self, ctx: zmq.Context, tree: GlobalPromptTree | None, loads: LoadTracker,
                 timeout_s: float = 3.0) -> None:
        self.ctx = ctx
        self.tree = tree
        self.loads = loads
        self.timeout_s = timeout_s
        self.tes: dict[str, EngineRecord] = {}
        self.kv_events = cluster_auth.client(ctx.socket(zmq.SUB))  # every TE's PUB; read on the JE's reader thread
        self.kv_events.setsockopt(zmq.SUBSCRIBE, b"")
        self._kv_event_sources: dict[str, str] = {}  # PUB address -> TE name
        # the SUB socket belongs to the reader thread: (dis)connections wait here until it applies them
        self._subscription_changes: queue.SimpleQueue = queue.SimpleQueue()
        self.links = TELinkWatch()  # the TEs' sockets as seen from here: a dead TE's link drops at once

    # ------------------------------------------------------------------ membership
    def on_heartbeat(self, hb: EngineHeartbeat, now: float) -> tuple[EngineRecord | None, bool]:
        """Record a heartbeat; returns (the TE, whether it is new). A leaving TE is dropped."""
        record = self.tes.get(hb.name)
        if hb.leaving:
            if record is not None and record.alive:
                self.drop(record, "it is shutting down")
            return record, False
        if record is not None and record.alive and record.heartbeat.input_addr != hb.input_addr:
            self.drop(record, "it restarted")  # same name, new process: start over
            record = None
        new = record is None or not record.alive
        if new:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            try:
                cluster_auth.client(sock, hb.input_addr)
                self.links.watch(sock, hb.name, hb.input_addr)
                sock.connect(hb.input_addr)
            except zmq.ZMQError:
                sock.close(0)  # a socket left open would hold the JE's context at shutdown
                raise
            record = EngineRecord(hb.name, hb, sock, now)
            self.tes[hb.name] = record
            if hb.kv_events_addr and self.tree is not None:
                self._subscription_changes.put(("connect", hb.kv_events_addr))
                self._kv_event_sources[hb.kv_events_addr] = hb.name
            logger.info("TE %s registered: %s in group %s at %s (attention TP%d x DP%d)", hb.name, hb.role,
                        hb.group, hb.input_addr, hb.attn_tp, hb.attn_dp)
        elif hb.draining != record.draining:
            logger.info("TE %s %s", hb.name, "is draining: no new requests go to it" if hb.draining else
                        "takes requests again")
        record.heartbeat = hb
        record.last_seen = now
        self.loads.report(hb.name, record.view_load)
        return record, new

    def drop(self, record: EngineRecord, why: str) -> None:
        if not record.alive:
            return
        record.alive = False
        logger.warning("TE %s dropped: %s", record.name, why)
        record.sock.close(0)
        if self.tree is not None:
            self.tree.remove_te(record.name)
        self.loads.forget(record.name)
        addr = record.heartbeat.kv_events_addr
        if addr in self._kv_event_sources:
            del self._kv_event_sources[addr]
            self._subscription_changes.put(("disconnect", addr))

    def on_link_event(self, event: TELinkEvent) -> EngineRecord | None:
        """The JE's link to a TE went down or came back: the TE if that changed whether it is routable."""
        record = self.get(event.te)
        if record is None or record.heartbeat.input_addr != event.input_addr or record.link_up == event.up:
            return None  # a TE dropped since, or one registered again under its name
        record.link_up = event.up
        if event.up:
            logger.info("TE %s: link back; routable again", record.name)
        else:
            logger.warning("TE %s: link lost (its process ended?); not routable until it is back", record.name)
        return record

    def apply_subscription_changes(self) -> None:
        """On the thread that reads `kv_events`: follow the TEs that came and went."""
        while True:
            try:
                action, addr = self._subscription_changes.get_nowait()
            except queue.Empty:
                return
            try:
                getattr(self.kv_events, action)(addr)
            except zmq.ZMQError:
                pass  # disconnecting an address that never connected

    def expired(self, now: float) -> list[EngineRecord]:
        return [r for r in self.tes.values() if r.alive and now - r.last_seen > self.timeout_s]

    def live(self) -> list[EngineRecord]:
        return [r for r in self.tes.values() if r.alive]

    def routable(self) -> list[EngineRecord]:
        """The live TEs that take new requests (not draining, not recovering their ranks: those keep their jobs;
        not cut off from the JE)."""
        return [r for r in self.tes.values()
                if r.alive and r.link_up and not r.draining and not r.heartbeat.stats.recovering]

    def views(self) -> list[TEView]:
        """What routing sees: the TEs that take new requests."""
        return [TEView(name=r.name, role=r.role, group=r.heartbeat.group, load=self.loads.load_of(r.name),
                       down_links=self._down_links(r))
                for r in self.routable()]

    def _down_links(self, decode: EngineRecord) -> frozenset[str]:
        """The prefill TEs whose link from them `decode` reports down, but for a prefill TE that (re)registered
        after the link went down: that report is about the process before it (restarted under its name)."""
        down = down_prefills(decode.heartbeat.stats.links)
        since = {link.prefill: link.since for link in decode.heartbeat.stats.links}
        return frozenset(p for p in down if (self.get(p) is None or since[p] >= self.get(p).registered_at))

    def link_down(self, decode: str, prefill: str) -> bool:
        """Whether decode TE `decode` last reported its KV link from `prefill` down (link probing)."""
        record = self.get(decode)
        return record is not None and prefill in self._down_links(record)

    def get(self, name: str) -> EngineRecord | None:
        record = self.tes.get(name)
        return record if record is not None and record.alive else None

    # ------------------------------------------------------------------ KV-event sync (prompt tree)
    def on_kv_events(self, te: str, batch: KVCacheEvents) -> bool:
        """Apply a TE's events; False when the JE must ask for a snapshot (a gap)."""
        record = self.get(te)
        if record is None or self.tree is None:
            return True
        if not record.synced or record.snapshot_query is not None:
            record.buffered.append(batch)  # replayed on top of the snapshot (those newer than it)
            return True
        if self.tree.apply(te, batch):
            return True
        last = self.tree.last_seq(te)
        if last is not None and batch.seq <= last:
            return True  # already covered by the snapshot
        record.synced = False
        record.buffered = [batch]
        return False

    def needs_snapshot(self, record: EngineRecord, now: float) -> bool:
        """A TE never synced, or one whose heartbeats have said for a while that it published events the
        tree has not seen (a heartbeat may overtake the batch it counts, so one second of lag is allowed)."""
        if self.tree is None or record.snapshot_query is not None:
            return False
        if not record.synced:
            return True
        if record.heartbeat.kv_event_seq <= (self.tree.last_seq(record.name) or 0):
            record.lagging_since = None
            return False
        if record.lagging_since is None:
            record.lagging_since = now
        return now - record.lagging_since > 1.0

    def load_snapshot(self, record: EngineRecord, snapshot: KVSnapshot) -> None:
        seq = snapshot.seq
        self.tree.load_snapshot(record.name, seq, snapshot.blocks)
        record.synced = True
        record.snapshot_query = None
        record.lagging_since = None
        buffered, record.buffered = record.buffered, []
        for batch in sorted(buffered, key=lambda b: b.seq):
            if batch.seq > seq and not self.tree.apply(record.name, batch):
                record.synced = False  # still a hole: the next check asks again
                break

    def close(self) -> None:
        """After the reader thread stopped."""
        for record in self.tes.values():
            if record.alive:
                record.sock.close(0)
        self.links.close()
        self.kv_events.close(0)
