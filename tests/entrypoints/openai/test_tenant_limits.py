"""Per-tenant limits on a fake clock: the token bucket (reserve on admission, settle with the tokens used),
running requests per tenant, connections per client address, the 429 with Retry-After through the app, the
per-tenant metrics, and the settings' flags."""
from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from meshserve.config import ConfigError
from meshserve.entrypoints.cli import build_parser
from meshserve.entrypoints.openai.api_server import build_app
from meshserve.entrypoints.openai.errors import APIError
from meshserve.entrypoints.openai.server_options import (
    TenantLimits,
    server_options,
    server_options_from_args,
)
from meshserve.entrypoints.openai.tenant_limits import (
    BYTES_PER_TOKEN,
    ConnectionLimiter,
    TenantGate,
    TenantLimiter,
    TenantLimitExceeded,
    TokenBucket,
    current_ticket,
    request_cost,
)
from tests.entrypoints.openai.fake_server import AdminFakeEngine
from tests.entrypoints.openai.test_api import MODEL, assert_openai_error


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# ---------------------------------------------------------------- token bucket
def test_a_bucket_starts_full_refills_per_second_and_tells_the_wait():
    bucket = TokenBucket(600, now=0.0)  # 10 tokens a second
    assert bucket.try_take(600, now=0.0) is None
    assert bucket.try_take(50, now=0.0) == pytest.approx(5.0)
    assert bucket.try_take(50, now=5.0) is None
    assert bucket.level == pytest.approx(0.0)


def test_a_take_larger_than_the_bucket_waits_for_a_full_bucket_then_leaves_a_debt():
    bucket = TokenBucket(600, now=0.0)
    bucket.try_take(1, now=0.0)
    assert bucket.try_take(1000, now=0.0) == pytest.approx(0.1)
    assert bucket.try_take(1000, now=0.1) is None
    assert bucket.level == pytest.approx(-400.0)
    assert bucket.try_take(10, now=0.1) == pytest.approx(41.0)


def test_a_shorter_burst_makes_a_smaller_bucket_refilled_as_fast():
    bucket = TokenBucket(600, now=0.0, burst_s=6.0)
    assert bucket.capacity == 60 and bucket.try_take(60, now=0.0) is None
    assert bucket.try_take(20, now=0.0) == pytest.approx(2.0)


def test_a_bucket_never_holds_more_than_its_capacity():
    bucket = TokenBucket(60, now=0.0)
    bucket.give_back(1000, now=500.0)
    assert bucket.level == 60 and bucket.is_full(500.0)


# ---------------------------------------------------------------- the limiter
def test_running_requests_per_tenant_are_capped_and_freed_on_release(clock):
    limiter = TenantLimiter(TenantLimits(max_requests_per_tenant=2), clock)
    first, _ = limiter.admit("key:a", 0), limiter.admit("key:a", 0)
    with pytest.raises(TenantLimitExceeded) as refused:
        limiter.admit("key:a", 0)
    assert refused.value.reason == "requests_per_tenant" and refused.value.retry_after_s > 0
    limiter.admit("key:b", 0)  # another tenant is not held back
    first.release()
    first.release()  # twice frees once
    assert limiter.running("key:a") == 1
    limiter.admit("key:a", 0)


def test_tokens_are_reserved_on_admission_and_the_unused_part_returned(clock):
    limiter = TenantLimiter(TenantLimits(tokens_per_minute_per_tenant=600), clock)
    ticket = limiter.admit("key:a", 500)
    assert limiter.bucket("key:a").level == pytest.approx(100)
    with pytest.raises(TenantLimitExceeded) as refused:
        limiter.admit("key:a", 200)
    assert refused.value.reason == "tokens_per_minute"
    assert refused.value.retry_after_s == pytest.approx(10.0)  # 100 tokens missing at 10 a second
    ticket.add_usage(prompt_tokens=50, generation_tokens=30)
    ticket.release()
    assert limiter.bucket("key:a").level == pytest.approx(520)
    limiter.admit("key:a", 200)
    limiter.admit("key:b", 600)  # buckets are per tenant


def test_a_request_that_used_more_than_it_reserved_leaves_a_debt(clock):
    limiter = TenantLimiter(TenantLimits(tokens_per_minute_per_tenant=600), clock)
    ticket = limiter.admit("key:a", 100)
    ticket.add_usage(400, 300)
    ticket.release()
    assert limiter.bucket("key:a").level == pytest.approx(-100)
    clock.now += 10.0  # 100 tokens later: back to zero, still short
    with pytest.raises(TenantLimitExceeded):
        limiter.admit("key:a", 1)


def test_idle_tenants_are_forgotten_once_their_bucket_is_full(clock):
    limiter = TenantLimiter(TenantLimits(tokens_per_minute_per_tenant=600), clock)
    ticket = limiter.admit("key:a", 10)
    ticket.add_usage(10, 0)
    clock.now += 60.0
    ticket.release()
    assert limiter.bucket("key:a") is None and limiter.running("key:a") == 0


def test_without_a_token_budget_nothing_is_reserved(clock):
    limiter = TenantLimiter(TenantLimits(), clock)
    assert limiter.admit("key:a", 10**9).reserved == 0 and limiter.bucket("key:a") is None


# ---------------------------------------------------------------- connections per address
def test_connections_beyond_an_address_share_are_refused_and_counted_apart():
    refused = []
    limiter = ConnectionLimiter(2, on_refused=refused.append)
    assert limiter.try_open("client:1.1.1.1") and limiter.try_open("client:1.1.1.1")
    assert not limiter.try_open("client:1.1.1.1")
    assert limiter.try_open("client:2.2.2.2")
    assert refused == ["client:1.1.1.1"] and limiter.admitted_total == 3
    limiter.close("client:1.1.1.1")
    assert limiter.held("client:1.1.1.1") == 1 and limiter.try_open("client:1.1.1.1")


# ---------------------------------------------------------------- a request's cost
@pytest.mark.parametrize(("body", "prompts", "completion"), [
    ({"prompt": "hello", "max_tokens": 7}, 1, 7),
    ({"prompt": ["a", "b", "c"], "max_tokens": 7, "n": 2}, 3, 14),
    ({"prompt": [[1, 2], [3, 4]], "max_tokens": 5}, 2, 5),
    ({"prompt": [1, 2, 3], "max_tokens": 5}, 1, 5),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}, 1, 9),
    ({"prompt": "hello"}, 1, 4096),  # no max_tokens: the model's context at most
])
def test_a_request_costs_its_body_estimate_plus_prompts_times_n_times_max_tokens(body, prompts, completion):
    raw = json.dumps(body).encode()
    assert request_cost(raw, 4096) == -(-len(raw) // BYTES_PER_TOKEN) + prompts * completion


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'{"max_tokens": "many"}'])
def test_a_body_that_does_not_parse_costs_its_size(raw):
    assert request_cost(raw, 4096) == -(-len(raw) // BYTES_PER_TOKEN)


# ---------------------------------------------------------------- the gate
class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def count_request(self, tenant):
        self.events.append(("request", tenant))

    def count_rejected(self, tenant, reason):
        self.events.append(("rejected", tenant, reason))

    def count_tokens(self, tenant, prompt, generation):
        self.events.append(("tokens", tenant, prompt, generation))


def test_the_gate_leaves_the_admin_and_routes_outside_v1_alone(clock):
    gate = TenantGate(TenantLimits(max_requests_per_tenant=1), 4096, clock=clock)
    assert gate.admit("admin", True, "POST", "/v1/completions", b"{}") is None
    assert gate.admit("client:x", False, "GET", "/health", b"") is None


def test_the_gate_answers_429_with_retry_after_and_reports_per_tenant(clock):
    recorder = Recorder()
    gate = TenantGate(TenantLimits(tokens_per_minute_per_tenant=120), 4096, recorder, clock)
    body = json.dumps({"prompt": "hi", "max_tokens": 100}).encode()
    with gate.admit("key:a", False, "POST", "/v1/completions", body) as ticket:
        assert current_ticket() is ticket
        ticket.add_usage(2, 3)
    assert current_ticket() is None
    with pytest.raises(APIError) as refused:
        gate.admit("key:a", False, "POST", "/v1/completions", body)
        gate.admit("key:a", False, "POST", "/v1/completions", body)
    error = refused.value
    assert error.status_code == 429 and error.error_type == "rate_limit_exceeded"
    assert int(error.headers["retry-after"]) >= 1
    assert ("tokens", "key:a", 2, 3) in recorder.events
    assert recorder.events[-1] == ("rejected", "key:a", "tokens_per_minute")


# ---------------------------------------------------------------- through the app
def _client(engine, **options) -> TestClient:
    return TestClient(build_app(engine, options=server_options({}, **options)), client=("127.0.0.1", 40000))


def test_over_its_token_budget_a_key_gets_429_with_retry_after_and_another_key_does_not():
    engine = AdminFakeEngine()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
    with _client(engine, api_keys=("key-a", "key-b"), tokens_per_minute_per_tenant=30) as client:
        a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
        assert client.post("/v1/completions", json=body, headers=a).status_code == 200
        statuses = [client.post("/v1/completions", json=body, headers=a) for _ in range(5)]
        refused = [r for r in statuses if r.status_code == 429]
        assert refused, [r.status_code for r in statuses]
        assert assert_openai_error(refused[0], 429, "rate_limit_exceeded")["code"] == "rate_limit_exceeded"
        assert int(refused[0].headers["retry-after"]) >= 1
        assert client.post("/v1/completions", json=body, headers=b).status_code == 200
        page = client.get("/metrics").text
    assert 'meshserve_tenant_rejected_total{reason="tokens_per_minute",tenant="key:' in page
    assert 'meshserve_tenant_tokens_total{kind="generation",tenant="key:' in page
    assert "key-a" not in page and "key-b" not in page  # the label is the key's hash, never the key
    assert 'meshserve_http_rejected_total{reason="rate_limited"}' in page


# ---------------------------------------------------------------- settings
def test_the_tenant_limits_have_flags_and_travel_flat():
    args = build_parser().parse_args(["serve", "--max-requests-per-tenant", "3",
                                      "--tokens-per-minute-per-tenant", "1000"])
    options = server_options_from_args(args, {})
    assert options.tenant_limits == TenantLimits(max_requests_per_tenant=3, tokens_per_minute_per_tenant=1000)
    assert server_options({}, **options.public_kwargs()) == options


def test_a_bad_tenant_limit_is_a_one_line_error_naming_it():
    with pytest.raises(ConfigError, match="^max_connections_per_client must be "):
        server_options({}, max_connections_per_client=0)
