"""Named context caches in the scheduler and the RTC (deepserve MatchByID).

Driven by test_scheduler's fake worker, whose fake KV cache holds a fingerprint of the token
history at every slot and checks it before each step: reusing a pinned block whose KV does not
belong to the prompt fails the run, and outputs are checked against the oracle.
"""
from __future__ import annotations

import pytest

from meshserve.core.admission import set_context_cache
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.request import Request
from meshserve.wire import codec
from meshserve.wire.client import AddRequest
from tests.core.test_scheduler import (
    BS,
    FakeWorker,
    expected_outputs,
    make_request,
    make_scheduler,
    prompt_of,
    run_sync,
)

CACHE = "ctxc-test"
PREFIX = prompt_of(3, 5 * BS + 2)  # 5 full blocks and 2 tokens over
FULL_BLOCKS = len(PREFIX) // BS


def create(sched, ex, cache_id: str = CACHE, ttl_s: float = 60.0, prompt: list[int] = PREFIX) -> None:
    """The API's creation request: one token, prompt pinned under the id."""
    req = make_request(f"create-{cache_id}", prompt, max_tokens=1)
    req.context_cache_id, req.context_cache_ttl_s = cache_id, ttl_s
    sched.add_request(req)
    run_sync(sched, ex)


def use(sched, ex, req_id: str, suffix: list[int], cache_id: str | None = CACHE, prefix: list[int] = PREFIX,
        max_tokens: int = 4):
    """A request whose prompt is the cached prefix plus `suffix`; its outputs checked against the oracle."""
    req = make_request(req_id, prefix + suffix, max_tokens=max_tokens)
    req.context_cache_id = cache_id
    sched.add_request(req)
    run = run_sync(sched, ex)
    assert run.outputs[req_id] == expected_outputs(prefix + suffix, max_tokens)
    return run.finish[req_id]


def test_creation_pins_the_prompts_full_blocks():
    sched, ex = make_scheduler(num_blocks=32), FakeWorker()
    create(sched, ex)
    pinned = sched.kv_manager.match_by_id(CACHE)
    assert len(pinned) == FULL_BLOCKS
    assert all(sched.kv_manager.ref_count(b) == 1 for b in pinned)  # the id's own reference: the request is gone
    assert sched.kv_manager.num_evictable_blocks == 0  # pinned cached blocks are not evictable
    assert sched.context_caches[CACHE].token_ids == PREFIX[:FULL_BLOCKS * BS]


def test_a_request_naming_the_id_reuses_the_pinned_blocks_without_prefix_caching():
    sched, ex = make_scheduler(num_blocks=32, prefix_caching=False), FakeWorker()
    create(sched, ex)
    done = use(sched, ex, "with-id", prompt_of(9, 7))
    assert done.num_cached_tokens == FULL_BLOCKS * BS
    # the same prompt without the id: prefix caching is off, so nothing is reused
    assert use(sched, ex, "without-id", prompt_of(9, 7), cache_id=None).num_cached_tokens == 0


def test_pinned_blocks_survive_lru_pressure_that_evicts_a_plain_prefix():
    sched, ex = make_scheduler(num_blocks=16, max_num_seqs=2), FakeWorker()
    create(sched, ex)
    other = prompt_of(11, 4 * BS + 1)
    use(sched, ex, "plain", [], cache_id=None, prefix=other)  # cached in the tree only
    for i in range(12):  # fill the pool again and again with unrelated prompts
        use(sched, ex, f"pressure-{i}", [], cache_id=None, prefix=prompt_of(100 + i, 6 * BS + 1))
    assert use(sched, ex, "plain-again", [], cache_id=None, prefix=other).num_cached_tokens == 0
    assert use(sched, ex, "after", prompt_of(12, 3)).num_cached_tokens == FULL_BLOCKS * BS


def test_a_prompt_that_is_exactly_the_prefix_still_computes_its_last_token():
    prefix = prompt_of(4, 3 * BS)  # a whole number of blocks
    sched, ex = make_scheduler(num_blocks=32, prefix_caching=False), FakeWorker()
    create(sched, ex, prompt=prefix)
    assert len(sched.kv_manager.match_by_id(CACHE)) == 3
    assert use(sched, ex, "same", [], prefix=prefix).num_cached_tokens == 2 * BS


def test_only_leading_blocks_that_match_the_prompt_are_reused():
    sched, ex = make_scheduler(num_blocks=32, prefix_caching=False), FakeWorker()
    create(sched, ex)
    diverging = PREFIX[:2 * BS] + [t + 1 for t in PREFIX[2 * BS:]]  # differs from the third block on
    assert use(sched, ex, "diverging", [1, 2], prefix=diverging).num_cached_tokens == 2 * BS


def test_an_unknown_id_falls_back_to_prefix_matching():
    sched, ex = make_scheduler(num_blocks=32), FakeWorker()
    use(sched, ex, "warm", [], cache_id=None, prefix=PREFIX)
    assert use(sched, ex, "unknown", [5], cache_id="ctxc-never-made").num_cached_tokens == FULL_BLOCKS * BS


def test_delete_and_expiry_unpin():
    sched, ex = make_scheduler(num_blocks=32, prefix_caching=False), FakeWorker()
    create(sched, ex)
    create(sched, ex, cache_id="ctxc-short", ttl_s=5.0, prompt=prompt_of(5, 3 * BS))
    assert sched.kv_manager.usage == (FULL_BLOCKS + 3) / 32
    assert sched.drop_context_cache(CACHE) is True
    assert sched.drop_context_cache(CACHE) is False
    assert sched.kv_manager.match_by_id(CACHE) is None
    assert use(sched, ex, "after-delete", [7]).num_cached_tokens == 0
    assert sched.expire_context_caches() == []  # not yet
    assert sched.expire_context_caches(now=float("inf")) == ["ctxc-short"]
    assert sched.context_caches == {} and sched.kv_manager.usage == 0.0


def test_deleting_a_cache_while_it_is_being_created_leaves_nothing_pinned():
    sched, ex = make_scheduler(num_blocks=32, max_num_batched_tokens=BS), FakeWorker()
    req = make_request("create", PREFIX, max_tokens=1)
    req.context_cache_id, req.context_cache_ttl_s = CACHE, 60.0
    sched.add_request(req)
    out = sched.schedule()  # a first chunk only: the prompt is not computed yet
    sched.update_from_output(out, ex.execute(out))
    assert sched.drop_context_cache(CACHE) is True
    run_sync(sched, ex)
    assert sched.kv_manager.match_by_id(CACHE) is None and CACHE not in sched.context_caches
    assert sched.kv_manager.usage == 0.0


def test_rtc_id_pins_hold_against_allocation():
    kv_manager = KVCacheManager(4, BS)
    blocks = kv_manager.alloc_blocks(2)
    kv_manager.insert_prefix(list(range(2 * BS)), blocks, 2)
    kv_manager.register_id(CACHE, blocks)
    kv_manager.free(blocks)  # the request is done; the id still holds them
    assert kv_manager.alloc_blocks(3) is None  # only 2 free blocks: the pinned ones cannot be evicted
    assert kv_manager.unregister_id(CACHE) is True
    assert len(kv_manager.alloc_blocks(4)) == 4  # unpinned, they are evictable again


def test_add_request_carries_the_cache_fields_and_checks_them():
    item = AddRequest(req_id="r", prompt_token_ids=[1, 2, 3], sampling_params={}, arrival_time=0.0,
                          context_cache_id=CACHE, context_cache_ttl_s=30.0)
    decoded = codec.decode(codec.encode(item))
    req = Request.from_message(decoded)
    assert (req.context_cache_id, req.context_cache_ttl_s) == (CACHE, 30.0)
    target = Request("t", [1, 2, 3])
    set_context_cache(target, decoded)
    assert (target.context_cache_id, target.context_cache_ttl_s) == (CACHE, 30.0)
    for bad in (dict(context_cache_ttl_s=30.0), dict(context_cache_id=CACHE, context_cache_ttl_s=0.0)):
        with pytest.raises(ValueError):
            set_context_cache(target, AddRequest(req_id="b", prompt_token_ids=[1], sampling_params={},
                                                 arrival_time=0.0, **bad))


def test_caches_pin_at_most_half_of_the_pool():
    sched, ex = make_scheduler(num_blocks=16), FakeWorker()
    create(sched, ex)  # 5 of the 8 blocks named caches may hold
    assert sched.can_pin(3) and not sched.can_pin(4)
    create(sched, ex, cache_id="ctxc-over", prompt=prompt_of(6, 4 * BS))  # admitted before the others pinned
    assert "ctxc-over" not in sched.context_caches and sched.kv_manager.match_by_id("ctxc-over") is None
    assert sched.num_pinned_blocks == FULL_BLOCKS


def test_expiry_drops_exactly_the_caches_past_their_deadline_and_keeps_the_pinned_count():
    sched, ex = make_scheduler(num_blocks=64), FakeWorker()
    for i, ttl_s in enumerate((5.0, 50.0, 10.0)):
        create(sched, ex, cache_id=f"ctxc-{i}", ttl_s=ttl_s, prompt=prompt_of(20 + i, 2 * BS))
    assert sched.num_pinned_blocks == 6
    sched.drop_context_cache("ctxc-2")  # deleted before its deadline: its heap entry is stale
    assert sched.num_pinned_blocks == 4
    deadline_0 = sched.context_caches["ctxc-0"].deadline
    assert sched.expire_context_caches(now=deadline_0 - 1e-3) == []
    assert sched.expire_context_caches(now=deadline_0 + 20.0) == ["ctxc-0"]  # ctxc-2 is not reported twice
    assert sorted(sched.context_caches) == ["ctxc-1"] and sched.num_pinned_blocks == 2
    assert sched.kv_manager.match_by_id("ctxc-0") is None and len(sched.kv_manager.match_by_id("ctxc-1")) == 2
