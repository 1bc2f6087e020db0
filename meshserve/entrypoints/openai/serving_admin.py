"""The operator routes: GET /admin/eplb/load|status, POST /admin/eplb/rebalance (expert load balancing,
xdeepserve §4.5) and POST /admin/faults (fault injection, off unless --enable-fault-injection).

`RequestGuard` admits only the admin (its key, or a loopback client without one); bodies are checked here,
before the engine sees them, and a command the engine refuses is a 400 with its reason.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from meshserve.entrypoints.openai.errors import APIError, engine_dead, from_exception
from meshserve.entrypoints.openai.serving_base import ServingBase
from meshserve.moe.placement import EMPTY as EMPTY_SLOT
from meshserve.moe.placement import ExpertPlacement
from meshserve.utils.faults import Fault
from meshserve.wire.errors import EngineDeadError

_BoundedInt = Annotated[int, Field(strict=True, ge=0, le=1 << 20)]
_Slot = Annotated[int, Field(strict=True, ge=EMPTY_SLOT, le=1 << 20)]  # a logical expert id, or empty
_LayerKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,6}$")]


class ExpertPlacementBody(BaseModel):
    """An expert placement as `meshserve eplb plan --out` writes it (meshserve/moe/placement.py)."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["meshserve-expert-placement/1"]
    num_logical: Annotated[int, Field(strict=True, ge=1, le=1 << 20)]
    num_ranks: Annotated[int, Field(strict=True, ge=1, le=1 << 16)]
    redundant_per_rank: _BoundedInt
    slots_per_rank: _BoundedInt | None = None
    layers: dict[_LayerKey, list[_Slot]] = Field(min_length=1)
    replicas: dict[_LayerKey, list[list[_BoundedInt]]] | None = None


class EplbRebalanceRequest(BaseModel):
    """`{}` (the server plans from its recorded load) or `{"placement": ...}`."""

    model_config = ConfigDict(extra="forbid")
    placement: ExpertPlacementBody | None = None


class AdminServing(ServingBase):
    async def command(self, op: str, args: dict | None = None) -> dict[str, Any]:
        """An operator command's result; a refused command is a 400 with the engine's reason."""
        if not self.engine.healthy:
            raise engine_dead(self.engine.dead_error or "unknown error")
        try:
            reply = await self.engine.admin(op, args)
        except EngineDeadError as exc:
            raise engine_dead(exc) from None
        if not reply.ok:
            raise APIError(400, reply.error or f"{op} failed")
        return reply.to_json()

    async def eplb_rebalance(self, raw: Request) -> dict[str, Any]:
        """Start a live expert reconfiguration; the body is validated here, before the engine sees it."""
        body = await raw.body()
        if not body.strip():
            return await self.command("eplb.rebalance", {})
        try:
            req = EplbRebalanceRequest.model_validate_json(body)
        except ValidationError as exc:
            raise APIError(400, f"bad placement request: {from_exception(exc).message}") from None
        if req.placement is None:
            return await self.command("eplb.rebalance", {})
        placement = req.placement.model_dump(exclude_none=True)
        try:  # the placement's own checks (shape, slot counts, expert ids) before the engine sees it
            ExpertPlacement.from_dict(placement)
        except ValueError as exc:
            raise APIError(400, f"bad placement: {exc}") from None
        return await self.command("eplb.rebalance", {"placement": placement})

    async def inject_fault(self, raw: Request) -> dict[str, Any]:
        """Arm a fault in a TE (tests and benchmarks: `--enable-fault-injection`); the body is the fault
        (`meshserve.utils.faults.Fault`), plus `te` naming the TE in a deployment."""
        if not self.context.options.enable_fault_injection:
            raise APIError(404, "fault injection is off; start the server with --enable-fault-injection")
        try:
            body = json.loads(await raw.body() or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            args = {"te": str(body.pop("te"))} if "te" in body else {}
            fault = msgspec.convert(body, Fault)
        except (ValueError, msgspec.ValidationError) as exc:
            raise APIError(400, f"bad fault: {exc}") from None
        return await self.command("fault.inject", {**args, "fault": msgspec.to_builtins(fault)})
