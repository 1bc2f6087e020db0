"""A real `meshserve serve` keeps answering /health while it is sent requests that ask for a huge fan-out.

The bodies that froze the frontend (1,000 and 3,000 token-id prompts with n = 128: 128,000 and 384,000 engine
requests from 11 and 33 KB) are refused with 400 before any engine request is built, while a large request
within the limits (128 prompts) is served. Meanwhile a
thread asks /health on one keep-alive connection, at most `PROBES` times: every answer is 200 and the
slowest takes at most 100 ms, or twice the slowest of a quiet round as long where a loaded shared machine's
own noise is larger. A freeze lasted seconds and fails every attempt; a hiccup of the machine may spoil one,
so up to `ATTEMPTS` rounds are run and the best one counts.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.server_process import running_server

STARTUP_TIMEOUT_S = 180
ATTEMPTS = 5  # the first round that stays within the bound ends the test
PROBES = 2000  # per round, at most
PROBE_PAUSE_S = 0.005
HEALTH_LIMIT_S = 0.100


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model) -> Iterator[str]:
    model_dir = tiny_model("deepseek_v3", seed=3, name="tiny-dsv3")
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    # one torch thread: the engine's processes then leave the frontend a core on a small machine; the torch path:
    # the frontend is under test, and the native kernels' build would wait for every other process loading it
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MESHSERVE_CPU_KERNELS", "0")
        with running_server(["--model", str(model_dir), "--num-threads", "1"], log_path, STARTUP_TIMEOUT_S) as base:
            yield base


class HealthProbe:
    """GET /health in a loop on a thread (bounded in count) until stopped, recording each answer's latency."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._probe, daemon=True)

    def _probe(self) -> None:
        with httpx.Client(base_url=self.base, timeout=30) as client:
            while not self.stop.is_set() and len(self.latencies) < PROBES:
                started = time.perf_counter()
                status = client.get("/health").status_code
                self.latencies.append(time.perf_counter() - started)
                self.statuses.append(status)
                time.sleep(PROBE_PAUSE_S)

    def __enter__(self) -> HealthProbe:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def _post(base: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base}/v1/completions", content=content, headers={"Content-Type": "application/json"},
                      timeout=120)


def _one_round(base: str, model: str) -> HealthProbe:
    amplifying = [{"model": model, "prompt": [[1, 2, 3]] * prompts, "n": 128, "max_tokens": 1}
                  for prompts in (1000, 3000)]
    allowed = {"model": model, "prompt": [[7 + i % 50] * 64 for i in range(128)], "max_tokens": 1}
    results: dict[str, httpx.Response] = {}

    def send(name: str, body: dict | bytes) -> None:
        results[name] = _post(base, body)

    requests = {"amplifying-1000": amplifying[0], "amplifying-3000": amplifying[1], "allowed-128": allowed}
    with HealthProbe(base) as probe:
        time.sleep(0.2)  # a few probes before the load
        threads = [threading.Thread(target=send, args=item) for item in requests.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=180)
        time.sleep(0.2)
    for name in ("amplifying-1000", "amplifying-3000"):
        assert results[name].status_code == 400, results[name].text
        assert results[name].json()["error"]["code"] == "too_many_choices"
    assert results["allowed-128"].status_code == 200, results["allowed-128"].text
    assert len(results["allowed-128"].json()["choices"]) == 128
    assert probe.statuses and set(probe.statuses) == {200}
    return probe


def _quiet_round(base: str, seconds: float) -> HealthProbe:
    """The machine's own noise: /health with nothing else sent."""
    with HealthProbe(base) as probe:
        time.sleep(seconds)
    return probe


def test_health_answers_within_100_ms_while_amplifying_requests_are_refused(server):
    model = httpx.get(f"{server}/v1/models").json()["data"][0]["id"]
    # the first request pays one-time costs (the engine reader's start, first prefill): not what is measured
    assert _post(server, {"model": model, "prompt": [[7] * 8] * 4, "max_tokens": 1}).status_code == 200
    worst, spent = [], []
    for _ in range(ATTEMPTS):
        started = time.monotonic()
        worst.append(max(_one_round(server, model).latencies))
        spent.append(time.monotonic() - started)
        if worst[-1] <= HEALTH_LIMIT_S:
            break
    quiet = max(_quiet_round(server, max(spent)).latencies)
    print(f"slowest /health per loaded round (s): {[round(w, 4) for w in worst]}; quiet: {quiet:.4f}")
    # a shared machine's noise beyond the limit, measured alike, is not the server's doing
    bound = max(HEALTH_LIMIT_S, 2 * quiet)
    assert min(worst) <= bound, f"/health took up to {worst} s while the requests ran (quiet: {quiet:.3f} s)"
