"""Context caching in the memory pool: the scheduler half of the pool connector (deepserve RTC populate).

A waiting request's prompt blocks are keyed by their tokens (`meshserve.pool.context_keys`); one batched
`exists` asks the pool which leading ones it holds. Blocks the pool holds beyond the local prefix-cache hit
are fetched rather than computed when that pays (`FetchCostModel`): once their KV blocks are allocated the
DP group's ranks fetch them in the background, and the request runs from the fewest blocks any rank wrote
(a block the pool lost is computed, never a failure). Full blocks whose KV is computed are stored in the
pool for other engines (prompt blocks; generated ones too with `pool_store_decode_blocks`).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from meshserve.config import PoolConfig
from meshserve.core.kv_connector.base import FinishedLoad, KVConnectorScheduler
from meshserve.core.request import Request, RequestStatus
from meshserve.pool.context_keys import block_keys, chain_block_keys, key_root, rank_key
from meshserve.pool.fetch_cost import FetchCostModel
from meshserve.wire.client import EngineStats
from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport, PoolBlock, PoolFetch

logger = logging.getLogger(__name__)


class PoolLookup(Protocol):
    """What the scheduler half needs of the pool (a `PoolClient`)."""

    def exists_async(self, namespace: str, keys: list[str]) -> Future: ...


@dataclass
class _PoolKeys:
    """A looked-up request's pool keys: its full blocks' keys, and what the pool is known to hold."""

    root: str  # what block 0's key chains from
    keys: list[str]  # prompt blocks (bar the last token's); decode blocks are added as they fill when stored
    lookup: Future | None = None  # the pool's answer to `exists`, until taken
    num_hit_blocks: int = 0  # leading blocks the pool holds
    num_stored_blocks: int = 0  # leading blocks known to be in the pool (hit or stored)


@dataclass
class _Fetch:
    """A populate in flight: the DP group's ranks that reported, the fewest blocks one wrote."""

    req: Request
    num_fetched: int  # the blocks ordered, lowered by each rank's report
    ranks: set[int] = field(default_factory=set)


class PoolConnector(KVConnectorScheduler):
    def __init__(self, config: PoolConfig, pool: PoolLookup, model_id: str, block_size: int, attn_tp: int,
                 cost: FetchCostModel) -> None:
        self.config = config
        self.pool = pool
        self.model_id = model_id
        self.block_size = block_size
        self.attn_tp = attn_tp  # ranks of a DP group: each fetches and stores its own part of a block
        self.cost = cost  # shared by the TE's DP groups: it learns the prefill rate from every step
        self._keys: dict[str, _PoolKeys] = {}  # req_id -> its keys, from its first lookup until it finishes
        self._fetches: dict[str, _Fetch] = {}
        self._store_queue: list[PoolBlock] = []
        self._fetch_queue: list[PoolFetch] = []
        self.num_hit_tokens = 0  # prompt tokens fetched from the pool instead of computed

    # ------------------------------------------------------------ lookup
    def get_num_new_matched_tokens(self, req: Request, num_local_tokens: int) -> int | None:
        keys = self._keys.get(req.req_id) or self._start_lookup(req)
        if keys.lookup is not None:
            if not keys.lookup.done():
                return None
            self._take_lookup(req.req_id, keys)
        num_pool = max(0, keys.num_hit_blocks - num_local_tokens // self.block_size)
        if num_pool < self.cost.min_fetch_blocks():
            return 0  # too short to pay for a round trip to the pool: computed instead
        return num_pool * self.block_size

    def _start_lookup(self, req: Request) -> _PoolKeys:
        """Ask the pool (one batched exists, rank 0's parts) which leading prompt blocks it holds."""
        namespace, salt = self.config.pool_namespace, req.tenancy.cache_salt
        # like the local prefix cache, never the block of the last prompt token: its logits are needed
        keys = _PoolKeys(key_root(self.model_id, namespace, salt),
                         block_keys(req.prompt_token_ids[:-1], self.block_size, self.model_id, namespace,
                                    cache_salt=salt))
        if keys.keys:
            keys.lookup = self.pool.exists_async(namespace, [rank_key(k, 0, self.attn_tp) for k in keys.keys])
        self._keys[req.req_id] = keys
        return keys

    @staticmethod
    def _take_lookup(req_id: str, keys: _PoolKeys) -> None:
        future, keys.lookup = keys.lookup, None
        try:
            found = future.result()
        except Exception as exc:  # noqa: BLE001 - a pool that cannot answer costs hits, never the request
            logger.warning("request %s: pool lookup failed (%s); computing its prompt", req_id, exc)
            found = []
        keys.num_hit_blocks = next((i for i, present in enumerate(found) if not present), len(found))
        keys.num_stored_blocks = keys.num_hit_blocks

    @property
    def busy(self) -> bool:
        return any(k.lookup is not None and not k.lookup.done() for k in self._keys.values())

    # ------------------------------------------------------------ fetch
    def update_state_after_alloc(self, req: Request, num_local_tokens: int, num_external_tokens: int) -> None:
        first = num_local_tokens // self.block_size
        positions = range(first, first + num_external_tokens // self.block_size)
        keys = self._keys[req.req_id].keys
        self._fetch_queue.append(PoolFetch(req_id=req.req_id, blocks=[
            PoolBlock(req.block_ids[pos], keys[pos]) for pos in positions]))
        self._fetches[req.req_id] = _Fetch(req, len(positions))

    def update_connector_output(self, report: KVConnectorReport) -> list[FinishedLoad]:
        finished = []
        for done in report.pool_fetches:
            fetch = self._fetches.get(done.req_id)
            if fetch is None:
                continue
            fetch.ranks.add(report.rank)
            # the ranks of a TP group compute the same tokens: all start after the fewest blocks any one wrote
            fetch.num_fetched = max(0, min(fetch.num_fetched, done.num_blocks))
            if len(fetch.ranks) < self.attn_tp:
                continue
            del self._fetches[done.req_id]
            finished.append(self._fetched(fetch))
        return finished

    def _fetched(self, fetch: _Fetch) -> FinishedLoad:
        req, num_tokens = fetch.req, fetch.num_fetched * self.block_size
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KV:  # not aborted meanwhile
            if num_tokens < req.num_external_tokens:
                first_miss = req.num_computed_tokens + num_tokens
                logger.warning("request %s: the pool misses block %d on; computing from token %d", req.req_id,
                               first_miss // self.block_size, first_miss)
            self.num_hit_tokens += num_tokens
        return FinishedLoad(req, num_tokens)

    # ------------------------------------------------------------ store
    def on_blocks_ready(self, req: Request, num_full_blocks: int) -> None:
        keys = self._keys.get(req.req_id)
        if keys is None:
            return  # never looked up (a decode TE's pulled request): another engine stores its prompt
        if self.config.pool_store_decode_blocks and num_full_blocks > len(keys.keys):
            parent = keys.keys[-1] if keys.keys else keys.root
            keys.keys += chain_block_keys(parent, req.all_token_ids, self.block_size, len(keys.keys),
                                          num_full_blocks - len(keys.keys))
        num_store = min(num_full_blocks, len(keys.keys))
        for pos in range(keys.num_stored_blocks, num_store):
            self._store_queue.append(PoolBlock(req.block_ids[pos], keys.keys[pos]))
        keys.num_stored_blocks = max(keys.num_stored_blocks, num_store)

    # ------------------------------------------------------------ per step
    def build_connector_meta(self, meta: KVConnectorMetadata) -> None:
        meta.pool_stores += self._store_queue
        meta.pool_fetches += self._fetch_queue
        self._store_queue, self._fetch_queue = [], []

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe_step(num_tokens, seconds)

    def request_finished(self, req: Request) -> None:
        self._keys.pop(req.req_id, None)
        return None

    def fill_stats(self, stats: EngineStats) -> None:
        stats.pool_hit_tokens += self.num_hit_tokens
