"""The OpenAI-compatible API, driven in-process against a scripted fake engine.

The fake engine answers sample k of every request with the bytes of REPLIES[k]
(one token per byte with the byte-level test tokenizer), cut at max_tokens, so
every expected text, token count and logprob below follows from the script.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from meshserve.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob
from meshserve.entrypoints.openai.api_server import build_app
from meshserve.wire.client import NO_TENANCY, AdminReply, EngineStats
from meshserve.wire.errors import EngineDeadError, QueueFullError, RequestTooLongError
from meshserve.wire.sampling_params import SamplingParams

MODEL = "fake-moe"
MAX_MODEL_LEN = 128
REPLIES = ["The quick brown fox.", "Lorem ipsum dolor."]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
REPO_ROOT = Path(__file__).resolve().parents[3]


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte, so texts and token counts correspond exactly."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def fake_logprob(sample: int, position: int) -> float:
    return -0.1 * (position + 1) - 0.01 * sample


def cached_tokens_for(prompt_len: int) -> int:
    return prompt_len // 2


class FakeEngine:
    """Scripted engine: deterministic replies, and switches to fail in each way the real one can."""

    model_name = MODEL
    max_model_len = MAX_MODEL_LEN

    def __init__(self) -> None:
        self.tokenizer = make_byte_tokenizer()
        self.calls: list[dict] = []
        self.aborted: list[str] = []
        self.closed_unfinished: list[str] = []
        self.tokens_emitted = 0
        self.token_delay_s = 0.0
        self.fail_with: Exception | None = None  # raised when a request is submitted
        self.fail_after_tokens: int | None = None  # fail mid-request after this many tokens
        self.stats = EngineStats(num_running=2, num_waiting=1, kv_usage=0.25, num_kv_blocks=100,
                                 prefix_cache_queries=100, prefix_cache_hits=40)
        self.stats_queries = 0
        self._dead_error: str | None = None

    def kill(self, error: str) -> None:
        self._dead_error = error

    @property
    def healthy(self) -> bool:
        return self._dead_error is None

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    def health(self) -> dict:
        return {}

    async def start(self) -> None:
        pass

    async def get_stats(self) -> EngineStats:
        self.stats_queries += 1
        return self.stats

    async def admin(self, op: str, args: dict | None = None) -> AdminReply:
        return AdminReply(query_id=0, ok=False, error=f"the fake engine takes no operator commands ({op})")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, prompt, prompt_token_ids, params, request_id, priority=0, context_cache_id=None,
                       context_cache_ttl_s=None, tenancy=NO_TENANCY):
        """Every prompt the same way: a context cache's prefix is part of `prompt_token_ids` already."""
        assert isinstance(params, SamplingParams)
        self.calls.append({"prompt": prompt, "prompt_token_ids": list(prompt_token_ids), "params": params,
                           "request_id": request_id, "priority": priority, "tenancy": tenancy})
        if self._dead_error is not None:
            raise EngineDeadError(self._dead_error)
        if self.fail_with is not None:
            raise self.fail_with
        scripts = [self.tokenizer.encode(REPLIES[k % len(REPLIES)])[: params.max_tokens] for k in range(params.n)]
        full_lengths = [len(self.tokenizer.encode(REPLIES[k % len(REPLIES)])) for k in range(params.n)]
        outs = [CompletionOutput(index=k, logprobs=[] if params.logprobs is not None else None)
                for k in range(params.n)]
        finished = False
        try:
            for step in range(max(len(s) for s in scripts)):
                if self.fail_after_tokens is not None and step == self.fail_after_tokens:
                    for out in outs:
                        out.text_delta, out.token_ids_delta, out.logprobs_delta = "", [], None
                        out.finish_reason = "error"
                    finished = True
                    yield self._output(request_id, prompt, prompt_token_ids, outs, error="worker 0 lost its device")
                    return
                for k, out in enumerate(outs):
                    self._advance(out, scripts[k], full_lengths[k], step, params)
                finished = all(o.finished for o in outs)
                yield self._output(request_id, prompt, prompt_token_ids, outs)
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
        finally:
            if not finished:
                self.closed_unfinished.append(request_id)

    def _advance(self, out: CompletionOutput, script: list[int], full_len: int, step: int,
                 params: SamplingParams) -> None:
        out.text_delta, out.token_ids_delta, out.logprobs_delta = "", [], None
        if out.finished:
            return
        token = script[step]
        self.tokens_emitted += 1
        out.token_ids_delta = [token]
        out.token_ids = out.token_ids + [token]
        out.text_delta = self.tokenizer.decode([token])
        out.text += out.text_delta
        if params.logprobs is not None:
            chosen = fake_logprob(out.index, step)
            top = [TokenLogprob((token + a) % 256, chosen - a, self.tokenizer.decode([(token + a) % 256]))
                   for a in range(params.logprobs)]
            position = PositionLogprobs(TokenLogprob(token, chosen, out.text_delta), top)
            out.logprobs_delta = [position]
            out.logprobs = out.logprobs + [position]
        if len(out.token_ids) == len(script):
            out.finish_reason = "length" if len(script) < full_len else "stop"

    @staticmethod
    def _output(request_id, prompt, prompt_token_ids, outs, error=None) -> RequestOutput:
        return RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
            outputs=[dataclasses.replace(o) for o in outs], finished=all(o.finished for o in outs),
            num_cached_tokens=cached_tokens_for(len(prompt_token_ids)), error=error)


# ---------------------------------------------------------------- fixtures and helpers
@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, max_queue_hint=1024)) as c:
        yield c


def sse_events(response) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    text = response.text
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(response, status: int, error_type: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    assert error["message"]
    return error


def tokens_of(engine: FakeEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


# ---------------------------------------------------------------- models, health
def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model"
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_openai_error(client.get("/v1/models/other"), 404, "not_found_error")


def test_served_model_name_replaces_the_engine_name(engine):
    with TestClient(build_app(engine, served_model_name="alias")) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["alias"]
        ok = c.post("/v1/completions", json={"model": "alias", "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["model"] == "alias"
        assert_openai_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}), 404, "not_found_error")


def test_health_follows_the_engine(client, engine):
    assert client.get("/health").status_code == 200
    engine.kill("worker 1 exited with code 137")
    error = assert_openai_error(client.get("/health"), 503, "service_unavailable_error")
    assert "worker 1 exited with code 137" in error["message"]


# ---------------------------------------------------------------- completions
def test_completion_text_prompt(client, engine):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": REPLIES[0][:5], "logprobs": None, "finish_reason": "length"}]
    prompt_ids = tokens_of(engine, "Say hi")
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                             "total_tokens": len(prompt_ids) + 5,
                             "prompt_tokens_details": {"cached_tokens": cached_tokens_for(len(prompt_ids))}}
    call = engine.calls[0]
    assert call["prompt"] == "Say hi" and call["prompt_token_ids"] == prompt_ids
    assert call["request_id"] == body["id"]
    assert r.headers["x-request-id"] == body["id"]


def test_completion_that_ends_on_its_own_finishes_with_stop(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 40}).json()
    assert body["choices"][0]["text"] == REPLIES[0]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(REPLIES[0])


def test_omitted_max_tokens_defaults_to_openais_16(client, engine):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello"})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": None})
    assert [call["params"].max_tokens for call in engine.calls] == [16, 16]
    # chat keeps generating until the context ends
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert engine.calls[2]["params"].max_tokens == MAX_MODEL_LEN - len(engine.calls[2]["prompt_token_ids"])


def test_batch_of_prompts_with_n_gives_one_choice_per_prompt_and_sample(client, engine):
    token_prompt = tokens_of(engine, "xyz")
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [token_prompt, "ab"], "n": 2,
                                             "max_tokens": 6})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # choice p * n + k is sample k of prompt p
    assert [c["text"] for c in body["choices"]] == [REPLIES[0][:6], REPLIES[1][:6]] * 2
    assert [c["prompt_token_ids"] for c in engine.calls] == [token_prompt, tokens_of(engine, "ab")]
    assert engine.calls[0]["prompt"] is None
    assert [c["request_id"] for c in engine.calls] == [body["id"] + "-0", body["id"] + "-1"]
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 4 * 6
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_tokens_for(3) + cached_tokens_for(2)


def test_list_of_token_id_lists_is_a_batch(client, engine):
    prompts = [tokens_of(engine, "a"), tokens_of(engine, "bc")]
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 3}).json()
    assert len(body["choices"]) == 2
    assert [c["prompt_token_ids"] for c in engine.calls] == prompts


def test_sampling_fields_reach_the_engine(client, engine):
    r = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 1, "stop": "\n",
        "seed": 1234, "presence_penalty": 0.5, "frequency_penalty": -0.5, "user": "u1",
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "stop_token_ids": [7, 8],
        "min_tokens": 2, "include_stop_str_in_output": True, "skip_special_tokens": False, "priority": 3,
    })
    assert r.status_code == 200, r.text
    call = engine.calls[0]
    assert call["priority"] == 3
    assert call["params"] == SamplingParams(
        n=1, temperature=0.5, top_p=0.9, top_k=20, min_p=0.05, seed=1234, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, stop=["\n"], stop_token_ids=[7, 8], max_tokens=7,
        min_tokens=2, ignore_eos=True, logprobs=None, include_stop_str_in_output=True, skip_special_tokens=False)


def test_openai_defaults_when_fields_are_absent_or_null(client, engine):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": None,
                                         "top_p": None, "stop": None})
    params = engine.calls[0]["params"]
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (1.0, 1.0, -1, [])


def next_token_text(engine: FakeEngine, text: str) -> str:
    """The fake's second-best alternative to the one-token `text`: the next token id."""
    (token,) = engine.tokenizer.encode(text)
    return engine.tokenizer.decode([(token + 1) % 256])


def test_completion_logprobs(client, engine):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                                "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    text = REPLIES[0][:4]
    assert logprobs["tokens"] == list(text)
    assert logprobs["token_logprobs"] == pytest.approx([fake_logprob(0, j) for j in range(4)])
    assert logprobs["text_offset"] == [0, 1, 2, 3]
    for j, top in enumerate(logprobs["top_logprobs"]):
        # the fake's alternatives: the chosen token, then the next token id one nat less likely
        assert top == pytest.approx({text[j]: fake_logprob(0, j),
                                     next_token_text(engine, text[j]): fake_logprob(0, j) - 1})


def test_completion_echo_prepends_the_prompt(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "Q: ", "max_tokens": 3,
                                                "echo": True}).json()
    assert body["choices"][0]["text"] == "Q: " + REPLIES[0][:3]


def test_completion_stream(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 6, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLIES[0][:6]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_completion_stream_with_n_and_usage(client, engine):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 40, "n": 2,
                                             "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks:
        assert chunk["usage"] is None
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            assert choice["index"] not in finishes
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: REPLIES[0], 1: REPLIES[1]}
    assert finishes == {0: "stop", 1: "stop"}
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(REPLIES[0]) + len(REPLIES[1])
    assert usage_chunk["usage"]["prompt_tokens"] == len(tokens_of(engine, "Hi"))


def test_completion_stream_logprobs_continue_text_offsets(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5, "logprobs": 0,
                                             "stream": True})
    chunks = sse_events(r)[:-1]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    token_logprobs = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert offsets == [0, 1, 2, 3, 4]
    assert token_logprobs == pytest.approx([fake_logprob(0, j) for j in range(5)])


def test_completion_stream_echo_sends_the_prompt_first(client):
    chunks = sse_events(client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Q: ", "max_tokens": 3, "echo": True, "stream": True}))[:-1]
    assert chunks[0]["choices"][0]["text"].startswith("Q: ")
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Q: " + REPLIES[0][:3]


# ---------------------------------------------------------------- chat
def test_chat_completion(client, engine):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 8,
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
                     {"role": "assistant", "content": "Hi."},
                     {"role": "user", "content": "Again"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLIES[0][:8]},
                                "logprobs": None, "finish_reason": "length"}]
    expected_prompt = "<|system|>Be brief.\n<|user|>Hello\n<|assistant|>Hi.\n<|user|>Again\n<|assistant|>"
    call = engine.calls[0]
    assert call["prompt"] == expected_prompt
    assert call["prompt_token_ids"] == engine.tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)
    assert body["usage"]["completion_tokens"] == 8


def test_chat_max_completion_tokens_wins_over_max_tokens(client, engine):
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 9, "max_completion_tokens": 4})
    assert engine.calls[0]["params"].max_tokens == 4


def test_chat_stream_sends_the_role_first(client):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "n": 2,
        "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # one role chunk per choice before any content
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert sorted(c["choices"][0]["index"] for c in chunks[:2]) == [0, 1]
    contents = {0: "", 1: ""}
    for chunk in chunks[2:]:
        (choice,) = chunk["choices"]
        assert "role" not in choice["delta"]
        contents[choice["index"]] += choice["delta"].get("content", "")
    assert contents == {0: REPLIES[0], 1: REPLIES[1]}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == sum(map(len, REPLIES))


def test_chat_logprobs(client, engine):
    body = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "logprobs": True, "top_logprobs": 2}).json()
    assert engine.calls[0]["params"].logprobs == 2
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == list(REPLIES[0][:3])
    for j, entry in enumerate(content):
        assert entry["logprob"] == pytest.approx(fake_logprob(0, j))
        assert entry["bytes"] == list(entry["token"].encode())
        assert [t["token"] for t in entry["top_logprobs"]] == [entry["token"], next_token_text(engine, entry["token"])]
    no_top = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}).json()
    assert engine.calls[1]["params"].logprobs == 0
    assert [e["top_logprobs"] for e in no_top["choices"][0]["logprobs"]["content"]] == [[], []]


def test_chat_stream_logprobs(client):
    chunks = sse_events(client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True,
        "stream": True}))[:-1]
    entries = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in entries] == list(REPLIES[0][:3])


# ---------------------------------------------------------------- errors
BAD_COMPLETION_BODIES = {
    "malformed json": b'{"model": "fake-moe", "prompt": ',
    "not an object": b'["fake-moe"]',
    "empty body": b"",
    "wrong type": {"model": MODEL, "prompt": "Hi", "max_tokens": "5"},
    "bool for int": {"model": MODEL, "prompt": "Hi", "n": True},
    "unknown field": {"model": MODEL, "prompt": "Hi", "bogus": 1},
    "missing model": {"prompt": "Hi"},
    "missing prompt": {"model": MODEL},
    "zero max_tokens": {"model": MODEL, "prompt": "Hi", "max_tokens": 0},
    "negative max_tokens": {"model": MODEL, "prompt": "Hi", "max_tokens": -3},
    "negative temperature": {"model": MODEL, "prompt": "Hi", "temperature": -0.1},
    "temperature above 2": {"model": MODEL, "prompt": "Hi", "temperature": 2.5},
    "top_p zero": {"model": MODEL, "prompt": "Hi", "top_p": 0},
    "top_p above 1": {"model": MODEL, "prompt": "Hi", "top_p": 1.5},
    "n zero": {"model": MODEL, "prompt": "Hi", "n": 0},
    "logprobs too many": {"model": MODEL, "prompt": "Hi", "logprobs": 21},
    "logprobs negative": {"model": MODEL, "prompt": "Hi", "logprobs": -1},
    "empty prompt": {"model": MODEL, "prompt": ""},
    "empty prompt list": {"model": MODEL, "prompt": []},
    "empty prompt in batch": {"model": MODEL, "prompt": ["a", ""]},
    "mixed prompt list": {"model": MODEL, "prompt": ["a", 3]},
    "token id outside vocab": {"model": MODEL, "prompt": [1, 999999]},
    "empty stop string": {"model": MODEL, "prompt": "Hi", "stop": [""]},
    "stream_options without stream": {"model": MODEL, "prompt": "Hi", "stream_options": {"include_usage": True}},
    "suffix": {"model": MODEL, "prompt": "Hi", "suffix": "end"},
    "echo with logprobs": {"model": MODEL, "prompt": "Hi", "echo": True, "logprobs": 1},
    # caught by SamplingParams' own validation
    "min_tokens above max_tokens": {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "min_tokens": 5},
    "top_k below -1": {"model": MODEL, "prompt": "Hi", "top_k": -5},
}


@pytest.mark.parametrize("body", BAD_COMPLETION_BODIES.values(), ids=BAD_COMPLETION_BODIES.keys())
def test_bad_completion_requests_are_400(client, engine, body):
    kwargs = ({"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes)
              else {"json": body})
    assert_openai_error(client.post("/v1/completions", **kwargs), 400)
    assert engine.calls == []


BAD_CHAT_BODIES = {
    "no messages": {"model": MODEL, "messages": []},
    "unknown role": {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
    "image part": {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
    "content not text": {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
    "top_logprobs without logprobs": {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "top_logprobs": 2},
    "logprobs as int": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 2},
    "tools": {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
              "tools": [{"type": "function", "function": {"name": "f"}}]},
    "zero max_completion_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                   "max_completion_tokens": 0},
}


@pytest.mark.parametrize("body", BAD_CHAT_BODIES.values(), ids=BAD_CHAT_BODIES.keys())
def test_bad_chat_requests_are_400(client, engine, body):
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400)
    assert engine.calls == []


def test_validation_errors_name_the_parameter(client):
    error = assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                                     "temperature": 3}), 400)
    assert error["param"] == "temperature" and "temperature" in error["message"]
    error = assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                                     "frobnicate": 1}), 400)
    assert "frobnicate" in error["message"]
    error = assert_openai_error(client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "user"}]}), 400)
    assert error["param"] == "messages[1].content"


def test_unknown_model_is_404(client, engine):
    for path, extra in [("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        error = assert_openai_error(client.post(path, json={"model": "gpt-9", **extra}), 404, "not_found_error")
        assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    assert engine.calls == []


def test_too_long_request_states_the_numbers(client, engine):
    prompt = "x" * 120
    error = assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                     "max_tokens": 10}), 400)
    for number in ("128", "130", "120", "10"):
        assert number in error["message"]
    assert error["code"] == "context_length_exceeded"
    error = assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 128}), 400)
    assert "128" in error["message"]
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8}).status_code == 200
    assert len(engine.calls) == 1


def test_engine_length_rejection_is_400(client, engine):
    engine.fail_with = RequestTooLongError("prompt (60) + max_tokens (4) needs 5 blocks; the KV pool has 3")
    error = assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                                     "max_tokens": 4}), 400)
    assert "the KV pool has 3" in error["message"]


def test_full_queue_is_503(client, engine):
    engine.fail_with = QueueFullError("1024 requests are waiting")
    for stream in (False, True):
        error = assert_openai_error(client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": stream}), 503, "service_unavailable_error")
        assert "1024" in error["message"] and error["code"] == "queue_full"


def test_dead_engine_rejects_new_requests_with_503(client, engine):
    engine.kill("worker 0 died")
    for path, extra in [("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        error = assert_openai_error(client.post(path, json={"model": MODEL, **extra}), 503,
                                    "service_unavailable_error")
        assert "worker 0 died" in error["message"]


def test_engine_dying_at_submission_is_503(client, engine):
    engine.fail_with = EngineDeadError("master exited")
    assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}), 503,
                        "service_unavailable_error")


def test_failure_mid_request_is_500(client, engine):
    engine.fail_after_tokens = 2
    error = assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                                     "max_tokens": 8}), 500, "server_error")
    assert "worker 0 lost its device" in error["message"]


def test_failure_mid_stream_is_an_error_event_then_done(client, engine):
    engine.fail_after_tokens = 2
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 8, "stream": True})
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert "worker 0 lost its device" in error["message"] and error["type"] == "server_error"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-2])
    assert content == REPLIES[0][:2]


def test_unknown_route_and_wrong_method_use_error_json(client):
    assert_openai_error(client.get("/v1/nothing"), 404, "not_found_error")
    assert_openai_error(client.get("/v1/completions"), 405)


def test_request_id_header_is_honoured(client, engine):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                    headers={"X-Request-Id": "trace-42"})
    assert r.json()["id"] == "cmpl-trace-42"
    assert r.headers["x-request-id"] == "cmpl-trace-42"
    assert engine.calls[0]["request_id"] == "cmpl-trace-42"
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 2}, headers={"X-Request-Id": "trace-43"})
    assert chat.json()["id"] == "chatcmpl-trace-43"


def test_generated_request_ids_are_unique(client):
    ids = {client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}).json()["id"]
           for _ in range(3)}
    assert len(ids) == 3


# ---------------------------------------------------------------- client disconnects
async def _drive_until_disconnect(app, path: str, payload: dict, disconnect_when) -> list[bytes]:
    """Run one request through the raw ASGI app; the client hangs up once `disconnect_when(chunks)` holds."""
    body = json.dumps(payload).encode()
    chunks: list[bytes] = []
    hang_up = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])

    async def watch():
        while not disconnect_when(chunks):
            await asyncio.sleep(0.005)
        hang_up.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 50000), "server": ("test", 80)}
    watcher = asyncio.create_task(watch())
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    watcher.cancel()
    return chunks


def test_streaming_client_that_hangs_up_aborts_its_request(engine):
    engine.token_delay_s = 0.02
    app = build_app(engine)
    payload = {"model": MODEL, "prompt": "Hi", "max_tokens": 40, "stream": True}
    chunks = asyncio.run(_drive_until_disconnect(app, "/v1/completions", payload, lambda c: len(c) >= 3))
    request_id = engine.calls[0]["request_id"]
    assert engine.aborted == [request_id]
    assert engine.closed_unfinished == [request_id]
    assert engine.tokens_emitted < len(REPLIES[0])
    assert b"[DONE]" not in b"".join(chunks)


def test_non_streaming_client_that_hangs_up_aborts_its_request(engine):
    engine.token_delay_s = 0.02
    app = build_app(engine)
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40}
    chunks = asyncio.run(_drive_until_disconnect(app, "/v1/chat/completions", payload,
                                                 lambda _: engine.tokens_emitted >= 3))
    assert engine.aborted == [engine.calls[0]["request_id"]]
    assert engine.tokens_emitted < len(REPLIES[0])
    assert chunks == []


def test_finished_requests_are_not_aborted(client, engine):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True})
    assert engine.aborted == [] and engine.closed_unfinished == []


# ---------------------------------------------------------------- metrics
def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_after_a_few_requests(client, engine):
    usages, finish_reasons = [], []
    for body in ({"model": MODEL, "prompt": "Hi", "max_tokens": 5},
                 {"model": MODEL, "prompt": "Hello there", "max_tokens": 40, "n": 2}):
        r = client.post("/v1/completions", json=body).json()
        usages.append(r["usage"])
        finish_reasons += [c["finish_reason"] for c in r["choices"]]
    streamed = sse_events(client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}}))
    usages.append(streamed[-2]["usage"])
    finish_reasons.append("length")

    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = _samples(r.text)
    assert engine.stats_queries == 1
    assert samples[("meshserve_time_to_first_token_seconds_count", ())] == 3
    assert samples[("meshserve_e2e_request_latency_seconds_count", ())] == 3
    assert samples[("meshserve_time_per_output_token_seconds_count", ())] == 3
    generated = sum(u["completion_tokens"] for u in usages)
    assert samples[("meshserve_generation_tokens_total", ())] == generated
    assert samples[("meshserve_prompt_tokens_total", ())] == sum(u["prompt_tokens"] for u in usages)
    for reason in ("stop", "length"):
        assert samples[("meshserve_request_success_total", (("finish_reason", reason),))] == \
            finish_reasons.count(reason)
    # every token was generated within the rate window
    assert samples[("meshserve_generation_tokens_per_second", ())] == pytest.approx(generated / 10.0)
    assert samples[("meshserve_num_requests_running", ())] == 2
    assert samples[("meshserve_num_requests_waiting", ())] == 1
    assert samples[("meshserve_kv_cache_usage_ratio", ())] == 0.25
    assert samples[("meshserve_prefix_cache_hit_rate", ())] == pytest.approx(0.4)
    assert samples[("meshserve_prefix_cache_queries_total", ())] == 100
    assert samples[("meshserve_prefix_cache_hits_total", ())] == 40

    # engine gauges are re-read at every scrape
    engine.stats = msgspec.structs.replace(engine.stats, num_running=0, num_waiting=0, kv_usage=0.0,
                                           prefix_cache_queries=200, prefix_cache_hits=150)
    samples = _samples(client.get("/metrics").text)
    assert samples[("meshserve_num_requests_running", ())] == 0
    assert samples[("meshserve_prefix_cache_hit_rate", ())] == pytest.approx(0.75)
    assert samples[("meshserve_prefix_cache_queries_total", ())] == 200


def test_failed_and_aborted_requests_are_not_counted_as_successes(client, engine):
    engine.fail_after_tokens = 1
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5})
    samples = _samples(client.get("/metrics").text)
    assert not any(name == "meshserve_request_success_total" for name, _ in samples)
    assert samples[("meshserve_e2e_request_latency_seconds_count", ())] == 0
    assert samples[("meshserve_generation_tokens_total", ())] == 1


def test_each_app_has_its_own_registry():
    first, second = FakeEngine(), FakeEngine()
    with TestClient(build_app(first)) as a, TestClient(build_app(second)) as b:
        a.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        assert _samples(a.get("/metrics").text)[("meshserve_generation_tokens_total", ())] == 4
        assert _samples(b.get("/metrics").text)[("meshserve_generation_tokens_total", ())] == 0


# ---------------------------------------------------------------- run_server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SERVER_SCRIPT = """
import sys
from meshserve.entrypoints.openai.api_server import run_server
from tests.entrypoints.openai.test_api import FakeEngine
run_server(FakeEngine(), "127.0.0.1", int(sys.argv[1]), log_level="warning")
print("run_server returned", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_server_serves_and_stops_cleanly_on_signals(sig):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, str(port)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=1) as client:  # one client: each one-shot httpx call builds a TLS context
            while True:
                assert proc.poll() is None, proc.communicate()[1]
                try:
                    if client.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "server did not become healthy in 30 s"
                time.sleep(0.1)
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}, timeout=10)
        assert r.json()["choices"][0]["text"] == REPLIES[0][:3]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "run_server returned" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
