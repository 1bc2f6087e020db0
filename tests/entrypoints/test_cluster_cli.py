"""`meshserve status` and `meshserve cluster`: the status tables, and one-line errors when there is no
deployment or no manager to ask."""
from __future__ import annotations

import json

from meshserve.entrypoints.cli import main
from meshserve.entrypoints.cluster import format_status
from meshserve.wire.cluster import ClusterStatus, GroupStatus, JEStatus, TEStatus


def test_status_tables():
    status = ClusterStatus(
        name="default", backend="local", manager_pid=42, warm=1,
        groups=[GroupStatus(group="main", role="colocated", current=2, target=2, min_count=0, max_count=4,
                                reason="queue 6 > 2 per TE x 1 TE")],
        tes=[TEStatus(name="main-colocated-1", group="main", role="colocated", state="ready", pid=7,
                          host="localhost", source="prewarmed+fork", restarts=1, num_running=3, kv_usage=0.25,
                          uptime_s=12.4)],
        jes=[JEStatus(name="je-0", http_addr="http://127.0.0.1:8000", pid=5, state="ready")],
        events=["12:00:00 start TE main-colocated-1 (prewarmed+fork): queue 6 > 2 per TE x 1 TE"])
    text = format_status(status)
    assert "deployment default (local backend, manager pid 42, 1 pre-warmed TE(s) idle)" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("TE "))
    row = next(line for line in lines if line.startswith("main-colocated-1"))
    assert header.split() == ["TE", "ROLE", "STATE", "PID", "HOST", "STARTED", "AS", "RESTARTS", "RUNNING",
                              "WAITING", "KV", "UP"]
    assert row.split() == ["main-colocated-1", "colocated", "ready", "7", "localhost", "prewarmed+fork", "1", "3",
                           "0", "25%", "12s"]
    pool = next(line for line in lines if line.startswith("main/colocated"))
    assert pool.split() == ["main/colocated", "2", "2", "0", "4", "queue", "6", ">", "2", "per", "TE", "x", "1", "TE"]
    assert "je-0  http://127.0.0.1:8000  ready  5" in text
    assert lines[-1].strip().startswith("12:00:00 start TE")


def test_no_deployment_is_one_line(tmp_path, capsys):
    assert main(["status", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshserve: error: no managed deployment in") and len(err.splitlines()) == 1
    assert main(["cluster", "scale", "main/colocated", "2", "--state-dir", str(tmp_path)]) == 2
    assert main(["cluster", "down", "--state-dir", str(tmp_path)]) == 2


def test_a_dead_manager_is_named(tmp_path, capsys):
    """The state of a manager that is gone: status says so, in one line, and how to take the deployment over."""
    (tmp_path / "state.json").write_text(json.dumps({
        "name": "default", "backend": "local", "deployment": "colocated", "model": "m", "manager_pid": 999999999,
        "manager_create_time": 0.0, "host": "127.0.0.1", "control_port": 1, "register_port": 2}))
    assert main(["status", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not running" in err and "meshserve cluster up colocated" in err and len(err.splitlines()) == 1


def test_a_bad_deployment_is_refused_before_anything_starts(tmp_path, capsys):
    bad = tmp_path / "deployment.yaml"
    bad.write_text("te_groups:\n  - {role: colocated, count: 3, min: 0, max: 2}\n")
    assert main(["cluster", "up", str(bad), "--state-dir", str(tmp_path / "state")]) == 2
    err = capsys.readouterr().err.strip()
    assert "need min <= count <= max" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "state").exists()


def test_a_bad_router_setting_is_refused_before_anything_starts(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main(["cluster", "up", "colocated", "--model", str(model), "--hold-s", "-1",
                 "--state-dir", str(tmp_path / "state")]) == 2
    err = capsys.readouterr().err.strip()
    assert "hold_s must be a number >= 0" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "state").exists()
