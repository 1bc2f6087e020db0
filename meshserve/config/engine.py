"""The engine's settings: one struct per concern, composed into `EngineConfig`.

Each object is handed the concern it needs (`config.cache_config`, ...) at construction. Callers that
think in flat names (the CLI, deployment files, `LLM(model, max_num_seqs=8)`) go through
`EngineConfig.from_kwargs`, which routes every name to its concern. `to_dict` / `from_dict` carry the
nested form to other processes.
"""
from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from meshserve.config.base import ConfigError, ConfigStruct, Setting, settings_of
from meshserve.config.cache import CacheConfig
from meshserve.config.eplb import EplbConfig
from meshserve.config.kv_transfer import KVTransferConfig
from meshserve.config.model import ModelConfig
from meshserve.config.parallel import ParallelConfig
from meshserve.config.pool import PoolConfig
from meshserve.config.scheduler import SchedulerConfig
from meshserve.config.speculative import SpeculativeConfig


class EngineConfig(ConfigStruct, frozen=True):
    model_config: ModelConfig
    cache_config: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    eplb_config: EplbConfig = msgspec.field(default_factory=EplbConfig)
    pool_config: PoolConfig = msgspec.field(default_factory=PoolConfig)
    kv_transfer_config: KVTransferConfig = msgspec.field(default_factory=KVTransferConfig)
    speculative_config: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    te_name: Annotated[str, Meta(
        description="this engine's name in a deployment (transfer peers and routing tables use it)")] = "te"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.parallel_config.microbatches == 2 and self.scheduler_config.max_num_seqs < 2:
            raise ConfigError("microbatches 2 splits a step's sequences in two: it needs max_num_seqs >= 2, got "
                              f"{self.scheduler_config.max_num_seqs}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Settings by their flat names (`block_size=32`), each routed to its concern."""
        unknown = sorted(set(kwargs) - set(CONCERN_OF))
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        return _build(cls, {"model": model, **kwargs})

    def replace(self, **kwargs: Any) -> EngineConfig:
        """A copy with some settings changed, by their flat names (before anything is built from it)."""
        unknown = sorted(set(kwargs) - set(CONCERN_OF))
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        return _build(type(self), {**self.flat(), **kwargs})

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        return {name: getattr(self.concern(name), name) for name in CONCERN_OF}

    def concern(self, name: str) -> Any:
        """The struct that holds setting `name` (this config itself for te_name)."""
        attr = CONCERN_OF[name]
        return self if attr is None else getattr(self, attr)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(str(exc)) from None


# the concern structs by attribute name, in the order `--help` shows them
CONCERNS: dict[str, type[ConfigStruct]] = {
    "model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig, "eplb_config": EplbConfig, "pool_config": PoolConfig,
    "kv_transfer_config": KVTransferConfig, "speculative_config": SpeculativeConfig,
}
# flat setting name -> the attribute of its concern (None: EngineConfig's own field)
CONCERN_OF: dict[str, str | None] = {
    **{s.name: attr for attr, cls in CONCERNS.items() for s in settings_of(cls)},
    **{s.name: None for s in settings_of(EngineConfig)},
}


def engine_settings() -> dict[str, tuple[Setting, ...]]:
    """Every engine setting, grouped by concern ("model", "cache", ..., "engine" for te_name)."""
    groups = {attr.removesuffix("_config"): settings_of(cls) for attr, cls in CONCERNS.items()}
    return {**groups, "engine": settings_of(EngineConfig)}


def _build(cls: type[EngineConfig], flat: dict[str, Any]) -> EngineConfig:
    parts: dict[str, dict[str, Any]] = {attr: {} for attr in CONCERNS}
    top = {}
    for name, value in flat.items():
        attr = CONCERN_OF[name]
        (top if attr is None else parts[attr])[name] = value
    return cls(**{attr: CONCERNS[attr](**values) for attr, values in parts.items()}, **top)
