"""DRAM and SSD tiers: LRU by bytes, per-namespace limits, write-through, rebuild, promotion."""
from __future__ import annotations

import os
import threading

import pytest

from meshserve.pool.tiers import DramTier, SsdTier, TieredStore


def _value(tag: int, size: int) -> bytes:
    return bytes([tag % 256]) * size


def test_dram_lru_evicts_least_recently_used_by_bytes():
    tier = DramTier(capacity=300)
    for name in ("a", "b", "c"):
        assert tier.put("ns", name, _value(1, 100))
    assert tier.get("ns", "a") is not None  # a is now the most recent; b the least
    assert tier.put("ns", "d", _value(2, 150))  # needs 150 bytes: evicts b then c
    assert [k for _, k in tier.entries()] == ["a", "d"]
    assert tier.used == 250
    assert not tier.put("ns", "huge", _value(3, 301))  # larger than the whole tier
    assert tier.used == 250
    # replacing a key frees its old bytes first
    assert tier.put("ns", "a", _value(4, 10))
    assert tier.used == 160 and bytes(tier.get("ns", "a")) == _value(4, 10)


def test_dram_namespace_limit_evicts_only_its_own_entries():
    tier = DramTier(capacity=1000)
    tier.set_limits({"tenant": 200})
    assert tier.put("other", "o1", _value(1, 300))
    for i in range(2):
        assert tier.put("tenant", f"t{i}", _value(2, 100))
    assert tier.put("tenant", "t2", _value(3, 100))  # over its 200 bytes: drops its own oldest
    assert ("tenant", "t0") not in tier and ("other", "o1") in tier
    assert tier.namespace_bytes() == {"other": 300, "tenant": 200}
    assert not tier.put("tenant", "big", _value(4, 201))  # never fits its limit
    # shrinking the limit evicts down to it at once, still only that namespace
    tier.set_limits({"tenant": 100})
    assert tier.namespace_bytes() == {"other": 300, "tenant": 100}
    assert ("tenant", "t2") in tier
    # without a limit a namespace may use the whole tier (evicting others only by capacity)
    tier.set_limits({})
    assert tier.put("tenant", "big", _value(5, 600))
    assert tier.used == 1000


def test_ssd_lru_by_bytes_and_files(tmp_path):
    tier = SsdTier(tmp_path, capacity=250)
    for name in ("a", "b"):
        assert tier.put("ns", name, _value(1, 100))
    assert tier.get("ns", "a") == _value(1, 100)
    assert tier.put("ns", "c", _value(2, 100))  # evicts b, the least recently used
    assert ("ns", "b") not in tier and not tier.path_of("ns", "b").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        tier.path_of("ns", k).name for k in ("a", "c"))
    assert tier.delete("ns", "a") and not tier.path_of("ns", "a").exists()
    assert not tier.delete("ns", "a")
    assert tier.used == 100


def test_ssd_namespace_limit_evicts_only_its_own_entries(tmp_path):
    tier = SsdTier(tmp_path, capacity=10_000)
    tier.set_limits({"tenant": 250})
    assert tier.put("other", "o", _value(1, 500))
    for i in range(4):
        assert tier.put("tenant", f"t{i}", _value(i, 100))
    assert [k for ns, k in tier.entries() if ns == "tenant"] == ["t2", "t3"]
    assert ("other", "o") in tier


def test_write_through_and_restart_rebuilds_index_in_lru_order(tmp_path):
    store = TieredStore(dram_bytes=10_000, ssd_dir=tmp_path, ssd_bytes=300)
    for name in ("a", "b", "c"):
        assert store.put("ns", name, _value(ord(name), 100))
    assert store.ssd.path_of("ns", "a").exists()  # written through before the put returns
    assert store.get("ns", "a") == _value(ord("a"), 100)  # a is most recent; b least
    (tmp_path / "stale.blk.tmp-1-1").write_bytes(b"half a write")  # a crash mid-write
    (tmp_path / "junk.blk").write_bytes(b"not a pool entry")
    del store

    restarted = TieredStore(dram_bytes=10_000, ssd_dir=tmp_path, ssd_bytes=300)
    assert restarted.num_keys == 3 and restarted.dram_used == 0
    assert restarted.namespace_bytes() == {"ns": 300}
    assert not (tmp_path / "stale.blk.tmp-1-1").exists() and not (tmp_path / "junk.blk").exists()
    assert restarted.put("ns", "d", _value(ord("d"), 100))  # evicts b, the LRU before the restart
    assert not restarted.exists("ns", "b")
    for name in ("a", "c", "d"):
        assert restarted.get("ns", name) == _value(ord(name), 100)


def test_get_promotes_from_ssd_into_dram(tmp_path):
    store = TieredStore(dram_bytes=200, ssd_dir=tmp_path, ssd_bytes=1000)
    for name in ("a", "b", "c"):
        assert store.put("ns", name, _value(ord(name), 100))
    assert store.dram.entries() == [("ns", "b"), ("ns", "c")]  # a fell out of DRAM only
    assert store.exists("ns", "a") and store.num_keys == 3
    assert store.get("ns", "a") == _value(ord("a"), 100)  # from SSD ...
    assert ("ns", "a") in store.dram and ("ns", "b") not in store.dram  # ... and now in DRAM
    assert store.dram_used == 200 and store.ssd_used == 300


def test_ssd_eviction_and_delete_remove_from_both_tiers(tmp_path):
    store = TieredStore(dram_bytes=1000, ssd_dir=tmp_path, ssd_bytes=200)
    for name in ("a", "b", "c"):
        assert store.put("ns", name, _value(1, 100))
    assert ("ns", "a") not in store.dram and store.get("ns", "a") is None  # SSD evicted it: gone
    assert store.delete("ns", "b") and store.get("ns", "b") is None
    assert not store.delete("ns", "b")
    assert store.dram_used == store.ssd_used == 100
    # a refused put drops an older value instead of serving it
    store.set_namespace_limits({"ns": 150})
    assert not store.put("ns", "c", _value(2, 151))
    assert store.get("ns", "c") is None


def test_store_namespace_limits_hold_across_tiers(tmp_path):
    store = TieredStore(dram_bytes=1000, ssd_dir=tmp_path, ssd_bytes=1000)
    store.set_namespace_limits({"t1": 200})
    assert store.put("t2", "x", _value(1, 400))
    for i in range(5):
        assert store.put("t1", f"k{i}", _value(i, 100))
    assert store.namespace_bytes() == {"t1": 200, "t2": 400}
    assert [store.exists("t1", f"k{i}") for i in range(5)] == [False, False, False, True, True]
    assert store.get("t2", "x") == _value(1, 400)


def test_dram_only_mode_and_memoryview_values():
    store = TieredStore(dram_bytes=100)
    assert store.ssd is None
    backing = bytearray(b"0123456789" * 5)
    assert store.put("ns", "k", memoryview(backing)[10:30])
    assert bytes(store.get("ns", "k")) == b"0123456789" * 2
    assert store.ssd_used == 0 and store.dram_used == 20 and store.num_keys == 1
    assert store.put("ns", "k2", b"x" * 90)  # evicts k by capacity
    assert not store.exists("ns", "k")


def test_store_is_thread_safe(tmp_path):
    store = TieredStore(dram_bytes=4000, ssd_dir=tmp_path, ssd_bytes=8000)
    errors = []

    def worker(tag: int) -> None:
        try:
            for i in range(50):
                store.put("ns", f"{tag}-{i}", _value(tag, 100))
                store.get("ns", f"{tag}-{i // 2}")
                if i % 7 == 0:
                    store.delete("ns", f"{tag}-{i - 1}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert store.ssd_used <= 8000 and store.dram_used <= 4000
    files = [p for p in os.listdir(tmp_path) if p.endswith(".blk")]
    assert len(files) == store.num_keys and store.ssd_used == 100 * store.num_keys


def test_capacity_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        DramTier(0)
    with pytest.raises(ValueError):
        TieredStore(dram_bytes=100, ssd_dir=tmp_path, ssd_bytes=0)


def test_dram_refusing_a_new_value_drops_the_old_one(tmp_path):
    store = TieredStore(dram_bytes=150, ssd_dir=tmp_path, ssd_bytes=1000)
    assert store.put("ns", "k", _value(1, 100))
    assert store.put("ns", "k", _value(2, 200))  # on SSD only: too large for DRAM
    assert ("ns", "k") not in store.dram
    assert store.get("ns", "k") == _value(2, 200)
