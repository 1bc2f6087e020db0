"""The scheduler half of a KV connector: how remote KV (memory pool, prefill -> decode) enters the scheduler.

The shape of vLLM's KV connector (`KVConnectorBase_V1`), on step boundaries: the scheduler asks each
connector how many of a waiting request's tokens it can load beyond the local prefix-cache hit
(`get_num_new_matched_tokens`), allocates the blocks and tells it (`update_state_after_alloc`); the
request then waits in `WAITING_FOR_REMOTE_KV` while the ranks load in the background. Each step the
connector's orders go to the ranks as typed metadata (`build_connector_meta`); the ranks' reports come back
(`update_connector_output`) and name the loads that ended. A request leaving the scheduler is offered to
the connectors (`request_finished`), which may take over its blocks (a prefill TE's hold). The worker
halves live in `meshserve.worker.kv_connector`.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.core.request import Request
from meshserve.wire.client import EngineStats
from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport, KVTransferParams


@dataclass(frozen=True)
class FinishedLoad:
    """A background load every rank of the DP group has finished (or given up on)."""

    req: Request
    num_loaded_tokens: int  # leading tokens past the local hit whose KV arrived; fewer than ordered: computed
    num_cached_tokens: int | None = None  # what the request reports as cached (default: every token not computed)


class KVConnectorScheduler:
    """Scheduler half of a KV connector, one per DP group. Every hook has a do-nothing default."""

    # whether the blocks for a load may be had by preempting lower-ranked running requests (else it waits)
    may_preempt: bool = True

    def get_num_new_matched_tokens(self, req: Request, num_local_tokens: int) -> int | None:
        """Tokens of `req` past its `num_local_tokens` (prefix-cache hit) this connector loads in the
        background; 0: none; None: not known yet (a lookup is in flight; the request waits, others go first)."""
        return 0

    def update_state_after_alloc(self, req: Request, num_local_tokens: int, num_external_tokens: int) -> None:
        """The blocks of `req` are allocated: order the load of `num_external_tokens` after `num_local_tokens`."""

    def build_connector_meta(self, meta: KVConnectorMetadata) -> None:
        """Add the orders not yet sent to this step's metadata."""

    def update_connector_output(self, report: KVConnectorReport) -> list[FinishedLoad]:
        """Take one rank's report; the loads every rank of the DP group has now finished."""
        return []

    def on_blocks_ready(self, req: Request, num_full_blocks: int) -> None:
        """The first `num_full_blocks` full blocks of `req` hold computed KV (a step returned)."""

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step computed `num_tokens` tokens in `seconds`."""

    def request_finished(self, req: Request) -> KVTransferParams | None:
        """`req` leaves the scheduler (its status says why). Params: this connector took over `req.block_ids`
        (the scheduler must not free them) and the caller gets the params."""
        return None

    def release(self, req_id: str) -> bool:
        """Free what this connector holds for `req_id` (its KV was pulled, or never will be)."""
        return False

    def expire(self, now: float | None = None) -> list[str]:
        """Free holds past their deadline; the requests freed."""
        return []

    @property
    def busy(self) -> bool:
        """A lookup is in flight on another thread: the master looks again soon."""
        return False

    def fill_stats(self, stats: EngineStats) -> None:
        """Add this connector's counters to the DP group's stats."""

    def close(self) -> None:
        """Let go of outside resources."""
