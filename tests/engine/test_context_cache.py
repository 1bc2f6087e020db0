"""Context caching in the memory pool through the whole engine.

A prefix computed by one TE is a pool hit for another (fresh) TE; outputs are identical with the
cache off, with blocks from the local RTC and with blocks from the pool; a pool that goes away
costs hits, never requests; pool blocks populate in the background while the TE keeps stepping.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.config import EngineConfig
from meshserve.engine.async_client import AsyncEngineClient
from meshserve.models.factory import make_model
from meshserve.pool.context_keys import block_keys, model_identity, rank_key
from meshserve.pool.controller import run_controller
from meshserve.pool.sdk import PoolClient
from meshserve.pool.server import PoolServer
from tests.pool.pool_processes import free_address, pool_processes, start_pool, stop, wait_until

ARCHS = ("deepseek_v3", "qwen3_moe")
BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# every pool hit is fetched (the fetch-vs-recompute model is tested on its own)
ENGINE = dict(block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=128,
              pool_fetch_latency_ms=0.0)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(100, 31900, (40,), generator=g).tolist()
    return [shared + torch.randint(100, 31900, (n,), generator=g).tolist() for n in (3, 17, 30)] + \
        [torch.randint(100, 31900, (70,), generator=g).tolist()]


def _generate(model_dir, prompts, **engine_args):
    with LLM(model=str(model_dir), **ENGINE, **engine_args) as llm:
        outs = llm.generate(prompts, GREEDY)
        stats = llm.get_stats()
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs], stats


@contextlib.contextmanager
def _running_pool(logs):
    """A pool controller and one server (DRAM only), started as a user does; yields (controller, server)."""
    controller = free_address()
    with pool_processes() as procs:
        procs.append(start_pool(["controller", "--bind", controller, "--server-timeout", "3"], logs / "pool.log"))
        server = start_pool(["server", "--controller", controller, "--bind", free_address(), "--dram-gb", "0.5",
                             "--heartbeat", "0.2"], logs / "pool.log")
        procs.append(server)
        with PoolClient(controller, timeout_s=2.0) as client:
            wait_until(lambda: client.view() is not None and len(client.view().servers) == 1, 30,
                       "the pool server to join")
        yield controller, server


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with _running_pool(tmp_path_factory.mktemp("pool")) as running:
        yield running


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """One model per architecture for the whole module: the tests keep apart by pool namespace."""
    return {arch: make_model(arch, "tiny", tmp_path_factory.mktemp(arch), seed=4) for arch in ARCHS}


@pytest.fixture(scope="module")
def reference(models) -> Callable[[str], list[list[int]]]:
    """arch -> the greedy outputs of `_prompts()` with no cache at all (one engine per arch, on first use)."""
    outputs: dict[str, list[list[int]]] = {}

    def of(arch: str) -> list[list[int]]:
        if arch not in outputs:
            outputs[arch] = _generate(models[arch], _prompts(), enable_prefix_caching=False)[0]
        return outputs[arch]
    return of


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prefix_computed_by_one_te_is_a_pool_hit_for_another(arch, pool, models, reference):
    controller, _ = pool
    model_dir = models[arch]
    prompts = _prompts()
    reference = reference(arch)

    first, _, first_stats = _generate(model_dir, prompts, pool_controller=controller, pool_namespace=arch)
    assert first == reference
    # the first TE stored every full prompt block (bar the last token's) in the background
    keys = block_keys(prompts[3][:-1], BLOCK, model_identity(str(model_dir), "float32"), arch)
    with PoolClient(controller, timeout_s=2.0) as client:
        wait_until(lambda: all(client.exists(arch, [rank_key(k, 0, 1) for k in keys])), 30,
                   "the first TE's blocks to reach the pool")

    second, cached, stats = _generate(model_dir, prompts, pool_controller=controller, pool_namespace=arch)
    assert second == reference
    assert stats.pool_hit_tokens >= len(keys) * BLOCK
    assert cached[3] == len(keys) * BLOCK  # the unshared prompt came from the pool alone

    # another tenant never sees these blocks
    _, _, other = _generate(model_dir, prompts, pool_controller=controller, pool_namespace=arch + "-other")
    assert other.pool_hit_tokens == 0


def test_self_contained_dp_groups_store_to_and_fetch_from_the_pool(pool, models, reference):
    """Each group's master is a pool client of its own; its ranks store and fetch their blocks as one group of a
    lockstep TE would (the same keys)."""
    controller, _ = pool
    arch, prompts = "deepseek_v3", _prompts()
    groups = dict(parallel="attn=TP1+DP2 moe=TP1+EP2", dp_groups="self-contained", pool_controller=controller,
                  pool_namespace="self-contained")
    first, _, _ = _generate(models[arch], prompts, **groups)
    assert first == reference(arch)
    keys = block_keys(prompts[3][:-1], BLOCK, model_identity(str(models[arch]), "float32"), "self-contained")
    with PoolClient(controller, timeout_s=2.0) as client:
        wait_until(lambda: all(client.exists("self-contained", [rank_key(k, 0, 1) for k in keys])), 30,
                   "the first TE's blocks to reach the pool")
    second, cached, stats = _generate(models[arch], prompts, **groups)
    assert second == reference(arch)
    assert stats.pool_hit_tokens >= len(keys) * BLOCK and cached[3] == len(keys) * BLOCK


def test_a_pool_that_goes_away_costs_hits_not_requests(models, reference, tmp_path):
    with _running_pool(tmp_path) as (controller, server):
        _check_pool_loss(controller, server, models["deepseek_v3"], reference("deepseek_v3"))


def _check_pool_loss(controller, server, model_dir, reference):
    prompts = _prompts()
    _generate(model_dir, prompts, pool_controller=controller, pool_namespace="gone")
    stop(server)  # every block of this namespace lived on it
    outs, _, stats = _generate(model_dir, prompts, pool_controller=controller, pool_namespace="gone")
    assert outs == reference
    assert stats.pool_hit_tokens == 0


def test_blocks_missing_on_one_tp_rank_are_recomputed_by_the_whole_group(pool, models, reference):
    """Attention TP2 stores one part per rank. When rank 1's part of a block is gone although rank 0's
    is there (the master probes rank 0's), both ranks compute from that block on."""
    controller, _ = pool
    model_dir = models["qwen3_moe"]
    prompts = _prompts()[3:]
    tp2 = dict(parallel="attn=TP2+DP1 moe=TP2+EP1", pool_controller=controller, pool_namespace="tp2")
    reference = reference("qwen3_moe")[3:]
    assert _generate(model_dir, prompts, **tp2)[0] == reference
    keys = block_keys(prompts[0][:-1], BLOCK, model_identity(str(model_dir), "float32"), "tp2")
    with PoolClient(controller, timeout_s=2.0) as client:
        wait_until(lambda: all(client.exists("tp2", [rank_key(k, r, 2) for k in keys for r in (0, 1)])), 30,
                   "both ranks' blocks to reach the pool")
        assert all(client.delete("tp2", [rank_key(k, 1, 2) for k in keys[3:]]))
    outs, cached, stats = _generate(model_dir, prompts, **tp2)
    assert outs == reference
    # the probe promised every block; both ranks wrote blocks 0-2 and computed from block 3 on
    assert cached[0] == stats.pool_hit_tokens == 3 * BLOCK


def test_a_te_starts_from_the_pool_model_cache(pool, models, tmp_path):
    """With the model in the pool, a TE starts from a directory holding no weights at all."""
    from meshserve.worker import model_cache

    controller, _ = pool
    model_dir = models["deepseek_v3"]
    prompts = _prompts()[:2]
    # a TE on the disk copy computes the prompts; its KV blocks are keyed by the weights' content
    reference, _, _ = _generate(model_dir, prompts, pool_controller=controller, pool_namespace="weights")
    keys = block_keys(prompts[1][:-1], BLOCK, model_identity(str(model_dir), "float32"), "weights")
    with PoolClient(controller, timeout_s=10.0) as client:
        wait_until(lambda: all(client.exists("weights", [rank_key(k, 0, 1) for k in keys])), 30,
                   "the first TE's blocks to reach the pool")
        model_cache.put_model(client, str(model_dir), model_id="tiny-dsv3")
        weightless = model_cache.fetch_model_files(client, "tiny-dsv3", tmp_path / "from-pool")
    assert not list(weightless.glob("*.safetensors"))
    assert model_identity(str(weightless), "float32") == model_identity(str(model_dir), "float32")
    outs, _, stats = _generate(weightless, prompts, pool_controller=controller, pool_namespace="weights")
    assert outs == reference
    assert stats.pool_hit_tokens >= len(keys) * BLOCK  # the same model's blocks, whichever copy computed them


def test_generated_blocks_reach_the_pool_only_when_asked(pool, models):
    """A follow-up turn (prompt + previous answer) reuses the answer's blocks from the pool with
    pool_store_decode_blocks, and only its prompt's without."""
    controller, _ = pool
    model_dir = models["deepseek_v3"]
    first_prompt = _prompts()[3]
    long_answer = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    hits = {}
    for store_decode in (False, True):
        namespace = f"turns-{store_decode}"
        with LLM(model=str(model_dir), **ENGINE, pool_controller=controller, pool_namespace=namespace,
                 pool_store_decode_blocks=store_decode) as llm:
            answer = llm.generate([first_prompt], long_answer)[0].token_ids
        follow_up = first_prompt + list(answer) + [101, 102, 103]
        full_blocks = (len(first_prompt) + len(answer) - 1) // BLOCK  # the last token's KV is never computed
        keys = block_keys(follow_up, BLOCK, model_identity(str(model_dir), "float32"), namespace, full_blocks)
        expected = len(keys) if store_decode else (len(first_prompt) - 1) // BLOCK
        _wait_for_pool_blocks(controller, namespace, keys, expected)
        reference, _, _ = _generate(model_dir, [follow_up], enable_prefix_caching=False)
        tokens, cached, _ = _generate(model_dir, [follow_up], pool_controller=controller, pool_namespace=namespace)
        assert tokens == reference
        hits[store_decode] = cached[0]
    assert hits[False] == (len(first_prompt) - 1) // BLOCK * BLOCK
    assert hits[True] == full_blocks * BLOCK > hits[False]


def _wait_for_pool_blocks(controller: str, namespace: str, keys: list[str], expected: int) -> None:
    with PoolClient(controller, timeout_s=2.0) as client:
        wait_until(lambda: sum(client.exists(namespace, [rank_key(k, 0, 1) for k in keys])) >= expected, 30,
                   "the first turn's blocks to reach the pool")


def test_short_pool_matches_are_computed_when_fetching_costs_more(pool, models, reference):
    """With a pool round trip priced far above computing a block, the fresh TE computes the prefix:
    no pool hits once the prefill rate is measured, and the same outputs."""
    controller, _ = pool
    model_dir = models["deepseek_v3"]
    prompts = _prompts()
    namespace = "fetch-cost"
    reference = reference("deepseek_v3")
    _generate(model_dir, prompts, pool_controller=controller, pool_namespace=namespace)
    keys = block_keys(prompts[3][:-1], BLOCK, model_identity(str(model_dir), "float32"), namespace)
    with PoolClient(controller, timeout_s=2.0) as client:
        wait_until(lambda: all(client.exists(namespace, [rank_key(k, 0, 1) for k in keys])), 30,
                   "the first TE's blocks to reach the pool")
    with LLM(model=str(model_dir), **{**ENGINE, "pool_fetch_latency_ms": 60_000.0}, pool_controller=controller,
             pool_namespace=namespace) as llm:
        llm.generate([torch.randint(100, 31900, (64,)).tolist()], GREEDY)  # a prefill step measures the rate
        outs = llm.generate(prompts, GREEDY)
        stats = llm.get_stats()
    assert [o.token_ids for o in outs] == reference
    assert stats.pool_hit_tokens == 0


class _GetGatedPoolServer(PoolServer):
    """A real pool server whose gets wait at a gate while `hold` is set: a slow pool, on demand."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold, self.release = threading.Event(), threading.Event()
        self.gets_held = 0

    def _get(self, request):
        if self.hold.is_set():
            self.gets_held += 1
            self.release.wait(10.0)
        return super()._get(request)


@contextlib.contextmanager
def _gated_pool():
    """An in-process controller and one gated server; yields (controller address, server)."""
    controller, stop = free_address(), threading.Event()
    threads = [threading.Thread(target=run_controller, args=(controller, 60.0, 16, stop), daemon=True)]
    server = _GetGatedPoolServer("gated", free_address(), controller, 64 << 20, heartbeat_s=0.2)
    threads.append(threading.Thread(target=server.serve, daemon=True))
    for thread in threads:
        thread.start()
    try:
        with PoolClient(controller, timeout_s=2.0) as client:
            wait_until(lambda: client.view() is not None and len(client.view().servers) == 1, 30,
                       "the pool server to join")
        yield controller, server
    finally:
        server.release.set()
        server.stop()
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        assert not any(thread.is_alive() for thread in threads)


def test_pool_blocks_populate_in_the_background_while_other_requests_decode(models, reference):
    """deepserve RTC populate: while the pool holds back a request's blocks, the TE keeps decoding
    another request; the waiting request runs once its blocks are in, from the pool's KV."""
    model_dir = models["deepseek_v3"]
    prompt = _prompts()[3]
    reference = reference("deepseek_v3")[3:]
    with _gated_pool() as (controller, server):
        _generate(model_dir, [prompt], pool_controller=controller, pool_namespace="async")
        keys = block_keys(prompt[:-1], BLOCK, model_identity(str(model_dir), "float32"), "async")
        with PoolClient(controller, timeout_s=2.0) as client:
            wait_until(lambda: all(client.exists("async", [rank_key(k, 0, 1) for k in keys])), 30,
                       "the first TE's blocks to reach the pool")
        engine = AsyncEngineClient(EngineConfig.from_kwargs(str(model_dir), pool_controller=controller,
                                                pool_namespace="async", **ENGINE))
        try:
            decoded, fetched = asyncio.run(_decode_while_fetching(engine, server, prompt))
        finally:
            engine.shutdown()
    assert decoded >= 3, "the other request made no progress while the pool fetch was held"
    assert fetched.token_ids == reference[0]
    assert fetched.num_cached_tokens == len(keys) * BLOCK  # every prompt block came from the pool


async def _decode_while_fetching(engine: AsyncEngineClient, server: _GetGatedPoolServer, prompt: list[int]):
    """Tokens the decoding request produced while the other request's pool get was held, and the other
    request's final output."""
    produced: list[int] = []

    async def decode() -> None:  # a prompt shorter than a block: nothing to look up in the pool
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        async for out in engine.generate(None, [5, 6, 7], params, "decoding"):
            produced[:] = out.token_ids
            if len(produced) >= 400:
                return

    async def until(predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    async def fetch():
        final = None
        async for out in engine.generate(None, prompt, GREEDY, "fetching"):
            final = out
        return final

    decoding = asyncio.create_task(decode())
    try:
        await until(lambda: len(produced) >= 2, 60, "the decoding request's first tokens")
        server.hold.set()
        fetching = asyncio.create_task(fetch())
        await until(lambda: server.gets_held >= 1, 20, "the fetch to reach the pool server")
        before = len(produced)
        # the runner's pool client waits 5 s per call: release well within it, so the blocks are hits
        await until(lambda: len(produced) >= before + 3 or decoding.done(), 3, "decode steps during the fetch")
        decoded = len(produced) - before
        assert not fetching.done()
        server.release.set()
        fetched = await asyncio.wait_for(fetching, 60)
    finally:
        server.release.set()
        decoding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await decoding
    return decoded, fetched
