"""Jobs no TE can take now, held until one can (scaling from zero; a dead TE the cluster manager restarts).

With `hold_s` > 0 a new job no TE can take waits, not refused, until a TE that can take it registers (its
pool was scaled to zero and comes back), then goes out in arrival order; a job off a failed TE that no
other TE can take waits up to `migrate_deadline_s` the same way. One held longer than its limit fails as
an unroutable one does (503). The cluster manager learns from the JE's reports which pools the held jobs
wait for (`waiting_for_pools`) and starts their TEs.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from meshserve.router.dispatch import Dispatcher
from meshserve.router.engine_registry import EngineRegistry
from meshserve.router.jobs import Job, JobTable, RouteUnavailableError
from meshserve.router.routing import ANY_POOL, NoRouteError, pool_key

logger = logging.getLogger(__name__)

FailRequest = Callable[[str, Exception], None]  # (child id, the error its caller sees)


class HeldJobs:
    def __init__(self, jobs: JobTable, registry: EngineRegistry, dispatcher: Dispatcher, fail: FailRequest,
                 hold_s: float) -> None:
        """`hold_s`: how long a job may wait unless `hold` is given another limit."""
        self.jobs, self.registry, self.dispatcher, self.fail = jobs, registry, dispatcher, fail
        self.hold_s = hold_s
        self._held: deque[Job] = deque()  # oldest first (some may be aborted since)

    @property
    def pending(self) -> bool:
        """Whether any job is held (some may have been aborted since)."""
        return bool(self._held)

    def hold(self, job: Job, why: str, limit_s: float | None = None) -> None:
        """Keep a job no TE can take until one can, at most `limit_s` (default hold_s)."""
        if job.held_since is None:
            job.held_since = time.monotonic()
        job.hold_limit_s = self.hold_s if limit_s is None else limit_s
        if not self._held:
            logger.info("holding requests until a TE can take them (at most %g s): %s", job.hold_limit_s, why)
        self._held.append(job)

    def serve(self, now: float) -> None:
        """Dispatch the held jobs a TE can take now, oldest first; fail those held past their limit."""
        held, self._held = self._held, deque()
        can_route = bool(self.registry.routable())
        for job in held:
            if not self.jobs.is_current(job):
                continue  # aborted, or failed with its request's other jobs
            try:
                if not can_route:
                    raise NoRouteError("no TE takes requests")
                if job.token_ids:
                    self.dispatcher.dispatch_resume(job)
                else:
                    self.dispatcher.dispatch(job)
            except NoRouteError as exc:
                self._keep_or_fail(job, now, exc)
                continue
            logger.info("request %s went to TE %s after waiting %.1f s for one", job.child_id, job.te,
                        now - job.held_since)
            job.held_since = None

    def _keep_or_fail(self, job: Job, now: float, exc: NoRouteError) -> None:
        if now - job.held_since < job.hold_limit_s:
            self._held.append(job)
        else:
            self.fail(job.child_id, RouteUnavailableError(
                f"no TE could take the request within {job.hold_limit_s:g} s: {exc}"))

    def live(self) -> list[Job]:
        """The held jobs whose callers still wait."""
        return [j for j in self._held if self.jobs.is_current(j)]

    def waiting_for_pools(self) -> list[str]:
        """The pools a held job waits for: those of the groups seen that have no TE taking requests now, or
        ANY_POOL when this JE cannot tell (it has never seen a TE)."""
        seen = {pool_key(r.heartbeat.group, r.role) for r in self.registry.tes.values()}
        serving = {pool_key(r.heartbeat.group, r.role) for r in self.registry.routable()}
        return sorted(seen - serving) or [ANY_POOL]
