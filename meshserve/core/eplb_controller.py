"""The master's side of expert load balancing (xdeepserve §4.5): load slices and live reconfiguration.

Load: the driver rank of each DP group reports its tokens per logical expert when a
step asks (`StepBatch.report_load`, at most every `report_every_s`); the reports
are summed over DP groups into time slices of `slice_s` seconds.

Reconfiguration: a new placement (given, or planned from the recorded slices)
goes to every rank in rounds of four phases, each carried by a step
(`StepBatch.eplb`) so all ranks switch at the same step boundary while the TE
keeps serving:

  prefetch          ranks read the changing slots' weights in the background
  (all ranks ack)   disable_and_load: the mapping stops using those slots, and
                    ranks copy the weights into them in the background
  (all ranks ack)   enable: the mapping switches to the new placement

A round may change only slots whose expert keeps an unchanged copy meanwhile; a
move of primaries takes several rounds (meshserve/moe/live_moves.py), and a
planned placement (`eplb_live_mode` full: every slot planned, as before serving)
is first renumbered to move as few experts as it can. A rank that fails a phase
stops the sequence: every rank drops the round at the same step boundary
(`abort`), so all of them still route with one mapping; the rounds done stay.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import msgspec

from meshserve.config import EngineConfig
from meshserve.moe.live_moves import align_to_current, placement_rounds
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import EMPTY, ExpertPlacement, PlacementShape, engine_shape, load_placement_file
from meshserve.wire.client import EplbStatus, ExpertLoad
from meshserve.wire.eplb import EplbCommand, EplbPhase, PlacementData
from meshserve.wire.worker import WorkerEventKind, WorkerReady

logger = logging.getLogger(__name__)

MAX_SLICES = 720  # recorded history kept (two hours of 10 s slices)


class EplbError(RuntimeError):
    """A rebalancing request the engine cannot carry out (shown to the operator as is)."""


@dataclass
class EplbControl:
    """What the next step carries for expert load balancing (StepBatch.eplb, StepBatch.report_load)."""

    eplb: EplbCommand | None = None
    report_load: bool = False


def placement_data(placement: ExpertPlacement) -> PlacementData:
    return msgspec.convert(placement.to_dict(), PlacementData)


@dataclass
class _Reconfiguration:
    placement: ExpertPlacement  # this round's
    phase: str  # "prefetch" -> "prefetching" -> "load" -> "loading" -> "enable"
    acks: set[int] = field(default_factory=set)
    started: float = 0.0
    later_rounds: list[ExpertPlacement] = field(default_factory=list)
    round: int = 1
    rounds: int = 1


class EplbController:
    def __init__(self, shape: PlacementShape | None, moe_layers: list[int], world_size: int, slice_s: float,
                 interval_s: float | None = None, report_every_s: float = 1.0,
                 initial: ExpertPlacement | None = None, live_mode: str = "full",
                 clock: Callable[[], float] = time.time, rebalance_below: float = 1.0) -> None:
        """`clock`: unix seconds (the simulator hands its virtual clock). `rebalance_below`: an automatic rebalance
        moves only while the recorded load's balancedness under the placement in use is at most this (as SGLang's
        `eplb_min_rebalancing_utilization_threshold`)."""
        self.clock = clock
        self.rebalance_below = rebalance_below
        self.shape = shape
        self.moe_layers = list(moe_layers)
        self.world_size = world_size
        self.slice_s = slice_s
        self.interval_s = interval_s
        self.live_mode = live_mode  # how a placement planned while serving is planned (meshserve/moe/eplb.py MODES)
        self.report_every_s = min(report_every_s, slice_s)
        self.placement = initial or (ExpertPlacement.default(shape, self.moe_layers) if shape is not None else None)
        self.slices: list[list[list[int]]] = []
        self.slice_starts: list[float] = []
        now = clock()
        self._current = self._zeros()
        self._current_start = now
        self._last_report = 0.0
        self._last_rebalance = now
        self._reconfig: _Reconfiguration | None = None
        self.num_reconfigurations = 0
        self.last_error: str | None = None
        self.last_started_at: float | None = None  # unix times of the last reconfiguration
        self.last_finished_at: float | None = None

    @classmethod
    def for_ranks(cls, config: EngineConfig, ready: WorkerReady) -> EplbController:
        """The controller of a TE whose rank 0 reported `ready` (its MoE layers and experts)."""
        strategy = config.parallel_config.strategy
        eplb = config.eplb_config
        shape = None
        if ready.moe_layers and ready.num_logical_experts:
            shape = engine_shape(ready.num_logical_experts, strategy.routed_ep, eplb.eplb_redundant_experts)
        initial = load_placement_file(eplb.eplb_placement) if eplb.eplb_placement else None
        return cls(shape, ready.moe_layers, strategy.world_size, eplb.eplb_slice_s, eplb.eplb_interval_s,
                   initial=initial, live_mode=eplb.eplb_live_mode, rebalance_below=eplb.eplb_rebalance_below)

    @property
    def enabled(self) -> bool:
        """Whether this model has MoE layers to record."""
        return self.shape is not None and bool(self.moe_layers)

    def _zeros(self) -> list[list[int]]:
        return [[0] * (self.shape.num_logical if self.shape else 0) for _ in self.moe_layers]

    # ------------------------------------------------------------------ load
    def step_control(self, now: float) -> EplbControl:
        """Control for a step about to run (it has work)."""
        control = EplbControl(eplb=self._phase_control())
        if self.enabled and now - self._last_report >= self.report_every_s:
            control.report_load = True
            self._last_report = now
        return control

    def idle_control(self) -> EplbControl:
        """Control that must reach the ranks even when no step runs (reconfiguration phases)."""
        return EplbControl(eplb=self._phase_control())

    def on_counts(self, counts: list[list[int]]) -> None:
        if not self.enabled:
            return
        if len(counts) != len(self.moe_layers):
            logger.warning("expert load report has %d layers, expected %d; ignored", len(counts), len(self.moe_layers))
            return
        for row, new in zip(self._current, counts):
            for e, c in enumerate(new[:len(row)]):
                row[e] += int(c)

    def tick(self, now: float) -> None:
        """Close finished slices; start an automatic rebalance when one is due."""
        if not self.enabled:
            return
        while now - self._current_start >= self.slice_s:
            self._close_slice()
        if (self.interval_s is not None and self._reconfig is None and self.slices
                and now - self._last_rebalance >= self.interval_s):
            self._last_rebalance = now
            try:
                recent = max(1, int(round(self.interval_s / self.slice_s)))
                self.rebalance(None, window_slices=recent, rebalance_below=self.rebalance_below)
            except EplbError as exc:
                logger.info("automatic rebalance skipped: %s", exc)

    def _close_slice(self) -> None:
        self.slices.append(self._current)
        self.slice_starts.append(self._current_start)
        if len(self.slices) > MAX_SLICES:
            del self.slices[0], self.slice_starts[0]
        self._current = self._zeros()
        self._current_start += self.slice_s

    def record(self, include_current: bool = True, window_slices: int | None = None) -> ExpertLoadRecord:
        if not self.enabled:
            raise EplbError("the model has no MoE layers: there is no expert load to record")
        counts = list(self.slices)
        starts = list(self.slice_starts)
        if include_current:
            counts.append(self._current)
            starts.append(self._current_start)
        if window_slices is not None:
            counts, starts = counts[-window_slices:], starts[-window_slices:]
        return ExpertLoadRecord(num_logical=self.shape.num_logical, moe_layers=self.moe_layers,
                                slice_seconds=self.slice_s, counts=[[list(r) for r in s] for s in counts],
                                slice_start_times=starts)

    # ------------------------------------------------------------------ reconfiguration
    def load(self) -> ExpertLoad:
        """The recorded load as an admin result."""
        return msgspec.convert(self.record().to_dict(), ExpertLoad)

    def rebalance(self, placement: PlacementData | dict | None, window_slices: int | None = None,
                  rebalance_below: float = 1.0) -> ExpertPlacement:
        """Start moving to `placement`, or to a plan from the recorded load, in as many rounds as that takes (a
        plan only while the placement in use balances the recorded load at most `rebalance_below`: a plan fitted
        to a window's counts always beats it on them, if only by their noise, and every move unbalances the TE
        while its rounds run)."""
        if not self.enabled:
            raise EplbError("the model has no MoE layers to rebalance")
        if self.shape.num_slots == self.shape.num_logical:
            raise EplbError("no redundant expert slots: every slot holds the only copy of its expert, so nothing "
                            "can move while serving; start the engine with --eplb-redundant-experts N")
        if self._reconfig is not None:
            raise EplbError(f"a reconfiguration is already running (phase {self._reconfig.phase})")
        if placement is None:
            # a window is the last slices closed (the one under way has only begun when an automatic rebalance is
            # due: with the interval one slice long, it was all the window held, and nothing was ever planned)
            record = self.record(include_current=window_slices is None, window_slices=window_slices)
            if not any(c for s in record.counts for row in s for c in row):
                raise EplbError("no expert load recorded yet")
            now = _balancedness(self.placement, record) if rebalance_below < 1 else 0.0
            if now > rebalance_below:
                raise EplbError(f"the placement in use balances the recorded load {now:.3f}, above "
                                f"{rebalance_below:g}: it stays")
            new = self._planned(record)
        else:
            new = self._given(placement)
        try:
            rounds = placement_rounds(self.placement, new)
        except ValueError as exc:
            raise EplbError(f"placement cannot be applied while serving: {exc}") from None
        self._reconfig = _Reconfiguration(rounds[0], "prefetch", started=self.clock(), later_rounds=rounds[1:],
                                          rounds=len(rounds))
        self.last_started_at, self.last_finished_at = self._reconfig.started, None
        self.last_error = None
        logger.info("expert placement reconfiguration started (%d round(s))", len(rounds))
        return new

    def _planned(self, record: ExpertLoadRecord) -> ExpertPlacement:
        # keeps numpy out of the master until it plans a placement
        from meshserve.moe.eplb import plan_placement

        if self.shape.uneven and self.live_mode == "redundant":
            raise EplbError(f"the {self.shape.num_logical} experts do not split evenly over the "
                            f"{self.shape.num_ranks} EP ranks (a shrunk layout): there are no primary slots for "
                            "eplb_live_mode 'redundant' to keep; use 'full'")
        plan = plan_placement(record, self.shape, mode=self.live_mode, base=self.placement)
        return ExpertPlacement(self.shape, {layer: align_to_current(self.shape, self.placement.layers[layer], slots)
                                            for layer, slots in plan.layers.items()})

    def _given(self, placement: PlacementData | dict) -> ExpertPlacement:
        if isinstance(placement, PlacementData):
            placement = placement.to_dict()
        try:
            new = ExpertPlacement.from_dict(placement)
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            raise EplbError(f"bad placement: {exc}") from None
        if new.shape != self.shape:
            raise EplbError(f"placement is for {new.shape}, the engine has {self.shape}")
        if sorted(new.layers) != sorted(self.moe_layers):
            raise EplbError(f"placement covers layers {sorted(new.layers)}, the model's MoE layers are "
                            f"{self.moe_layers}")
        return new

    def _phase_control(self) -> EplbCommand | None:
        """The phase command a due phase sends (once), moving the reconfiguration on."""
        r = self._reconfig
        start = self._PHASE_STARTS.get(r.phase) if r is not None else None
        return start(self, r) if start is not None else None

    def _start_prefetch(self, r: _Reconfiguration) -> EplbCommand:
        r.phase, r.acks = "prefetching", set()
        return EplbCommand(EplbPhase.PREFETCH, placement_data(r.placement))

    def _start_load(self, r: _Reconfiguration) -> EplbCommand:
        r.phase, r.acks = "loading", set()
        return EplbCommand(EplbPhase.DISABLE_AND_LOAD)

    def _start_abort(self, r: _Reconfiguration) -> EplbCommand:
        self._reconfig = None
        return EplbCommand(EplbPhase.ABORT)

    def _start_enable(self, r: _Reconfiguration) -> EplbCommand:
        self.placement = r.placement
        if r.later_rounds:  # the next round's prefetch goes out with the step after this one
            self._reconfig = _Reconfiguration(r.later_rounds[0], "prefetch", started=r.started,
                                              later_rounds=r.later_rounds[1:], round=r.round + 1, rounds=r.rounds)
            return EplbCommand(EplbPhase.ENABLE)
        self._reconfig = None
        self.num_reconfigurations += 1
        self.last_finished_at = self.clock()
        logger.info("expert placement reconfiguration %d done in %.2f s", self.num_reconfigurations,
                    self.last_finished_at - r.started)
        return EplbCommand(EplbPhase.ENABLE)

    # the phase a reconfiguration waits in -> what starts it (the others wait for every rank's ack)
    _PHASE_STARTS: ClassVar[dict] = {"prefetch": _start_prefetch, "load": _start_load, "abort": _start_abort,
                     "enable": _start_enable}

    def on_event(self, rank: int, kind: WorkerEventKind, detail: str) -> None:
        r = self._reconfig
        if kind == WorkerEventKind.EPLB_FAILED:
            phase = r.phase if r is not None else "?"
            self.last_error = f"rank {rank} failed in phase {phase}: {detail}"
            logger.error("expert placement reconfiguration stopped: %s", self.last_error)
            # every rank drops the round at the same step boundary, keeping one mapping
            if r is not None and r.phase == "loading":  # the ranks empty the slots that were being written
                self.placement = _without_changing_slots(self.placement, r.placement)
            self._reconfig = _Reconfiguration(self.placement, "abort")
            return
        expected = {WorkerEventKind.EPLB_PREFETCHED: "prefetching", WorkerEventKind.EPLB_LOADED: "loading"}.get(kind)
        if r is None or expected != r.phase:
            logger.warning("unexpected worker event %s from rank %d", kind, rank)
            return
        r.acks.add(rank)
        if len(r.acks) == self.world_size:
            r.phase = "load" if kind == WorkerEventKind.EPLB_PREFETCHED else "enable"

    @property
    def busy(self) -> bool:
        return self._reconfig is not None

    @property
    def has_pending_control(self) -> bool:
        return self._reconfig is not None and self._reconfig.phase in self._PHASE_STARTS

    def status(self) -> EplbStatus:
        return EplbStatus(
            enabled=self.enabled,
            phase=self._reconfig.phase if self._reconfig else "idle",
            round=self._reconfig.round if self._reconfig else 0,
            rounds=self._reconfig.rounds if self._reconfig else 0,
            num_reconfigurations=self.num_reconfigurations,
            last_error=self.last_error,
            last_started_at=self.last_started_at,
            last_finished_at=self.last_finished_at,
            num_slices=len(self.slices),
            slice_seconds=self.slice_s,
            interval_seconds=self.interval_s,
            placement=placement_data(self.placement) if self.placement is not None else None,
        )


def _balancedness(placement: ExpertPlacement, record: ExpertLoadRecord) -> float:
    """Mean over max device load of `record` under `placement`, averaged over the MoE layers."""
    from meshserve.moe.balance import balancedness  # numpy, as the planner

    return sum(balancedness(placement.layers[layer], record.layer_counts(layer), placement.shape.num_ranks)
               for layer in record.moe_layers) / len(record.moe_layers)


def _without_changing_slots(current: ExpertPlacement, aborted: ExpertPlacement) -> ExpertPlacement:
    """`current` with the slots a round aborted while loading left empty (what every rank does, balancer.abort)."""
    return ExpertPlacement(current.shape, {
        layer: [EMPTY if expert != aborted.layers[layer][slot] else expert for slot, expert in enumerate(slots)]
        for layer, slots in current.layers.items()})
