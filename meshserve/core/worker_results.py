"""The master's handling of what its ranks send (step outputs, background events, KV connector reports,
failures, pongs): a mixin of `EngineCore`, as SGLang's scheduler keeps its output processing in a mixin
of its own. `workers`, the DP groups and what works on them are those of the ranks of now: handling one
result (a failure) may restart the ranks and build them again."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from meshserve.core.dp_group import StepMismatchError
from meshserve.core.worker_group import RESULTS
from meshserve.wire.dp_group import GroupExpertLoad
from meshserve.wire.kv import KVConnectorReport
from meshserve.wire.receive import drop_frame, recv_message
from meshserve.wire.worker import ModelRunnerOutput, WorkerEvent, WorkerEventKind, WorkerFailure, WorkerPong

if TYPE_CHECKING:
    from meshserve.core.client_links import GroupLink
    from meshserve.core.dp_group import DPGroup, GroupPlace
    from meshserve.core.eplb_controller import EplbController
    from meshserve.core.kv_events import KVEventPublisher
    from meshserve.core.recovery import RankRecovery
    from meshserve.core.request_outputs import RequestOutputs
    from meshserve.core.scheduler import Scheduler
    from meshserve.core.spec_controller import StepSpeculation
    from meshserve.core.waiting_queue import DPWaitingQueue
    from meshserve.core.worker_group import WeightServers, WorkerGroup
    from meshserve.wire.heartbeat import EngineHeartbeat

logger = logging.getLogger(__name__)


class WorkerResults:
    """Takes what the ranks sent and hands each message to its handler; a failure to handle one fails the
    engine (its state may be half updated), not the master."""

    workers: WorkerGroup
    weight_servers: WeightServers
    groups: list[DPGroup]
    schedulers: list[Scheduler]
    dp_size: int
    queue: DPWaitingQueue
    outputs: RequestOutputs
    eplb: EplbController
    kv_events: KVEventPublisher
    speculation: StepSpeculation
    recovery: RankRecovery
    dead_error: str | None
    stop_requested: bool
    place: GroupPlace | None  # a self-contained group's master: its link reports to the TE shell
    link: GroupLink

    def _fail(self, error: str) -> None: ...  # EngineCore's

    def _heartbeat(self) -> EngineHeartbeat: ...  # EngineCore's

    def _take_results(self) -> None:
        # `self.workers` looked up again each time: handling a result may have restarted the ranks
        while self.workers.results.poll(0):
            self._take_result(recv_message(self.workers.results, RESULTS))

    def _take_result(self, item) -> None:
        """One message from the workers: a frame that is not one is dropped; a failure to handle
        a real one is the engine's fault (its state may be half updated): the engine fails, the
        master lives on to say so."""
        if item is None:
            return
        if type(item) not in self._RESULT_HANDLERS:
            drop_frame(RESULTS, f"a {type(item).__name__} is not an worker's message")
            return
        if isinstance(item, ModelRunnerOutput) and not self._expected_output(item):
            return
        try:
            self._on_result(item)
        except Exception as exc:  # noqa: BLE001 - reported through the engine's health, not a dead master
            logger.exception("handling a %s failed", type(item).__name__)
            self._fail(f"the master failed on an worker's {type(item).__name__}: {exc}")

    def _expected_output(self, item: ModelRunnerOutput) -> bool:
        """Whether a step output names a DP group with a step in flight (else it is dropped)."""
        known = 0 <= item.dp_rank < self.dp_size
        if not known or (self.dead_error is None and not self.groups[item.dp_rank].in_flight):
            drop_frame(RESULTS, f"step output of DP group {item.dp_rank} with no step in flight")
            return False
        return True

    def _on_result(self, item) -> None:
        # a failed engine still hears of its ranks' health; their other results no longer count
        if self.dead_error is None or isinstance(item, (WorkerFailure, WorkerPong)):
            self._RESULT_HANDLERS[type(item)](self, item)

    def _on_worker_failure(self, item: WorkerFailure) -> None:
        self._rank_failed(self.workers.explain(item), self.workers.dead_ranks())

    def _rank_failed(self, error: str, dead_ranks: list[int]) -> None:
        if self.stop_requested:
            logger.info("rank(s) %s ended while stopping: %s", dead_ranks, error)
            return
        if self.dead_error is None:
            self.recovery.on_rank_failure(error, self.workers, dead_ranks)

    def _on_pong(self, item: WorkerPong) -> None:
        # the health table counts this master's ranks from 0 (a self-contained group's start further on)
        self.recovery.health.on_pong(item.rank - self.workers.first_rank, item.seq, time.monotonic())

    def _on_worker_event(self, event: WorkerEvent) -> None:
        """A rank finished an expert-placement phase (or failed it), its weight server is ready, or it rolled a
        step back after a transient error."""
        if event.kind == WorkerEventKind.ROLLED_BACK:
            self.recovery.health.on_rolled_back(event.rank, event.detail)
        elif event.kind == WorkerEventKind.WEIGHTS_SERVED:
            self.weight_servers.on_served(event.rank, event.detail, self.workers.world_size)
        elif self.place is None:
            self.eplb.on_event(event.rank, event.kind, event.detail)
        else:  # a phase of the shell's reconfiguration
            self.link.report(event)

    def _on_step_output(self, item: ModelRunnerOutput) -> None:
        if item.expert_load is not None:
            if self.place is None:
                self.eplb.on_counts(item.expert_load)
            else:  # the shell records the TE's load and moves its experts
                self.link.report(GroupExpertLoad(counts=item.expert_load))
        group = self.groups[item.dp_rank]
        try:
            sched, deltas = group.take_output(item)
        except StepMismatchError as exc:
            self._fail(str(exc))
            return
        self.speculation.observe(sched, item)
        self.queue.on_deltas(deltas)
        if self.place is not None and any(delta.finish_reason is not None for delta in deltas):
            # the shell places requests by this group's figures, and finishes change them: it hears of them
            # before the clients do, whose next requests it places
            self.link.report(self._heartbeat())
        self.outputs.send(deltas)
        self.kv_events.publish(group.index, group.kv_manager.drain_events())

    def _on_kv_connector_report(self, report: KVConnectorReport) -> None:
        """A rank's KV connectors finished background work (pool fetches, KV pulls)."""
        group = report.dp_rank - (0 if self.place is None else self.place.index)  # the TE's DP group: ours
        if not 0 <= group < self.dp_size:
            drop_frame(RESULTS, f"KV connector report of DP group {report.dp_rank}")
            return
        self.schedulers[group].update_connector_output(report)

    _RESULT_HANDLERS = {ModelRunnerOutput: _on_step_output, WorkerEvent: _on_worker_event,
                        KVConnectorReport: _on_kv_connector_report, WorkerFailure: _on_worker_failure,
                        WorkerPong: _on_pong}
