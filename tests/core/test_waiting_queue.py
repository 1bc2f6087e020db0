"""The DP waiting queue over real schedulers: queue order, placement, aborts and failure."""
from __future__ import annotations

import pytest

from meshserve.core.waiting_queue import DPWaitingQueue, may_hit
from meshserve.wire.errors import QueueFullError
from tests.core.test_scheduler import BS, make_request, make_scheduler, prompt_of


def _queue(num_groups: int = 2, max_waiting: int = 8) -> DPWaitingQueue:
    return DPWaitingQueue([make_scheduler(num_blocks=32) for _ in range(num_groups)], max_waiting, BS)


def test_one_group_takes_a_request_at_once():
    queue = _queue(num_groups=1)
    queue.admit(make_request("a", prompt_of(1, 5)))
    assert queue.pending == [] and queue.schedulers[0].has_unfinished_requests()


def test_requests_wait_in_priority_then_arrival_order():
    queue = _queue()
    for req_id, priority, arrival in (("late", 0, 2.0), ("urgent", -1, 3.0), ("early", 0, 1.0)):
        queue.admit(make_request(req_id, prompt_of(1, 5), priority=priority, arrival_time=arrival))
    assert [r.req_id for r in queue.pending] == ["urgent", "early", "late"]


def test_placement_hands_every_request_to_a_group_and_remembers_it():
    queue = _queue()
    for i in range(4):
        queue.admit(make_request(f"r{i}", prompt_of(i, 6)))
    queue.place()
    assert queue.pending == [] and sorted(queue.owner) == ["r0", "r1", "r2", "r3"]
    assert sorted(r.req_id for r in queue.unfinished()) == ["r0", "r1", "r2", "r3"]
    with pytest.raises(ValueError, match="already in use"):
        queue.admit(make_request("r0", prompt_of(9, 6)))


def test_abort_reaches_the_queue_and_the_owning_group():
    queue = _queue()
    queue.admit(make_request("placed", prompt_of(1, 6)))
    queue.place()
    group = queue.owner["placed"]
    assert queue.schedulers[group].get_request("placed") is not None
    queue.admit(make_request("waiting", prompt_of(2, 6)))
    queue.abort(["placed", "waiting"])
    assert queue.pending == [] and queue.owner == {}
    assert queue.schedulers[group].get_request("placed") is None
    assert queue.unfinished() == []


def test_a_full_queue_refuses_and_failing_empties_it():
    queue = _queue(max_waiting=2)
    queue.admit(make_request("a", prompt_of(1, 5)))
    queue.admit(make_request("b", prompt_of(2, 5)))
    with pytest.raises(QueueFullError):
        queue.admit(make_request("c", prompt_of(3, 5)))
    deltas = queue.fail_all("gone")
    assert [(d.req_id, d.finish_reason, d.error) for d in deltas] == [("a", "error", "gone"), ("b", "error", "gone")]
    assert queue.pending == [] and queue.unfinished() == []


def test_placement_finds_a_cached_prefix_by_matching_only_the_groups_that_may_hold_it(monkeypatch):
    """The request goes to the group whose cache holds its prefix. Only that group is fully matched: the others'
    caches lead with other blocks (or hold nothing), which one lookup of the first block tells."""
    queue = _queue(num_groups=4, max_waiting=16)
    prompt = prompt_of(3, 4 * BS + 1)
    holder = queue.schedulers[2].kv_manager
    blocks = holder.alloc_blocks(4)
    holder.insert_prefix(prompt, blocks, 4)
    holder.free(blocks)  # cached and evictable, as a finished request leaves them
    other = queue.schedulers[1].kv_manager
    other_blocks = other.alloc_blocks(2)
    other.insert_prefix(prompt_of(7, 2 * BS), other_blocks, 2)
    other.free(other_blocks)
    matched = []
    for index, scheduler in enumerate(queue.schedulers):
        full_match = scheduler.match_cached_blocks
        monkeypatch.setattr(scheduler, "match_cached_blocks",
                            lambda req, full_match=full_match, index=index: matched.append(index) or full_match(req))
    queue.admit(make_request("cached", prompt))
    queue.admit(make_request("fresh", prompt_of(11, 3 * BS)))
    queue.place()
    assert queue.owner["cached"] == 2
    assert matched == [2]  # the fresh prompt's first block is no group's, the cached one's only group 2's
    assert all(may_hit(scheduler, make_request("x", prompt), tuple(prompt[:BS])) == (index == 2)
               for index, scheduler in enumerate(queue.schedulers))
