"""Relational Tensor Cache: the master's bookkeeping of the paged KV cache.

Three structures over one pool of fixed-size blocks (deepserve §4.3, Table 1):

- a block pool with reference counts (`alloc_blocks`, `append_block`, `acquire`, `free`);
- a radix tree over full blocks for implicit prefix caching (`match_by_prefix`,
  `insert_prefix`); a node's key is the tuple of its block's token ids and its
  parent is the node of the preceding block, so equal prefixes share nodes. The
  tree has one root per prefix-cache namespace (a request's `cache_salt`, one per
  tenant unless the operator shares it): equal prefixes of two namespaces never
  share a node, and their chain hashes differ (docs/caching.md#tenant-isolation);
- an id index (`match_by_id`, `register_id`, `unregister_id`) for explicit
  caching (a session, a transfer handle); registered blocks stay pinned.

A block registered in the tree outlives its last reference: it stays cached and
becomes evictable. Eviction takes the least-recently used unreferenced leaf, so
a parent always outlives its children and a prefix is never cut in the middle.

Holds ids only; the workers own the tensors the ids point into.
Not thread-safe: the master calls it from its scheduling loop.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from meshserve.wire.client import CachedBlock
from meshserve.wire.kv import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, chain_block_hash

# Without a consumer, keep the most recent events only, so an idle buffer cannot grow without bound.
MAX_BUFFERED_EVENTS = 65536




# ---------------------------------------------------------------- radix tree
@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    block_id: int
    block_hash: int
    parent: _Node | None  # None: a child of its namespace's root
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    cache_salt: str = ""  # the namespace whose root holds it (set on a chain's first node)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_event: Callable[[CacheEvent], None] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._on_event = on_event
        self._events: deque[CacheEvent] = deque(maxlen=MAX_BUFFERED_EVENTS)

        self._ref_counts = [0] * num_blocks
        self._num_referenced = 0
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced and not in the tree
        self._roots: dict[str, dict[tuple[int, ...], _Node]] = {}  # cache salt -> its root's children
        self._nodes: dict[int, _Node] = {}  # block id -> its tree node
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, oldest first
        self._id_index: dict[Hashable, list[int]] = {}

        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # ------------------------------------------------------------ metrics
    @property
    def num_free_blocks(self) -> int:
        """Blocks that hold nothing (neither referenced nor cached)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix tree, referenced or not."""
        return len(self._nodes)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks without references."""
        return len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        """Free plus evictable: an upper bound of what `alloc_blocks` can hand out now."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks with at least one reference."""
        return self._num_referenced / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def ref_count(self, block_id: int) -> int:
        self._check_block_id(block_id)
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._nodes

    def block_hash(self, block_id: int) -> int | None:
        """The chained hash of a cached block, None when the block is not in the tree."""
        node = self._nodes.get(block_id)
        return node.block_hash if node else None

    # ------------------------------------------------------------ block pool
    def alloc_blocks(self, n: int) -> list[int] | None:
        """n blocks with one reference each, evicting cached blocks if the free list is short;
        None (and nothing allocated) when there are not n to be had."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_available_blocks:
            return None
        blocks: list[int] = []
        while len(blocks) < n and self._free:
            blocks.append(self._free.popleft())
        removed: list[int] = []
        while len(blocks) < n:
            block_id = self._evict_one(removed)
            if block_id is None:
                # only unreferenced parents of referenced children are left: give back what we took
                self._free.extendleft(reversed(blocks))
                self._emit_removed(removed)
                return None
            blocks.append(block_id)
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        self._num_referenced += len(blocks)
        self._emit_removed(removed)
        return blocks

    def append_block(self) -> int | None:
        """One block for a decode step (see `alloc_blocks`)."""
        blocks = self.alloc_blocks(1)
        return blocks[0] if blocks else None

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (allocated, or cached after a prefix match)."""
        for block_id in block_ids:
            self._check_block_id(block_id)
            if self._ref_counts[block_id] == 0 and block_id not in self._nodes:
                raise ValueError(f"block {block_id} is free; only allocated or cached blocks can be acquired")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                self._evictable.pop(block_id, None)
                self._num_referenced += 1
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Unreferenced cached blocks become evictable; the
        last block of a sequence is released first so that it is also evicted first."""
        for block_id, count in Counter(block_ids).items():
            self._check_block_id(block_id)
            if self._ref_counts[block_id] < count:
                raise ValueError(f"block {block_id} is freed more often than it is referenced")
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._num_referenced -= 1
                if block_id in self._nodes:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    # ------------------------------------------------------------ prefix tree
    def holds_first_block(self, first_block: tuple[int, ...], cache_salt: str = "") -> bool:
        """Whether a sequence starting with the tokens `first_block` may have a cached prefix here (one dict
        lookup: callers that ask many managers skip the full match where this says no)."""
        return self.enable_prefix_caching and first_block in self._roots.get(cache_salt, ())

    def match_by_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None,
                        record: bool = True, cache_salt: str = "") -> list[int]:
        """Block ids of the longest prefix of full blocks cached under `cache_salt` within the first
        `max_tokens` tokens (all of them by default). Takes no reference; counts the lookup when `record`."""
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        matched: list[int] = []
        if self.enable_prefix_caching:
            children = self._roots.get(cache_salt, {})
            for start in range(0, limit - self.block_size + 1, self.block_size):
                node = children.get(tuple(token_ids[start : start + self.block_size]))
                if node is None:
                    break
                matched.append(node.block_id)
                children = node.children
            # a hit counts as a use: the head of the chain becomes the most recent
            for block_id in reversed(matched):
                if block_id in self._evictable:
                    self._evictable.move_to_end(block_id)
        if record:
            self.record_prefix_lookup(len(token_ids), len(matched) * self.block_size)
        return matched

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup in the hit-rate metric (for callers that match before they commit)."""
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def insert_prefix(self, token_ids: Sequence[int], block_ids: Sequence[int], num_full_blocks: int,
                      cache_salt: str = "") -> None:
        """Register the first `num_full_blocks` blocks of a sequence whose KV is computed, under the
        prefix-cache namespace `cache_salt`.

        Where a node for the same tokens already exists it is kept, and the caller's own
        block for that position stays unregistered (it is freed normally)."""
        if not self.enable_prefix_caching or num_full_blocks <= 0:
            return
        if num_full_blocks * self.block_size > len(token_ids) or num_full_blocks > len(block_ids):
            raise ValueError(
                f"{num_full_blocks} full blocks of {self.block_size} tokens need that many tokens and "
                f"block ids; got {len(token_ids)} tokens and {len(block_ids)} blocks"
            )
        parent: _Node | None = None
        children = self._roots.setdefault(cache_salt, {})
        new_nodes: list[_Node] = []
        for i in range(num_full_blocks):
            key = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            node = children.get(key)
            if node is None:
                block_id = block_ids[i]
                self._check_block_id(block_id)
                if block_id in self._nodes:
                    raise ValueError(f"block {block_id} is already cached for other tokens")
                if self._ref_counts[block_id] == 0:
                    raise ValueError(f"block {block_id} is free; only a held block can be cached")
                parent_hash = parent.block_hash if parent else None
                node = _Node(key, block_id, chain_block_hash(parent_hash, key, cache_salt), parent,
                             cache_salt=cache_salt)
                children[key] = node
                self._nodes[block_id] = node
                new_nodes.append(node)
            parent = node
            children = node.children
        if new_nodes:
            first_parent = new_nodes[0].parent
            self._emit(BlockStored(
                block_hashes=[n.block_hash for n in new_nodes],
                parent_block_hash=first_parent.block_hash if first_parent else None,
                token_ids=[t for n in new_nodes for t in n.key],
                block_size=self.block_size,
            ))

    def snapshot(self) -> list[CachedBlock]:
        """Every cached block as (block_hash, parent_block_hash or None, token_ids), parents first: what a
        router that lost events needs to rebuild its view of this cache."""
        out: list[CachedBlock] = []
        stack = [node for children in self._roots.values() for node in children.values()]
        while stack:
            node = stack.pop()
            out.append((node.block_hash, node.parent.block_hash if node.parent else None, list(node.key)))
            stack.extend(node.children.values())
        return out

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix. Referenced blocks stay with their holders (and return to
        the free list when released); unreferenced cached blocks are freed now."""
        for block_id in self._evictable:
            self._free.append(block_id)
        self._evictable.clear()
        self._nodes.clear()
        self._roots = {}
        self._emit(AllBlocksCleared())

    def _evict_one(self, removed_hashes: list[int]) -> int | None:
        for block_id in self._evictable:  # least recently used first
            node = self._nodes[block_id]
            if not node.children:
                break
        else:
            return None
        del self._evictable[block_id]
        siblings = node.parent.children if node.parent else self._roots[node.cache_salt]
        del siblings[node.key]
        if node.parent is None and not siblings:
            del self._roots[node.cache_salt]  # a namespace's last chain: its root goes too
        del self._nodes[block_id]
        removed_hashes.append(node.block_hash)
        return block_id

    # ------------------------------------------------------------ id index
    def match_by_id(self, key: Hashable) -> list[int] | None:
        blocks = self._id_index.get(key)
        return list(blocks) if blocks is not None else None

    def register_id(self, key: Hashable, block_ids: Sequence[int]) -> None:
        """Index blocks under `key`, pinning them (one reference each) until unregistered.
        Registering a key again replaces its blocks."""
        self.acquire(block_ids)
        old = self._id_index.get(key)
        self._id_index[key] = list(block_ids)
        if old is not None:
            self.free(old)

    def unregister_id(self, key: Hashable) -> bool:
        """Drop the index entry and its pins; False when the key was not registered."""
        blocks = self._id_index.pop(key, None)
        if blocks is None:
            return False
        self.free(blocks)
        return True

    # ------------------------------------------------------------ events
    def drain_events(self) -> list[CacheEvent]:
        """Buffered events (only buffered when no `on_event` callback was given)."""
        events = list(self._events)
        self._events.clear()
        return events

    def _emit(self, event: CacheEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)
        else:
            self._events.append(event)

    def _emit_removed(self, removed_hashes: list[int]) -> None:
        if removed_hashes:
            self._emit(BlockRemoved(block_hashes=removed_hashes))

    def _check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range [0, {self.num_blocks})")
