"""The memory pool's KV blocks on virtual time, for the served pool connector (meshserve/core/kv_connector/pool.py).

Every simulated TE with the pool (`simulate run --kv-pool`) runs the connector the engine runs: it keys a waiting
prompt's blocks, asks the pool which leading ones it holds, fetches those beyond its local prefix-cache hit when
fetching pays (the served `FetchCostModel`, learning the prefill rate from the TE's own steps), and stores the
blocks it computed for the other TEs. The pool here is what they share: the set of keys stored, answered at once
(its round trip is in the fetch's time), with room for every block. A fetch lands the pool's latency plus its
blocks' KV over the TE's KV link after the step that ordered it.
"""
from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future

from meshserve.pool.context_keys import rank_key


class SimPool:
    """The keys the simulated TEs stored, shared by every TE of a deployment."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def exists_async(self, namespace: str, keys: list[str]) -> Future:
        """`PoolLookup`: which of `keys` the pool holds, answered at once."""
        answer: Future = Future()
        answer.set_result([key in self.keys for key in keys])
        return answer

    def store(self, block_keys: Iterable[str]) -> None:
        """A TE's ranks stored these blocks (one rank per DP group: their whole KV)."""
        self.keys.update(rank_key(key, 0, 1) for key in block_keys)
