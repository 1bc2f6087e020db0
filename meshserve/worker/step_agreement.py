"""A rank's loop under self-contained DP groups (xdeepserve §4.2): steps come from its own group's master, and
the ranks of every group agree on each step among themselves, with no master in between.

Each DP group's master schedules on its own and sends its steps to its group's ranks only. The groups still meet
at every MoE dispatch and combine, so before each forward every rank of the TE takes part in one round of
agreement: a gather to rank 0 and a send back of a few integers per rank (the step at the head of its
queue, that step's tokens, and whether it was told to stop), as SGLang's DP-attention schedulers gather their
batch sizes (`ParallelContext.agree_on_step`, over the step board of parallel/step_board.py). From the same
rows every rank reads the same plan (`plan_round`):

- a DP group runs its head step when every one of its ranks holds it (a step still on its way to one of them waits
  for the next round, so the group's TP ranks never run different steps);
- a group with nothing to run joins the forward with an empty batch (a dummy step), so the others are not held;
  but a group that ran a step in the last forward and has none now is most likely only late (its master
  schedules one step ahead, and may be slower than the ranks once): the round is taken again after a short pause
  (`LATE_ROUND_PAUSES_S`) before the others go on without it, which costs a millisecond or two instead of a
  whole forward for everyone and the late group's step a forward later;
- two micro-batches when configured and the largest step that runs is big enough for them;
- no forward at all when no group has a step; then the next round comes after a short pause that doubles while
  the TE stays idle (`IDLE_ROUND_MIN_S` to `IDLE_ROUND_MAX_S`): every rank computes the same pause from the same
  rows, so they meet again without anyone to wake them. A step arriving meanwhile waits at most that long.
- a rank told to stop says so in its row, and every rank leaves together;
- an expert-placement phase (the shell's live EPLB, relayed by each group's master) is applied by every rank
  before the first forward at which every rank has received it, so all ranks route with one mapping.

Between rounds the rank answers its master's pings and arms the faults it forwards, as in the lockstep loop. A
step's output leaves after the next round has met, just before the next forward: the masters, woken by it, then
take the CPU while the ranks run, not while the ranks of every group need it at once to meet (on a host with
fewer cores than processes that was most of a step's non-model time).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import zmq

from meshserve.utils import faults
from meshserve.utils.gc_pauses import StepCollector
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.eplb import EplbCommand
from meshserve.wire.receive import drop_frame, recv_message
from meshserve.wire.worker import (
    InjectFault,
    ModelRunnerOutput,
    SchedulerOutput,
    StepBatch,
    WorkerEvent,
    WorkerPing,
    WorkerPong,
)
from meshserve.worker import fault_hooks

if TYPE_CHECKING:
    from meshserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

IDLE_ROUND_MIN_S = 0.0005
IDLE_ROUND_MAX_S = 0.020
LATE_ROUND_PAUSES_S = (0.0005, 0.001, 0.002, 0.004)  # the waits for a late group, before going on without it
_MASTER_CHECK_S = 1.0
NO_STEP = -1


class AgreedStep(NamedTuple):
    """What the runner takes from a round for the step it runs."""

    forward_id: int  # the forward's number, the same on every rank (rollbacks agree on it)
    microbatches: int
    mtp_forwards: int  # MTP forwards every rank runs after the main one (the most any running group needs)


@dataclass(frozen=True)
class RoundPlan:
    """What every rank does after one round of agreement."""

    stop: bool  # a rank was told to stop: every rank leaves
    runs: list[bool]  # per DP group: it runs the step at the head of its queue
    microbatches: int
    late: bool = False  # a group that ran a step in the last forward has none yet while others have theirs
    mtp_forwards: int = 0  # the MTP forwards of the running step that has the most
    eplb_phases: int = 0  # expert-placement phases every rank has received: applied before the forward

    @property
    def forward(self) -> bool:
        return any(self.runs)


def plan_round(rows: list[list[int]], attn_tp: int, microbatches: int, microbatch_min_tokens: int,
               ran_last: list[bool] | None = None) -> RoundPlan:
    """The plan every rank reads from the gathered rows ([head step id or NO_STEP, its tokens, stop, its MTP
    forwards, expert-placement phases received] per rank,
    in rank order; the ranks of DP group g are g * attn_tp .. g * attn_tp + attn_tp - 1). `ran_last`: which groups
    ran a step in the last round with a forward (the same on every rank: it came from that round's rows)."""
    stop = any(row[2] for row in rows)
    runs, tokens, mtp = [], [], []
    for first in range(0, len(rows), attn_tp):
        group = rows[first:first + attn_tp]
        step = group[0][0]
        runs.append(step != NO_STEP and all(row[0] == step for row in group))
        tokens.append(group[0][1] if runs[-1] else 0)
        mtp.append(group[0][3] if runs[-1] else 0)
    split = microbatches == 2 and max(tokens, default=0) >= microbatch_min_tokens
    late = any(runs) and any(ran and not now for ran, now in zip(ran_last or [], runs))
    return RoundPlan(stop=stop, runs=runs, microbatches=2 if split else 1, late=late, mtp_forwards=max(mtp, default=0),
                     eplb_phases=min((row[4] for row in rows), default=0))


def idle_pause_s(idle_rounds: int) -> float:
    """The pause before the next round after `idle_rounds` rounds in a row without a forward."""
    return min(IDLE_ROUND_MAX_S, IDLE_ROUND_MIN_S * 2 ** min(max(0, idle_rounds - 1), 16))


class AgreeingLoop:
    """One rank's loop: take its master's messages between rounds, agree, run (or join with nothing)."""

    def __init__(self, rank: int, runner: ModelRunner, work: zmq.Socket, results: zmq.Socket,
                 master_gone: Callable[[], bool], collector: StepCollector) -> None:
        self.rank, self.runner = rank, runner
        self.work, self.results = work, results
        self.master_gone, self.collector = master_gone, collector
        parallel_config = runner.config.parallel_config
        self.attn_tp = parallel_config.strategy.attn_tp
        self.microbatches, self.microbatch_min_tokens = (parallel_config.microbatches,
                                                         parallel_config.microbatch_min_tokens)
        self.pending: deque[StepBatch] = deque()
        self.stopping = False
        self.rounds = 0  # rounds with a forward: the same count on every rank, so it names a step for rollbacks
        self.steps_run = 0  # ... of which with this group's step (the others joined with nothing)
        self._idle_rounds = 0
        self._late_rounds = 0  # rounds taken again in a row for a late group
        self._ran_last: list[bool] = []  # the groups that ran a step in the last forward
        self._eplb: list[EplbCommand] = []  # expert-placement phases received, in order
        self._eplb_applied = 0
        self._next_master_check = 0.0
        self._unsent: ModelRunnerOutput | None = None  # the last step's output, sent after the next round

    def run(self) -> None:
        next_round = time.monotonic()
        while True:
            self._report_background()
            if next_round > time.monotonic():
                self.send_output()  # a pause: nothing to hold it back for
            if not self._wait_until(next_round):
                return  # the master is gone (the other groups fail at the next round and recover)
            plan = plan_round(self.runner.parallel.agree_on_step(self._row()), self.attn_tp, self.microbatches,
                              self.microbatch_min_tokens, self._ran_last)
            while self._eplb_applied < plan.eplb_phases:  # every rank has it: all apply it before this forward
                self.runner.apply_eplb(self._eplb[self._eplb_applied])
                self._eplb_applied += 1
            if plan.stop:
                self.send_output()
                logger.info("shutting down after %d forwards (%d of them this group's steps)", self.rounds,
                            self.steps_run)
                return
            if not plan.forward:
                self._ran_last = []
                self._idle_rounds += 1
                next_round = time.monotonic() + idle_pause_s(self._idle_rounds)
                continue
            if plan.late and self._late_rounds < len(LATE_ROUND_PAUSES_S):
                next_round = time.monotonic() + LATE_ROUND_PAUSES_S[self._late_rounds]
                self._late_rounds += 1
                continue
            self._idle_rounds = self._late_rounds = 0
            self._ran_last = plan.runs
            batch = self.pending.popleft() if plan.runs[self.runner.parallel.dp_rank] else None
            self.send_output()
            self._forward(batch, AgreedStep(self.rounds + 1, plan.microbatches, plan.mtp_forwards))
            next_round = time.monotonic()

    def _row(self) -> list[int]:
        """This rank's row of a round: the step at the head of its queue and its tokens, and whether to stop."""
        head = self.pending[0].per_dp[0] if self.pending else None
        if head is None:
            return [NO_STEP, 0, int(self.stopping), 0, len(self._eplb)]
        return [head.step_id, head.total_num_scheduled_tokens, int(self.stopping), self.runner.mtp_forwards_of(head),
                len(self._eplb)]

    def _forward(self, batch: StepBatch | None, agreed: AgreedStep) -> None:
        """This group's step, or an empty one beside the groups that run theirs."""
        self.rounds += 1
        runner = self.runner
        if batch is None:
            runner.execute_rolling_back(SchedulerOutput(step_id=NO_STEP), agreed.microbatches, agreed)
            return
        self.steps_run += 1
        self._unsent = runner.run_batch(batch, agreed=agreed)
        if batch.collect_garbage:
            self.collector.collect()

    def send_output(self) -> None:
        """The last step's output, sent once the next round has met (or before a pause): the master wakes to it
        while the ranks run the next forward, rather than taking the CPU the ranks need to meet."""
        if self._unsent is not None:
            self.results.send(codec.encode(self._unsent))
            self._unsent = None

    def _wait_until(self, deadline: float) -> bool:
        """Take the master's messages until `deadline` (at once when this rank has a step and the time has come);
        False when the master is gone."""
        while True:
            wait_s = max(0.0, deadline - time.monotonic())
            if self.stopping:
                wait_s = 0.0
            if self.work.poll(math.ceil(wait_s * 1000)):  # rounded up: a wait under 1 ms must not spin
                while self.work.poll(0):
                    self._take(recv_message(self.work, "worker-work"))
                if time.monotonic() < deadline and not self.stopping:
                    continue
            now = time.monotonic()
            if now >= self._next_master_check:
                self._next_master_check = now + _MASTER_CHECK_S
                if self.master_gone():
                    logger.warning("master is gone; exiting")
                    return False
            if now >= deadline or self.stopping:
                return True

    def _take(self, item) -> None:
        if isinstance(item, Shutdown):
            self.stopping = True  # said in the next round: every rank leaves with this one
        elif isinstance(item, WorkerPing):
            self.results.send(codec.encode(WorkerPong(rank=self.rank, seq=item.seq)))
        elif isinstance(item, InjectFault):
            faults.arm(item.fault)
        elif isinstance(item, StepBatch):
            if item.per_dp:
                self.pending.append(item)
            else:  # control only: a connector's work starts now; an expert-placement phase waits for agreement
                self.runner.start_kv_connectors(item.kv_connector)
                if item.eplb is not None:
                    self._eplb.append(item.eplb)
        elif item is not None:
            drop_frame("worker-work", f"unexpected {type(item).__name__}")

    def _report_background(self) -> None:
        for kind, detail in self.runner.poll_background():
            self.results.send(codec.encode(WorkerEvent(rank=self.rank, kind=kind, detail=detail)))
        report = self.runner.take_kv_connector_report()
        if report is not None:
            self.results.send(codec.encode(report))


def serve_agreeing(rank: int, runner: ModelRunner, work: zmq.Socket, results: zmq.Socket,
                   master_gone: Callable[[], bool], collector: StepCollector) -> None:
    """`worker._serve`'s counterpart under self-contained DP groups."""
    fault_hooks.install(runner, rank, master_gone)  # wraps nothing until a fault is armed
    loop = AgreeingLoop(rank, runner, work, results, master_gone, collector)
    try:
        loop.run()
    finally:  # a round that failed (a peer died) leaves the last step's tokens good: the master keeps them
        with contextlib.suppress(zmq.ZMQError):
            loop.send_output()

