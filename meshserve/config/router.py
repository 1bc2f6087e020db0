"""The job executor's settings (`meshserve.router.router.Router`, deepserve §3, §5): its model, how it routes,
where TEs reach it, when it gives up on a TE or a job, and which cluster managers it reports to."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from meshserve.config.base import ConfigStruct

# the routing policies by name (meshserve.router.routing says what each does)
RoutingPolicyName = Literal["round_robin", "load", "locality", "pd_aware", "combined"]


class RouterConfig(ConfigStruct, frozen=True):
    model: Annotated[str, Meta(
        description="HF-format model directory: the tokenizer, EOS ids and (while no TE is seen) context length")]
    served_model_name: Annotated[str, Meta(
        description="the model's name in the API (default: the model directory's name)")] | None = None
    routing: Annotated[RoutingPolicyName, Meta(
        description="the job executor's routing policy (a multi-TE deployment file's `routing` unless this is "
                    "given)")] = "round_robin"
    host: Annotated[str, Meta(
        description="address the job executor binds for its TEs (their registrations and outputs)")] = "127.0.0.1"
    register_port: Annotated[int, Meta(
        ge=0, le=65535, description="where TEs register with the job executor (0: a free port)")] = 0
    heartbeat_timeout_s: Annotated[float, Meta(
        gt=0, description="a TE whose heartbeats stop for this long is dropped and its jobs move")] = 5.0
    max_attempts: Annotated[int, Meta(
        ge=1, description="TEs a job that has streamed no token is tried on before it fails")] = 3
    hold_s: Annotated[float, Meta(
        ge=0, description="how long a JE holds a request no TE can take yet (a pool scaling from zero; "
                          "0: refused at once)")] = 0.0
    migrate_deadline_s: Annotated[float, Meta(
        ge=0, description="how long a job whose TE failed may wait for another (or the restarted one) before it "
                          "fails")] = 60.0
    manager_addrs: Annotated[tuple[str, ...], Meta(
        description="cluster managers the job executor reports its TEs and demand to")] = ()
    report_interval_s: Annotated[float, Meta(
        gt=0, description="seconds between two reports to the cluster managers")] = 0.5
    name: Annotated[str, Meta(
        description="who this job executor is in its reports (default: je-PID-REGISTERPORT)")] = ""
    http_addr: Annotated[str, Meta(description="its HTTP address in its reports")] = ""
