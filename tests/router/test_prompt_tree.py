"""The global prompt tree, fed by real RTC events through the wire format the master publishes."""
from __future__ import annotations

import random
import threading

import pytest

from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.router.prompt_tree import GlobalPromptTree
from meshserve.wire import codec
from meshserve.wire.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVCacheEvents, chain_block_hash

BS = 4


def tokens(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


class FakeTE:
    """One TE's DP groups (real RTCs) and the KVCacheEvents batches its master would publish."""

    def __init__(self, name: str, dp_size: int = 1, num_blocks: int = 64) -> None:
        self.name = name
        self.kv_managers = [KVCacheManager(num_blocks=num_blocks, block_size=BS) for _ in range(dp_size)]
        self.seq = 0

    def cache(self, toks: list[int], dp: int = 0) -> None:
        kv_manager = self.kv_managers[dp]
        n = len(toks) // BS
        hit = kv_manager.match_by_prefix(toks, record=False)
        kv_manager.acquire(hit)
        blocks = hit + kv_manager.alloc_blocks(n - len(hit))
        kv_manager.insert_prefix(toks, blocks, n)
        kv_manager.free(blocks)

    def publish(self, dp: int = 0):
        """The drained events as a decoded KVCacheEvents, exactly as a subscriber receives it."""
        self.seq += 1
        batch = KVCacheEvents(seq=self.seq, timestamp=0.0, events=self.kv_managers[dp].drain_events(), dp_rank=dp)
        return codec.decode(codec.encode(batch))


def batch_of(seq: int, *events: KVCacheEvent) -> KVCacheEvents:
    return KVCacheEvents(seq=seq, timestamp=0.0, events=list(events), dp_rank=0)


def test_insert_and_match_whole_blocks_of_the_prefix():
    tree, a, b = GlobalPromptTree(BS), FakeTE("a"), FakeTE("b")
    shared = tokens(0, 2)
    a.cache(shared + tokens(100, 2))
    b.cache(shared)
    assert tree.apply("a", a.publish()) and tree.apply("b", b.publish())

    assert tree.match(shared + tokens(100, 2) + [7, 7]) == {"a": 16, "b": 8}  # the partial block never counts
    assert tree.match(shared + tokens(200, 1)) == {"a": 8, "b": 8}
    assert tree.match(shared[:BS] + [999] * BS) == {"a": 4, "b": 4}
    assert tree.match(tokens(500, 3)) == {}
    assert tree.match(shared[: BS - 1]) == {}  # shorter than one block
    assert tree.num_blocks == 4
    assert tree.holders_count() == {"a": 4, "b": 2}


def test_block_hashes_are_the_rtc_chain_hashes():
    tree, a = GlobalPromptTree(BS), FakeTE("a")
    toks = tokens(0, 2)
    a.cache(toks)
    tree.apply("a", a.publish())
    h0 = chain_block_hash(None, toks[:BS])
    h1 = chain_block_hash(h0, toks[BS:])
    assert tree.blocks_held("a") == {h0, h1}
    assert tree.holders(h1) == {("a", 0)}
    assert tree.state()[h1][0] == h0  # the child hangs under its parent


def test_eviction_removes_the_block_and_its_descendants_and_prunes():
    tree, a = GlobalPromptTree(BS), FakeTE("a", num_blocks=4)
    first = tokens(0, 3)
    a.cache(first)
    tree.apply("a", a.publish())
    assert tree.match(first) == {"a": 12}
    a.cache(tokens(100, 2))  # needs 2 blocks out of 1 free: evicts the LRU leaf of `first`
    assert tree.apply("a", a.publish())
    assert tree.match(first) == {"a": 8}
    assert tree.match(tokens(100, 2)) == {"a": 8}
    assert tree.num_blocks == 4  # the evicted node is gone, not kept unheld

    batch = batch_of(a.seq + 1, BlockRemoved(block_hashes=sorted(tree.blocks_held("a"))))
    assert tree.apply("a", batch)
    assert tree.match(first) == {} and tree.num_blocks == 0


def test_removing_a_parent_still_held_child_stops_the_match_there():
    tree = GlobalPromptTree(BS)
    toks = tokens(0, 3)
    h: list[int] = []
    for i in range(3):
        h.append(chain_block_hash(h[-1] if h else None, toks[i * BS : (i + 1) * BS]))
    stored = BlockStored(block_hashes=h, parent_block_hash=None, token_ids=toks, block_size=BS)
    tree.apply("a", batch_of(1, stored))
    tree.apply("b", batch_of(1, stored))
    tree.apply("a", batch_of(2, BlockRemoved(block_hashes=[h[1]])))
    assert tree.match(toks) == {"a": 4, "b": 12}  # a keeps block 2 but not the prefix leading to it
    assert tree.num_blocks == 3
    tree.remove_te("b")
    assert tree.match(toks) == {"a": 4}
    assert tree.num_blocks == 3  # block 1 is held by nobody but still carries a's block 2
    tree.apply("a", batch_of(3, BlockRemoved(block_hashes=[h[2]])))
    assert tree.num_blocks == 1  # block 2 went, and block 1 with it
    assert tree.holders(h[1]) == frozenset()


def test_all_blocks_cleared_forgets_that_dp_group_only():
    tree, a, b = GlobalPromptTree(BS), FakeTE("a", dp_size=2), FakeTE("b")
    a.cache(tokens(0, 2), dp=0)
    a.cache(tokens(0, 1), dp=1)
    b.cache(tokens(0, 2))
    for batch in (a.publish(0), a.publish(1)):
        assert tree.apply("a", batch)
    tree.apply("b", b.publish())
    a.kv_managers[0].reset_prefix_cache()
    assert tree.apply("a", a.publish(0))
    assert tree.match(tokens(0, 2)) == {"a": 4, "b": 8}  # dp 1 still holds the first block
    assert tree.blocks_held("a", 0) == set()


def test_two_dp_groups_report_the_best_group():
    tree, a = GlobalPromptTree(BS), FakeTE("a", dp_size=2)
    a.cache(tokens(0, 1), dp=0)
    a.cache(tokens(0, 3), dp=1)
    tree.apply("a", a.publish(0))
    tree.apply("a", a.publish(1))
    assert tree.match(tokens(0, 3)) == {"a": 12}
    assert tree.holders(chain_block_hash(None, tokens(0, 1))) == {("a", 0), ("a", 1)}
    # the groups' caches are separate: dp 0 losing the block does not touch dp 1
    a.kv_managers[1].reset_prefix_cache()
    tree.apply("a", a.publish(1))
    assert tree.match(tokens(0, 3)) == {"a": 4}


def test_a_seq_gap_is_refused_and_changes_nothing():
    tree, a = GlobalPromptTree(BS), FakeTE("a")
    a.seq = 41  # the first batch is taken whatever its seq
    a.cache(tokens(0, 1))
    assert tree.apply("a", a.publish())
    assert tree.last_seq("a") == 42
    a.cache(tokens(100, 1))
    lost = a.publish()  # seq 43 never arrives
    a.cache(tokens(200, 1))
    assert not tree.apply("a", a.publish())
    assert tree.match(tokens(200, 1)) == {}
    assert not tree.apply("a", batch_of(42))  # a replay is refused too
    assert tree.apply("a", lost)
    assert tree.match(tokens(100, 1)) == {"a": 4}


def test_a_foreign_block_size_is_an_error_not_a_silent_mismatch():
    tree = GlobalPromptTree(BS)
    stored = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[0] * 8, block_size=8)
    with pytest.raises(ValueError, match="8 tokens"):
        tree.apply("a", batch_of(1, stored))
    assert tree.num_blocks == 0 and tree.last_seq("a") is None


def test_snapshot_replaces_what_was_known():
    tree, a = GlobalPromptTree(BS), FakeTE("a")
    a.cache(tokens(0, 2))
    tree.apply("a", a.publish())
    new = tokens(300, 2)
    h0 = chain_block_hash(None, new[:BS])
    h1 = chain_block_hash(h0, new[BS:])
    tree.load_snapshot("a", 17, {0: [[h0, None, new[:BS]], [h1, h0, new[BS:]]], 1: [[h0, None, new[:BS]]]})
    assert tree.match(tokens(0, 2)) == {}
    assert tree.match(new) == {"a": 8}
    assert tree.blocks_held("a", 1) == {h0}
    assert tree.num_blocks == 2 and tree.last_seq("a") == 17
    assert not tree.apply("a", batch_of(17))
    assert tree.apply("a", batch_of(18, AllBlocksCleared()))
    assert tree.match(new) == {"a": 4}  # dp 1 keeps its block


def test_snapshot_from_an_rtc_rebuilds_the_view_events_built():
    a = FakeTE("a", dp_size=2)
    a.cache(tokens(0, 3), dp=0)
    a.cache(tokens(0, 1) + tokens(100, 1), dp=0)
    a.cache(tokens(500, 2), dp=1)
    by_events = GlobalPromptTree(BS)
    by_events.apply("a", a.publish(0))
    by_events.apply("a", a.publish(1))
    by_snapshot = GlobalPromptTree(BS)
    by_snapshot.load_snapshot("a", a.seq, {dp: kv_manager.snapshot() for dp, kv_manager in enumerate(a.kv_managers)})
    assert by_snapshot.state() == by_events.state() and by_snapshot.num_blocks == 6


def test_remove_te_and_rejoin():
    tree, a = GlobalPromptTree(BS), FakeTE("a")
    a.cache(tokens(0, 2))
    tree.apply("a", a.publish())
    tree.remove_te("a")
    assert tree.match(tokens(0, 2)) == {} and tree.num_blocks == 0 and tree.last_seq("a") is None
    assert tree.apply("a", batch_of(1))  # a restarted TE starts over


def test_two_replicas_fed_the_same_events_agree():
    rng = random.Random(0)
    tes = [FakeTE(f"te{i}", dp_size=2, num_blocks=12) for i in range(3)]
    prefixes = [tokens(1000 * i, 3) for i in range(4)]
    replicas = [GlobalPromptTree(BS), GlobalPromptTree(BS)]
    for _ in range(60):
        te = rng.choice(tes)
        dp = rng.randrange(2)
        if rng.random() < 0.05:
            te.kv_managers[dp].reset_prefix_cache()
        else:
            head = rng.choice(prefixes)[: BS * rng.randint(1, 3)]
            te.cache(head + tokens(rng.randrange(50) * 10_000, rng.randint(0, 2)), dp)
        batch = te.publish(dp)
        for tree in replicas:
            assert tree.apply(te.name, batch)
    a, b = replicas
    assert a.state() == b.state() and a.num_blocks > 0
    for p in prefixes:
        assert a.match(p) == b.match(p)
        # and the tree agrees with the TEs' own caches
        want = {te.name: max(len(r.match_by_prefix(p, record=False)) * BS for r in te.kv_managers) for te in tes}
        assert a.match(p) == {k: v for k, v in want.items() if v}


def test_matching_while_events_arrive_on_another_thread():
    tree, a = GlobalPromptTree(BS), FakeTE("a", num_blocks=256)
    batches = []
    for i in range(100):
        a.cache(tokens(0, 2) + tokens(10_000 + 100 * i, 1))
        batches.append(a.publish())

    applied = []

    def feed():
        for batch in batches:
            applied.append(tree.apply("a", batch))

    thread = threading.Thread(target=feed)
    thread.start()
    for _ in range(200):
        assert tree.match(tokens(0, 2)).get("a", 8) == 8
    thread.join()
    assert applied == [True] * len(batches)
    assert tree.match(tokens(0, 2) + tokens(10_000 + 9900, 1)) == {"a": 12}
