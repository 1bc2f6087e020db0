"""The TE's prefix-cache events, published for routers (prefix-aware routing).

Each DP group's KV cache manager records the blocks it caches and evicts; after every step the master
publishes them, numbered, on a PUB socket that routers subscribe to (`kv_events_endpoint`); a router that
misses a number asks for a snapshot (the `kv.snapshot` admin operation). New ranks start with empty
caches: the routers are told to forget every block of the TE. Without an endpoint nothing is published.
"""
from __future__ import annotations

import time

import zmq

from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.kv import AllBlocksCleared, KVCacheEvents


class KVEventPublisher:
    def __init__(self, ctx: zmq.Context, endpoint: str, engine: str) -> None:
        self.engine = engine
        self.seq = 0  # the number of the last batch published
        self.addr = ""  # where routers subscribe: the endpoint as bound
        self._socket: zmq.Socket | None = None
        if endpoint:
            self._socket = ctx.socket(zmq.PUB)
            self._socket.setsockopt(zmq.LINGER, 0)
            cluster_auth.server(self._socket, endpoint)  # cached prompts are users' data
            self._socket.bind(endpoint)
            # a wildcard port ("tcp://host:*") is chosen by the bind itself, so no other process can take
            # it between choosing and binding
            self.addr = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, group: int, events: list) -> None:
        """One DP group's cache events of a step (nothing is sent for none)."""
        if events and self._socket is not None:
            self._send(group, events)

    def publish_cleared(self, num_groups: int, first_group: int = 0) -> None:
        """The new ranks' KV caches start empty: routers forget what this TE (or this self-contained DP group,
        `first_group` its index) had cached."""
        if self._socket is not None:
            for group in range(first_group, first_group + num_groups):
                self._send(group, [AllBlocksCleared()])

    def _send(self, group: int, events: list) -> None:
        self.seq += 1
        self._socket.send(codec.encode(KVCacheEvents(seq=self.seq, timestamp=time.time(), dp_rank=group,
                                                     engine=self.engine, events=events)))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
