"""The JE's global prompt tree: which TE (and DP group) caches which prefix (deepserve §5.2).

Each TE's RTC publishes its prefix-cache changes as `KVCacheEvents`; this tree
replays them, so matching a prompt here tells, for every TE, how many of the
prompt's tokens it could reuse without asking it.

Nodes are full blocks named by their chain hash (`chain_block_hash`): a block's
hash covers its whole prefix and its prefix-cache namespace (the request's
`cache_salt`), so one dict lookup per prompt block walks the tree, and two
trees fed the same events hold the same nodes (how JE replicas stay consistent).
Each node records its holders, (te, dp_rank) pairs; a holder matches a prompt
up to the first block of the chain it does not hold. A node that nobody holds
stays only while it has children, so the tree never keeps more than the TEs cache.

Thread-safe: events arrive on a subscriber thread, matches come from the
asyncio thread; one lock guards everything.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from meshserve.wire.client import CachedBlock
from meshserve.wire.kv import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, KVCacheEvents, chain_block_hash

Holder = tuple[str, int]  # (te name, dp rank)


@dataclass(eq=False)
class _Node:
    parent: int | None  # None: at the root, or a placeholder whose parent is not known yet
    children: set[int] = field(default_factory=set)
    holders: set[Holder] = field(default_factory=set)


class GlobalPromptTree:
    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._lock = threading.Lock()
        self._nodes: dict[int, _Node] = {}
        self._held: dict[str, dict[int, set[int]]] = {}  # te -> dp rank -> hashes it holds
        self._last_seq: dict[str, int] = {}

    # ------------------------------------------------------------ updates
    def apply(self, te: str, batch: KVCacheEvents) -> bool:
        """Replay one batch of `te`'s prefix-cache events.

        False, with nothing applied, when `batch.seq` does not follow the last seq seen from
        `te` (a gap, or a batch already applied): the caller resyncs with `load_snapshot`.
        The first batch from a TE is taken whatever its seq."""
        for event in batch.events:  # check everything first, so a bad batch changes nothing
            if isinstance(event, BlockStored) and event.block_size != self.block_size:
                raise ValueError(f"TE {te} caches blocks of {event.block_size} tokens; "
                                 f"this tree uses {self.block_size}")
        with self._lock:
            last = self._last_seq.get(te)
            if last is not None and batch.seq != last + 1:
                return False
            self._last_seq[te] = batch.seq
            for event in batch.events:
                self._EVENT_HANDLERS[type(event)](self, te, batch.dp_rank, event)
            return True

    def _on_stored(self, te: str, dp: int, event: BlockStored) -> None:
        self._store_chain(te, dp, event.parent_block_hash, event.block_hashes)

    def _on_removed(self, te: str, dp: int, event: BlockRemoved) -> None:
        for block_hash in event.block_hashes:
            self._release(te, dp, block_hash)

    def _on_cleared(self, te: str, dp: int, event: AllBlocksCleared) -> None:
        self._clear(te, dp)

    _EVENT_HANDLERS: ClassVar[dict[type[CacheEvent], Callable]] = {
        BlockStored: _on_stored, BlockRemoved: _on_removed, AllBlocksCleared: _on_cleared}

    def load_snapshot(self, te: str, seq: int, blocks_by_dp: dict[int, list[CachedBlock]]) -> None:
        """Replace all that is known of `te` with its cache contents as of batch `seq`.

        Each block is (block_hash, parent_block_hash or None, token_ids), parents first."""
        with self._lock:
            self._forget(te)
            for dp, blocks in blocks_by_dp.items():
                for block_hash, parent_hash, _token_ids in blocks:
                    self._store(te, int(dp), parent_hash, block_hash)
            self._last_seq[te] = seq

    def remove_te(self, te: str) -> None:
        """Forget a TE that died or left: its blocks no longer match, its seq is reset."""
        with self._lock:
            self._forget(te)
            self._last_seq.pop(te, None)

    # ------------------------------------------------------------ queries
    def match(self, prompt_token_ids: Sequence[int], cache_salt: str = "") -> dict[str, int]:
        """For each TE holding the prompt's first block: prompt tokens its best DP group caches
        as a prefix (whole blocks, consecutive from the start). Only blocks cached under the same
        `cache_salt` (prefix-cache namespace) match: the TEs salt their chains' hashes with it."""
        bs = self.block_size
        num_blocks = len(prompt_token_ids) // bs
        best: dict[str, int] = {}
        with self._lock:
            alive: set[Holder] = set()
            parent: int | None = None
            for depth in range(num_blocks):
                block_hash = chain_block_hash(parent, prompt_token_ids[depth * bs : (depth + 1) * bs], cache_salt)
                node = self._nodes.get(block_hash)
                holders = node.holders if node is not None else set()
                if depth == 0:
                    alive = set(holders)
                else:
                    for te, _dp in alive - holders:  # their cached prefix ends before this block
                        best[te] = max(best.get(te, 0), depth * bs)
                    alive &= holders
                if not alive:
                    break
                parent = block_hash
            for te, _dp in alive:  # still alive: they hold every full block of the prompt
                best[te] = max(best.get(te, 0), num_blocks * bs)
        return best

    @property
    def num_blocks(self) -> int:
        """Nodes in the tree (held blocks plus unheld ancestors of held ones)."""
        with self._lock:
            return len(self._nodes)

    def holders(self, block_hash: int) -> frozenset[Holder]:
        with self._lock:
            node = self._nodes.get(block_hash)
            return frozenset(node.holders) if node is not None else frozenset()

    def holders_count(self) -> dict[str, int]:
        """Blocks each TE holds, summed over its DP groups."""
        with self._lock:
            return {te: sum(len(h) for h in by_dp.values()) for te, by_dp in self._held.items()}

    def blocks_held(self, te: str, dp_rank: int | None = None) -> set[int]:
        """Hashes `te` holds (in one DP group, or in any)."""
        with self._lock:
            by_dp = self._held.get(te, {})
            if dp_rank is not None:
                return set(by_dp.get(dp_rank, ()))
            return set().union(*by_dp.values()) if by_dp else set()

    def last_seq(self, te: str) -> int | None:
        """The seq of the last batch applied from `te` (to drop stale batches after a resync)."""
        with self._lock:
            return self._last_seq.get(te)

    def state(self) -> dict[int, tuple[int | None, frozenset[Holder]]]:
        """Every node as hash -> (parent hash, holders); equal for trees fed the same events."""
        with self._lock:
            return {h: (n.parent, frozenset(n.holders)) for h, n in self._nodes.items()}

    # ------------------------------------------------------------ internals (lock held)
    def _store_chain(self, te: str, dp: int, parent_hash: int | None, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            self._store(te, dp, parent_hash, block_hash)
            parent_hash = block_hash

    def _store(self, te: str, dp: int, parent_hash: int | None, block_hash: int) -> None:
        node = self._nodes.get(block_hash)
        if node is None:
            node = self._nodes[block_hash] = _Node(parent_hash)
            self._link(block_hash, parent_hash)
        elif node.parent is None and parent_hash is not None:
            node.parent = parent_hash  # a placeholder learns where it hangs
            self._link(block_hash, parent_hash)
        node.holders.add((te, dp))
        self._held.setdefault(te, {}).setdefault(dp, set()).add(block_hash)

    def _link(self, block_hash: int, parent_hash: int | None) -> None:
        if parent_hash is None:
            return
        parent = self._nodes.get(parent_hash)
        if parent is None:  # the parent is cached by nobody we know: keep its place until it is
            parent = self._nodes[parent_hash] = _Node(None)
        parent.children.add(block_hash)

    def _release(self, te: str, dp: int, block_hash: int) -> None:
        held = self._held.get(te, {}).get(dp)
        if held is None or block_hash not in held:
            return
        held.discard(block_hash)
        self._nodes[block_hash].holders.discard((te, dp))
        self._prune(block_hash)

    def _clear(self, te: str, dp: int) -> None:
        for block_hash in list(self._held.get(te, {}).get(dp, ())):
            self._release(te, dp, block_hash)
        self._held.get(te, {}).pop(dp, None)

    def _forget(self, te: str) -> None:
        for dp in list(self._held.get(te, {})):
            self._clear(te, dp)
        self._held.pop(te, None)

    def _prune(self, block_hash: int | None) -> None:
        """Drop nodes nobody holds and nothing hangs from, walking up from `block_hash`."""
        while block_hash is not None:
            node = self._nodes.get(block_hash)
            if node is None or node.holders or node.children:
                return
            del self._nodes[block_hash]
            parent = self._nodes.get(node.parent) if node.parent is not None else None
            if parent is not None:
                parent.children.discard(block_hash)
            block_hash = node.parent
