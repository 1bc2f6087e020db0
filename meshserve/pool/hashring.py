"""Consistent hashing with virtual nodes: which pool server owns a key.

Every server gets `virtual_nodes` points on a 64-bit ring (blake2b of "server#i", stable
across processes and Python versions, unlike `hash`). A key belongs to the first point at or
after its own hash, so adding or removing a server moves only the keys of the arcs it gains or
loses; every other key keeps its owner.
"""
from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable

DEFAULT_VIRTUAL_NODES = 64


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, servers: Iterable[str] = (), virtual_nodes: int = DEFAULT_VIRTUAL_NODES):
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        self._servers: set[str] = set()
        self._points: list[int] = []   # sorted ring positions
        self._owners: list[str] = []   # server of each position
        for server in servers:
            self.add(server)

    @property
    def servers(self) -> frozenset[str]:
        return frozenset(self._servers)

    def __len__(self) -> int:
        return len(self._servers)

    def __contains__(self, server: str) -> bool:
        return server in self._servers

    def add(self, server: str) -> None:
        if server in self._servers:
            return
        self._servers.add(server)
        for i in range(self.virtual_nodes):
            point = stable_hash(f"{server}#{i}")
            at = bisect.bisect_left(self._points, point)
            # Ties (vanishingly rare) are broken by server id so the ring never depends on insertion order.
            while at < len(self._points) and self._points[at] == point and self._owners[at] < server:
                at += 1
            self._points.insert(at, point)
            self._owners.insert(at, server)

    def remove(self, server: str) -> None:
        if server not in self._servers:
            return
        self._servers.discard(server)
        kept = [(p, s) for p, s in zip(self._points, self._owners) if s != server]
        self._points = [p for p, _ in kept]
        self._owners = [s for _, s in kept]

    def owner(self, key: str) -> str | None:
        """The server that holds `key`; None on an empty ring."""
        if not self._points:
            return None
        at = bisect.bisect_left(self._points, stable_hash(key)) % len(self._points)
        return self._owners[at]

    def owners(self, key: str, n: int) -> list[str]:
        """Up to `n` distinct servers for `key` walking the ring clockwise (the first is `owner(key)`),
        for replicas."""
        if not self._points or n < 1:
            return []
        found: list[str] = []
        start = bisect.bisect_left(self._points, stable_hash(key))
        for step in range(len(self._points)):
            server = self._owners[(start + step) % len(self._points)]
            if server not in found:
                found.append(server)
                if len(found) == min(n, len(self._servers)):
                    break
        return found
