"""Live expert load balancing in a simulated TE: the served `EplbController` (meshserve/core/eplb_controller.py) on
virtual time, with the op model's expert imbalance following the placement it moves to.

A TE of an op model (`simulate run --hardware ... --expert-load zipf:H --eplb-interval-s S`) starts on the engine's
default placement (each expert device holds its contiguous share of the experts, the redundant slots empty), as a
served TE does. Every step the controller asks for, the TE reports the tokens its steps routed since the last report,
drawn from a seeded Zipf load whose hottest expert takes H times the mean, or from a recorded load (`meshserve eplb
record`: its first MoE layer, slice after slice in turn, standing for every layer). The controller records them in
slices and every S seconds, while the placement in use balances the recent slices' load at most `rebalance_below`,
plans a placement from them with the served planner (meshserve/moe/eplb.py) and moves to it in its rounds, each in
the served phases (prefetch, disable and load, enable), carried by steps:

- prefetch: each expert device reads the weights of the experts its changing slots take, over the KV link
  (`kv_link_gbps`: the same link a pool fetch uses), the busiest device's share of every MoE layer;
- disable and load: the device copies them into the slots (at `hbm_read_gbps`);
- enable: the steps from then on are timed with the new placement's imbalance (the busiest expert device's tokens
  over the mean, on the load's expected counts).

One MoE layer's placement stands for every layer (the op model prices one imbalance for all), and the TE's ranks
acknowledge a phase together, when its busiest device is done.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from meshserve.config.eplb import EplbConfig
from meshserve.core.eplb_controller import EplbController
from meshserve.moe.balance import device_loads
from meshserve.moe.placement import EMPTY, PlacementShape
from meshserve.moe.synthetic_load import zipf_exponent
from meshserve.sim.hardware import HardwareError
from meshserve.sim.profile import GroupWork
from meshserve.wire.eplb import EplbCommand, EplbPhase
from meshserve.wire.worker import WorkerEventKind

LAYER = 0  # the one MoE layer recorded and placed, standing for every MoE layer


@dataclasses.dataclass(frozen=True)
class LiveEplbSettings:
    interval_s: float  # a rebalance planned and started this often
    hot_ratio: float = 0.0  # a Zipf load: the hottest expert's tokens over the mean (xdeepserve Fig. 11a: about 30)
    # or a recorded load (`meshserve eplb record`): one layer's counts per expert, slice after slice, in turn
    recorded: tuple[tuple[int, ...], ...] = ()
    recorded_slice_s: float = 0.0
    slice_s: float = 10.0  # the controller's recording slices (the engine's default `eplb_slice_s`)
    report_every_s: float = 1.0
    # a rebalance moves only while the placement balances the recorded load at most this (the engine's default)
    rebalance_below: float = EplbConfig().eplb_rebalance_below

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or not self.slice_s > 0 or not self.report_every_s > 0 or not (
                0 < self.rebalance_below <= 1):
            raise ValueError(f"live EPLB needs positive interval, slice and report times, got {self}")
        if (self.hot_ratio > 1) == bool(self.recorded) or (self.recorded and not self.recorded_slice_s > 0):
            raise ValueError("live EPLB needs one expert load: a Zipf hot ratio above 1, or recorded slices and "
                             "their length")


def placement_shape(num_experts: int, deployment) -> PlacementShape:
    """The engine's placement shape for an op model's layout: its expert devices and routed slots per device."""
    dies, slots = deployment.expert_dies, deployment.routed_slots_per_die
    if num_experts % dies == 0:
        return PlacementShape(num_experts, dies, slots - num_experts // dies)
    return PlacementShape(num_experts, dies, 0, uneven_slots_per_rank=slots)


def check_layout(model) -> None:
    """Refuse a step timer whose placement live EPLB does not simulate (HardwareError, a ValueError)."""
    deployment = getattr(model, "deployment", None)
    if not hasattr(deployment, "expert_dies"):
        raise HardwareError("live EPLB is simulated on an op model of a MoE layout (--hardware), not on a fitted "
                            "profile or a dense model")
    if deployment.disagg or deployment.moe_tp > 1:
        raise HardwareError("live EPLB is simulated on expert-parallel layouts (moe=EPn) without disaggregation")


class LiveEplb:
    """One simulated TE's expert placement, moved by the served controller on the TE's virtual clock."""

    def __init__(self, model, settings: LiveEplbSettings, clock: Callable[[], float], groups: int,
                 seed: int = 0) -> None:
        """`model`: the TE's `OpStepModel`, whose layout gives the shape and whose expert imbalance is replaced as
        the placement moves; `groups`: the DP groups simulated, each standing for its share of the layout's (the
        load reported is the whole layout's)."""
        check_layout(model)
        deployment = model.deployment
        self.model, self.settings = model, settings
        self.groups_per_simulated = deployment.dp / groups
        self.shape = placement_shape(model.shape.experts, deployment)
        rng = np.random.default_rng(seed)
        if settings.recorded:
            recorded = np.asarray(settings.recorded, dtype=np.float64)
            if recorded.shape[1] != self.shape.num_logical:
                raise HardwareError(f"the recorded load has {recorded.shape[1]} experts, the model "
                                    f"{self.shape.num_logical}")
            self._slices = recorded / np.maximum(recorded.sum(axis=1, keepdims=True), 1.0)
        else:
            popularity = np.arange(1, self.shape.num_logical + 1, dtype=np.float64) ** -zipf_exponent(
                self.shape.num_logical, settings.hot_ratio)
            zipf = np.empty(self.shape.num_logical)
            zipf[rng.permutation(self.shape.num_logical)] = popularity / popularity.sum()
            self._slices = zipf[None, :]
        self._slice_index = 0
        self.weights = self._slices[0]  # the load's shares now (a recorded load's slice in turn)
        self._rng = rng
        self.controller = EplbController(self.shape, [LAYER], world_size=1, slice_s=settings.slice_s,
                                         interval_s=settings.interval_s, report_every_s=settings.report_every_s,
                                         clock=clock, rebalance_below=settings.rebalance_below)
        self._unreported = 0  # tokens routed since the last report
        self._acks: list[tuple[float, WorkerEventKind]] = []  # (due, event): the ranks' acknowledgements
        self._round_bytes = 0.0  # what the busiest expert device reads for the round under way
        self.rounds = 0  # rounds enabled
        self._models: dict[float, object] = {}
        self.imbalance = self.imbalance_of(self.controller.placement.layers[LAYER])
        # (when, imbalance): at the start, at each enable, and at each slice of a recorded load
        self.timeline: list[tuple[float, float]] = []

    def imbalance_of(self, slots: Sequence[int]) -> float:
        """The busiest expert device's tokens over the mean, on the load's expected counts."""
        loads = device_loads(list(slots), self.weights[None, :], self.shape.num_ranks)[0]
        return float(loads.max() / loads.mean())

    def step_seconds(self, now: float, groups: Sequence[GroupWork]) -> float:
        """A step starting at `now`: the acknowledgements due, the controller's slices and phase, then the step
        timed with the placement in use (an enable applies before the forward that carries it)."""
        if not self.timeline:
            self.timeline.append((now, self.imbalance))
        slice_index = int(now / self.settings.recorded_slice_s) % len(self._slices) if self.settings.recorded else 0
        if slice_index != self._slice_index:  # a recorded load's next slice: the same placement, another imbalance
            self._slice_index, self.weights = slice_index, self._slices[slice_index]
            self.imbalance = self.imbalance_of(self.controller.placement.layers[LAYER])
            self.timeline.append((now, self.imbalance))
        while self._acks and self._acks[0][0] <= now:
            _, kind = self._acks.pop(0)
            self.controller.on_event(0, kind, "")
        self.controller.tick(now)
        working = any(work.rows for work in groups)
        control = self.controller.step_control(now) if working else self.controller.idle_control()
        if control.report_load and self._unreported:
            routed = round(self._unreported * self.groups_per_simulated) * self.model.shape.top_k
            counts = self._rng.multinomial(routed, self.weights)
            self.controller.on_counts([counts.tolist()])
            self._unreported = 0
        if control.eplb is not None:
            self._apply(control.eplb, now)
        self._unreported += sum(work.rows for work in groups)
        return self.current_model().step_seconds(groups)

    def _apply(self, command: EplbCommand, now: float) -> None:
        if command.phase == EplbPhase.PREFETCH:
            self._round_bytes = self._moved_bytes(command.placement.layers[str(LAYER)])
            self._acks.append((now + self._round_bytes / (1e9 * self.model.hw.value("kv_link_gbps")),
                               WorkerEventKind.EPLB_PREFETCHED))
        elif command.phase == EplbPhase.DISABLE_AND_LOAD:
            self._acks.append((now + self._round_bytes / (1e9 * self.model.hw.value("hbm_read_gbps")),
                               WorkerEventKind.EPLB_LOADED))
        elif command.phase == EplbPhase.ENABLE:
            self.imbalance = self.imbalance_of(self.controller.placement.layers[LAYER])
            self.timeline.append((now, self.imbalance))
            self.rounds += 1
        self._acks.sort(key=lambda ack: ack[0])

    def _moved_bytes(self, target: Sequence[int]) -> float:
        """The busiest expert device's new experts in a round, over every MoE layer."""
        current, per_rank = self.controller.placement.layers[LAYER], self.shape.slots_per_rank
        changed = max(sum(1 for slot in range(rank * per_rank, (rank + 1) * per_rank)
                          if target[slot] not in (current[slot], EMPTY))
                      for rank in range(self.shape.num_ranks))
        shape = self.model.shape
        expert_bytes = 3 * shape.hidden * shape.moe_inter * self.model.weight_bytes  # gate, up and down, one layer
        return changed * expert_bytes * (shape.layers - shape.dense_layers)

    def current_model(self):
        """The op model with the placement's imbalance (one per imbalance seen)."""
        model = self._models.get(self.imbalance)
        if model is None:
            model = self._models[self.imbalance] = self.model.with_expert_imbalance(max(1.0, self.imbalance))
        return model

    def summary(self) -> dict:
        return {"reconfigurations": self.controller.num_reconfigurations, "rounds": self.rounds,
                "imbalance": [[round(t, 3), round(x, 4)] for t, x in self.timeline]}
