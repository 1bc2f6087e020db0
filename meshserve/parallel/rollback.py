"""Iteration rollback across a TE's ranks (xdeepserve §6.2, Stage 3: fine-grained error handling): which
errors of a step's collectives are transient, and how the ranks agree to run the step again.

A network glitch breaks a collective on every rank that takes part in it: gloo reports the closed or reset
connection (or, on a rank left waiting for a peer, its collective timeout) as a `RuntimeError` from its
transport, NCCL and torch's own network layer as `DistBackendError` / `DistNetworkError`. Those are
transient: the step can be run again once the ranks have new communicators. Anything else is not.

The old communicators cannot carry the agreement, so the ranks meet in the TCPStore the world rendezvoused on
(a TCP server in rank 0's process, apart from the gloo or NCCL connections): round n of a rank publishes
`rollback/n/<rank>` = the step it failed and waits, bounded, until every rank has published. All ranks
failed the same step: each rebuilds its groups and runs the step again. The ranks failed different steps
(one finished the step and failed the next) or one never arrives (dead, or busy elsewhere): the rollback is
abandoned (`RollbackAbandoned`) and the master's recovery (restart the ranks, token recomputation) takes over.
"""
from __future__ import annotations

import re
from datetime import timedelta

import torch.distributed as dist

# what gloo's TCP transport says when a peer's connection goes (closed, reset, a broken pipe) or a
# collective outlasts the group's timeout ("Timed out waiting 10000ms for recv operation to complete")
_GLOO_TRANSIENT = re.compile(r"connection (closed|reset) by peer|broken pipe|timed out", re.IGNORECASE)
# torch's own classes for a failed network or backend (NCCL reports its errors and timeouts as the latter)
_TRANSIENT_CLASSES: tuple[type[BaseException], ...] = (dist.DistNetworkError, dist.DistBackendError)
_KEY_PREFIX = "meshserve/rollback"


def is_transient(exc: BaseException) -> bool:
    """Whether a step that raised `exc` may be rolled back and run again on new communicators."""
    if isinstance(exc, _TRANSIENT_CLASSES):
        return True
    message = str(exc)
    # gloo raises plain RuntimeErrors; its messages name the source file under gloo/transport
    return type(exc) is RuntimeError and "gloo" in message and _GLOO_TRANSIENT.search(message) is not None


class RollbackAbandoned(RuntimeError):
    """The ranks could not agree on a rollback (different steps failed, or a rank did not arrive in time): the
    rank gives up so the master recovers the TE."""


class RollbackAgreement:
    """One rank's side of the rollback rounds, over the world's store. Every rank counts the same rounds, since
    each round either ends in a rollback on every rank or abandons it on every rank that arrived."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, wait_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.wait_s = wait_s  # how long a rank waits for the others (they may still sit in a collective)
        self.round = 0

    def agree(self, step_id: int) -> None:
        """Publish that this rank failed `step_id` and wait for every rank's word; RollbackAbandoned unless all
        of them failed the same step."""
        self.round += 1
        if self.round > 2:  # every rank has read round n - 2 once any rank has finished round n - 1
            self.store.delete_key(self._key(self.round - 2, self.rank))
        keys = [self._key(self.round, rank) for rank in range(self.world_size)]
        try:
            self.store.set(keys[self.rank], str(step_id))
            self.store.wait(keys, timedelta(seconds=self.wait_s))
            steps = [int(value) for value in self.store.multi_get(keys)]
        except dist.DistError as exc:  # a timeout, or the store itself is gone (rank 0 died)
            raise RollbackAbandoned(f"step {step_id}: {self._missing(keys)} did not join the rollback within "
                                    f"{self.wait_s:g} s ({type(exc).__name__}: {exc})") from exc
        if any(step != step_id for step in steps):
            failed = ", ".join(f"rank {rank} step {step}" for rank, step in enumerate(steps))
            raise RollbackAbandoned(f"step {step_id}: the ranks failed different steps ({failed})")

    def _key(self, round_: int, rank: int) -> str:
        return f"{_KEY_PREFIX}/{round_}/{rank}"

    def _missing(self, keys: list[str]) -> str:
        try:
            missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
        except dist.DistError:
            return "the store (rank 0's process)"
        return f"rank(s) {missing}" if missing else "every rank"
