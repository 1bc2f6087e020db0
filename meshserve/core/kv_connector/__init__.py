"""KV connectors, scheduler halves: remote KV (memory pool, prefill -> decode) enters the scheduler here.

`KVConnectors` builds one TE's connectors from its settings, one set per DP group, and is what the master
talks to: it hands each scheduler its group's connectors and routes ReleaseKV and hold expiry to them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from meshserve.config import EngineConfig
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.kv_connector.base import FinishedLoad, KVConnectorScheduler
from meshserve.core.kv_connector.pd import PDConnector, PDEndpoint, accept_kv_transfer
from meshserve.core.kv_connector.pool import PoolConnector
from meshserve.core.request import Request
from meshserve.pool.context_keys import kv_layout_name, model_identity
from meshserve.pool.fetch_cost import FetchCostModel
from meshserve.pool.sdk import PoolClient
from meshserve.wire.base import Message
from meshserve.wire.client import ReleaseKV
from meshserve.wire.kv import KVTransferParams
from meshserve.wire.worker import WorkerReady

__all__ = ["FinishedLoad", "KVConnectorScheduler", "KVConnectors", "PDConnector", "PDEndpoint", "PoolConnector"]


class KVConnectors:
    """The scheduler halves of one TE's KV connectors, per DP group in the order its scheduler asks them
    (a decode TE's pull first: a request it claims is never looked up in the pool)."""

    def __init__(self, config: EngineConfig, ready: list[WorkerReady], kv_managers: list[KVCacheManager],
                 engine_addr: str, send: Callable[[str, Message], None], first_group: int = 0) -> None:
        """`first_group`: the TE's DP group of `kv_managers[0]` (a self-contained group's master holds one)."""
        self.config = config
        self.per_group: list[list[KVConnectorScheduler]] = [[] for _ in kv_managers]
        self._pool: PoolClient | None = None
        strategy = config.parallel_config.strategy
        if config.kv_transfer_config.kv_transfer != "none":
            for group, kv_manager in enumerate(kv_managers):
                ranks = ready[group * strategy.attn_tp:(group + 1) * strategy.attn_tp]
                endpoint = PDEndpoint(engine=config.te_name, engine_addr=engine_addr, dp_rank=first_group + group,
                                      attn_tp=strategy.attn_tp, attn_dp=strategy.attn_dp,
                                      regions=[r.kv_region for r in ranks if r.kv_region is not None])
                self.per_group[group].append(PDConnector(
                    config.kv_transfer_config, kv_manager, endpoint,
                    lambda addr, req_ids: send(addr, ReleaseKV(req_ids=req_ids))))
        if config.pool_config.pool_controller:
            self._add_pool_connectors(config, ready[0].kv_bytes_per_token, strategy.attn_tp)

    def _add_pool_connectors(self, config: EngineConfig, kv_bytes_per_token: int, attn_tp: int) -> None:
        pool_config, block_size = config.pool_config, config.cache_config.block_size
        self._pool = PoolClient(pool_config.pool_controller, name="master")
        # one rank's share of a block crosses the pool; its ranks fetch in parallel
        cost = FetchCostModel(kv_bytes_per_token * block_size, block_size, pool_config.pool_fetch_latency_ms / 1000,
                              pool_config.pool_fetch_gbps * 1e9)
        # the blocks' number formats (compute dtype, INT8 KV, W8A8 weights) and, for an engine that drafts,
        # the MTP layer's KV in every block: each is another layout
        kv_layout = kv_layout_name(config.model_config.dtype, config.cache_config.kv_cache_dtype,
                                   config.model_config.quantization,
                                   config.speculative_config.enabled)
        model_id = model_identity(config.model_config.model, kv_layout)
        for connectors in self.per_group:
            connectors.append(PoolConnector(pool_config, self._pool, model_id, block_size, attn_tp, cost))

    def __iter__(self) -> Iterator[KVConnectorScheduler]:
        return (connector for connectors in self.per_group for connector in connectors)

    def accept(self, request: Request, params: KVTransferParams, output_token_ids: list[int]) -> None:
        """Admit a disaggregated request (ValueError when this TE cannot take it)."""
        accept_kv_transfer(self.config.kv_transfer_config, self.config.cache_config.block_size, request, params,
                           output_token_ids)

    def release(self, req_ids: list[str]) -> None:
        """Free the KV held for these requests, in whichever DP group holds it."""
        for req_id in req_ids:
            for connector in self:
                connector.release(req_id)

    def expire(self) -> None:
        for connector in self:
            connector.expire()

    @property
    def busy(self) -> bool:
        return any(connector.busy for connector in self)

    def close(self) -> None:
        for connector in self:
            connector.close()
        if self._pool is not None:
            self._pool.close()
