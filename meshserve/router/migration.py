"""Moving jobs off a TE that failed or is recovering its ranks (request migration, xdeepserve §6.2).

A failed TE's jobs without tokens are routed again; those that streamed tokens continue on another TE from
their prompt plus those tokens (token recomputation; a handed-off job on another decode TE of its group,
which pulls the prompt's KV when it can); a job no TE can take now is held for one (the cluster manager
restarts the dead TE) up to `migrate_deadline_s`. A colocated job tried on `max_attempts` TEs fails.
A TE restarting its ranks keeps its jobs and continues them when it is back; those another TE can take
now move there instead (sooner).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from meshserve.router.dispatch import Dispatcher
from meshserve.router.engine_registry import EngineRecord, EngineRegistry
from meshserve.router.held_jobs import HeldJobs
from meshserve.router.jobs import Job, JobTable, RouteUnavailableError
from meshserve.router.routing import NoRouteError
from meshserve.wire.client import AbortRequests

logger = logging.getLogger(__name__)

FailJob = Callable[[Job, str], None]  # (the job, the error its caller sees)


class Migration:
    def __init__(self, registry: EngineRegistry, jobs: JobTable, dispatcher: Dispatcher, held: HeldJobs,
                 fail_job: FailJob, max_attempts: int, deadline_s: float) -> None:
        self.registry, self.jobs, self.dispatcher, self.held = registry, jobs, dispatcher, held
        self.fail_job = fail_job
        self.max_attempts, self.deadline_s = max_attempts, deadline_s
        self.migrated = 0  # jobs moved off a failed or recovering TE

    def drop_te(self, record: EngineRecord, why: str) -> None:
        """Drop a TE and move its jobs."""
        self.registry.drop(record, why)
        for job in self.jobs.on_te(record.name):
            self._migrate(job, record.name, why)

    def move_off_recovering(self, record: EngineRecord, why: str) -> None:
        """Move the jobs of a TE restarting its ranks that another TE can take now; the recovering TE is told
        to drop its copy of those."""
        moved = []
        for job in self.jobs.on_te(record.name):
            old_id = self._move_while_recovering(job, record.name)
            if old_id is not None:
                moved.append(old_id)
        if moved:
            logger.warning("moved %d request(s) off TE %s while it recovers (%s)", len(moved), record.name, why)
            self.dispatcher.send(record, AbortRequests(req_ids=moved))

    def _move_while_recovering(self, job: Job, te: str) -> str | None:
        """The engine id the job had on the recovering TE `te` if it moved, None if it stays there."""
        old_id, stage = job.engine_id, job.stage
        try:
            if job.token_ids:
                self.dispatcher.dispatch_resume(job, exclude={te})
            else:
                self.dispatcher.dispatch(job, exclude={te})
        except NoRouteError:
            return None  # it stays: the TE continues it after its recovery
        if stage == "decode":
            self.dispatcher.release_prefill_hold(job)
        self.jobs.loads.on_finished(te, old_id)
        self.migrated += 1
        return old_id

    def _migrate(self, job: Job, dead_te: str, why: str) -> None:
        try:
            self._redispatch(job, dead_te, why)
        except RouteUnavailableError as exc:
            self.fail_job(job, str(exc))
            return
        except NoRouteError as exc:
            self.jobs.finish(job)  # off the dead TE; held until another can take it
            self.jobs.track(job)
            job.te = job.decode_te = ""
            job.stage = "colocated"
            self.held.hold(job, f"TE {dead_te} failed ({why}) and {exc}", self.deadline_s)
            return
        self.migrated += 1
        logger.warning("request %s moved off TE %s to %s with %d token(s) so far", job.child_id, dead_te, job.te,
                       len(job.token_ids))

    def _redispatch(self, job: Job, dead_te: str, why: str) -> None:
        """Send the job on from where it is; NoRouteError when no TE can take it now, RouteUnavailableError
        when it must fail."""
        if job.stage == "decode":
            try:
                self.dispatcher.dispatch_decode(job, exclude={dead_te}, recompute=True)
            except NoRouteError:
                self.dispatcher.release_prefill_hold(job)  # nobody will pull the prompt's KV now
                self.dispatcher.dispatch_resume(job, exclude={dead_te})
        elif job.token_ids:
            self.dispatcher.dispatch_resume(job, exclude={dead_te})
        elif job.attempt < self.max_attempts:
            self.dispatcher.dispatch(job, exclude={dead_te})
        else:
            raise RouteUnavailableError(f"TE {dead_te} failed while serving the request ({why}), "
                                        f"and {job.attempt} TEs have tried it")
