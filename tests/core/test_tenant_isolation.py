"""Prefix-cache isolation between tenants: block hashes, the KV cache manager's radix tree, the scheduler's
prefix hits, the memory pool's keys and the router's prompt tree all keep equal prompts of two cache salts
apart, and an AddRequest's tenancy survives the wire."""
from __future__ import annotations

import pytest

from meshserve.core.admission import MAX_TENANCY_CHARS, Admission
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.request import Request
from meshserve.pool.context_keys import block_keys, key_root
from meshserve.router.prompt_tree import GlobalPromptTree
from meshserve.wire import codec
from meshserve.wire.client import AddRequest, Tenancy
from meshserve.wire.errors import InvalidRequestError
from meshserve.wire.kv import BlockRemoved, BlockStored, KVCacheEvents, chain_block_hash
from meshserve.wire.sampling_params import SamplingParams
from tests.core.test_scheduler import BS, FakeWorker, make_request, make_scheduler, prompt_of, run_sync

SALT_A, SALT_B = "a" * 32, "b" * 32


def cache(kv_manager: KVCacheManager, tokens: list[int], salt: str) -> list[int]:
    n = len(tokens) // BS
    blocks = kv_manager.alloc_blocks(n)
    kv_manager.insert_prefix(tokens, blocks, n, salt)
    kv_manager.free(blocks)
    return blocks


def test_a_salt_changes_the_chain_hash_of_every_block():
    tokens = list(range(BS))
    plain, a, b = (chain_block_hash(None, tokens, salt) for salt in ("", SALT_A, SALT_B))
    assert len({plain, a, b}) == 3
    assert plain == chain_block_hash(None, tokens)  # the unsalted hash is the one single-tenant engines had
    assert chain_block_hash(a, tokens, SALT_B) == chain_block_hash(a, tokens)  # children inherit via the parent
    assert chain_block_hash(a, tokens) != chain_block_hash(b, tokens)
    # the salt is length-prefixed: a salt cannot pose as another salt plus leading token bytes
    assert chain_block_hash(None, [1], "x") != chain_block_hash(None, [1], "x\x01")


def test_the_radix_tree_matches_only_within_a_salt():
    kv_manager = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = prompt_of(1, 3 * BS)
    blocks = cache(kv_manager, tokens, SALT_A)
    assert kv_manager.match_by_prefix(tokens, cache_salt=SALT_A) == blocks
    assert kv_manager.match_by_prefix(tokens, cache_salt=SALT_B) == []
    assert kv_manager.match_by_prefix(tokens) == []  # nor unsalted
    events = kv_manager.drain_events()
    (stored,) = [e for e in events if isinstance(e, BlockStored)]
    assert stored.block_hashes[0] == chain_block_hash(None, tokens[:BS], SALT_A)

    # the same tokens under B get blocks (and hashes) of their own; both namespaces then match
    blocks_b = cache(kv_manager, tokens, SALT_B)
    assert set(blocks_b).isdisjoint(blocks)
    assert kv_manager.match_by_prefix(tokens, cache_salt=SALT_A) == blocks
    assert kv_manager.match_by_prefix(tokens, cache_salt=SALT_B) == blocks_b
    assert len(kv_manager.snapshot()) == 6


def test_eviction_removes_a_namespace_s_chain_and_its_root():
    kv_manager = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = prompt_of(2, 2 * BS)
    cache(kv_manager, tokens, SALT_A)
    cache(kv_manager, tokens, SALT_B)
    kv_manager.drain_events()
    assert kv_manager.alloc_blocks(4) is not None  # evicts all four cached blocks
    removed = [h for e in kv_manager.drain_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len(removed) == 4
    assert kv_manager.match_by_prefix(tokens, cache_salt=SALT_A) == []
    assert kv_manager.snapshot() == []


def test_the_scheduler_reports_a_hit_only_to_the_same_tenancy():
    sched, ex = make_scheduler(), FakeWorker()
    prompt = prompt_of(7, 3 * BS + 2)

    def admit(req_id: str, salt: str) -> int:
        req = make_request(req_id, prompt, max_tokens=2)
        req.tenancy = Tenancy(tenant=f"t-{salt[:1]}", cache_salt=salt)
        sched.add_request(req)
        step = sched.schedule()
        (new,) = step.new_reqs
        sched.update_from_output(step, ex.execute(step))
        run_sync(sched, ex)
        return new.num_computed_tokens

    assert admit("a1", SALT_A) == 0
    assert admit("b1", SALT_B) == 0  # A's cached prompt is no hit for B: as if A had sent nothing
    assert admit("a2", SALT_A) == 3 * BS
    assert admit("b2", SALT_B) == 3 * BS  # B's own earlier request is


def test_pool_keys_are_salted():
    tokens = prompt_of(3, 2 * BS)
    plain = block_keys(tokens, BS, "model", "pool")
    a = block_keys(tokens, BS, "model", "pool", cache_salt=SALT_A)
    b = block_keys(tokens, BS, "model", "pool", cache_salt=SALT_B)
    assert plain == block_keys(tokens, BS, "model", "pool", cache_salt="")
    assert set(plain).isdisjoint(a) and set(a).isdisjoint(b)
    assert key_root("model", "pool") != key_root("model", "pool", SALT_A)


def test_the_router_prompt_tree_matches_only_within_a_salt():
    kv_manager, tree = KVCacheManager(num_blocks=16, block_size=BS), GlobalPromptTree(BS)
    tokens = prompt_of(4, 2 * BS)
    cache(kv_manager, tokens, SALT_A)
    assert tree.apply("te0", KVCacheEvents(seq=1, timestamp=0.0, events=kv_manager.drain_events()))
    assert tree.match(tokens, SALT_A) == {"te0": 2 * BS}
    assert tree.match(tokens, SALT_B) == {}
    assert tree.match(tokens) == {}


def test_tenancy_travels_in_an_add_request_and_reaches_the_request():
    tenancy = Tenancy(tenant="key:0123456789abcdef", cache_salt=SALT_A)
    msg = AddRequest(req_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(), arrival_time=0.0,
                     tenancy=tenancy)
    decoded = codec.decode(codec.encode(msg))
    assert decoded.tenancy == tenancy
    assert Request.from_message(decoded).tenancy == tenancy
    plain = codec.decode(codec.encode(AddRequest(req_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(),
                                                 arrival_time=0.0)))
    assert plain.tenancy == Tenancy()


def test_the_master_refuses_an_overlong_tenant_or_salt():
    admission = Admission(vocab_size=100, block_size=BS, queue=None, kv_connectors=None, outputs=None, recovery=None)
    long = "x" * (MAX_TENANCY_CHARS + 1)
    for tenancy in (Tenancy(tenant=long), Tenancy(cache_salt=long)):
        with pytest.raises(InvalidRequestError, match="tenant or cache salt"):
            admission.check(AddRequest(req_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(),
                                       arrival_time=0.0, tenancy=tenancy))
    admission.check(AddRequest(req_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(), arrival_time=0.0,
                               tenancy=Tenancy(tenant="t" * MAX_TENANCY_CHARS, cache_salt=SALT_A)))
