"""Limits that keep the API server responsive and its input well-formed: content type (415), body size
(413, declared or chunked), body and header read timeouts (408), the connection cap (503), prompt
length before tokenizing, tokenizing off the event loop, slow readers cut off, admin arguments
validated, context-cache quotas and TTL ceiling, and graceful shutdown."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from meshserve.entrypoints.openai.api_server import build_app
from meshserve.entrypoints.openai.context_caches import (
    ContextCacheLimits,
    ContextCacheNotFound,
    ContextCacheQuotaExceeded,
    ContextCacheStore,
)
from meshserve.entrypoints.openai.server_options import server_options
from tests.entrypoints.openai.fake_server import AdminFakeEngine, running_fake_server
from tests.entrypoints.openai.test_api import MODEL, REPLIES, assert_openai_error, sse_events

LOOPBACK = ("127.0.0.1", 40000)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
POST_BODIES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT,
               "/v1/context_caches": {"model": MODEL, "prompt": [5, 6, 7]}, "/admin/eplb/rebalance": {}}
SMALL_BODY_LIMIT = 64 * 1024


def make_client(engine: AdminFakeEngine | None = None, **options) -> TestClient:
    return TestClient(build_app(engine or AdminFakeEngine(), options=server_options({}, **options)), client=LOOPBACK)


@pytest.fixture
def engine() -> AdminFakeEngine:
    return AdminFakeEngine()


@pytest.fixture
def client(engine):
    with make_client(engine) as c:
        yield c


# ---------------------------------------------------------------- content type and malformed bodies
@pytest.mark.parametrize("path", POST_BODIES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None, "application/jsonx"])
def test_post_bodies_other_than_json_are_415(client, engine, path, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post(path, content=json.dumps(POST_BODIES[path]).encode(), headers=headers)
    assert assert_openai_error(response, 415)["code"] == "unsupported_media_type"
    assert engine.calls == [] and engine.admin_calls == []


@pytest.mark.parametrize("path", POST_BODIES)
def test_json_with_a_charset_is_accepted(client, path):
    response = client.post(path, content=json.dumps(POST_BODIES[path]).encode(),
                           headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", POST_BODIES)
@pytest.mark.parametrize("body", [b"\xff\xfe{\"model\": 1}", b"{\"prompt\": \"\xc3\x28\"}", b"{not json", b"[1, 2]",
                                  b"\"text\"", b"null"], ids=["utf16-bom", "bad-utf8", "not-json", "list", "string",
                                                              "null"])
def test_malformed_bodies_are_openai_400_on_every_endpoint(client, engine, path, body):
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400)
    assert engine.calls == [] and engine.admin_calls == []


PLACEMENT = {"format": "meshserve-expert-placement/1", "num_logical": 4, "num_ranks": 2, "redundant_per_rank": 1,
             "layers": {"1": [0, 1, 3, 2, 3, -1]}}
BAD_REBALANCE = {
    "infinite num_logical": b'{"placement": {"format": "meshserve-expert-placement/1", "num_logical": 1e999, '
                            b'"num_ranks": 2, "redundant_per_rank": 0, "layers": {"1": [0, 1]}}}',
    "layers as empty list": {"placement": {**PLACEMENT, "layers": []}},
    "no layers": {"placement": {**PLACEMENT, "layers": {}}},
    "float num_ranks": {"placement": {**PLACEMENT, "num_ranks": 2.5}},
    "string num_logical": {"placement": {**PLACEMENT, "num_logical": "4"}},
    "huge num_logical": {"placement": {**PLACEMENT, "num_logical": 2 ** 70}},
    "slot below empty": {"placement": {**PLACEMENT, "layers": {"1": [0, 1, 3, 2, 3, -2]}}},
    "too few slots": {"placement": {**PLACEMENT, "layers": {"1": [0, 1, 2, 3]}}},
    "expert beyond num_logical": {"placement": {**PLACEMENT, "layers": {"1": [0, 1, 3, 2, 3, 4]}}},
    "uneven split": {"placement": {**PLACEMENT, "num_logical": 5}},
    "layer key not a number": {"placement": {**PLACEMENT, "layers": {"x": [0, 1]}}},
    "unknown format": {"placement": {**PLACEMENT, "format": "nope"}},
    "unknown field": {"placement": PLACEMENT, "force": True},
    "placement not an object": {"placement": [1, 2]},
}


@pytest.mark.parametrize("body", BAD_REBALANCE.values(), ids=BAD_REBALANCE.keys())
def test_bad_rebalance_arguments_are_400_before_the_engine(client, engine, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post("/admin/eplb/rebalance", content=content, headers={"Content-Type": "application/json"})
    assert "bad placement" in assert_openai_error(response, 400)["message"]
    assert engine.admin_calls == []


def test_a_valid_placement_reaches_the_engine(client, engine):
    assert client.post("/admin/eplb/rebalance", json={"placement": PLACEMENT}).status_code == 200
    assert engine.admin_calls == [("eplb.rebalance", {"placement": PLACEMENT})]


# ---------------------------------------------------------------- prompt length and tokenizing
def test_prompts_longer_than_the_character_limit_are_400_before_tokenizing(engine):
    encoded: list[str] = []
    original = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: encoded.append("x") or original(*a, **k)
    with make_client(engine, max_prompt_chars=50) as c:
        for path, body in (("/v1/completions", {**COMPLETION, "prompt": "x" * 51}),
                           ("/v1/completions", {**COMPLETION, "prompt": ["x" * 30, "y" * 30]}),
                           ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 51}]}),
                           ("/v1/context_caches", {"model": MODEL, "prompt": "x" * 51})):
            error = assert_openai_error(c.post(path, json=body), 400)
            assert error["code"] == "context_length_exceeded" and "50" in error["message"]
        assert encoded == [] and engine.calls == []
        assert c.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 50}).status_code == 200
    assert len(engine.calls) == 1


def test_the_default_character_limit_follows_the_context_length(engine):
    with make_client(engine) as c:
        too_long = "x" * (engine.max_model_len * 32 + 1)
        assert_openai_error(c.post("/v1/completions", json={**COMPLETION, "prompt": too_long}), 400)


def test_tokenizing_and_templating_run_off_the_event_loop(client, engine):
    threads: list[str] = []
    original = engine.tokenizer.encode

    def recording_encode(text, *args, **kwargs):
        if text not in REPLIES:  # the fake engine encodes its scripted replies itself
            threads.append(threading.current_thread().name)
        return original(text, *args, **kwargs)

    engine.tokenizer.encode = recording_encode
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert len(threads) >= 2 and all(name.startswith("tokenizer") for name in threads), threads


# ---------------------------------------------------------------- slow readers
def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(engine):
    """The ASGI send blocks for good after the first chunks (a client whose socket buffers are full)."""
    engine.token_delay_s = 0.01
    app = build_app(engine, options=server_options({}, write_timeout_s=0.3))
    body = json.dumps({**COMPLETION, "max_tokens": 20, "stream": True}).encode()
    sent: list[dict] = []
    bodies = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if bodies:
            return bodies.pop()
        await asyncio.sleep(3600)  # never disconnects

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) > 3:
            await asyncio.sleep(3600)  # the client reads nothing more

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": LOOPBACK, "server": ("test", 80),
             "headers": [(b"host", b"test"), (b"content-type", b"application/json")]}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=20))
    assert engine.aborted == [engine.calls[0]["request_id"]]
    assert engine.tokens_emitted < len(REPLIES[0])


# ---------------------------------------------------------------- a real server: size, timeouts, connections
@pytest.fixture(scope="module")
def server():
    options = {"max_body_bytes": SMALL_BODY_LIMIT, "body_timeout_s": 1.0, "header_timeout_s": 1.0,
               "max_connections": 6}
    with running_fake_server(options) as (base, proc):
        yield base
        assert proc.poll() is None


def test_a_body_declared_too_large_is_413(server):
    body = json.dumps({**COMPLETION, "prompt": "x" * (2 * SMALL_BODY_LIMIT)}).encode()
    response = httpx.post(f"{server}/v1/completions", content=body, headers={"Content-Type": "application/json"},
                          timeout=30)
    assert assert_openai_error(response, 413)["code"] == "request_too_large"
    assert httpx.post(f"{server}/v1/completions", json=COMPLETION, timeout=30).status_code == 200


def test_a_chunked_body_that_grows_too_large_is_413(server):
    def chunks():
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(2 * SMALL_BODY_LIMIT // 4096):
            yield b"x" * 4096
        yield b'"}'

    response = httpx.post(f"{server}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"},
                          timeout=30)
    assert_openai_error(response, 413)
    small = httpx.post(f"{server}/v1/completions", content=iter([json.dumps(COMPLETION).encode()]),
                       headers={"Content-Type": "application/json"}, timeout=30)
    assert small.status_code == 200


def _raw_exchange(base: str, data: bytes, read_timeout_s: float = 15.0) -> bytes:
    """Send `data`, then read until the server closes the connection (the test fails on a hang)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout_s) as sock:
        sock.sendall(data)
        received = b""
        while True:
            chunk = sock.recv(65536)  # socket.timeout here means the server waited forever
            if not chunk:
                return received
            received += chunk


def test_a_body_shorter_than_its_content_length_is_408_not_a_hang(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    started = time.monotonic()
    answer = _raw_exchange(server, head + b'{"model": ')
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer
    assert time.monotonic() - started < 10


def test_headers_that_never_finish_are_408_and_closed(server):
    answer = _raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_connections_beyond_the_cap_are_503(server):
    idle = [socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) for _ in range(6)]
    try:
        time.sleep(0.1)  # the server has accepted them (they count as open connections)
        refused = httpx.get(f"{server}/v1/models", timeout=10)
        assert assert_openai_error(refused, 503, "service_unavailable_error")["code"] == "too_many_connections"
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{server}/v1/models", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the server did not recover after the idle connections closed"
        time.sleep(0.1)


# ---------------------------------------------------------------- graceful shutdown
def test_sigterm_lets_short_streams_finish_and_ends_long_ones_with_an_error_and_done():
    with running_fake_server({"shutdown_grace_s": 1.0}, token_delay_s=0.3) as (base, proc):
        results: dict[str, httpx.Response] = {}

        def stream(name: str, max_tokens: int) -> None:
            body = {**COMPLETION, "max_tokens": max_tokens, "stream": True}
            results[name] = httpx.post(f"{base}/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=stream, args=("short", 2)), threading.Thread(target=stream,
                                                                                        args=("long", 20))]
        for t in threads:
            t.start()
        time.sleep(0.4)  # both streams are running
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        proc.wait(30)
        assert proc.returncode == 0
    short, long = sse_events(results["short"]), sse_events(results["long"])
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == "server_shutting_down"
    assert len(long) < 20


# ---------------------------------------------------------------- context caches: TTL ceiling and quotas
def test_a_ttl_beyond_the_ceiling_is_400(engine):
    with make_client(engine, max_context_cache_ttl=60) as c:
        body = {"model": MODEL, "prompt": [5, 6, 7], "ttl_seconds": 61}
        error = assert_openai_error(c.post("/v1/context_caches", json=body), 400)
        assert error["param"] == "ttl_seconds" and "60" in error["message"]
        cache = c.post("/v1/context_caches", json={"model": MODEL, "prompt": [5, 6, 7]}).json()
        assert cache["expires_at"] - cache["created"] <= 60  # the default ttl fits under the ceiling


def _create(c: TestClient, key: str, num_tokens: int = 3) -> httpx.Response:
    body = {"model": MODEL, "prompt": list(range(5, 5 + num_tokens))}
    return c.post("/v1/context_caches", json=body, headers={"Authorization": f"Bearer {key}"})


def test_each_key_has_its_own_quota_of_caches_and_tokens(engine):
    with make_client(engine, api_keys=("a", "b"), context_caches_per_key=2, context_cache_tokens_per_key=10) as c:
        assert _create(c, "a").status_code == 200 and _create(c, "a").status_code == 200
        error = assert_openai_error(_create(c, "a"), 429, "rate_limit_exceeded")
        assert error["code"] == "context_cache_quota_exceeded"
        assert _create(c, "b", num_tokens=10).status_code == 200
        over = assert_openai_error(_create(c, "b", num_tokens=1), 429, "rate_limit_exceeded")
        assert "10 one key may keep pinned" in over["message"]


def test_caches_belong_to_their_key_and_the_admin_lists_and_frees_them(engine):
    with make_client(engine, api_keys=("a", "b"), admin_key="root") as c:
        mine = _create(c, "a").json()["id"]
        path = f"/v1/context_caches/{mine}"
        assert c.get(path, headers={"Authorization": "Bearer a"}).status_code == 200
        assert_openai_error(c.get(path, headers={"Authorization": "Bearer b"}), 404, "not_found_error")
        assert_openai_error(c.delete(path, headers={"Authorization": "Bearer b"}), 404, "not_found_error")
        use = {**COMPLETION, "context_cache_id": mine}
        assert_openai_error(c.post("/v1/completions", json=use, headers={"Authorization": "Bearer b"}), 404,
                            "not_found_error")
        listed = c.get("/v1/context_caches", headers={"Authorization": "Bearer root"}).json()["data"]
        assert [entry["id"] for entry in listed] == [mine] and listed[0]["owner"].startswith("key:")
        assert c.delete(path, headers={"Authorization": "Bearer root"}).json()["deleted"] is True
        assert c.get("/v1/context_caches", headers={"Authorization": "Bearer root"}).json()["data"] == []
        assert ("context_cache.delete", {"id": mine}) in engine.admin_calls


def test_store_quota_counts_reservations_and_gives_them_back():
    store = ContextCacheStore(limits=ContextCacheLimits(caches_per_owner=2, tokens_per_owner=100, total_caches=3))
    store.reserve("ctxc-1", "a", 60)
    with pytest.raises(ContextCacheQuotaExceeded):
        store.reserve("ctxc-2", "a", 41)  # 60 reserved + 41 > 100
    store.release("ctxc-1")
    store.reserve("ctxc-2", "a", 41)
    store.add("ctxc-2", MODEL, 41, ttl_s=10.0, owner="a", token_ids=[1])
    assert store.usage("a") == (1, 41)
    store.add("ctxc-3", MODEL, 1, ttl_s=10.0, owner="b", token_ids=[1])
    store.add("ctxc-4", MODEL, 1, ttl_s=10.0, owner="c", token_ids=[1])
    with pytest.raises(ContextCacheQuotaExceeded, match="maximum of 3"):
        store.reserve("ctxc-5", "d", 1)
    store.delete("ctxc-3")
    assert store.usage("b") == (0, 0)
    store.reserve("ctxc-5", "d", 1)


def test_store_expires_in_expiry_order_through_many_deletions():
    clock = [1000.0]
    store = ContextCacheStore(clock=lambda: clock[0], limits=ContextCacheLimits(caches_per_owner=10_000,
                                                                               total_caches=10_000))
    for i in range(500):
        store.add(f"ctxc-{i}", MODEL, 1, ttl_s=1.0 + (i * 7919) % 500, owner="a", token_ids=[1])
    for i in range(0, 500, 2):
        store.delete(f"ctxc-{i}")
    assert len(store._expiry) <= 2 * len(store) + 64  # deleted ids do not pile up in the heap
    clock[0] += 250.0
    alive = {c.id for c in store.list()}
    assert alive == {f"ctxc-{i}" for i in range(1, 500, 2) if 1.0 + (i * 7919) % 500 > 250.0}
    assert store.usage("a") == (len(alive), len(alive))
    expired = next(f"ctxc-{i}" for i in range(1, 500, 2) if f"ctxc-{i}" not in alive)
    with pytest.raises(ContextCacheNotFound) as raised:
        store.get(expired)
    assert raised.value.expired
