"""Context caching in the memory pool, and model weights from its model cache."""
from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from meshserve.config.base import ConfigStruct


class PoolConfig(ConfigStruct, frozen=True):
    pool_controller: Annotated[str, Meta(
        description="the memory pool's controller (`meshserve pool controller`, e.g. tcp://127.0.0.1:7600)")
    ] | None = None
    pool_namespace: Annotated[str, Meta(
        description="tenant of this engine's KV blocks: blocks are shared within a namespace only")] = "default"
    pool_load_weights: Annotated[bool, Meta(
        description="with a pool: load weights from its model cache when the model is there")] = True
    pool_store_decode_blocks: Annotated[bool, Meta(
        description="also store blocks of generated tokens (multi-turn reuse)")] = False
    # the fetch-vs-recompute cost model (`meshserve bench cache` measures both)
    pool_fetch_latency_ms: Annotated[float, Meta(ge=0, description="the pool's round trip (ms)")] = 2.0
    pool_fetch_gbps: Annotated[float, Meta(gt=0, description="the pool's bandwidth (GB/s)")] = 2.0
