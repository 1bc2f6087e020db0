"""The expert-load-balancing workflow an operator runs against a live server (4 ranks, pure EP):
record the load, plan a placement from it, reconfigure live, check the status; and the admin API's errors."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import ExpertPlacement
from tests.e2e.server_process import running_server

STARTUP_TIMEOUT_S = 90


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshserve.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    model_dir = tiny_model("deepseek_v3", seed=2, name="tiny-dsv3")
    args = ["--model", str(model_dir), "--parallel", "attn=TP1+DP4 moe=TP1+EP4",
            "--eplb-redundant-experts", "1", "--eplb-slice-s", "0.5"]
    with running_server(args, tmp_path_factory.mktemp("server") / "server.log", STARTUP_TIMEOUT_S) as base:
        yield base


def _complete(base: str, n: int = 4) -> list[str]:
    texts = []
    for i in range(n):
        body = {"model": httpx.get(f"{base}/v1/models").json()["data"][0]["id"], "prompt": f"expert load {i}",
                "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def test_record_plan_rebalance_status(server, tmp_path):
    before = _complete(server)
    load_file = tmp_path / "load.json"
    recorded = _cli("eplb", "record", "--url", server, "--duration", "1", "--out", str(load_file))
    assert recorded.returncode == 0, recorded.stderr
    record = ExpertLoadRecord.load(load_file)
    assert record.num_logical == 16 and record.moe_layers == [1, 2, 3]

    _complete(server)  # traffic inside the recording window too, so the file holds load
    recorded = _cli("eplb", "record", "--url", server, "--duration", "0", "--out", str(load_file))
    assert recorded.returncode == 0, recorded.stderr
    full = httpx.get(f"{server}/admin/eplb/load").json()
    assert sum(sum(row) for per_layer in full["counts"] for row in per_layer) > 0

    placement_file = tmp_path / "placement.json"
    full_file = tmp_path / "full.json"
    full_file.write_text(json.dumps(full))
    planned = _cli("eplb", "plan", "--load", str(full_file), "--devices", "4", "--redundant", "4",
                   "--out", str(placement_file))
    assert planned.returncode == 0, planned.stderr
    placement = ExpertPlacement.from_dict(json.loads(placement_file.read_text()))
    assert any(len(r) > 1 for layer in placement.layers for r in placement.replicas(layer))

    done = _cli("eplb", "rebalance", "--url", server, "--placement", str(placement_file))
    assert done.returncode == 0, done.stderr
    status = httpx.get(f"{server}/admin/eplb/status").json()
    assert status["phase"] == "idle" and status["num_reconfigurations"] == 1
    assert ExpertPlacement.from_dict(status["placement"]).layers == placement.layers
    shown = _cli("eplb", "status", "--url", server)
    assert shown.returncode == 0 and "replicated experts per layer" in shown.stdout
    assert _complete(server) == before  # same greedy texts on the new placement


def test_admin_errors_are_openai_error_json(server):
    bad = httpx.post(f"{server}/admin/eplb/rebalance", json={"placement": {"format": "nope"}})
    assert bad.status_code == 400 and "bad placement" in bad.json()["error"]["message"]
    junk = httpx.post(f"{server}/admin/eplb/rebalance", content=b"{not json",
                      headers={"Content-Type": "application/json"})
    assert junk.status_code == 400 and junk.json()["error"]["type"] == "invalid_request_error"
    refused = _cli("eplb", "rebalance", "--url", "http://127.0.0.1:9", "--wait", "0")
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1
