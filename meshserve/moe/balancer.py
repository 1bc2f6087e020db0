"""A model's expert placement at run time: load counts, and live reconfiguration of redundant slots.

`model.expert_balancer` (an `ExpertBalancer`, None for dense models) owns, for the MoE
layers of the model's decoder stack:
- the expert-load counter every MoE layer adds its routed tokens into (xdeepserve §4.5
  step 1), read and reset by `take_counts`;
- the placement in use and each layer's `SlotMap` (step 4);
- the four-phase reconfiguration of step 3 (one round of a move: meshserve/moe/live_moves.py splits a
  move of any experts, primaries included, into rounds this can apply):
  1. `start_prefetch(new)`: a background thread reads, from the checkpoint, this rank's
     TP slice of every expert that one of this rank's slots is about to receive;
  2. `disable_changing_slots()`: every layer routes with the current placement minus the
     slots that change (on every rank, so all ranks keep one table); every expert must keep a
     slot that does not change, which `start_prefetch` checks;
  3. `start_load()`: a background thread copies the prefetched weights into those slots
     (and repacks them for oneDNN);
  4. `enable()`: every layer routes with the new placement.
  Forwards run between the phases. Every rank calls each phase at the same step boundary
  (the engine's job); `prefetch_done()` and `load_done()` only say whether this rank's
  background work is over (they raise its error). `start_load()` and `enable()` wait for
  the previous phase's thread if it is still running. After a failure, `abort()` on every
  rank drops the reconfiguration (slots that were being written become empty).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from meshserve.layers.moe import FusedMoEWeights
from meshserve.moe.expert_checkpoint import ExpertCheckpoint
from meshserve.moe.live_moves import check_every_expert_served
from meshserve.moe.placement import EMPTY, ExpertPlacement
from meshserve.moe.recorder import ExpertLoadCounter
from meshserve.moe.slots import SlotMap, changed_slots

# where HF checkpoints keep a decoder layer's routed experts
DEFAULT_EXPERT_PREFIX = "model.layers.{layer}.mlp.experts"

IDLE, PREFETCH, DISABLED, LOADING = "idle", "prefetch", "disabled", "loading"


class MoEBlock(Protocol):
    """What the balancer needs of a model's MoE block: its runtime (an `MoERuntime`) and its weights."""

    runtime: object
    experts: FusedMoEWeights


class _Background:
    """One function on a daemon thread; `done()` re-raises what it raised."""

    def __init__(self, name: str, fn: Callable[[], None]) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller of done()/wait()
            self.error = exc

    def done(self) -> bool:
        if self.thread.is_alive():
            return False
        if self.error is not None:
            raise RuntimeError(f"{self.name} failed: {type(self.error).__name__}: {self.error}") from self.error
        return True

    def wait(self) -> None:
        self.thread.join()
        self.done()


@dataclass
class _Reconfiguration:
    new: ExpertPlacement
    changing: dict[int, list[int]]  # layer -> global slots whose expert changes (on every rank)
    writes: list[tuple[int, int, int]]  # (layer position, local slot, new expert or EMPTY) on this rank
    phase: str = PREFETCH
    prefetched: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    worker: _Background | None = None


class ExpertBalancer:
    def __init__(self, blocks: dict[int, MoEBlock], expert_prefix: str = DEFAULT_EXPERT_PREFIX) -> None:
        if not blocks:
            raise ValueError("an expert balancer needs at least one MoE layer")
        self.moe_layers: list[int] = sorted(blocks)
        self._blocks = [blocks[layer] for layer in self.moe_layers]
        runtime = self._blocks[0].runtime
        self.shape = runtime.placement_shape
        if any(b.runtime.placement_shape != self.shape for b in self._blocks):
            raise ValueError("every MoE layer of a model must have the same expert placement shape")
        self.placement = ExpertPlacement.default(self.shape, self.moe_layers)
        self.expert_prefix = expert_prefix
        # the checkpoint that `start_prefetch` reads experts from (load_model sets it)
        self.model_dir: str | None = None
        self._device = self._blocks[0].experts.w13.device
        self._first_local_slot = self._blocks[0].experts.first_slot
        self.counter = ExpertLoadCounter(len(self.moe_layers), self.shape.num_logical, self._device)
        for position, block in enumerate(self._blocks):
            block.runtime.attach_load_counts(self.counter.row(position))
        self._pending: _Reconfiguration | None = None

    # ------------------------------------------------------------------ load counts
    def take_counts(self) -> list[list[int]]:
        """Tokens routed to each logical expert, [MoE layer position][expert], since the last call; resets."""
        return self.counter.take()

    # ------------------------------------------------------------------ reconfiguration
    @property
    def phase(self) -> str:
        """"idle", or the reconfiguration phase begun last: "prefetch", "disabled", "loading"."""
        return IDLE if self._pending is None else self._pending.phase

    def start_prefetch(self, new: ExpertPlacement, offline: bool = False) -> None:
        """Phase 1: read this rank's new slot weights from the checkpoint in the background.

        Live, every expert must keep a slot that does not change (it serves while the changing ones are
        disabled); `offline` is for a placement applied before serving starts, where any slot may change."""
        if self._pending is not None:
            raise RuntimeError(f"an expert reconfiguration is already in phase {self._pending.phase!r}; "
                               "finish it (enable) or abort it first")
        self._check_new(new, offline)
        if self.model_dir is None:
            raise RuntimeError("the expert balancer has no checkpoint to read experts from "
                               "(set expert_balancer.model_dir to the model directory)")
        changing = {layer: changed_slots(self.placement.layers[layer], new.layers[layer]) for layer in self.moe_layers}
        first, count = self._first_local_slot, self._blocks[0].experts.num_slots  # none on an attention rank
        writes = [(position, slot - first, new.layers[layer][slot])
                  for position, layer in enumerate(self.moe_layers)
                  for slot in changing[layer] if first <= slot < first + count]
        pending = _Reconfiguration(ExpertPlacement(self.shape, {layer: list(new.layers[layer])
                                                                for layer in self.moe_layers}), changing, writes)
        model_dir = self.model_dir
        pending.worker = _Background("expert prefetch", lambda: self._prefetch(pending, model_dir))
        self._pending = pending

    def prefetch_done(self) -> bool:
        return self._require(PREFETCH, DISABLED, action="prefetch_done").worker.done()

    def disable_changing_slots(self) -> None:
        """Phase 2: stop routing to every slot that changes (the old mapping minus those slots)."""
        pending = self._require(PREFETCH, action="disable_changing_slots")
        self._set_maps(self.placement, pending.changing, disable=True)
        pending.phase = DISABLED

    def start_load(self) -> None:
        """Phase 3: copy the prefetched weights into the disabled slots in the background
        (waits for the prefetch first if it is still running)."""
        pending = self._require(DISABLED, action="start_load")
        pending.worker.wait()
        pending.phase = LOADING
        pending.worker = _Background("expert load", lambda: self._load(pending))

    def load_done(self) -> bool:
        return self._require(LOADING, action="load_done").worker.done()

    def enable(self) -> None:
        """Phase 4: route with the new placement (waits for the load first if it is still running)."""
        pending = self._require(LOADING, action="enable")
        pending.worker.wait()
        self._set_maps(pending.new, pending.changing, disable=False)
        self.placement = pending.new
        self._pending = None

    def abort(self) -> None:
        """Drop the reconfiguration in progress (none: no-op). Every rank must call it at the same step
        boundary: the result depends only on the phase, so all ranks keep one table."""
        pending = self._pending
        if pending is None:
            return
        if pending.worker is not None:
            pending.worker.thread.join()
        if pending.phase == LOADING:  # slots being written may hold anything now
            layers = {}
            for layer, slots in self.placement.layers.items():
                gone = set(pending.changing[layer])
                layers[layer] = [EMPTY if slot in gone else expert for slot, expert in enumerate(slots)]
            self.placement = ExpertPlacement(self.shape, layers)
            for position, slot, _ in pending.writes:
                self._blocks[position].experts.clear_slot(slot)
        self._set_maps(self.placement, pending.changing, disable=False)
        self._pending = None

    def reconfigure(self, new: ExpertPlacement, offline: bool = False) -> None:
        """All four phases at once, blocking (at startup, or where no forward needs to run in between)."""
        self.start_prefetch(new, offline)
        if offline:  # no forward runs in between, and the changing slots may hold an expert's only copy
            self._pending.phase = DISABLED
        else:
            self.disable_changing_slots()
        self.start_load()
        self.enable()

    # ------------------------------------------------------------------ pieces
    def _check_new(self, new: ExpertPlacement, offline: bool = False) -> None:
        if not isinstance(new, ExpertPlacement):
            raise TypeError(f"expected an ExpertPlacement, got {type(new).__name__}")
        if new.shape != self.shape:
            raise ValueError(f"placement shape {new.shape} does not match the model's {self.shape}")
        if set(new.layers) != set(self.moe_layers):
            raise ValueError(f"placement covers layers {sorted(new.layers)}; the model's MoE layers are "
                             f"{self.moe_layers}")
        for layer in self.moe_layers if not offline else ():
            check_every_expert_served(self.placement.layers[layer], new.layers[layer], f"layer {layer}")

    def _require(self, *phases: str, action: str) -> _Reconfiguration:
        if self._pending is None or self._pending.phase not in phases:
            raise RuntimeError(f"{action}() needs a reconfiguration in phase {' or '.join(map(repr, phases))}, "
                               f"not {self.phase!r}")
        return self._pending

    def _set_maps(self, placement: ExpertPlacement, changing: dict[int, list[int]], disable: bool) -> None:
        """Give each layer with changing slots the map of `placement`, without those slots when `disable`."""
        for layer, block in zip(self.moe_layers, self._blocks):
            if changing[layer]:
                block.runtime.slot_map = SlotMap.from_slots(placement.layers[layer], self.shape.num_logical,
                                                            changing[layer] if disable else (), self._device)

    def _prefetch(self, pending: _Reconfiguration, model_dir: str) -> None:
        with ExpertCheckpoint(model_dir) as checkpoint:
            for position, _, expert in pending.writes:
                if expert == EMPTY or (position, expert) in pending.prefetched:
                    continue
                weights = self._blocks[position].experts
                prefix = self.expert_prefix.format(layer=self.moe_layers[position])
                pending.prefetched[(position, expert)] = checkpoint.read(
                    prefix, expert, weights.column_range(), weights.intermediate_size, weights.float_dtype,
                    int8_grid=weights.is_int8)

    def _load(self, pending: _Reconfiguration) -> None:
        for position, slot, expert in pending.writes:
            weights = self._blocks[position].experts
            if expert == EMPTY:
                weights.clear_slot(slot)
            else:
                weights.write_slot(slot, expert, *pending.prefetched[(position, expert)])
        pending.prefetched.clear()
        if self._device.type == "cuda":  # done means the copies have landed
            torch.cuda.current_stream(self._device).synchronize()
