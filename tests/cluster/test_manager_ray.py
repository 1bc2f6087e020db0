"""The cluster manager on the Ray backend, on a Ray cluster of this machine: the deployment starts (every
process a detached Ray actor's), an operator scales a pool up, a TE killed with kill -9 is restarted, and
`cluster down` removes everything."""
from __future__ import annotations

import psutil
import pytest

from tests.cluster.cluster_processes import cli, complete, kill9, managed_deployment, status, wait_for

pytestmark = pytest.mark.slow

API_KEY = "ray-test-key"  # the JEs listen on the node's routable address, so they need a key
DEPLOYMENT = """
te_groups:
  - {group: main, role: colocated, count: 1, min: 1, max: 2}
engine: {num_kv_blocks: 64, num_threads: 1}
"""


def _ready(state_dir):
    return [t for t in status(state_dir)["tes"] if t["state"] == "ready"]


def test_start_scale_up_kill_and_restart_on_ray(ray_address, tiny_model, tmp_path):
    model = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    path = tmp_path / "deployment.yaml"
    path.write_text(DEPLOYMENT)
    state_dir = tmp_path / "state"
    with managed_deployment(str(path), str(model), state_dir, "--backend", "ray", "--ray-address", ray_address,
                            "--api-key", API_KEY):
        live = status(state_dir)
        assert live["backend"] == "ray"
        [je] = live["jes"]
        url = je["http_addr"]
        assert complete(url, api_key=API_KEY).json()["usage"]["completion_tokens"] == 4
        # scale up: a second TE of the pool
        done = cli("cluster", "scale", "main/colocated", "2", "--state-dir", str(state_dir))
        assert done.returncode == 0, done.stderr
        two = wait_for(lambda: len(r := _ready(state_dir)) == 2 and r, 180, "two TEs ready")
        # kill -9 one TE's process (its actor stays and reports it dead): the manager starts it again
        victim = two[0]
        kill9(victim["pid"])
        wait_for(lambda: any(t["name"] == victim["name"] and t["restarts"] == 1 for t in _ready(state_dir)), 180,
                 "the killed TE restarted through Ray")
        assert len(_ready(state_dir)) == 2
        reply = wait_for(lambda: (r := complete(url, api_key=API_KEY)).status_code == 200 and r, 60, "a completion")
        assert reply.json()["usage"]["completion_tokens"] == 4
        pids = [t["pid"] for t in _ready(state_dir)]
    # cluster down (the context's exit) removed every actor: their processes are gone
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
