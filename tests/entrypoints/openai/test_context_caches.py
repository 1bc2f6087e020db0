"""Named context caches through the OpenAI API, in-process against the real engine (tiny deepseek_v3).

The model has random weights, so outputs are checked against the same server: a request naming a
cache must give the greedy output of its full prompt sent without the id, computed from scratch.
Each test uses its own random token ids, so prefixes never meet across tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
import uuid

import httpx
import pytest

from meshserve.config import EngineConfig
from meshserve.engine.async_client import AsyncEngineClient
from meshserve.entrypoints.openai.api_server import build_app
from meshserve.entrypoints.openai.context_caches import DEFAULT_TTL_S, ContextCacheNotFound, ContextCacheStore
from meshserve.router.routing import RoutingPolicy, TELoad, TEView
from meshserve.wire.client import ContextCacheDeleted
from meshserve.wire.sampling_params import SamplingParams
from tests.router.deployment_processes import running_deployment

MODEL = "tiny"
BLOCK = 8
NUM_KV_BLOCKS = 48
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


class LoopThread:
    """One event loop for the whole module: the engine client stays bound to the loop it first ran on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Api:
    def __init__(self, loop: LoopThread, app, engine: AsyncEngineClient) -> None:
        self.loop, self.engine = loop, engine
        self.client = loop.run(self._client(app))
        self.tokenizer = engine.tokenizer

    @staticmethod
    async def _client(app) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)

    def call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        return self.loop.run(self.client.request(method, path, json=body))

    def create(self, **body) -> dict:
        response = self.call("POST", "/v1/context_caches", {"model": MODEL, **body})
        assert response.status_code == 200, response.text
        return response.json()

    def complete(self, prompt, **extra) -> dict:
        response = self.call("POST", "/v1/completions", {"model": MODEL, "prompt": prompt, **GREEDY, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    def chat(self, messages, **extra) -> dict:
        response = self.call("POST", "/v1/chat/completions", {"model": MODEL, "messages": messages, **GREEDY, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    def pinned_in_engine(self) -> dict:
        reply = self.loop.run(self.engine.admin("context_cache.list"))
        assert reply.ok, reply.error
        return reply.to_json()


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})


@contextlib.contextmanager
def serving(model_dir, **engine_args):
    config = EngineConfig.from_kwargs(str(model_dir), served_model_name=MODEL, block_size=BLOCK,
                          num_kv_blocks=NUM_KV_BLOCKS, max_model_len=NUM_KV_BLOCKS * BLOCK, max_num_seqs=4,
                          max_num_batched_tokens=256, **engine_args)
    engine = AsyncEngineClient(config, log_level=logging.WARNING)
    loop = LoopThread()
    try:
        api = Api(loop, build_app(engine), engine)
        yield api
        loop.run(api.client.aclose())
    finally:
        loop.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def api(model_dir):
    with serving(model_dir) as api:
        yield api


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 31900) for _ in range(n)]


def cached_tokens(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def assert_error(response: httpx.Response, status: int, error_type: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type
    assert error["param"] == param
    return error


# ---------------------------------------------------------------- the frontend's store
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_store_expires_into_tombstones_that_fade():
    clock = FakeClock()
    store = ContextCacheStore(clock=clock, tombstone_s=100.0, max_tombstones=2)
    kept = store.add("ctxc-a", MODEL, 3, ttl_s=10.0, token_ids=[1, 2, 3])
    assert store.get("ctxc-a") == kept and kept.kind == "prompt" and kept.expires_at == 1010.0
    store.add("ctxc-b", MODEL, 5, ttl_s=20.0, messages=[{"role": "user", "content": "hi"}])
    clock.now = 1015.0
    with pytest.raises(ContextCacheNotFound) as expired:
        store.get("ctxc-a")
    assert expired.value.expired and expired.value.expired_at == 1010.0
    assert store.get("ctxc-b").kind == "messages" and len(store) == 1
    with pytest.raises(ContextCacheNotFound) as unknown:
        store.get("ctxc-never")
    assert not unknown.value.expired
    clock.now = 1200.0  # both tombstones are older than tombstone_s: the ids read as unknown
    with pytest.raises(ContextCacheNotFound) as faded:
        store.get("ctxc-a")
    assert not faded.value.expired
    for i in range(3):  # at most max_tombstones are kept
        store.add(f"ctxc-{i}", MODEL, 1, ttl_s=1.0, token_ids=[1])
    clock.now += 2
    assert [store_error(store, f"ctxc-{i}") for i in range(3)] == [False, True, True]


def store_error(store: ContextCacheStore, cache_id: str) -> bool:
    with pytest.raises(ContextCacheNotFound) as exc:
        store.get(cache_id)
    return exc.value.expired


def test_store_refuses_bad_entries():
    store = ContextCacheStore()
    with pytest.raises(ValueError):
        store.add("ctxc-x", MODEL, 1, ttl_s=10.0)  # neither tokens nor messages
    with pytest.raises(ValueError):
        store.add("ctxc-x", MODEL, 1, ttl_s=0.0, token_ids=[1])
    store.add("ctxc-x", MODEL, 1, ttl_s=10.0, token_ids=[1])
    with pytest.raises(ValueError):
        store.add("ctxc-x", MODEL, 1, ttl_s=10.0, token_ids=[1])
    store.delete("ctxc-x")
    with pytest.raises(ContextCacheNotFound):
        store.delete("ctxc-x")


def test_router_routes_to_a_named_te_only_while_it_can_serve():
    views = [TEView("c0", "colocated", "g", TELoad()), TEView("p0", "prefill", "pd", TELoad()),
             TEView("d0", "decode", "pd", TELoad(num_running=3)), TEView("d1", "decode", "pd", TELoad()),
             TEView("sick", "colocated", "g", TELoad(), healthy=False)]
    router = RoutingPolicy()
    assert router.route_to("c0", views, "pinned").tes == ["c0"]
    assert router.route_to("p0", views, "pinned").tes == ["p0", "d1"]  # the least loaded decode TE of its group
    assert router.route_to("sick", views, "pinned") is None
    assert router.route_to("d0", views, "pinned") is None  # a decode TE is no entry
    assert router.route_to("gone", views, "pinned") is None


# ---------------------------------------------------------------- creating and using
def test_a_prompt_cache_gives_the_full_prompts_output_and_reports_the_reuse(api):
    prefix, suffix = random_tokens(5 * BLOCK + 3, seed=1), random_tokens(7, seed=2)
    oracle = api.complete(prefix + suffix)
    assert cached_tokens(oracle) == 0  # computed from scratch

    before = time.time()
    cache = api.create(prompt=prefix)
    assert cache["id"].startswith("ctxc-") and cache["object"] == "context_cache"
    assert cache["model"] == MODEL and cache["num_tokens"] == len(prefix)
    assert int(before) <= cache["created"] <= time.time()
    assert cache["expires_at"] - cache["created"] == pytest.approx(DEFAULT_TTL_S, abs=1)
    assert api.call("GET", f"/v1/context_caches/{cache['id']}").json() == cache
    assert api.pinned_in_engine()[cache["id"]]["num_tokens"] == 5 * BLOCK  # the full blocks

    reused = api.complete(suffix, context_cache_id=cache["id"])
    assert reused["choices"][0]["text"] == oracle["choices"][0]["text"]
    assert reused["usage"]["prompt_tokens"] == len(prefix) + len(suffix)
    assert cached_tokens(reused) >= 5 * BLOCK
    api.call("DELETE", f"/v1/context_caches/{cache['id']}")


def test_a_text_prompt_cache_continues_without_a_second_bos(api):
    text, more = f"Context {uuid.uuid4().hex} " * 4, " and then the question."
    cache = api.create(prompt=text, ttl_seconds=60)
    prefix_ids = api.tokenizer.encode(text, add_special_tokens=True)
    assert cache["num_tokens"] == len(prefix_ids)
    assert cache["expires_at"] - cache["created"] == pytest.approx(60, abs=1)
    reused = api.complete(more, context_cache_id=cache["id"])
    full = prefix_ids + api.tokenizer.encode(more, add_special_tokens=False)
    assert reused["usage"]["prompt_tokens"] == len(full)
    assert cached_tokens(reused) >= len(prefix_ids) // BLOCK * BLOCK
    assert reused["choices"][0]["text"] == api.complete(full)["choices"][0]["text"]
    api.call("DELETE", f"/v1/context_caches/{cache['id']}")


def test_a_messages_cache_is_followed_by_the_chats_messages(api):
    topic = uuid.uuid4().hex
    history = [{"role": "system", "content": f"You answer questions about {topic}."},
               {"role": "user", "content": f"Tell me about {topic} in some detail, please."},
               {"role": "assistant", "content": f"{topic} is a long hexadecimal string."}]
    follow_up = [{"role": "user", "content": "Why?"}]
    oracle = api.chat(history + follow_up)
    assert cached_tokens(oracle) == 0

    cache = api.create(messages=history)
    rendered = api.tokenizer.apply_chat_template(history, add_generation_prompt=False, tokenize=False)
    assert cache["num_tokens"] == len(api.tokenizer.encode(rendered, add_special_tokens=False))
    reused = api.chat(follow_up, context_cache_id=cache["id"])
    assert reused["choices"][0]["message"]["content"] == oracle["choices"][0]["message"]["content"]
    assert reused["usage"]["prompt_tokens"] == oracle["usage"]["prompt_tokens"]
    assert cached_tokens(reused) >= cache["num_tokens"] // BLOCK * BLOCK
    api.call("DELETE", f"/v1/context_caches/{cache['id']}")


def test_pinned_blocks_survive_lru_pressure(api):
    prefix, suffix = random_tokens(5 * BLOCK, seed=3), random_tokens(3, seed=4)
    cache = api.create(prompt=prefix)
    plain = random_tokens(5 * BLOCK + 1, seed=5)
    api.complete(plain)  # in the prefix cache only

    async def pressure():  # more distinct prompts than the pool holds, four at a time
        await asyncio.gather(*(api.client.post("/v1/completions", json={
            "model": MODEL, "prompt": random_tokens(8 * BLOCK, seed=100 + i), **GREEDY, "max_tokens": 1})
            for i in range(7)))

    api.loop.run(pressure())
    assert cached_tokens(api.complete(plain)) == 0  # the pressure evicted the unpinned prefix
    assert cached_tokens(api.complete(suffix, context_cache_id=cache["id"])) == 5 * BLOCK
    api.call("DELETE", f"/v1/context_caches/{cache['id']}")


# ---------------------------------------------------------------- lifetime
def test_delete_unpins_and_the_id_is_then_unknown(api):
    cache = api.create(prompt=random_tokens(3 * BLOCK, seed=6))
    assert cache["id"] in api.pinned_in_engine()
    deleted = api.call("DELETE", f"/v1/context_caches/{cache['id']}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": cache["id"], "object": "context_cache.deleted", "deleted": True}
    assert cache["id"] not in api.pinned_in_engine()
    error = assert_error(api.call("POST", "/v1/completions", {"model": MODEL, "prompt": [5, 6], **GREEDY,
                                                              "context_cache_id": cache["id"]}),
                         404, "not_found_error", "context_cache_id")
    assert "expired" not in error["message"]
    assert_error(api.call("GET", f"/v1/context_caches/{cache['id']}"), 404, "not_found_error")
    assert_error(api.call("DELETE", f"/v1/context_caches/{cache['id']}"), 404, "not_found_error")


def test_an_expired_id_is_404_saying_it_expired(api):
    cache = api.create(prompt=random_tokens(3 * BLOCK, seed=7), ttl_seconds=0.5)
    time.sleep(0.7)
    error = assert_error(api.call("POST", "/v1/completions", {"model": MODEL, "prompt": [5, 6], **GREEDY,
                                                              "context_cache_id": cache["id"]}),
                         404, "not_found_error", "context_cache_id")
    assert "expired" in error["message"] and error["code"] == "context_cache_expired"
    assert "expired" in assert_error(api.call("GET", f"/v1/context_caches/{cache['id']}"),
                                     404, "not_found_error")["message"]
    deadline = time.monotonic() + 5  # the engine unpins on its own clock
    while cache["id"] in api.pinned_in_engine():
        assert time.monotonic() < deadline, "the engine kept an expired cache pinned"
        time.sleep(0.1)


# ---------------------------------------------------------------- bad requests
def test_unknown_ids_are_404_on_both_endpoints(api):
    for path, body in (("/v1/completions", {"prompt": [5, 6]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        error = assert_error(api.call("POST", path, {"model": MODEL, **body, **GREEDY,
                                                     "context_cache_id": "ctxc-nope"}),
                             404, "not_found_error", "context_cache_id")
        assert error["code"] == "context_cache_not_found"
    assert_error(api.call("GET", "/v1/context_caches/ctxc-nope"), 404, "not_found_error")


def test_a_cache_is_used_with_the_endpoint_of_its_kind(api):
    prompt_cache = api.create(prompt=random_tokens(BLOCK, seed=8))
    messages_cache = api.create(messages=[{"role": "system", "content": "Be brief."}])
    chat = api.call("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                     **GREEDY, "context_cache_id": prompt_cache["id"]})
    assert "/v1/completions" in assert_error(chat, 400, "invalid_request_error", "context_cache_id")["message"]
    completion = api.call("POST", "/v1/completions", {"model": MODEL, "prompt": [5, 6], **GREEDY,
                                                      "context_cache_id": messages_cache["id"]})
    assert "/v1/chat/completions" in assert_error(completion, 400, "invalid_request_error",
                                                  "context_cache_id")["message"]
    for cache in (prompt_cache, messages_cache):
        api.call("DELETE", f"/v1/context_caches/{cache['id']}")


def test_caches_may_pin_half_of_the_kv_cache_then_creation_is_503(api):
    share = NUM_KV_BLOCKS // 2 // 3  # three caches fill the half named caches may pin
    caches = [api.create(prompt=random_tokens(share * BLOCK, seed=20 + i)) for i in range(3)]
    over = api.call("POST", "/v1/context_caches", {"model": MODEL, "prompt": random_tokens(BLOCK, seed=23)})
    assert over.status_code == 503 and over.json()["error"]["code"] == "queue_full"
    api.call("DELETE", f"/v1/context_caches/{caches[0]['id']}")
    caches[0] = api.create(prompt=random_tokens(BLOCK, seed=23))  # room again
    for cache in caches:
        api.call("DELETE", f"/v1/context_caches/{cache['id']}")


@pytest.mark.parametrize("body, param", [
    ({"prompt": [5, 6], "ttl_seconds": 0}, "ttl_seconds"),
    ({"prompt": [5, 6], "ttl_seconds": -3}, "ttl_seconds"),
    ({"prompt": [5, 6], "ttl_seconds": 86401}, "ttl_seconds"),
    ({"prompt": [5, 6], "ttl_seconds": "60"}, "ttl_seconds"),
    ({"prompt": [5, 6], "messages": [{"role": "user", "content": "hi"}]}, None),
    ({}, None),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 10 ** 9]}, "prompt"),
    ({"prompt": list(range(100, 100 + NUM_KV_BLOCKS * BLOCK))}, "prompt"),  # leaves no room after it
])
def test_bad_creation_requests_are_400(api, body, param):
    response = api.call("POST", "/v1/context_caches", {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or (param is not None and error["param"].startswith(param))


def test_creating_for_another_model_is_404(api):
    response = api.call("POST", "/v1/context_caches", {"model": "other", "prompt": [5, 6]})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------- several DP groups
def test_with_two_dp_groups_requests_go_to_the_group_that_pins_the_blocks(model_dir):
    with serving(model_dir, parallel="attn=TP1+DP2 moe=TP1+EP2") as api:
        prefix = random_tokens(4 * BLOCK, seed=9)
        cache = api.create(prompt=prefix)
        group = api.pinned_in_engine()[cache["id"]]["dp_rank"]
        assert group in (0, 1)
        # the other group has never seen the prefix: a use placed there would report no cached tokens
        texts = []
        for i in range(2):
            reused = api.complete([7, 8, 9], context_cache_id=cache["id"])
            assert cached_tokens(reused) == 4 * BLOCK, f"use {i} missed the pinned blocks"
            texts.append(reused["choices"][0]["text"])
        assert texts == [api.complete(prefix + [7, 8, 9])["choices"][0]["text"]] * 2


# ---------------------------------------------------------------- job executor over several TEs
def test_the_job_executor_sends_a_caches_requests_to_the_te_that_pins_it(model_dir):
    engine = {"block_size": BLOCK, "num_kv_blocks": NUM_KV_BLOCKS}
    with running_deployment(str(model_dir), "colocated2", engine=engine, routing="round_robin") as (jes, _):
        je = jes[0]
        prefix = random_tokens(4 * BLOCK, seed=10)

        async def final(prompt, request_id, **cache):
            last = None
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            async for out in je.generate(None, prompt, params, request_id, **cache):
                last = out
            return last

        async def scenario():
            await final(prefix, "create", context_cache_id="ctxc-je", context_cache_ttl_s=60.0)
            # round robin alone would alternate the TEs; the other one has never seen the prefix
            uses = [await final(prefix + [7, i], f"use-{i}", context_cache_id="ctxc-je") for i in range(3)]
            deleted = await je.admin("context_cache.delete", {"id": "ctxc-je"})
            return uses, deleted

        uses, deleted = asyncio.run(scenario())
        assert [u.num_cached_tokens for u in uses] == [4 * BLOCK] * 3
        assert deleted.ok and deleted.data == ContextCacheDeleted(id="ctxc-je", deleted=True)
