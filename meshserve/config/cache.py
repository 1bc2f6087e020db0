"""The paged KV cache: block size, how many blocks, prefix caching, cache events."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from meshserve.config.base import ConfigError, ConfigStruct


class CacheConfig(ConfigStruct, frozen=True):
    block_size: Annotated[int, Meta(ge=1, description="tokens per KV cache block (a power of two)")] = 16
    kv_cache_memory_gb: Annotated[float, Meta(
        description="memory budget the KV cache is sized from (GB per rank)")] = 1.0
    num_kv_blocks: Annotated[int, Meta(
        ge=1, description="exact KV cache size in blocks; overrides the memory budget (tests, tuning)")] | None = None
    kv_cache_dtype: Annotated[Literal["auto", "int8"], Meta(
        description="KV cache entries: auto (the model's dtype) or int8 (per-token scales kept in each row; "
                    "about twice the tokens of a bfloat16 cache in the same memory)")] = "auto"
    enable_prefix_caching: Annotated[bool, Meta(description="reuse the KV blocks of a shared prompt prefix")] = True
    kv_events_endpoint: Annotated[str, Meta(
        description="ZMQ PUB address for prefix-cache events (e.g. tcp://127.0.0.1:5557)")] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_gb <= 0 and self.num_kv_blocks is None:
            raise ConfigError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
