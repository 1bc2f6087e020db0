"""The job executor's job table: each attempt gets a new engine id, a late delta of an earlier attempt finds no
job, and a finished job leaves no load behind on its TE."""
from __future__ import annotations

from meshserve.router.jobs import Job, JobTable
from meshserve.router.routing import LoadTracker
from meshserve.wire.sampling_params import SamplingParams


def job(child_id: str = "r-0") -> Job:
    return Job(child_id, "r", SamplingParams(max_tokens=4), [5, 6, 7], 0, 0.0, None)


def test_each_attempt_has_its_own_engine_id_and_the_earlier_one_is_forgotten():
    table, j = JobTable(LoadTracker()), job()
    table.track(j)
    table.new_attempt(j)
    first = j.engine_id
    table.new_attempt(j)
    assert (first, j.engine_id) == ("r-0@1", "r-0@2")
    assert table.get(first) is None and table.get(j.engine_id) is j


def test_jobs_are_found_by_their_te_and_a_finished_one_leaves_no_load():
    loads = LoadTracker()
    table, a, b = JobTable(loads), job("r-0"), job("r-1")
    for j, te in ((a, "te-a"), (b, "te-b")):
        table.track(j)
        table.new_attempt(j)
        j.te = te
        loads.on_dispatch(te, len(j.prompt_token_ids), j.engine_id)
    assert table.on_te("te-a") == [a]
    table.finish(a)
    assert not table.tracks("r-0") and table.get(a.engine_id) is None and table.on_te("te-a") == []
    assert table.is_current(b) and not table.is_current(job("r-1"))  # another object for the same child
    assert loads.load_of("te-a").num_waiting == 0 and loads.load_of("te-b").num_waiting == 1
