"""Deployment files for one engine: the model, its parallel strategy and engine settings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshserve.config.base import ConfigError
from meshserve.config.engine import CONCERN_OF, EngineConfig


def read_deployment_yaml(path: str) -> Any:
    """A deployment file's YAML; ConfigError names the file when it cannot be read or parsed."""
    # start-up: yaml only when a deployment file is read
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read deployment file {path!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"deployment file {path!r} is not valid YAML: {exc}") from None


# keys `meshserve plan --out` writes for information only
_DEPLOYMENT_INFO_KEYS = {"world_size", "attention", "moe", "estimate", "topology"}
_DEPLOYMENT_ENGINE_KEYS = {"parallel", "moe_comm", "int8_dispatch"}


@dataclass(frozen=True)
class Deployment:
    """A deployment file: the model, its parallel strategy and engine settings for one TE.

    ```yaml
    model: models/ds-small            # optional: default is the built-in default model
    parallel: "attn=TP1+DP2 moe=TP1+EP2"
    moe_comm: fused                   # fused | sync
    int8_dispatch: false
    engine: {max_num_seqs: 32}        # any EngineConfig field
    ```
    """

    model: str | None
    engine: dict[str, Any]

    @classmethod
    def load(cls, path: str) -> Deployment:
        return cls.from_dict(read_deployment_yaml(path), path)

    @classmethod
    def from_dict(cls, data: Any, source: str = "deployment") -> Deployment:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level")
        unknown = sorted(set(data) - _DEPLOYMENT_INFO_KEYS - _DEPLOYMENT_ENGINE_KEYS - {"model", "engine"})
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}")
        engine = data.get("engine") or {}
        if not isinstance(engine, dict):
            raise ConfigError(f"{source}: 'engine' must be a mapping of engine settings")
        names = set(CONCERN_OF) - {"model"}
        bad = sorted(set(engine) - names)
        if bad:
            raise ConfigError(f"{source}: unknown engine setting(s) {', '.join(bad)}")
        merged = dict(engine)
        for key in _DEPLOYMENT_ENGINE_KEYS:
            if key in data:
                if key in engine and engine[key] != data[key]:
                    raise ConfigError(f"{source}: {key} is given twice with different values")
                merged[key] = data[key]
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise ConfigError(f"{source}: 'model' must be a path")
        try:  # validate now: a bad strategy is reported against the file
            EngineConfig.from_kwargs(model or "", **merged)
        except (TypeError, ConfigError) as exc:
            raise ConfigError(f"{source}: {exc}") from None
        return cls(model=model, engine=merged)
