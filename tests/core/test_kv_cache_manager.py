"""Relational Tensor Cache: block refcounts, prefix tree, LRU eviction, id index, events, metrics."""
from __future__ import annotations

import pytest

from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.wire.kv import AllBlocksCleared, BlockRemoved, BlockStored, chain_block_hash

BS = 4


def seq(start: int, n_blocks: int) -> list[int]:
    """Tokens of n full blocks, distinct per start."""
    return list(range(start, start + n_blocks * BS))


def cache_sequence(kv_manager: KVCacheManager, tokens: list[int]) -> list[int]:
    """Allocate, register and release a sequence of full blocks; returns its block ids."""
    n = len(tokens) // BS
    blocks = kv_manager.alloc_blocks(n)
    assert blocks is not None
    kv_manager.insert_prefix(tokens, blocks, n)
    kv_manager.free(blocks)
    return blocks


def test_refcounts_and_free_return_blocks_to_the_pool():
    kv_manager = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    blocks = kv_manager.alloc_blocks(3)
    assert len(set(blocks)) == 3
    assert all(kv_manager.ref_count(b) == 1 for b in blocks)
    assert kv_manager.num_free_blocks == 5 and kv_manager.usage == pytest.approx(3 / 8)

    kv_manager.acquire(blocks[:1])  # shared by a second holder
    assert kv_manager.ref_count(blocks[0]) == 2
    kv_manager.free(blocks)
    assert kv_manager.ref_count(blocks[0]) == 1 and kv_manager.ref_count(blocks[1]) == 0
    assert kv_manager.num_free_blocks == 7
    kv_manager.free(blocks[:1])
    assert kv_manager.num_free_blocks == 8 and kv_manager.usage == 0.0

    with pytest.raises(ValueError, match="freed more often"):
        kv_manager.free(blocks[:1])
    with pytest.raises(ValueError, match="free"):
        kv_manager.acquire(blocks[:1])  # neither allocated nor cached
    with pytest.raises(ValueError, match="out of range"):
        kv_manager.free([8])


def test_alloc_is_all_or_nothing_and_append_block():
    kv_manager = KVCacheManager(num_blocks=4, block_size=BS)
    first = kv_manager.alloc_blocks(3)
    assert kv_manager.alloc_blocks(2) is None
    assert kv_manager.num_free_blocks == 1  # the failed call took nothing
    last = kv_manager.append_block()
    assert last is not None and last not in first
    assert kv_manager.append_block() is None
    assert kv_manager.alloc_blocks(0) == []
    with pytest.raises(ValueError):
        kv_manager.alloc_blocks(-1)


def test_cached_blocks_survive_free_and_are_matched():
    kv_manager = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = seq(100, 3) + [7, 7]  # three full blocks and a partial one
    blocks = kv_manager.alloc_blocks(4)
    kv_manager.insert_prefix(tokens, blocks, 3)
    kv_manager.free(blocks)
    assert kv_manager.num_cached_blocks == 3
    assert kv_manager.num_free_blocks == 5  # the partial block is not cached
    assert kv_manager.num_evictable_blocks == 3 and kv_manager.usage == 0.0

    assert kv_manager.match_by_prefix(tokens) == blocks[:3]
    assert kv_manager.match_by_prefix(seq(100, 2) + [0] * BS) == blocks[:2]  # diverges in block 3
    assert kv_manager.match_by_prefix(tokens, max_tokens=3 * BS - 1) == blocks[:2]  # keep a token to compute
    assert kv_manager.match_by_prefix([1] + tokens) == []

    kv_manager.acquire(blocks[:2])  # a hit taken by a new request leaves the evictable set
    assert kv_manager.num_evictable_blocks == 1 and kv_manager.ref_count(blocks[0]) == 1


def test_a_duplicate_block_keeps_the_existing_node():
    kv_manager = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = seq(0, 2)
    a = kv_manager.alloc_blocks(2)
    b = kv_manager.alloc_blocks(2)  # computed the same tokens independently
    kv_manager.insert_prefix(tokens, a, 2)
    kv_manager.insert_prefix(tokens, b, 2)
    assert kv_manager.num_cached_blocks == 2
    assert kv_manager.match_by_prefix(tokens) == a
    assert not kv_manager.is_cached(b[0])
    kv_manager.free(b)
    assert kv_manager.num_free_blocks == 4  # b's blocks went straight back


def test_lru_evicts_least_recently_used_leaf_and_never_a_referenced_block():
    kv_manager = KVCacheManager(num_blocks=4, block_size=BS)
    old = cache_sequence(kv_manager, seq(0, 1))
    new = cache_sequence(kv_manager, seq(50, 1))
    held = kv_manager.alloc_blocks(1)
    kv_manager.insert_prefix(seq(90, 1), held, 1)  # cached but still referenced
    assert kv_manager.num_free_blocks == 1

    got = kv_manager.alloc_blocks(2)  # the free block plus one eviction
    assert old[0] in got and new[0] not in got
    assert kv_manager.match_by_prefix(seq(0, 1)) == []
    assert kv_manager.match_by_prefix(seq(50, 1)) == new
    assert kv_manager.alloc_blocks(2) is None  # only `new` is evictable; `held` is referenced
    assert kv_manager.match_by_prefix(seq(50, 1)) == new  # a failed alloc evicts nothing
    assert kv_manager.alloc_blocks(1) == new
    assert kv_manager.match_by_prefix(seq(90, 1)) == held


def test_a_match_refreshes_recency():
    kv_manager = KVCacheManager(num_blocks=2, block_size=BS)
    first = cache_sequence(kv_manager, seq(0, 1))
    second = cache_sequence(kv_manager, seq(50, 1))
    assert kv_manager.match_by_prefix(seq(0, 1)) == first  # now `second` is the least recently used
    assert kv_manager.alloc_blocks(1) == second
    assert kv_manager.match_by_prefix(seq(0, 1)) == first


def test_a_parent_is_not_evicted_before_its_children():
    events = []
    kv_manager = KVCacheManager(num_blocks=3, block_size=BS, on_event=events.append)
    tokens = seq(0, 3)
    blocks = kv_manager.alloc_blocks(3)
    kv_manager.insert_prefix(tokens, blocks, 3)
    for b in blocks:  # the root block becomes unreferenced first, so it is the oldest
        kv_manager.free([b])
    stored = events[0]
    evicted = []
    for n in (3, 2, 1):
        evicted += kv_manager.alloc_blocks(1)
        assert kv_manager.match_by_prefix(tokens) == blocks[: n - 1]  # always a whole prefix left
    assert evicted == blocks[::-1]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == stored.block_hashes[::-1]


def test_eviction_skips_an_unreferenced_parent_of_a_referenced_child():
    kv_manager = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = seq(0, 2)
    parent = kv_manager.alloc_blocks(1)
    kv_manager.insert_prefix(tokens, parent, 1)
    kv_manager.free(parent)
    # another sequence computed the same first block itself, then its own second block
    dup_first, child = kv_manager.alloc_blocks(2)
    kv_manager.insert_prefix(tokens, [dup_first, child], 2)
    assert kv_manager.match_by_prefix(tokens) == [parent[0], child]
    kv_manager.free([dup_first])
    assert kv_manager.num_free_blocks == 2
    # parent is unreferenced and least recent, but its child is held: not evictable
    assert kv_manager.alloc_blocks(3) is None
    assert kv_manager.num_free_blocks == 2
    assert kv_manager.match_by_prefix(tokens) == [parent[0], child]
    kv_manager.free([child])
    got = kv_manager.alloc_blocks(4)
    assert set(got) == {0, 1, 2, 3}


def test_events_carry_chained_hashes_equal_for_equal_prefixes():
    a_events, b_events = [], []
    a = KVCacheManager(num_blocks=8, block_size=BS, on_event=a_events.append)
    b = KVCacheManager(num_blocks=8, block_size=BS, on_event=b_events.append)
    common = seq(0, 2)
    x = common + seq(500, 1)
    y = common + seq(700, 1)
    a.insert_prefix(x, a.alloc_blocks(3), 3)
    b.insert_prefix(y, b.alloc_blocks(3), 3)
    (ax,), (by,) = a_events, b_events
    assert isinstance(ax, BlockStored) and ax.block_size == BS and ax.parent_block_hash is None
    assert ax.token_ids == x and by.token_ids == y
    assert ax.block_hashes[:2] == by.block_hashes[:2]  # equal prefixes, equal hashes
    assert ax.block_hashes[2] != by.block_hashes[2]
    # the chain: each hash is that of its parent hash and its own tokens
    parent = None
    for i, h in enumerate(ax.block_hashes):
        assert h == chain_block_hash(parent, x[i * BS : (i + 1) * BS])
        assert 0 <= h < 2**64
        parent = h
    # the same tokens under a different parent hash differently
    assert chain_block_hash(None, seq(500, 1)) != ax.block_hashes[2]

    # extending an existing chain reports only the new block, under its parent's hash
    a.insert_prefix(y, a.alloc_blocks(3), 3)
    stored = a_events[-1]
    assert stored.block_hashes == [by.block_hashes[2]]
    assert stored.parent_block_hash == ax.block_hashes[1]
    assert stored.token_ids == y[2 * BS :]

    a.reset_prefix_cache()
    assert isinstance(a_events[-1], AllBlocksCleared)


def test_eviction_emits_block_removed_and_events_buffer_without_a_callback():
    kv_manager = KVCacheManager(num_blocks=2, block_size=BS)
    blocks = cache_sequence(kv_manager, seq(0, 2))
    (stored,) = kv_manager.drain_events()
    assert kv_manager.drain_events() == []
    kv_manager.alloc_blocks(2)
    removed = kv_manager.drain_events()
    assert [type(e) for e in removed] == [BlockRemoved]
    assert removed[0].block_hashes == stored.block_hashes[::-1]
    assert kv_manager.num_cached_blocks == 0 and blocks


def test_id_index_pins_blocks_until_unregistered():
    kv_manager = KVCacheManager(num_blocks=4, block_size=BS)
    blocks = kv_manager.alloc_blocks(2)
    kv_manager.insert_prefix(seq(0, 1), blocks, 1)
    kv_manager.register_id("session-1", blocks)
    kv_manager.free(blocks)  # the owner is done; the index still holds them
    assert kv_manager.match_by_id("session-1") == blocks
    assert kv_manager.match_by_id("other") is None
    assert all(kv_manager.ref_count(b) == 1 for b in blocks)
    assert kv_manager.alloc_blocks(3) is None  # pinned blocks are never evicted or reused
    assert kv_manager.usage == pytest.approx(0.5)

    kv_manager.register_id("session-1", blocks[:1])  # replacing releases the old pins
    assert kv_manager.ref_count(blocks[0]) == 1 and kv_manager.ref_count(blocks[1]) == 0
    assert kv_manager.unregister_id("session-1") is True
    assert kv_manager.unregister_id("session-1") is False
    assert kv_manager.match_by_id("session-1") is None
    assert kv_manager.usage == 0.0
    assert kv_manager.is_cached(blocks[0])  # still in the prefix cache, now evictable
    assert len(kv_manager.alloc_blocks(4)) == 4


def test_hit_rate_counts_tokens():
    kv_manager = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv_manager.hit_rate == 0.0
    tokens = seq(0, 2)
    cache_sequence(kv_manager, tokens)
    kv_manager.match_by_prefix(tokens + [1, 2])  # 10 queried, 8 hit
    kv_manager.match_by_prefix(seq(300, 1))  # 4 queried, 0 hit
    kv_manager.match_by_prefix(tokens, record=False)
    assert (kv_manager.prefix_queries, kv_manager.prefix_hits) == (14, 8)
    assert kv_manager.hit_rate == pytest.approx(8 / 14)


def test_reset_and_disabled_prefix_caching():
    kv_manager = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = seq(0, 2)
    cache_sequence(kv_manager, tokens)
    held = kv_manager.alloc_blocks(1)
    kv_manager.insert_prefix(seq(40, 1), held, 1)
    kv_manager.reset_prefix_cache()
    assert kv_manager.num_cached_blocks == 0 and kv_manager.num_free_blocks == 3
    assert kv_manager.match_by_prefix(tokens) == []
    kv_manager.free(held)
    assert kv_manager.num_free_blocks == 4  # no longer cached, so it is plainly free

    off = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    blocks = off.alloc_blocks(2)
    off.insert_prefix(tokens, blocks, 2)
    off.free(blocks)
    assert off.num_cached_blocks == 0 and off.num_free_blocks == 4
    assert off.match_by_prefix(tokens) == []


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=BS)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=0)
    kv_manager = KVCacheManager(num_blocks=4, block_size=BS)
    blocks = kv_manager.alloc_blocks(1)
    with pytest.raises(ValueError, match="full blocks"):
        kv_manager.insert_prefix([1, 2, 3], blocks, 1)
    with pytest.raises(ValueError, match="free"):
        kv_manager.insert_prefix(seq(0, 1), [3], 1)  # block 3 was never allocated
