"""A noisy tenant beside a polite one on a real `meshserve serve` (the tiny model, two API keys, per-tenant
limits on): the noisy key sends about 10x its token budget in a few seconds, many at once; the polite key,
well within its budget, sends a few requests meanwhile. Every polite request succeeds; the noisy key gets
429s (OpenAI's rate-limit error, with Retry-After); nobody gets a 5xx; the metrics count the refusals
against the noisy key's hash only, and never show a key."""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.server_process import running_server

STARTUP_TIMEOUT_S = 300
POLITE_KEY, NOISY_KEY = "polite-tenant-key", "noisy-tenant-key"
TOKENS_PER_MINUTE = 120  # a minute's budget fills the bucket: about 6 of these requests at once
NOISY_REQUESTS = 60  # about 10x what the budget allows over the few seconds they take
POLITE_REQUESTS = 4
BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model) -> Iterator[str]:
    model_dir = tiny_model("deepseek_v3", seed=3, name="tiny-dsv3")
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model", str(model_dir), "--num-threads", "1", "--api-key", POLITE_KEY, "--api-key", NOISY_KEY,
            "--tokens-per-minute-per-tenant", str(TOKENS_PER_MINUTE), "--max-requests-per-tenant", "4"]
    with running_server(args, log_path, STARTUP_TIMEOUT_S) as base:
        yield base


def _post(client: httpx.Client, model: str) -> httpx.Response:
    return client.post("/v1/completions", json={**BODY, "model": model}, timeout=120)


def _owner(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def test_a_noisy_tenant_gets_429s_and_a_polite_one_is_served(server):
    noisy_answers: list[httpx.Response] = []
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {POLITE_KEY}"}) as polite, \
            httpx.Client(base_url=server, headers={"Authorization": f"Bearer {NOISY_KEY}"},
                         limits=httpx.Limits(max_connections=16)) as noisy:
        model = polite.get("/v1/models").json()["data"][0]["id"]

        def flood() -> None:
            with ThreadPoolExecutor(max_workers=16) as pool:
                noisy_answers.extend(pool.map(lambda _: _post(noisy, model), range(NOISY_REQUESTS)))

        flooding = threading.Thread(target=flood)
        flooding.start()
        polite_answers = [_post(polite, model) for _ in range(POLITE_REQUESTS)]
        flooding.join(300)
        metrics = httpx.get(f"{server}/metrics", timeout=10).text
    assert not flooding.is_alive()
    assert [r.status_code for r in polite_answers] == [200] * POLITE_REQUESTS
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in polite_answers)
    statuses = [r.status_code for r in noisy_answers]
    assert len(statuses) == NOISY_REQUESTS and set(statuses) <= {200, 429}, statuses
    refused = [r for r in noisy_answers if r.status_code == 429]
    assert refused and 200 in statuses  # limited, not locked out
    assert refused[0].json()["error"]["type"] == "rate_limit_exceeded"
    assert int(refused[0].headers["retry-after"]) >= 1
    assert f'meshserve_tenant_rejected_total{{reason="tokens_per_minute",tenant="{_owner(NOISY_KEY)}"}}' in metrics \
        or f'meshserve_tenant_rejected_total{{reason="requests_per_tenant",tenant="{_owner(NOISY_KEY)}"}}' in metrics
    assert f'tenant="{_owner(POLITE_KEY)}"' in metrics  # its requests and tokens are counted
    assert f'reason="tokens_per_minute",tenant="{_owner(POLITE_KEY)}"' not in metrics
    assert POLITE_KEY not in metrics and NOISY_KEY not in metrics
