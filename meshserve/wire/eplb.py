"""Expert placements as they cross processes: the placement itself and the reconfiguration phases
every rank applies at the same step boundary (meshserve.core.eplb_controller drives them)."""
from __future__ import annotations

import enum

import msgspec


class EplbPhase(enum.StrEnum):
    """The steps of a live expert-placement reconfiguration (meshserve.core.eplb_controller)."""

    PREFETCH = "prefetch"  # read the changing slots' weights in the background
    DISABLE_AND_LOAD = "disable_and_load"  # stop routing to those slots and copy the weights in
    ENABLE = "enable"  # switch to the new placement
    ABORT = "abort"  # a rank failed a phase: every rank drops the reconfiguration


class PlacementData(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """An expert placement as it crosses a process: `ExpertPlacement.to_dict()` typed (JSON keys)."""

    format: str
    num_logical: int
    num_ranks: int
    redundant_per_rank: int
    layers: dict[str, list[int]]  # layer index -> the logical expert in each physical slot
    slots_per_rank: int | None = None  # uneven placements only
    replicas: dict[str, list[list[int]]] | None = None  # derived from `layers`: the slots of each expert

    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)


class EplbCommand(msgspec.Struct, forbid_unknown_fields=True):
    """One reconfiguration phase every rank applies at the same step boundary."""

    phase: EplbPhase
    placement: PlacementData | None = None  # the placement to move to (PREFETCH only)
