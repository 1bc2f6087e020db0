"""The cluster manager on the local backend: it serves, heals a killed TE and JE, survives its own kill -9
(the JEs keep serving) and a restarted manager takes the deployment over without starting duplicates."""
from __future__ import annotations

import json

import psutil
import pytest

from tests.cluster.cluster_processes import complete, kill9, managed_deployment, status, up, wait_for

DEPLOYMENT = """
te_groups:
  - {group: main, role: colocated, count: 1}
engine: {num_kv_blocks: 64, num_threads: 1}
"""


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    model = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    root = tmp_path_factory.mktemp("cluster")
    path = root / "deployment.yaml"
    path.write_text(DEPLOYMENT)
    state_dir = root / "state"
    with managed_deployment(str(path), str(model), state_dir) as base_url:
        yield {"url": base_url, "state_dir": state_dir, "path": path, "model": model,
               "port": int(base_url.rsplit(":", 1)[1])}


def _ready_tes(state_dir):
    return [t for t in status(state_dir)["tes"] if t["state"] == "ready"]


def test_serves_and_reports_status(deployment):
    reply = complete(deployment["url"])
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    live = status(deployment["state_dir"])
    assert [(t["group"], t["role"], t["state"]) for t in live["tes"]] == [("main", "colocated", "ready")]
    assert [j["state"] for j in live["jes"]] == ["ready"]
    assert live["groups"][0]["target"] == 1


def test_a_killed_te_is_restarted(deployment):
    [te] = _ready_tes(deployment["state_dir"])
    kill9(te["pid"])
    restarted = wait_for(lambda: [t for t in _ready_tes(deployment["state_dir"]) if t["restarts"] == 1], 120,
                         "the killed TE restarted and ready")
    assert restarted[0]["name"] == te["name"] and restarted[0]["pid"] != te["pid"]
    reply = wait_for(lambda: (r := complete(deployment["url"])).status_code == 200 and r, 60, "a completion")
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert any("died" in event for event in status(deployment["state_dir"])["events"])


def test_a_killed_je_is_restarted_on_its_port(deployment):
    [je] = status(deployment["state_dir"])["jes"]
    kill9(je["pid"])
    wait_for(lambda: [j for j in status(deployment["state_dir"])["jes"] if j["pid"] != je["pid"]
                      and j["state"] == "ready"], 60, "the killed JE restarted")
    reply = wait_for(lambda: (r := complete(deployment["url"])).status_code == 200 and r, 60,
                     "a completion through the restarted JE")
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_a_restarted_manager_takes_the_deployment_over(deployment):
    state_dir = deployment["state_dir"]
    before = status(state_dir)
    state = json.loads((state_dir / "state.json").read_text())
    kill9(state["manager_pid"])
    wait_for(lambda: not psutil.pid_exists(state["manager_pid"]) or
             psutil.Process(state["manager_pid"]).status() == psutil.STATUS_ZOMBIE, 10, "the manager gone")
    # the JE serves while no manager runs
    assert complete(deployment["url"]).status_code == 200
    up(str(deployment["path"]), str(deployment["model"]), state_dir, deployment["port"])
    after = status(state_dir)
    assert after["manager_pid"] != before["manager_pid"]
    # the same processes, none started twice
    assert [(t["name"], t["pid"]) for t in after["tes"]] == [(t["name"], t["pid"]) for t in before["tes"]]
    assert [(j["name"], j["pid"]) for j in after["jes"]] == [(j["name"], j["pid"]) for j in before["jes"]]
    # every TE master of this deployment registers with the manager's port: one process, as before
    manager_port = f"127.0.0.1:{state['register_port']}"
    te_masters = [p for p in psutil.process_iter(["cmdline"])
                  if "meshserve.core.te_process:run_te" in (p.info["cmdline"] or [])
                  and manager_port in " ".join(p.info["cmdline"] or [])]
    assert [p.pid for p in te_masters] == [t["pid"] for t in before["tes"]]
    assert any("took over" in event for event in after["events"])
    assert complete(deployment["url"]).status_code == 200
