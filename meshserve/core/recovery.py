"""Rank failures and their recovery (xdeepserve §6): the ranks restarted, every request going on.

A rank that dies, hangs (silent to the health pings of `rank_health`) or gives up on a step fails the
engine, or, as `on_rank_failure` says, has its ranks restarted: on the full layout, or ("shrink") on the
ranks left, with fewer DP groups and EP ranks (`shrink_layout`, xdeepserve §6.2 stage 2), growing back to
the full layout after `regrow_after_s`. Every unfinished request is admitted again with the tokens it
produced (token recomputation): nothing accepted is lost, a greedy request produces the same text. Ranks
restarted on the same layout load the expert placement served before the failure (a live rebalance survives). While
the new ranks start, the engine's heartbeat goes on and stats queries are answered; every other client
message waits for the new ranks. Too many recoveries too fast (`max_recoveries`) fail the engine.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from meshserve.config import EngineConfig
from meshserve.core.eplb_controller import EplbController
from meshserve.core.rank_health import RECOVERY_WINDOW_S, RankHealth, RecoveryState
from meshserve.core.request import Request
from meshserve.core.request_outputs import WARMUP_ID, RequestOutputs
from meshserve.core.worker_group import DEAD_GRACE_S, WorkerGroup
from meshserve.utils import faults
from meshserve.wire.client import AddRequest, FinishReason, RequestDelta, StatsQuery
from meshserve.wire.dp_group import WorldRestart
from meshserve.wire.errors import QueueFullError, RequestTooLongError
from meshserve.wire.kv import KVTransferRole
from meshserve.wire.worker import WorkerPing

logger = logging.getLogger(__name__)


class RankRecovery:
    """The recovery of one TE's ranks. What it does to the engine comes in as callbacks: `restart(config,
    removed)` starts the ranks of a layout and builds fresh state for them (raising when they do not start) and
    returns the layout they started with, `fail(error)` fails the engine, `unfinished()` lists the engine's
    requests, `admit(request)` admits one, `replay(item)` handles a client message that waited, and `eplb()`
    is the expert-placement controller of the ranks served now (its placement and load plan a shrink).

    The master of a self-contained DP group (`hand_over` given) plans no layout: its TE shell does, from every
    group's lost ranks, and its `restart` returns None when the group has no rank in the new layout. The
    group's requests then go to `hand_over`, with the client messages that waited, for the groups left."""

    def __init__(self, base_config: EngineConfig, outputs: RequestOutputs, *,
                 restart: Callable[[EngineConfig, list[int]], EngineConfig | None], fail: Callable[[str], None],
                 unfinished: Callable[[], list[Request]], admit: Callable[[Request], None],
                 replay: Callable[[object], None], eplb: Callable[[], EplbController],
                 hand_over: Callable[[list[Request], list], None] | None = None) -> None:
        parallel = base_config.parallel_config
        self.base_config = base_config  # the configured layout
        self.config = base_config  # the layout served now: a shrunk one while ranks are missing
        self.health = RankHealth(parallel.hang_timeout_s)
        self.state = RecoveryState(parallel.max_recoveries)
        self._outputs = outputs
        self._restart, self._fail, self._unfinished = restart, fail, unfinished
        self._admit, self._replay, self._eplb = admit, replay, eplb
        self._hand_over = hand_over
        self._deferred: list = []  # client messages that came while the ranks were recovered

    def defers(self, item) -> bool:
        """While the new ranks start, a client message other than a stats query waits for them (True: it was
        kept, to be handled once they serve)."""
        if self.state.in_progress is None or isinstance(item, (StatsQuery, WorldRestart)):
            return False
        self._deferred.append(item)
        return True

    def check(self, workers: WorkerGroup) -> None:
        """Ping the ranks (they answer between steps); recover them when one stays silent too long, and grow
        back to the full layout when it is time."""
        now = time.monotonic()
        seq = self.health.ping_due(now)
        if seq is not None:
            workers.send(WorkerPing(seq=seq))
        hung = [workers.first_rank + rank for rank in self.health.hung(now)]
        if hung:
            silent = max(self.health.silent_for(now))
            self.state.note_failure("hung", silent)
            self.on_rank_failure(f"rank(s) {hung} hung: no answer to health pings for {silent:.1f} s "
                                 f"(hang timeout {self.health.hang_timeout_s:g} s)", workers, [], hung=True)
            return
        shrunk = self.state.shrunk_since  # never set in a self-contained group: its shell grows the TE back
        if shrunk is not None and now - shrunk >= self.base_config.parallel_config.regrow_after_s:
            self._recover(f"growing back to {self.base_config.parallel_config.world_size} ranks", workers, [])

    def on_rank_failure(self, error: str, workers: WorkerGroup, dead_ranks: list[int], hung: bool = False) -> None:
        """A rank died, hung or gave up on a step: recover the ranks (the policy `on_rank_failure` says how),
        or fail the engine when the policy says so or too many recoveries came too fast."""
        if self.state.in_progress is not None:
            return
        policy = self.base_config.parallel_config.on_rank_failure
        if policy == "fail":
            self._fail(error)
            return
        if not self.state.allow(time.monotonic()):
            self._fail(f"{error} (and {self.state.max_recoveries} recoveries within "
                       f"{RECOVERY_WINDOW_S:.0f} s before it: giving up)")
            return
        removed: list[int] = []
        # a survivor's report may come before the death (a self-contained group's shell waits for every group)
        if policy == "shrink" and not hung and not dead_ranks and self._hand_over is None:
            deadline = time.monotonic() + DEAD_GRACE_S
            while not dead_ranks and time.monotonic() < deadline:
                time.sleep(0.05)
                dead_ranks = workers.dead_ranks()
        if policy == "shrink" and not hung and dead_ranks:
            # ranks of the layout served now (it may be shrunk already); a self-contained group names only the
            # ranks a signal ended: its other ranks exit on their own once a peer's death fails their round
            removed = dead_ranks if self._hand_over is None else workers.killed_ranks()
        self._recover(error, workers, removed)

    def _recover(self, reason: str, workers: WorkerGroup, removed: list[int]) -> None:
        """Restart the ranks (on the layout left without `removed`, or the full one) and let every request
        continue from its tokens so far."""
        now = time.monotonic()
        self.state.record(now)
        self.state.in_progress = reason
        self.state.note_failure(reason, self.state.last_failure_silent_s if "hung" in reason else 0.0)
        # faults armed from the environment fire in the ranks started with it, not again in their successors
        os.environ.pop(faults.ENV, None)
        requests = sorted((r for r in self._unfinished() if r.req_id != WARMUP_ID), key=lambda r: r.arrival_time)
        logger.warning("recovering the ranks (%s); %d request(s) continue from their tokens so far", reason,
                       len(requests))
        workers.shutdown(grace_s=DEAD_GRACE_S)  # survivors may be stuck in a collective with the dead one
        if self._hand_over is not None:  # the shell names the layout
            config = self.config
        else:
            config = self._layout_without(removed) if removed else self._with_served_placement(self.base_config)
        try:
            started = self._restart(config, removed)
        except Exception as exc:  # noqa: BLE001 - the engine fails; its owner restarts it, clients move on
            self.state.in_progress = None
            self._fail(f"{reason}; restarting the ranks failed: {exc}")
            self._refuse_deferred()
            return
        if started is None:  # a self-contained group left out of the new layout: the groups left go on
            deferred, self._deferred = self._deferred, []
            self._hand_over(requests, deferred)
            self.state.in_progress = None
            logger.warning("no rank in the new layout: %d request(s) handed over", len(requests))
            return
        self.config = started
        shrunk = started.parallel_config.world_size < self.base_config.parallel_config.world_size
        self.state.shrunk_since = time.monotonic() if shrunk and self._hand_over is None else None
        for request in requests:
            self._continue(request)
        self.state.in_progress = None
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            self._replay(item)
        logger.warning("recovered in %.1f s on %s: %d request(s) continue", time.monotonic() - now,
                       started.parallel_config.strategy, len(requests))

    def _with_served_placement(self, config: EngineConfig) -> EngineConfig:
        """`config` with the expert placement served now (a live rebalance's result survives the restart),
        where it has that placement's shape; else `config` (growing back from a shrunk layout)."""
        # start-up: the shrink planner's module (numpy) only once ranks are lost
        from meshserve.core.shrink_layout import grown_layout

        placement = self._eplb().placement
        try:
            return grown_layout(config, placement)
        except ValueError:
            return config

    def _layout_without(self, removed: list[int]) -> EngineConfig:
        """The layout on the ranks left (go on without them now; grow back after regrow_after_s), or the full
        one when the layout cannot shrink."""
        try:
            return self._shrunk_config(removed)
        except ValueError as exc:
            logger.warning("cannot go on without rank(s) %s (%s): restarting all ranks", removed, exc)
            return self.base_config

    def _shrunk_config(self, removed: list[int]) -> EngineConfig:
        """The layout on the ranks left: fewer DP groups and EP ranks, every expert kept on them, the placement
        planned from the one served now and its recorded load (`shrink_layout`); ValueError when it cannot."""
        # start-up: the shrink planner (numpy) only once ranks are lost
        from meshserve.core.shrink_layout import shrink_layout

        eplb = self._eplb()
        placement = eplb.placement
        record = eplb.record() if placement is not None else None
        return shrink_layout(self.config, placement, record, removed).config

    def _refuse_deferred(self) -> None:
        """The engine failed while new ranks started: the requests that waited for them are refused (handled
        now, by a dead engine); the other messages that waited are dropped."""
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            if isinstance(item, AddRequest):
                self._replay(item)

    def _continue(self, old: Request) -> None:
        """Admit a request again after a recovery, with the tokens it produced (token recomputation)."""
        request = Request(req_id=old.req_id, prompt_token_ids=old.prompt_token_ids,
                          sampling_params=old.sampling_params, arrival_time=old.arrival_time,
                          priority=old.priority, eos_token_ids=old.eos_token_ids)
        request.tenancy = old.tenancy
        for token in old.output_token_ids:
            request.append_output_token(token)
        if old.kv_transfer is not None and old.kv_transfer.role is KVTransferRole.PRODUCER:
            request.kv_transfer = old.kv_transfer  # computes the prompt again and hands it off again
        # a decode request whose KV pull was under way computes its prompt here instead
        self.state.migrated += 1
        try:
            self._admit(request)
        except (QueueFullError, RequestTooLongError, ValueError) as exc:
            self._outputs.send([RequestDelta(req_id=old.req_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
                                             error=f"could not continue after a recovery: {exc}",
                                             num_prompt_tokens=old.num_prompt_tokens)])


def hand_over_request(request: Request, reply_to: str) -> AddRequest:
    """A request as another DP group admits it to go on from the tokens it streamed (a self-contained group
    that leaves the layout hands its requests over): as `RankRecovery._continue` admits it here."""
    producer = request.kv_transfer is not None and request.kv_transfer.role is KVTransferRole.PRODUCER
    return AddRequest(req_id=request.req_id, prompt_token_ids=request.prompt_token_ids,
                      sampling_params=request.sampling_params, arrival_time=request.arrival_time,
                      priority=request.priority, eos_token_ids=request.eos_token_ids, reply_to=reply_to,
                      # a prefill TE's request computes its prompt again and hands it off again; a decode
                      # request whose KV pull was under way computes its prompt where it goes
                      kv_transfer=request.kv_transfer if producer else None,
                      output_token_ids=[] if producer else list(request.output_token_ids),
                      context_cache_id=request.context_cache_id, context_cache_ttl_s=request.context_cache_ttl_s,
                      tenancy=request.tenancy)
