"""The cluster manager's settings (`meshserve cluster up`): the deployment's name, where its processes run,
where its job executors serve, and how the manager heals and scales.

What a deployment file says (its TE groups, `autoscaler:` policy, `prewarm:` count, `devices:`) stays in the
file (meshserve/router/deployment.py); these are the manager's own settings, the same for any deployment.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from meshserve.config.base import ConfigError, ConfigStruct


class ClusterConfig(ConfigStruct, frozen=True):
    name: Annotated[str, Meta(min_length=1, description="the deployment's name (its state directory)")] = "default"
    backend: Annotated[Literal["local", "ray"], Meta(
        description="where processes run: this machine, or a Ray cluster")] = "local"
    ray_address: Annotated[str, Meta(
        description="an existing Ray cluster (HOST:PORT; default: start a local one)")] | None = None
    host: Annotated[str, Meta(description="address the JEs' HTTP servers bind")] = "127.0.0.1"
    metrics_host: Annotated[str, Meta(
        description="address the manager's Prometheus metrics (plain HTTP, no key) bind; beyond loopback only "
                    "on a network trusted with the deployment's load figures")] = "127.0.0.1"
    port: Annotated[int, Meta(
        ge=1, le=65535, description="the first JE's HTTP port (further JEs: the next ones)")] = 8000
    hold_s: Annotated[float, Meta(
        ge=0, description="how long a JE holds a request no TE can take yet (a pool scaling from zero)")] = 120.0
    autoscale: Annotated[bool, Meta(
        description="scale the pools as the deployment's `autoscaler:` asks (off: only an operator scales them)")
    ] = True
    preload: Annotated[bool, Meta(
        description="keep the checkpoints of pools about to scale up in the page cache (DRAM preload)")] = True
    heartbeat_timeout_s: Annotated[float, Meta(
        gt=0, description="a registered TE silent this long is hung: killed and restarted")] = 10.0

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(str(exc)) from None


# the settings `meshserve cluster up` takes as flags (the others are for benchmarks and tests building a manager)
CLUSTER_FLAGS = ("name", "backend", "ray_address", "host", "metrics_host", "port", "hold_s")
