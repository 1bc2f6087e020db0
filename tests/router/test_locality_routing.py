"""Locality-aware routing against real TEs: the JE's global prompt tree follows each TE's prefix cache
(inserts and LRU evictions, resyncs after lost events), and two JEs agree on where a prefix is cached.

One `colocated2` deployment with two JEs and a small KV cache (24 blocks of 16 tokens per TE), so a
few requests evict. The TEs' own `kv.snapshot` admin replies are the ground truth the tree is compared
with; prompts are random token ids, distinct per test, so earlier tests only add cache pressure.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from meshserve.wire.kv import BlockStored, chain_block_hash
from tests.router.deployment_processes import generate_all, running_deployment

BLOCK = 16
ENGINE = {"num_kv_blocks": 24, "block_size": BLOCK, "max_num_seqs": 8}
MAX_TOKENS = 4
SYNC_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model("deepseek_v3", seed=0, name="tiny-dsv3"))


@pytest.fixture(scope="module")
def deployment(model_dir):
    """(job executors, TE names): two JEs that both know both TEs."""
    with running_deployment(model_dir, "colocated2", engine=ENGINE, num_jes=2) as (jes, procs):
        yield jes, sorted(procs)


def random_prompts(seed: int, count: int, num_tokens: int, prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(10, 30000) for _ in range(num_tokens - len(prefix))] for _ in range(count)]


def block_hashes(prompt: list[int]) -> list[int]:
    """The chain hashes of the prompt's full blocks, as the TEs' caches name them."""
    hashes, parent = [], None
    for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
        parent = chain_block_hash(parent, prompt[start:start + BLOCK])
        hashes.append(parent)
    return hashes


def cached_prefix_tokens(prompt: list[int], cache: dict[int, int | None]) -> int:
    """Prompt tokens a cache of `cache` (hash -> parent) holds as a prefix, in whole blocks."""
    n = 0
    for block_hash in block_hashes(prompt):
        if block_hash not in cache:
            break
        n += BLOCK
    return n


async def start(jes) -> None:
    for je in jes:  # deliver each JE's heartbeats and KV events on this event loop
        await je.start()


async def te_cache(je, te: str) -> dict[int, dict[int, int | None]]:
    """The TE's own view: DP rank -> {block hash: parent hash}."""
    reply = await je.admin("kv.snapshot", {"te": te}, timeout_s=10)
    assert reply.ok, reply.error
    return {int(dp): {h: parent for h, parent, _tokens in blocks} for dp, blocks in reply.data.blocks.items()}


def tree_differences(je, te: str, cache: dict[int, dict[int, int | None]]) -> list[str]:
    """How the JE's tree disagrees with the TE's cache (empty: they agree, parents included)."""
    problems = []
    state = je.tree.state()
    for dp, blocks in cache.items():
        held = je.tree.blocks_held(te, dp)
        if held != set(blocks):
            problems.append(f"{te} dp{dp}: tree lacks {len(set(blocks) - held)} cached block(s), "
                            f"keeps {len(held - set(blocks))} evicted one(s)")
        wrong_parent = [h for h in held & set(blocks) if state[h][0] != blocks[h]]
        if wrong_parent:
            problems.append(f"{te} dp{dp}: {len(wrong_parent)} block(s) under the wrong parent")
    if je.tree.blocks_held(te) != set().union(*cache.values()):  # no blocks in DP groups the TE lacks
        problems.append(f"{te}: tree and cache differ over all DP groups")
    return problems


async def wait_until_synced(jes, tes: list[str]) -> dict[str, dict[int, dict[int, int | None]]]:
    """Poll (bounded) until every JE's tree equals every TE's cache; assert that it happened.
    Returns the TEs' caches as last read."""
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    while True:
        caches = {te: await te_cache(jes[0], te) for te in tes}
        problems = [f"JE {i}: {p}" for i, je in enumerate(jes)
                    for te in tes for p in tree_differences(je, te, caches[te])]
        if not problems or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert not problems, f"prompt tree still differs from the TEs' caches after {SYNC_TIMEOUT_S:.0f} s: {problems}"
    return caches


async def stats(je, te: str) -> dict:
    reply = await je.admin("stats", {"te": te}, timeout_s=10)
    assert reply.ok, reply.error
    return reply.to_json()


# ---------------------------------------------------------------------- the tree follows evictions
def test_tree_matches_te_caches_after_evictions(deployment):
    jes, tes = deployment
    je = jes[0]
    shared = random_prompts(100, 1, 2 * BLOCK)[0]
    first_wave = random_prompts(101, 4, 4 * BLOCK)  # unique prompts: the oldest, evicted later
    later_waves = [random_prompts(102 + i, 4, 4 * BLOCK, prefix=shared if i % 2 else ()) for i in range(4)]

    async def main():
        await start(jes)
        await generate_all(je, first_wave, MAX_TOKENS, policy="round_robin")
        early = await wait_until_synced(jes, tes)
        cached_early = {(te, i) for te in tes for i, p in enumerate(first_wave)
                        if cached_prefix_tokens(p, early[te][0]) == len(p)}
        assert len(cached_early) == len(first_wave), "every first-wave prompt is cached on the TE that ran it"
        assert all(set(je.tree.match(first_wave[i])) == {te} for te, i in cached_early)
        for wave in later_waves:  # 4 waves x 4 prompts x 4 blocks, 24 blocks per TE: LRU evicts
            await generate_all(je, wave, MAX_TOKENS, policy="round_robin")
        late = await wait_until_synced(jes, tes)
        evicted = {h for te in tes for h in set(early[te][0]) - set(late[te][0])}
        assert evicted, "the workload must evict blocks the TEs had cached"
        gone = [(te, i) for te, i in cached_early if block_hashes(first_wave[i])[0] not in late[te][0]]
        assert gone, "some first-wave prompt must have left its TE's cache entirely"
        for te, i in gone:
            assert te not in je.tree.match(first_wave[i]), f"the tree still routes an evicted prefix to {te}"
        # every prompt sent: the tree's match per TE is exactly the prefix that TE still caches
        for prompt in first_wave + [p for wave in later_waves for p in wave]:
            matched = je.tree.match(prompt)
            for te in tes:
                assert matched.get(te, 0) == cached_prefix_tokens(prompt, late[te][0])

    asyncio.run(main())


# ---------------------------------------------------------------------- routing to the cached TE
def test_locality_routes_to_the_te_caching_the_prefix(deployment):
    jes, tes = deployment
    je = jes[0]
    long_prompt = random_prompts(200, 1, 6 * BLOCK)[0]
    prefix = long_prompt[:5 * BLOCK]
    followers = random_prompts(201, 3, 6 * BLOCK, prefix=prefix)

    async def main():
        await start(jes)
        first = await generate_all(je, [long_prompt], MAX_TOKENS, policy="round_robin")
        assert first[0].num_cached_tokens == 0
        await wait_until_synced(jes, tes)
        holders = set(je.tree.match(long_prompt))
        assert len(holders) == 1, f"the long prompt should be cached on the one TE that ran it, not {holders}"
        holder = holders.pop()
        other = next(te for te in tes if te != holder)
        before = {te: await stats(je, te) for te in tes}
        outs = await generate_all(je, followers, MAX_TOKENS, policy="locality")
        after = {te: await stats(je, te) for te in tes}
        assert [o.num_cached_tokens for o in outs] == [len(prefix)] * len(followers)
        assert after[other]["prefix_cache_queries"] == before[other]["prefix_cache_queries"], \
            "a request sharing the cached prefix went to the TE without it"
        assert after[holder]["prefix_cache_hits"] - before[holder]["prefix_cache_hits"] == len(prefix) * len(followers)

    asyncio.run(main())


# ---------------------------------------------------------------------- two JEs agree
def test_two_jes_share_the_tree_and_route_to_the_cached_te(deployment):
    jes, tes = deployment
    long_prompt = random_prompts(300, 1, 6 * BLOCK)[0]
    prefix = long_prompt[:5 * BLOCK]
    followers = random_prompts(301, 2, 6 * BLOCK, prefix=prefix)

    async def main():
        await start(jes)
        await generate_all(jes[0], [long_prompt], MAX_TOKENS, policy="round_robin")
        await wait_until_synced(jes, tes)  # both JEs, from the same TEs' events (or snapshots)
        assert jes[0].tree.state() == jes[1].tree.state()
        holders = set(jes[0].tree.match(long_prompt))
        assert len(holders) == 1
        holder = holders.pop()
        other = next(te for te in tes if te != holder)
        for je in jes:
            decision = je.routing.route(followers[0], je.registry.views(), policy="locality")
            assert decision.te == holder, decision.reason
        before = await stats(jes[0], other)
        for je, follower in zip(jes, followers):  # each JE routes one request on its own
            outs = await generate_all(je, [follower], MAX_TOKENS, policy="locality")
            assert outs[0].num_cached_tokens == len(prefix)
        assert (await stats(jes[0], other))["prefix_cache_queries"] == before["prefix_cache_queries"]

    asyncio.run(main())


# ---------------------------------------------------------------------- resync after lost events
class LossyEvents:
    """Makes a JE lose KV-event batches on the way in (as a dropped message would) and records what
    the registry does about it: gaps it detects and snapshots it loads. Undone on exit."""

    def __init__(self, registry) -> None:
        self.registry = registry
        self.drop_stored = 0  # lose the next N batches that cache blocks
        self.drop_all = False
        self.lost: list[tuple[str, int]] = []  # (TE, seq)
        self.last_seq: dict[str, int] = {}  # the newest batch seen from each TE, lost or not
        self.gaps: list[str] = []  # TEs whose batch showed a loss
        self.loaded: list[str] = []  # TEs whose snapshot was loaded

    def __enter__(self) -> LossyEvents:
        deliver, load = self.registry.on_kv_events, self.registry.load_snapshot

        def on_kv_events(te, batch) -> bool:
            self.last_seq[te] = max(batch.seq, self.last_seq.get(te, 0))
            stores = any(isinstance(e, BlockStored) for e in batch.events)
            if self.drop_all or (self.drop_stored and stores):
                self.drop_stored -= 0 if self.drop_all else 1
                self.lost.append((te, batch.seq))
                return True
            ok = deliver(te, batch)
            if not ok:
                self.gaps.append(te)
            return ok

        def load_snapshot(record, data) -> None:
            self.loaded.append(record.name)
            load(record, data)

        self.registry.on_kv_events, self.registry.load_snapshot = on_kv_events, load_snapshot
        return self

    def __exit__(self, *exc) -> None:
        for name in ("on_kv_events", "load_snapshot", "needs_snapshot"):
            self.registry.__dict__.pop(name, None)

    def only_gaps_resync(self) -> None:
        """Switch off the heartbeat check, so that only a gap in seqs can trigger a snapshot."""
        needs = self.registry.needs_snapshot
        self.registry.needs_snapshot = lambda record, now: not record.synced and needs(record, now)


async def published_seq(je, te: str) -> int:
    reply = await je.admin("kv.snapshot", {"te": te}, timeout_s=10)
    assert reply.ok, reply.error
    return reply.data.seq


def test_a_lost_batch_is_detected_by_the_next_one(deployment):
    jes, tes = deployment
    je = jes[0]
    prompts = random_prompts(400, 4, 4 * BLOCK)

    async def main():
        await start(jes)
        await wait_until_synced(jes, tes)
        with LossyEvents(je.registry) as lossy:
            lossy.only_gaps_resync()
            lossy.drop_stored = 1
            await generate_all(je, prompts[:1], MAX_TOKENS, policy="round_robin")
            for prompt in prompts[1:]:  # round-robin: the TE that lost a batch publishes more
                await generate_all(je, [prompt], MAX_TOKENS, policy="round_robin")
            await wait_until_synced(jes, tes)
            assert len(lossy.lost) == 1
            te = lossy.lost[0][0]
            assert te in lossy.gaps and te in lossy.loaded, "the gap must be detected and fixed by a snapshot"

    asyncio.run(main())


def test_lost_last_batches_are_detected_by_heartbeats(deployment):
    jes, tes = deployment
    je = jes[0]
    prompts = random_prompts(500, 2, 4 * BLOCK)

    async def main():
        await start(jes)
        await wait_until_synced(jes, tes)
        with LossyEvents(je.registry) as lossy:
            lossy.drop_all = True
            await generate_all(je, prompts, MAX_TOKENS, policy="round_robin")
            # lose everything up to each TE's last batch (it may follow the final tokens), so no later
            # batch can reveal a gap: only the heartbeats' event count can tell that the JE lags
            deadline = time.monotonic() + SYNC_TIMEOUT_S
            while True:
                published = {te: await published_seq(je, te) for te in tes}
                if all(lossy.last_seq.get(te, 0) >= seq for te, seq in published.items()):
                    break
                assert time.monotonic() < deadline, "the TEs' events did not arrive"
                await asyncio.sleep(0.1)
            lossy.drop_all = False
            assert {te for te, _seq in lossy.lost} == set(tes), "both TEs must have lost events"
            await wait_until_synced(jes, tes)
            assert not lossy.gaps
            assert set(lossy.loaded) == set(tes)

    asyncio.run(main())
