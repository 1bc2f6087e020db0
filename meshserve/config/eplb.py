"""Expert load balancing (xdeepserve §4.5): redundant experts, load recording, rebalancing."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from meshserve.config.base import ConfigStruct


class EplbConfig(ConfigStruct, frozen=True):
    eplb_redundant_experts: Annotated[int, Meta(
        ge=0, description="redundant expert slots per EP rank (replicas of hot experts)")] = 0
    eplb_slice_s: Annotated[float, Meta(gt=0, description="length of one expert-load recording slice (s)")] = 10.0
    eplb_interval_s: Annotated[float, Meta(
        gt=0, description="rebalance automatically this often from the recorded load (s; default: never)")
    ] | None = None
    eplb_rebalance_below: Annotated[float, Meta(
        gt=0, le=1, description="an automatic rebalance moves experts only while the recorded load's balancedness "
                                "under the placement in use (mean over max device load) is at or below this (1: "
                                "every interval): each move's rounds unbalance the placement while they run")] = 0.95
    eplb_placement: Annotated[str, Meta(
        description="placement JSON file applied before serving (may move primary experts too), or the JSON "
                    "itself (a shrunk layout's config carries its placement inline)")] | None = None
    eplb_live_mode: Annotated[Literal["full", "redundant"], Meta(
        description="how a rebalance while serving plans: full places every expert, primaries included (moved "
                    "in rounds, each expert keeping a copy meanwhile); redundant plans only the redundant slots")
    ] = "full"
