"""The worker half of a KV connector: one rank's end of remote KV (memory pool, prefill -> decode).

Every rank of a DP group applies the same metadata at the same step boundary (`start_load_kv`: start
this step's loads and stores), lets them run in the background while it keeps stepping, and reports
what finished (`get_finished`); the scheduler half (`meshserve.core.kv_connector`) gathers the reports
of the group's ranks. The shape of vLLM's `KVConnectorBase_V1` worker side, at step granularity.
"""
from __future__ import annotations

from collections.abc import Callable

from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport


class KVConnectorWorker:
    """Worker half of a KV connector, one per rank."""

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Start this step's loads and stores (before the step's forward)."""

    def get_finished(self, report: KVConnectorReport) -> None:
        """Add the work that finished since the last call to `report`."""

    @property
    def busy(self) -> bool:
        """Background work is in flight: the rank reports promptly even when no step comes."""
        return False

    def wake_with(self, wake: Callable[[], None]) -> None:
        """Call `wake` (from any thread) when background work ends, so that the rank's loop, waiting for its next
        step, reports it at once (a connector without background threads never needs to)."""

    def close(self) -> None:
        """Let go of what it holds (shared memory, sockets)."""
