"""The prefix cache is no side channel between API keys: a real `meshserve serve` with three keys, where the
operator shares one prefix-cache namespace between keys A and C (`--shared-cache-keys`) and B has its own.

Key A stores a secret prompt twice over: as a named context cache and as a plain completion (so the prefix
cache, and with the pool on the memory pool, hold it). Key B then sends the same secret and an unseen prompt
of the same length: its `usage.prompt_tokens_details.cached_tokens` is the same for both (what B's own guess
would read without A), while C, sharing A's namespace, reads the hit. Run colocated and 1p1d, each with the
memory pool off and on; with the pool on the TEs' local prefix caches are off, so every hit comes from the pool
and the pool's keys alone must keep the tenants apart. Timing follows from the same lookups (equal hashes,
equal work: docs/caching.md#tenant-isolation); the suite asserts no timing.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from meshserve.entrypoints.openai.cache_namespaces import key_fingerprint
from meshserve.pool.sdk import PoolClient
from tests.e2e.server_process import running_server
from tests.pool.pool_processes import free_address, pool_processes, start_pool, wait_until

KEY_A, KEY_B, KEY_C = "sk-isolation-a", "sk-isolation-b", "sk-isolation-c"
MODEL = "tiny"
BLOCK = 16
PROMPT_TOKENS = 6 * BLOCK + 5
STARTUP_TIMEOUT_S = 180
POOL_JOIN_S = 60.0
POOL_WAIT_S = 30.0  # the pool stores blocks in the background: A's repeat polls until it hits
TOPOLOGIES = [("colocated", False), ("colocated", True), ("1p1d", False), ("1p1d", True)]


@pytest.fixture(scope="module")
def pool_controller(tmp_path_factory) -> Iterator[str]:
    """A pool controller and one DRAM server, started as a user does."""
    controller = free_address()
    logs = tmp_path_factory.mktemp("pool")
    with pool_processes() as procs:
        procs.append(start_pool(["controller", "--bind", controller, "--server-timeout", "3"], logs / "pool.log"))
        procs.append(start_pool(["server", "--controller", controller, "--bind", free_address(), "--dram-gb", "0.25",
                                 "--heartbeat", "0.2"], logs / "pool.log"))
        with PoolClient(controller, timeout_s=2.0) as client:
            wait_until(lambda: client.view() is not None and len(client.view().servers) == 1, POOL_JOIN_S,
                       "the pool server to join")
        yield controller


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=[f"{t}-pool" if p else t for t, p in TOPOLOGIES])
def server(request, tmp_path_factory, tiny_model) -> Iterator[tuple[str, bool]]:
    """(base URL, pool on) of a server for one topology; the pool variants keep the local prefix cache off."""
    topology, with_pool = request.param
    model_dir = tiny_model("deepseek_v3", seed=5, name="tiny-dsv3")
    args = ["--model", str(model_dir), "--served-model-name", MODEL, "--deployment", topology, "--num-threads", "1",
            "--block-size", str(BLOCK),
            "--api-key", KEY_A, "--api-key", KEY_B, "--api-key", KEY_C,
            "--shared-cache-keys", f"{key_fingerprint(KEY_A)},{key_fingerprint(KEY_C)}"]
    if with_pool:
        controller = request.getfixturevalue("pool_controller")
        args += ["--pool-controller", controller, "--pool-namespace", f"isolation-{topology}",
                 "--pool-fetch-latency-ms", "0", "--no-enable-prefix-caching"]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(args, log_path, STARTUP_TIMEOUT_S) as base:
        yield base, with_pool


def cached_tokens(base: str, key: str, prompt: list[int], **extra) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, **extra}
    response = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=120)
    assert response.status_code == 200, response.text
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens", 0)


def create_context_cache(base: str, key: str, prompt: list[int]) -> None:
    response = httpx.post(f"{base}/v1/context_caches", json={"model": MODEL, "prompt": prompt,
                                                             "ttl_seconds": 120},
                          headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert response.status_code in (200, 201), response.text


def test_another_key_reads_no_hit_unless_the_operator_shares_the_namespace(server):
    base, with_pool = server
    rng = random.Random(base)
    secret, unseen_b, unseen_c = ([rng.randrange(100, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(3))

    create_context_cache(base, KEY_A, secret)
    cached_tokens(base, KEY_A, secret)
    # A's own repeat hits (locally, or from the pool once its blocks are stored): the cache works here
    hits = []
    wait_until(lambda: hits.append(cached_tokens(base, KEY_A, secret)) or hits[-1] > 0, POOL_WAIT_S,
               "key A's repeat to read its cached prefix")

    b_secret = cached_tokens(base, KEY_B, secret)
    b_unseen = cached_tokens(base, KEY_B, unseen_b)
    assert b_secret == b_unseen == 0, "key B read key A's prompt in cached_tokens"
    # a request's own cache_salt splits its namespace: A's repeat under a salt reads nothing either
    assert cached_tokens(base, KEY_A, secret, cache_salt="another-session") == 0

    c_unseen = cached_tokens(base, KEY_C, unseen_c)
    assert cached_tokens(base, KEY_C, secret) > c_unseen, "the shared namespace did not share A's prefix"
