"""One rank's background populate of KV blocks from the memory pool (deepserve RTC `populate`).

The master orders a request's pool blocks fetched once their KV blocks are allocated; this rank asks
the pool for its share of each block (one batched, asynchronous get) and keeps stepping its other
requests meanwhile. Between steps it writes what arrived into its KV cache, up to the first block the
pool no longer has (evicted, server down or slow: a miss, never a failure), and reports how many
leading blocks it wrote as an executor event. The master schedules the request once every rank of
its attention TP group has reported, from the fewest blocks any of them got.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Callable

import torch

from meshserve.core.messages import POOL_FETCHED
from meshserve.pool.context_keys import rank_key

logger = logging.getLogger(__name__)



class RankPoolFetches:
    def __init__(self, pool, namespace: str, tp_rank: int, tp_size: int, block_nbytes: int,
                 write_block: Callable[[int, bytes], None]) -> None:
        self.pool = pool  # a PoolClient, or None: every fetch is a miss
        self.namespace = namespace
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.block_nbytes = block_nbytes
        self.write_block = write_block
        self._fetches: dict[str, tuple[list, Future | None]] = {}  # req_id -> (blocks, the pool's answer)

    @property
    def busy(self) -> bool:
        return bool(self._fetches)

    def start(self, order: dict) -> None:
        """Ask the pool for `order`'s blocks: {"req_id", "blocks": [[block_id, key], ...]}."""
        blocks = order["blocks"]
        keys = [rank_key(key, self.tp_rank, self.tp_size) for _, key in blocks]
        future = self.pool.get_async(self.namespace, keys) if self.pool is not None else None
        self._fetches[order["req_id"]] = (blocks, future)

    def poll(self) -> list[tuple[str, str]]:
        """Write the blocks of finished fetches; (POOL_FETCHED, "req_id\\tnum_leading_blocks_written") each."""
        events = []
        for req_id, (blocks, future) in list(self._fetches.items()):
            if future is not None and not future.done():
                continue
            del self._fetches[req_id]
            found = self._result(req_id, future)
            written = 0
            for block_id, key in blocks:
                data = found.get(rank_key(key, self.tp_rank, self.tp_size))
                if data is None or len(data) != self.block_nbytes:
                    break
                self.write_block(block_id, data)
                written += 1
            events.append((POOL_FETCHED, f"{req_id}\t{written}"))
        return events

    @staticmethod
    def _result(req_id: str, future: Future | None) -> dict:
        if future is None:
            return {}
        try:
            return future.result()
        except Exception as exc:  # the SDK answers misses; anything else still costs compute only
            logger.warning("request %s: pool fetch failed (%s); computing its prompt", req_id, exc)
            return {}


def write_block_into(kv_caches: list[torch.Tensor], block_size: int, entry_shape: tuple[int, ...],
                     dtype: torch.dtype) -> Callable[[int, bytes], None]:
    """A writer of one pool block (all layers' entries of one KV block, as stored) into `kv_caches`."""
    def write(block_id: int, data) -> None:
        block = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
        block = block.view(len(kv_caches), block_size, *entry_shape)
        for layer, kv in enumerate(kv_caches):
            kv[block_id].copy_(block[layer])

    return write
