"""Fair scheduling between tenants: the scheduler, on the fake worker, lets a tenant's single request past
another tenant's long backlog, shares starts by tokens, keeps priorities and FCFS within a tenant, and gives
an idle tenant no banked credit."""
from __future__ import annotations

from meshserve.core.fair_queue import FairWaitingQueue
from meshserve.core.waiting_queue import DPWaitingQueue
from meshserve.wire.client import Tenancy
from tests.core.test_scheduler import BS, FakeWorker, make_request, make_scheduler, prompt_of, run_sync


def of_tenant(tenant: str, req_id: str, prompt_len: int = 6, priority: int = 0, arrival: float = 0.0,
              max_tokens: int = 2):
    req = make_request(req_id, prompt_of(len(req_id) + prompt_len, prompt_len), max_tokens=max_tokens,
                       priority=priority, arrival_time=arrival)
    req.tenancy = Tenancy(tenant=tenant)
    return req


def start_order(sched, ex) -> list[str]:
    run_sync(sched, ex)
    return [new.req_id for _, new in ex.new_reqs_seen]


def test_one_request_is_not_starved_by_another_tenant_s_backlog():
    sched, ex = make_scheduler(num_blocks=256, max_num_seqs=1, max_waiting=1000), FakeWorker()
    for i in range(500):
        sched.add_request(of_tenant("noisy", f"n{i}", arrival=float(i)))
    sched.add_request(of_tenant("polite", "p0", arrival=1000.0))
    order = start_order(sched, ex)
    assert order.index("p0") <= 1  # at most one of the backlog's requests before it
    assert [r for r in order if r != "p0"] == [f"n{i}" for i in range(500)]  # FCFS within the tenant


def test_tenants_take_turns_by_tokens():
    sched, ex = make_scheduler(num_blocks=256, max_num_seqs=1), FakeWorker()
    for i in range(4):
        sched.add_request(of_tenant("long", f"l{i}", prompt_len=12, arrival=float(i)))
    for i in range(8):
        sched.add_request(of_tenant("short", f"s{i}", prompt_len=6, arrival=float(i)))
    order = start_order(sched, ex)
    # each long prompt costs two short ones: two shorts start for every long one
    first_six = order[:6]
    assert sum(r.startswith("l") for r in first_six) == 2 and sum(r.startswith("s") for r in first_six) == 4


def test_generated_tokens_are_charged_while_others_wait():
    """VTC's output charge: a tenant whose running request generates tokens falls behind in the queue."""
    queue = FairWaitingQueue()
    reqs = [of_tenant(t, f"{t[0]}{i}") for t in ("chatty", "terse") for i in range(3)]
    for i, req in enumerate(reqs):
        req.queue_key = (0, 1, 0.0, i)
        queue.add(req)
    queue.take(reqs[0])  # c0 starts: "chatty" is charged its 6 prompt tokens
    assert [r.req_id for r in queue.ordered()][:2] == ["t0", "c1"]  # turns by prompt tokens alone
    queue.charge_output("chatty", 9)  # c0 generated 9 tokens: 6 + 2 x 9 = 24, past terse's three prompts
    assert [r.req_id for r in queue.ordered()] == ["t0", "t1", "t2", "c1", "c2"]
    for req in queue.ordered():
        queue.take(req)
    queue.charge_output("chatty", 5)  # nobody waits: nothing to order, nothing kept
    assert queue._served == {}


def test_a_tenant_of_long_answers_starts_less_often():
    sched, ex = make_scheduler(num_blocks=256, max_num_seqs=1), FakeWorker()
    for i in range(4):
        sched.add_request(of_tenant("chatty", f"c{i}", arrival=float(i), max_tokens=12))
        sched.add_request(of_tenant("terse", f"t{i}", arrival=float(i), max_tokens=1))
    order = start_order(sched, ex)
    # equal prompts: by prompt tokens alone they would alternate; chatty's 12 tokens each cost it four turns
    assert order[:5] == ["c0", "t0", "t1", "t2", "t3"]


def test_priority_comes_before_fairness():
    sched, ex = make_scheduler(num_blocks=256, max_num_seqs=1), FakeWorker()
    for i in range(3):
        sched.add_request(of_tenant("a", f"a{i}", priority=0, arrival=float(i)))
    sched.add_request(of_tenant("b", "b-low", priority=5, arrival=0.0))
    sched.add_request(of_tenant("b", "b-high", priority=0, arrival=5.0))
    order = start_order(sched, ex)
    assert order[-1] == "b-low"
    assert order.index("b-high") <= 1


def test_an_idle_tenant_banks_no_credit():
    queue = FairWaitingQueue()
    early = [of_tenant("busy", f"e{i}") for i in range(3)]
    for req in early:
        req.queue_key = (0, 1, 0.0, int(req.req_id[1:]))
        queue.add(req)
    for req in early[:2]:
        queue.take(req)  # "busy" served 12 tokens while "late" was away
    late = [of_tenant("late", f"x{i}") for i in range(3)]
    for i, req in enumerate(late):
        req.queue_key = (0, 1, 1.0, 10 + i)
        queue.add(req)
    order = [r.req_id for r in queue.ordered()]
    # lifted to busy's counter: the late tenant alternates with busy's last request instead of running all first
    assert order.index("e2") <= 1


def test_a_single_tenant_keeps_fcfs_and_the_counters_reset_when_the_queue_empties():
    queue = FairWaitingQueue()
    reqs = [of_tenant("", f"r{i}") for i in range(3)]
    for i, req in enumerate(reversed(reqs)):
        req.queue_key = (0, 1, float(2 - i), i)
        queue.add(req)
    assert [r.req_id for r in queue.ordered()] == ["r0", "r1", "r2"]
    for req in queue.ordered():
        queue.take(req)
    assert len(queue) == 0 and queue._served == {}


def test_the_dp_queue_places_tenants_in_turns():
    queue = DPWaitingQueue([make_scheduler(num_blocks=32) for _ in range(2)], max_waiting=100, block_size=BS)
    for i in range(50):
        queue.admit(of_tenant("noisy", f"n{i}", arrival=float(i)))
    queue.admit(of_tenant("polite", "p0", arrival=100.0))
    order = [r.req_id for r in queue.pending]
    assert order.index("p0") <= 1 and [r for r in order if r != "p0"] == [f"n{i}" for i in range(50)]
    queue.abort(["n0"])  # an abort charges nobody
    remaining = [r.req_id for r in queue.pending]
    assert "n0" not in remaining and remaining.index("p0") <= 1
