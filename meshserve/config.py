"""Engine settings, shared by the CLI, the offline `LLM` and every engine process."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """An engine setting is invalid; the CLI prints it as one line."""


@dataclass(frozen=True)
class EngineConfig:
    model: str  # HF-format model directory
    served_model_name: str | None = None
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (the checkpoint's)
    device: str = "cpu"
    # paged KV cache
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0  # budget the KV pool is sized from
    num_kv_blocks: int | None = None  # exact pool size; overrides the budget (tests, tuning)
    enable_prefix_caching: bool = True
    # scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # chunked-prefill token budget per step
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_waiting: int = 1024  # queued requests beyond this are refused (HTTP 503)
    async_scheduling: bool = True  # prepare step n+1 while step n runs
    kv_events_endpoint: str | None = None  # ZMQ PUB address for prefix-cache events (e.g. tcp://127.0.0.1:5557)
    # executors
    num_threads: int | None = None  # torch threads per executor; default: all cores
    seed: int = 0
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory_gb <= 0 and self.num_kv_blocks is None:
            raise ConfigError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ConfigError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        return cls(**data)
