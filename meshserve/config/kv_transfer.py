"""Disaggregated prefill/decode: a prefill engine's ranks expose their KV caches, a decode engine's pull."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from meshserve.config.base import ConfigStruct


class KVTransferConfig(ConfigStruct, frozen=True):
    kv_transfer: Annotated[Literal["none", "producer", "consumer"], Meta(
        description="this engine's P/D part: producer (prefill) or consumer (decode); `meshserve te --role` sets it")
    ] = "none"
    kv_transfer_backend: Annotated[Literal["auto", "shm", "tcp", "dist"], Meta(
        description="how KV blocks move: auto (shared memory on one host, else TCP), shm, tcp, or dist "
                    "(torch.distributed send/recv)")] = "auto"
    kv_hold_timeout_s: Annotated[float, Meta(
        gt=0, description="a prefill engine frees held KV blocks no decode engine pulled in this time (s)")] = 300.0
