"""The worker half of the pool connector: one rank's stores to and populates from the memory pool
(context caching; deepserve RTC `populate`).

Stores: the rank copies its part of each newly full block out of its KV cache (the bytes are taken at
the step boundary, before the step can overwrite the block) and sends them in the background.
Populates: the rank asks the pool for its share of a request's blocks (one batched, asynchronous get)
and keeps stepping its other requests meanwhile. Between steps it writes what arrived into its KV cache,
up to the first block the pool no longer has (evicted, server down or slow: a miss, never a failure), and
reports how many leading blocks it wrote. The scheduler half runs the request once every rank of its
attention TP group has reported, from the fewest blocks any of them got.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from meshserve.pool.context_keys import rank_key
from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport, PoolBlock, PoolFetch, PoolFetchDone
from meshserve.worker.kv_connector.base import KVConnectorWorker

logger = logging.getLogger(__name__)

STORE_DRAIN_S = 5.0  # on a stop, stores still in flight get this long to reach the pool


class PoolConnectorWorker(KVConnectorWorker):
    def __init__(self, pool, namespace: str, tp_rank: int, tp_size: int, kv_caches: list[torch.Tensor]) -> None:
        self.pool = pool  # a PoolClient, or None: every fetch is a miss, nothing is stored
        self.namespace = namespace
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.kv_caches = kv_caches  # per layer [num_blocks, block_size, *entry]
        self.block_nbytes = sum(kv[0].nbytes for kv in kv_caches)  # one block, every layer: as stored
        self._fetches: dict[str, tuple[list[PoolBlock], Future | None]] = {}  # req_id -> (blocks, the pool's answer)
        self._stores: list[Future] = []  # puts not yet answered
        self._wake: Callable[[], None] | None = None  # the pool client's thread calls it as a fetch is answered

    @property
    def busy(self) -> bool:
        return bool(self._fetches)

    def wake_with(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if meta.pool_stores:
            self._store(meta.pool_stores)
        for fetch in meta.pool_fetches:
            self._start_fetch(fetch)

    def _key(self, key: str) -> str:
        return rank_key(key, self.tp_rank, self.tp_size)

    def _store(self, blocks: list[PoolBlock]) -> None:
        """Copy full blocks to the pool (the bytes are taken now; sending runs in the background)."""
        if self.pool is None:
            return
        values = {self._key(block.key): self.read_block(block.block_id) for block in blocks}
        self._stores = [future for future in self._stores if not future.done()]
        self._stores.append(self.pool.put_async(self.namespace, values))

    def close(self) -> None:
        """Stores still in flight finish first (up to STORE_DRAIN_S): the blocks of the last steps before a
        stop stay reusable by the next TE (the process ends at once after this, threads and all)."""
        deadline = time.monotonic() + STORE_DRAIN_S
        for future in self._stores:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - a lost store is a later miss, never a failure
                logger.debug("a store did not finish before the stop: %r", exc)

    def _start_fetch(self, fetch: PoolFetch) -> None:
        keys = [self._key(block.key) for block in fetch.blocks]
        future = self.pool.get_async(self.namespace, keys) if self.pool is not None else None
        self._fetches[fetch.req_id] = (fetch.blocks, future)
        if future is not None and self._wake is not None:
            future.add_done_callback(lambda _: self._wake())

    def get_finished(self, report: KVConnectorReport) -> None:
        """Write the blocks of finished fetches; report how many leading blocks each wrote."""
        for req_id, (blocks, future) in list(self._fetches.items()):
            if future is not None and not future.done():
                continue
            del self._fetches[req_id]
            found = self._result(req_id, future)
            written = 0
            for block in blocks:
                data = found.get(self._key(block.key))
                if data is None or len(data) != self.block_nbytes:
                    break
                self.write_block(block.block_id, data)
                written += 1
            report.pool_fetches.append(PoolFetchDone(req_id, written))

    @staticmethod
    def _result(req_id: str, future: Future | None) -> dict:
        if future is None:
            return {}
        try:
            return future.result()
        except Exception as exc:  # the SDK answers misses; anything else still costs compute only
            logger.warning("request %s: pool fetch failed (%s); computing its prompt", req_id, exc)
            return {}

    def read_block(self, block_id: int) -> bytes:
        """All layers' entries of one KV block, as stored in the pool."""
        block = torch.stack([kv[block_id] for kv in self.kv_caches]).cpu().contiguous()
        return block.view(torch.uint8).numpy().tobytes()

    def write_block(self, block_id: int, data) -> None:
        """Write one block read from the pool (`read_block`'s layout) into the KV cache."""
        first = self.kv_caches[0]
        block = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(first.dtype)
        block = block.view(len(self.kv_caches), *first.shape[1:])
        for layer, kv in enumerate(self.kv_caches):
            kv[block_id].copy_(block[layer])
