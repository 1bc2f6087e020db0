"""Storage tiers of a pool server: DRAM (LRU by bytes) over an SSD directory (LRU by bytes).

Both tiers account bytes per namespace and may hold each namespace to a byte limit: a
namespace that would go over its limit evicts its OWN least-recently-used entries, never
another namespace's. Only the tier's total capacity evicts across namespaces (plain LRU).

The store is inclusive: every DRAM entry is also on SSD (write-through), so data survives a
restart and the SSD index is the server's full content. DRAM-only mode (no SSD directory) keeps
everything in memory.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import msgpack

logger = logging.getLogger(__name__)

Value = bytes | bytearray | memoryview
Entry = tuple[str, str]  # (namespace, key)

_MAGIC = b"MSPB"
_HEADER = struct.Struct("<4sI")  # magic, length of the msgpack [namespace, key] that follows
_SUFFIX = ".blk"


def value_size(value: Value) -> int:
    return memoryview(value).nbytes


class LruAccounting:
    """LRU order and byte accounting, total and per namespace, shared by both tiers.

    Subclasses store the data; this class decides what to evict. `_drop` removes an entry's
    data and is called for every eviction.
    """

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"tier capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._sizes: OrderedDict[Entry, int] = OrderedDict()  # least recently used first
        self._by_namespace: dict[str, OrderedDict[str, None]] = {}
        self._namespace_bytes: dict[str, int] = {}
        self._limits: dict[str, int] = {}
        self.on_evict: Callable[[Entry], None] | None = None  # told of every entry this tier drops

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def entries(self) -> list[Entry]:
        return list(self._sizes)

    def namespace_bytes(self) -> dict[str, int]:
        return {ns: used for ns, used in self._namespace_bytes.items() if used}

    def limit_of(self, namespace: str) -> int:
        return min(self.capacity, self._limits.get(namespace, self.capacity))

    def set_limits(self, limits: dict[str, int]) -> list[Entry]:
        """Replace the per-namespace limits (namespaces not named have none); evicts down to them."""
        self._limits = dict(limits)
        evicted = []
        for namespace in list(self._namespace_bytes):
            evicted += self._evict_namespace(namespace, self.limit_of(namespace))
        return evicted

    def touch(self, entry: Entry) -> None:
        self._sizes.move_to_end(entry)
        self._by_namespace[entry[0]].move_to_end(entry[1])

    def fits(self, namespace: str, size: int) -> bool:
        return size <= self.limit_of(namespace)

    def make_room(self, namespace: str, size: int) -> list[Entry]:
        """Evict so that `size` more bytes of `namespace` fit: its own entries first, then any."""
        evicted = self._evict_namespace(namespace, self.limit_of(namespace) - size)
        while self.used + size > self.capacity and self._sizes:
            evicted.append(self._evict(next(iter(self._sizes))))
        return evicted

    def _account(self, entry: Entry, size: int) -> None:
        namespace, key = entry
        self._sizes[entry] = size
        self._by_namespace.setdefault(namespace, OrderedDict())[key] = None
        self._namespace_bytes[namespace] = self._namespace_bytes.get(namespace, 0) + size
        self.used += size

    def _unaccount(self, entry: Entry) -> int:
        namespace, key = entry
        size = self._sizes.pop(entry)
        keys = self._by_namespace[namespace]
        del keys[key]
        self._namespace_bytes[namespace] -= size
        if not keys:
            del self._by_namespace[namespace]
            del self._namespace_bytes[namespace]
        self.used -= size
        return size

    def _evict_namespace(self, namespace: str, allowed: int) -> list[Entry]:
        evicted = []
        while self._namespace_bytes.get(namespace, 0) > max(allowed, 0):
            oldest_key = next(iter(self._by_namespace[namespace]))
            evicted.append(self._evict((namespace, oldest_key)))
        return evicted

    def _evict(self, entry: Entry) -> Entry:
        self._unaccount(entry)
        self._drop(entry)
        if self.on_evict is not None:
            self.on_evict(entry)
        return entry

    def _drop(self, entry: Entry) -> None:
        raise NotImplementedError


class DramTier(LruAccounting):
    """Values in memory. Values are kept as given (bytes or a memoryview over a received frame)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._values: dict[Entry, Value] = {}

    def put(self, namespace: str, key: str, value: Value) -> bool:
        entry, size = (namespace, key), value_size(value)
        self.delete(namespace, key)  # a refused put must not leave the older value behind
        if not self.fits(namespace, size):
            return False
        self.make_room(namespace, size)
        self._values[entry] = value
        self._account(entry, size)
        return True

    def get(self, namespace: str, key: str) -> Value | None:
        entry = (namespace, key)
        value = self._values.get(entry)
        if value is not None:
            self.touch(entry)
        return value

    def delete(self, namespace: str, key: str) -> bool:
        entry = (namespace, key)
        if entry not in self._values:
            return False
        self._evict(entry)
        return True

    def _drop(self, entry: Entry) -> None:
        del self._values[entry]


class SsdTier(LruAccounting):
    """One file per entry in a directory: a header naming the namespace and key, then the value.

    File names hash namespace and key; files are written to a temporary name and renamed, so a
    crash never leaves a half-written entry under a real name. mtimes record the LRU order (set
    on write and on every access), so `rebuild` restores it after a restart.
    """

    def __init__(self, directory: str | os.PathLike, capacity: int):
        super().__init__(capacity)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._last_stamp_ns = 0
        self._temp_counter = 0
        self.rebuild()

    def path_of(self, namespace: str, key: str) -> Path:
        digest = hashlib.sha256(f"{namespace}\0{key}".encode()).hexdigest()
        return self.directory / (digest + _SUFFIX)

    def rebuild(self) -> None:
        """Index the directory: headers give the entries, mtimes their LRU order."""
        found = []
        for path in self.directory.iterdir():
            if not path.name.endswith(_SUFFIX):
                if ".tmp-" in path.name:  # left by a crash mid-write
                    path.unlink(missing_ok=True)
                continue
            try:
                namespace, key, header_len = _read_header(path)
                stat = path.stat()
                if stat.st_size < header_len:
                    raise ValueError("truncated entry")
            except Exception as exc:  # any unreadable file is dropped, never fatal at start-up
                logger.warning("dropping unreadable pool file %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, path.name, namespace, key, stat.st_size - header_len))
        for mtime_ns, _, namespace, key, size in sorted(found):
            self._last_stamp_ns = max(self._last_stamp_ns, mtime_ns)
            self.make_room(namespace, size)  # the capacity or a limit may have shrunk
            self._account((namespace, key), size)

    def put(self, namespace: str, key: str, value: Value) -> bool:
        entry, size = (namespace, key), value_size(value)
        if not self.fits(namespace, size):
            self.delete(namespace, key)  # a refused put must not leave the older value behind
            return False
        if entry in self:
            self._unaccount(entry)  # the rename below replaces the file
        self.make_room(namespace, size)
        path = self.path_of(namespace, key)
        self._temp_counter += 1
        temp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{self._temp_counter}")
        header = msgpack.packb([namespace, key], use_bin_type=True)
        try:
            with open(temp, "wb") as out:
                out.write(_HEADER.pack(_MAGIC, len(header)))
                out.write(header)
                out.write(value)
            os.replace(temp, path)
        except OSError as exc:
            logger.warning("writing %s/%s to SSD failed: %s", namespace, key, exc)
            temp.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            return False
        self._stamp(path)
        self._account(entry, size)
        return True

    def get(self, namespace: str, key: str) -> bytes | None:
        entry = (namespace, key)
        if entry not in self:
            return None
        path = self.path_of(namespace, key)
        try:
            with open(path, "rb") as file:
                magic, header_len = _HEADER.unpack(file.read(_HEADER.size))
                file.seek(header_len, os.SEEK_CUR)
                value = file.read()
        except (OSError, struct.error) as exc:
            logger.warning("reading %s/%s from SSD failed: %s", namespace, key, exc)
            self._evict(entry)
            return None
        self.touch(entry)
        return value

    def touch(self, entry: Entry) -> None:
        super().touch(entry)
        self._stamp(self.path_of(*entry))

    def delete(self, namespace: str, key: str) -> bool:
        entry = (namespace, key)
        if entry not in self:
            return False
        self._evict(entry)
        return True

    def _drop(self, entry: Entry) -> None:
        self.path_of(*entry).unlink(missing_ok=True)

    def _stamp(self, path: Path) -> None:
        # strictly increasing, so the order survives a restart even within one clock tick
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        try:
            os.utime(path, ns=(self._last_stamp_ns, self._last_stamp_ns))
        except OSError:
            pass


def _read_header(path: Path) -> tuple[str, str, int]:
    with open(path, "rb") as file:
        raw = file.read(_HEADER.size)
        if len(raw) != _HEADER.size:
            raise ValueError("truncated header")
        magic, length = _HEADER.unpack(raw)
        if magic != _MAGIC:
            raise ValueError("not a pool entry")
        namespace, key = msgpack.unpackb(file.read(length), raw=False)
    return namespace, key, _HEADER.size + length


class TieredStore:
    """DRAM over SSD, safe to use from several threads.

    put writes through to SSD, then into DRAM; get reads DRAM, else SSD and promotes the value
    into DRAM. The SSD tier holds everything the store holds (an entry evicted from SSD leaves
    DRAM too), so its accounting is the store's; without an SSD directory DRAM is all there is.
    """

    def __init__(self, dram_bytes: int, ssd_dir: str | os.PathLike | None = None, ssd_bytes: int = 0):
        self.dram = DramTier(dram_bytes)
        self.ssd = SsdTier(ssd_dir, ssd_bytes) if ssd_dir else None
        if self.ssd is not None:
            self.ssd.on_evict = lambda entry: self.dram.delete(*entry)  # keeps DRAM a subset of SSD
        self._lock = threading.RLock()

    @property
    def _backing(self) -> LruAccounting:
        return self.ssd if self.ssd is not None else self.dram

    def put(self, namespace: str, key: str, value: Value) -> bool:
        with self._lock:
            if self.ssd is not None:
                stored = self.ssd.put(namespace, key, value)
                if stored:
                    self.dram.put(namespace, key, value)  # DRAM refusing only costs a later SSD read
            else:
                stored = self.dram.put(namespace, key, value)
            if not stored:
                self.delete(namespace, key)  # never serve an older value than the one refused
            return stored

    def get(self, namespace: str, key: str) -> Value | None:
        with self._lock:
            value = self.dram.get(namespace, key)
            if self.ssd is None:
                return value
            if value is not None:
                if (namespace, key) in self.ssd:
                    self.ssd.touch((namespace, key))
                return value
            value = self.ssd.get(namespace, key)
            if value is not None:
                self.dram.put(namespace, key, value)
            return value

    def exists(self, namespace: str, key: str) -> bool:
        with self._lock:
            return (namespace, key) in self._backing

    def delete(self, namespace: str, key: str) -> bool:
        with self._lock:
            in_dram = self.dram.delete(namespace, key)
            return self.ssd.delete(namespace, key) if self.ssd is not None else in_dram

    def set_namespace_limits(self, limits: dict[str, int]) -> None:
        """Per-namespace byte limits on this server, in both tiers; unnamed namespaces have none."""
        with self._lock:
            self.dram.set_limits(limits)
            if self.ssd is not None:
                self.ssd.set_limits(limits)

    def namespace_bytes(self) -> dict[str, int]:
        with self._lock:
            return self._backing.namespace_bytes()

    @property
    def num_keys(self) -> int:
        return len(self._backing)

    @property
    def dram_used(self) -> int:
        return self.dram.used

    @property
    def ssd_used(self) -> int:
        return self.ssd.used if self.ssd is not None else 0
