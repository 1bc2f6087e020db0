"""Admission before expansion over the scripted engine: a request's choices (prompts x n) and tokens are checked
against the per-request limits and the waiting queue's room before any engine request is built; the gate's
count of waiting choices returns to zero however a request ends."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from meshserve.entrypoints.openai.admission import AdmissionGate, AdmissionLimits
from meshserve.entrypoints.openai.api_server import build_app
from meshserve.entrypoints.openai.errors import APIError
from meshserve.entrypoints.openai.server_options import server_options
from meshserve.wire.errors import QueueFullError
from tests.entrypoints.openai.test_api import MAX_MODEL_LEN, MODEL, FakeEngine, assert_openai_error, sse_events

# the shape that froze the frontend: 11 KB asking for 128,000 engine requests
AMPLIFYING = {"model": MODEL, "prompt": [[1, 2, 3]] * 1000, "n": 128, "max_tokens": 1}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


def make_client(engine: FakeEngine, max_queue_hint: int | None = 1024, **options) -> TestClient:
    return TestClient(build_app(engine, max_queue_hint=max_queue_hint, options=server_options({}, **options)))


def gate_of(client: TestClient) -> AdmissionGate:
    return client.app.state.serving.admission


def test_the_amplifying_body_is_400_before_any_engine_request(engine):
    with make_client(engine) as client:
        response = client.post("/v1/completions", json=AMPLIFYING)
        error = assert_openai_error(response, 400)
        assert error["code"] == "too_many_choices" and "128000" in error["message"]
        assert engine.calls == [] and gate_of(client).waiting == 0


@pytest.mark.parametrize(("prompts", "n"), [(128, 1), (64, 2), (1, 128)])
def test_a_request_at_the_choice_limit_is_served(engine, prompts, n):
    with make_client(engine) as client:
        body = {"model": MODEL, "prompt": [[5, 6, 7]] * prompts, "n": n, "max_tokens": 1}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == prompts * n
        assert gate_of(client).waiting == 0


def test_one_choice_over_the_limit_is_400(engine):
    with make_client(engine, max_choices_per_request=4) as client:
        body = {"model": MODEL, "prompt": ["a", "b", "c"], "n": 2}
        assert assert_openai_error(client.post("/v1/completions", json=body), 400)["code"] == "too_many_choices"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 5}
        assert assert_openai_error(client.post("/v1/chat/completions", json=chat), 400)["code"] == "too_many_choices"
        assert engine.calls == []
        assert client.post("/v1/completions", json={**body, "n": 1}).status_code == 200


def test_tokens_over_the_request_budget_are_400_before_any_engine_request(engine):
    with make_client(engine, max_tokens_per_request=100) as client:
        # 2 prompts x n=2 x (3 prompt tokens + 30) = 132 > 100
        body = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9, 10]], "n": 2, "max_tokens": 30}
        error = assert_openai_error(client.post("/v1/completions", json=body), 400)
        assert error["code"] == "request_tokens_exceeded" and "132" in error["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 4, "max_tokens": 30}
        assert assert_openai_error(client.post("/v1/chat/completions", json=chat), 400)["param"] == "max_tokens"
        assert engine.calls == []
        assert client.post("/v1/completions", json={**body, "max_tokens": 20}).status_code == 200  # 92 tokens


def test_the_default_token_budget_follows_the_context(engine):
    with make_client(engine) as client:
        limit = gate_of(client).limits.max_tokens
        assert limit == 32 * MAX_MODEL_LEN
        # without max_tokens a chat choice may fill the context: 33 of them are over the budget
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 33}
        assert assert_openai_error(client.post("/v1/chat/completions", json=chat), 400)["code"] == \
            "request_tokens_exceeded"


def test_no_room_in_the_waiting_queue_is_503_queue_full_and_room_comes_back(engine):
    with make_client(engine, max_queue_hint=8) as client:
        gate = gate_of(client)
        held = gate.reserve(6)  # other requests' choices, still waiting for their first token
        body = {"model": MODEL, "prompt": [[5, 6, 7]] * 3, "max_tokens": 2}
        error = assert_openai_error(client.post("/v1/completions", json=body), 503, "service_unavailable_error")
        assert error["code"] == "queue_full" and "at most 8" in error["message"]
        assert engine.calls == []
        held.started(4)
        assert client.post("/v1/completions", json=body).status_code == 200
        held.release()
        assert gate.waiting == 0


def test_a_request_larger_than_the_whole_queue_is_400(engine):
    with make_client(engine, max_waiting_choices=4) as client:
        body = {"model": MODEL, "prompt": "Hi", "n": 5}
        error = assert_openai_error(client.post("/v1/completions", json=body), 400)
        assert error["code"] == "too_many_choices" and "never" in error["message"]


def test_waiting_choices_are_released_however_the_request_ends(engine):
    with make_client(engine) as client:
        gate = gate_of(client)
        streamed = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 3, "stream": True})
        assert sse_events(streamed)[-1] == "[DONE]"
        engine.fail_with = QueueFullError("the waiting queue is full (1024 requests)")
        refused = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 2})
        assert assert_openai_error(refused, 503, "service_unavailable_error")["code"] == "queue_full"
        assert gate.waiting == 0


def test_without_a_queue_size_only_the_per_request_limits_apply(engine):
    with make_client(engine, max_queue_hint=None) as client:
        assert gate_of(client).limits.max_waiting is None
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 128,
                                                    "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------- the gate alone
def test_the_gate_counts_choices_until_their_first_output():
    gate = AdmissionGate(AdmissionLimits(max_choices=8, max_tokens=1000, max_waiting=10))
    first = gate.reserve(6)
    with pytest.raises(QueueFullError):
        gate.reserve(5)
    first.started(2)
    second = gate.reserve(5)
    assert gate.waiting == 9
    first.started(10)  # more than it holds: only its own 4 are let go
    assert gate.waiting == 5
    second.release()
    second.release()
    first.release()
    assert gate.waiting == 0


@pytest.mark.parametrize(("prompts", "n", "fits"), [(8, 1, True), (2, 4, True), (3, 3, False), (1, 9, False)])
def test_the_gate_multiplies_prompts_by_n(prompts, n, fits):
    gate = AdmissionGate(AdmissionLimits(max_choices=8, max_tokens=1000, max_waiting=None))
    if fits:
        gate.check_choices(prompts, n)
    else:
        with pytest.raises(APIError):
            gate.check_choices(prompts, n)


def test_the_gate_sums_prompt_and_max_tokens_over_prompts_and_choices():
    gate = AdmissionGate(AdmissionLimits(max_choices=8, max_tokens=100, max_waiting=None))
    gate.check_tokens([10, 20], [15, 5], 2)  # 2 x (25 + 25) = 100
    with pytest.raises(APIError):
        gate.check_tokens([10, 20], [15, 6], 2)
