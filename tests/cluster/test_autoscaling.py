"""The autoscaler through the cluster manager (local backend): a queue scales a pool up, idleness scales it
down and then to zero, and the first request after zero is held by the JE and answered (not an error)."""
from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.cluster_processes import complete, managed_deployment, status, wait_for

DEPLOYMENT = """
te_groups:
  - {group: main, role: colocated, count: 1, min: 0, max: 2}
engine: {num_kv_blocks: 64, num_threads: 1, max_num_seqs: 1}
prewarm: 1
autoscaler:
  interval_s: 0.5
  window_s: 3
  queue_per_te: 0.5
  scale_up_cooldown_s: 1
  scale_down_cooldown_s: 2
  down_stable_s: 2
  idle_to_zero_s: 15  # longer than the wait for the pre-warmed TE below
"""


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    model = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    root = tmp_path_factory.mktemp("autoscaling")
    path = root / "deployment.yaml"
    path.write_text(DEPLOYMENT)
    with managed_deployment(str(path), str(model), root / "state", "--hold-s", "120") as base_url:
        yield {"url": base_url, "state_dir": root / "state"}


def _pool(state_dir):
    [pool] = status(state_dir)["groups"]
    return pool


def test_a_queue_scales_up_and_idleness_scales_to_zero(deployment):
    state_dir = deployment["state_dir"]
    wait_for(lambda: status(state_dir)["warm"] >= 1, 60, "a pre-warmed TE ready")
    # one request at a time per TE (max_num_seqs 1): twelve of 150 tokens queue up for many seconds
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda i: complete(deployment["url"], f"request {i}", max_tokens=150), range(12)))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    events = status(state_dir)["events"]
    assert any("scale main/colocated to 2" in e for e in events), events
    wait_for(lambda: _pool(state_dir)["target"] == 0 and not status(state_dir)["tes"], 60, "scaled to zero")
    # every decision is a metric too, on the manager's metrics port
    port = json.loads((state_dir / "state.json").read_text())["metrics_port"]
    samples = _samples(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    # at least: on a busy host the first TE can sit idle past idle_to_zero_s while the warm TE warms up, and
    # the pool then scales to zero once more before the requests (then held, not queued, bring it back)
    assert samples.get(("meshserve_autoscaler_decisions_total",
                        (("direction", "up"), ("pool", "main/colocated"), ("reason", "queue"))), 0) >= 1, samples
    assert samples.get(("meshserve_autoscaler_decisions_total",
                        (("direction", "down"), ("pool", "main/colocated"), ("reason", "idle"))), 0) >= 1, samples
    # the pre-warmed TE forks its weights from a running TE, or loads the checkpoint when the pool had none
    warm_starts = [e for e in events if "start TE main-colocated-" in e and "(prewarmed" in e]
    assert warm_starts, events
    for weights in {"fork" if "(prewarmed+fork)" in e else "checkpoint" for e in warm_starts}:
        assert samples.get(("meshserve_cluster_scale_up_step_seconds_count",
                            (("process", "prewarmed"), ("step", "te_load"), ("weights", weights))), 0) >= 1, samples


def test_the_first_request_after_zero_is_held_and_answered(deployment):
    state_dir = deployment["state_dir"]
    wait_for(lambda: not status(state_dir)["tes"], 60, "no TE running")
    t0 = time.monotonic()
    reply = complete(deployment["url"], "after zero", max_tokens=4)
    waited = time.monotonic() - t0
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert _pool(state_dir)["target"] >= 1
    assert any("held" in e for e in status(state_dir)["events"]), status(state_dir)["events"]
    print(f"first request after zero answered after {waited:.1f} s")


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from a Prometheus text page."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}
