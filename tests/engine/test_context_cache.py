"""Context caching in the memory pool through the whole engine.

A prefix computed by one TE is a pool hit for another (fresh) TE; outputs are identical with the
cache off, with blocks from the local RTC and with blocks from the pool; a pool that goes away
costs hits, never requests.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.models.factory import make_model
from meshserve.pool.context_keys import block_keys, model_identity, rank_key
from meshserve.pool.sdk import PoolClient
from tests.pool.pool_processes import free_address, pool_processes, start_pool, stop, wait_until

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


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_a_prefix_computed_by_one_te_is_a_pool_hit_for_another(arch, pool, tmp_path):
    controller, _ = pool
    model_dir = make_model(arch, "tiny", tmp_path / "model", seed=4)
    prompts = _prompts()
    reference, _, _ = _generate(model_dir, prompts, enable_prefix_caching=False)

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


def test_a_pool_that_goes_away_costs_hits_not_requests(tmp_path):
    with _running_pool(tmp_path) as (controller, server):
        _check_pool_loss(controller, server, tmp_path)


def _check_pool_loss(controller, server, tmp_path):
    model_dir = make_model("deepseek_v3", "tiny", tmp_path / "model", seed=6)
    prompts = _prompts()
    reference, _, _ = _generate(model_dir, prompts, enable_prefix_caching=False)
    _generate(model_dir, prompts, pool_controller=controller, pool_namespace="gone")
    stop(server)  # every block of this namespace lived on it
    outs, _, stats = _generate(model_dir, prompts, pool_controller=controller, pool_namespace="gone")
    assert outs == reference
    assert stats.pool_hit_tokens == 0


def test_blocks_missing_on_one_tp_rank_are_recomputed_by_the_whole_group(pool, tmp_path):
    """Attention TP2 stores one part per rank. When rank 1's part of a block is gone although rank 0's
    is there (the master probes rank 0's), both ranks recompute from that block on, in the same step."""
    controller, _ = pool
    model_dir = make_model("qwen3_moe", "tiny", tmp_path / "model", seed=8)
    prompts = _prompts()[3:]
    tp2 = dict(parallel="attn=TP2+DP1 moe=TP2+EP1", pool_controller=controller, pool_namespace="tp2")
    reference, _, _ = _generate(model_dir, prompts, enable_prefix_caching=False)
    assert _generate(model_dir, prompts, **tp2)[0] == reference
    keys = block_keys(prompts[0][:-1], BLOCK, model_identity(str(model_dir), "float32"), "tp2")
    with PoolClient(controller, timeout_s=2.0) as client:
        wait_until(lambda: all(client.exists("tp2", [rank_key(k, r, 2) for k in keys for r in (0, 1)])), 30,
                   "both ranks' blocks to reach the pool")
        assert all(client.delete("tp2", [rank_key(k, 1, 2) for k in keys[3:]]))
    outs, cached, _ = _generate(model_dir, prompts, **tp2)
    assert outs == reference
    assert cached[0] == len(keys) * BLOCK  # promised by the probe; blocks 3.. were computed instead


def test_a_te_starts_from_the_pool_model_cache(pool, tmp_path):
    """With the model in the pool, a TE starts from a directory holding no weights at all."""
    from meshserve.pool import model_cache

    controller, _ = pool
    model_dir = make_model("deepseek_v3", "tiny", tmp_path / "model", seed=9)
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


def test_generated_blocks_reach_the_pool_only_when_asked(pool, tmp_path):
    """A follow-up turn (prompt + previous answer) reuses the answer's blocks from the pool with
    pool_store_decode_blocks, and only its prompt's without."""
    controller, _ = pool
    model_dir = make_model("deepseek_v3", "tiny", tmp_path / "model", seed=5)
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
        with PoolClient(controller, timeout_s=2.0) as client:
            expected = len(keys) if store_decode else (len(first_prompt) - 1) // BLOCK
            wait_until(lambda: sum(client.exists(namespace, [rank_key(k, 0, 1) for k in keys])) >= expected, 30,
                       "the first turn's blocks to reach the pool")
        reference, _, _ = _generate(model_dir, [follow_up], enable_prefix_caching=False)
        tokens, cached, _ = _generate(model_dir, [follow_up], pool_controller=controller, pool_namespace=namespace)
        assert tokens == reference
        hits[store_decode] = cached[0]
    assert hits[False] == (len(first_prompt) - 1) // BLOCK * BLOCK
    assert hits[True] == full_blocks * BLOCK > hits[False]


def test_short_pool_matches_are_computed_when_fetching_costs_more(pool, tmp_path):
    """With a pool round trip priced far above computing a block, the fresh TE computes the prefix:
    no pool hits once the prefill rate is measured, and the same outputs."""
    controller, _ = pool
    model_dir = make_model("deepseek_v3", "tiny", tmp_path / "model", seed=6)
    prompts = _prompts()
    namespace = "fetch-cost"
    reference, _, _ = _generate(model_dir, prompts, enable_prefix_caching=False)
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
