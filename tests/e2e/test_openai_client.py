"""The official `openai` client against a real `meshserve serve` process on the tiny deepseek_v3 model.

Every test runs twice: against the single-rank engine, and against `serve --deployment FILE` with a
multi-rank strategy (two DP groups of attention over expert parallelism), which must serve the same
API unchanged.

The model has random weights, so texts are checked against the server itself
(stream == non-stream when greedy, same seed -> same text, stop strings cut a
text generated without them) and token counts against the model's tokenizer.
"""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.e2e.server_process import running_server

STARTUP_TIMEOUT_S = 60
PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
# random weights rarely pick EOS, but greedy checks must not depend on that
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("deepseek_v3", name="tiny-dsv3")


DEPLOYMENT_YAML = """\
parallel: "attn=TP1+DP2 moe=TP1+EP2"
engine:
  max_num_seqs: 16
"""


@pytest.fixture(scope="module", params=["single-rank", "deployment-DP2+EP2"])
def server(request, model_dir, tmp_path_factory):
    """The server process, as a user starts it; yields its base URL."""
    workdir = tmp_path_factory.mktemp("server")
    args = ["--model", str(model_dir)]
    if request.param.startswith("deployment"):
        deployment = workdir / "deployment.yaml"
        deployment.write_text(DEPLOYMENT_YAML)
        args += ["--deployment", str(deployment)]
    with running_server(args, workdir / "server.log", STARTUP_TIMEOUT_S) as base:
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    # no retries: a 503 must surface, not be retried into a pass
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    return models[0].id


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def max_model_len(server, model) -> int:
    card = httpx.get(f"{server}/v1/models", timeout=10).json()["data"][0]
    return card["max_model_len"]


def metric_samples(server: str) -> dict[str, float]:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def test_health_and_models(server, model):
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200
    assert isinstance(model, str) and model


def test_completion_and_its_stream_agree(client, model, tokenizer):
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body=IGNORE_EOS)
    (choice,) = done.choices
    assert choice.finish_reason == "length"
    assert done.id.startswith("cmpl-") and done.object == "text_completion"
    assert done.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert done.usage.completion_tokens == 8
    assert done.usage.total_tokens == done.usage.prompt_tokens + 8

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.prompt_tokens == done.usage.prompt_tokens


def test_chat_and_its_stream_agree(client, model, tokenizer):
    done = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                          extra_body=IGNORE_EOS)
    (choice,) = done.choices
    assert done.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert done.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))

    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=IGNORE_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_n_samples(client, model):
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=3,
                                     extra_body=IGNORE_EOS)
    assert sorted(c.index for c in done.choices) == [0, 1]
    assert done.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, n=2, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    # a batch of prompts: choice p * n + k is sample k of prompt p
    batch = client.completions.create(model=model, prompt=[PROMPT, "Once upon a time"], max_tokens=3, n=2,
                                      temperature=0, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in batch.choices}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy samples of one prompt agree
    single = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, temperature=0,
                                       extra_body=IGNORE_EOS)
    assert texts[2] == single.choices[0].text


def test_logprobs(client, model):
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                     extra_body=IGNORE_EOS)
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        # greedy: nothing is more likely than the chosen token
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-4)

    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
                                          extra_body=IGNORE_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


def test_stop_string_cuts_the_text(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body=IGNORE_EOS).choices[0].text
    # a two-character piece first seen in the middle of the greedy text
    cut = next(k for k in range(2, len(full) - 2)
               if full.find(full[k:k + 2]) == k and full[k:k + 2].strip() and "\ufffd" not in full[:k + 2])
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                        stop=[full[cut:cut + 2]], extra_body=IGNORE_EOS).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[:cut]


def test_same_seed_same_text(client, model):
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body=IGNORE_EOS).choices[0].text

    assert sample(1234) == sample(1234)


def test_errors(client, model, tokenizer, max_model_len):
    prompt_ids = [tokenizer.encode("hello", add_special_tokens=False)[0]] * (max_model_len - 4)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model, prompt=prompt_ids, max_tokens=10)
    message = too_long.value.body["message"]
    for number in (max_model_len, max_model_len - 4, 10, max_model_len + 6):
        assert str(number) in message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=3.0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)


def test_metrics_count_the_traffic(server, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=3, extra_body=IGNORE_EOS)
    samples = metric_samples(server)
    assert samples["meshserve_time_to_first_token_seconds_count"] >= 1
    assert samples["meshserve_e2e_request_latency_seconds_count"] >= 1
    assert samples["meshserve_generation_tokens_total"] >= 3
    assert samples["meshserve_prompt_tokens_total"] >= 1
    assert 0 <= samples["meshserve_kv_cache_usage_ratio"] <= 1
    assert samples["meshserve_prefix_cache_hits_total"] <= samples["meshserve_prefix_cache_queries_total"]


def test_stream_closed_early_is_aborted(server, client, model, max_model_len):
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_model_len - 16, stream=True,
                                       extra_body=IGNORE_EOS)
    received = [chunk for _, chunk in zip(range(3), stream)]
    stream.close()
    assert len(received) == 3
    # the engine drops the request instead of generating thousands of tokens for nobody
    deadline = time.monotonic() + 10
    while metric_samples(server)["meshserve_num_requests_running"] > 0:
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.2)
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200
    after = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body=IGNORE_EOS)
    assert after.usage.completion_tokens == 4
