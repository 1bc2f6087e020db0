"""The job executor's jobs (deepserve §3): one per choice of a caller request, and where each runs now.

A job keeps its child id for life; each attempt on a TE (a first dispatch, a retry, a migration) gets a new
engine id, "CHILD@ATTEMPT", so a late delta of an earlier attempt is recognised and ignored. `JobTable` finds
a job by either id; like every job structure of the JE it is touched on the event loop's thread only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.router.routing import LoadTracker
from meshserve.wire.client import NO_TENANCY, Tenancy
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.kv import KVTransferParams
from meshserve.wire.sampling_params import SamplingParams


class RouteUnavailableError(EngineDeadError):
    """No TE (or P/D pair) can take the request now (HTTP 503)."""


@dataclass
class Job:
    """One engine-level request (one choice of a caller request) and where it runs now."""

    child_id: str
    parent_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    priority: int
    arrival_time: float
    policy: str | None
    attempt: int = 0
    engine_id: str = ""  # the id the TEs know this attempt by
    stage: str = "colocated"  # colocated | prefill | decode
    te: str = ""  # the TE running the current stage
    decode_te: str = ""  # a disaggregated job's chosen decode TE
    group: str = ""  # ... and its TE group (a replacement decode TE must serve the same model)
    kv_params: KVTransferParams | None = None  # the prefill TE's hand-off, kept for a decode TE that fails
    token_ids: list[int] = field(default_factory=list)  # tokens received so far
    context_cache_id: str | None = None  # a named context cache leading the prompt
    context_cache_ttl_s: float | None = None  # set: this job creates that cache
    tenancy: Tenancy = NO_TENANCY  # its sender and prefix-cache namespace: every leg's AddRequest carries it
    held_since: float | None = None  # time.monotonic() when it started waiting for a TE; None: not held
    hold_limit_s: float = 0.0  # ... and how long it may wait
    first_token_time: float = 0.0  # time.time() of its first token


class JobTable:
    """The live jobs by engine id (the current attempt's) and by child id, and their load on the TEs."""

    def __init__(self, loads: LoadTracker) -> None:
        self.loads = loads
        self._by_engine_id: dict[str, Job] = {}
        self._by_child: dict[str, Job] = {}

    def track(self, job: Job) -> None:
        """A new job, or one taken back after leaving a failed TE: its caller still waits for it."""
        self._by_child[job.child_id] = job

    def new_attempt(self, job: Job) -> None:
        """Give the job the engine id of its next attempt (the previous one's deltas are ignored from now)."""
        job.attempt += 1
        self._by_engine_id.pop(job.engine_id, None)
        job.engine_id = f"{job.child_id}@{job.attempt}"
        self._by_engine_id[job.engine_id] = job

    def get(self, engine_id: str) -> Job | None:
        return self._by_engine_id.get(engine_id)

    def of_child(self, child_id: str) -> Job | None:
        return self._by_child.get(child_id)

    def tracks(self, child_id: str) -> bool:
        """Whether the child's caller still waits for it (not finished, failed or aborted)."""
        return child_id in self._by_child

    def is_current(self, job: Job) -> bool:
        """Whether `job` is still its child's job (not aborted, nor failed with its request's other jobs)."""
        return self._by_child.get(job.child_id) is job

    def on_te(self, te: str) -> list[Job]:
        """The jobs whose current stage runs on TE `te`."""
        return [j for j in self._by_engine_id.values() if j.te == te]

    def finish(self, job: Job) -> None:
        """The job is done here (finished, failed, aborted, or off a failed TE): forget it and its load."""
        self._by_engine_id.pop(job.engine_id, None)
        self._by_child.pop(job.child_id, None)
        self.loads.on_finished(job.te, job.engine_id)
