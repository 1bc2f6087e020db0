"""Run `meshserve cluster up --detach` for tests, ask its status, and always take it down."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from meshserve.utils.processes import free_tcp_port, process_tree

CLI = [sys.executable, "-m", "meshserve.entrypoints.cli"]


def cli(*args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s)


def status(state_dir: Path) -> dict:
    done = cli("status", "--state-dir", str(state_dir), "--json", timeout_s=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def up(deployment: str, model: str, state_dir: Path, port: int, *extra: str) -> None:
    done = cli("cluster", "up", deployment, "--model", model, "--state-dir", str(state_dir), "--port", str(port),
               "--detach", *extra)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n" + _logs(state_dir)


def _logs(state_dir: Path) -> str:
    out = []
    for log in sorted(state_dir.glob("**/*.log")):
        out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(out)


def recorded_pids(state_dir: Path) -> list[int]:
    path = state_dir / "state.json"
    if not path.exists():
        return []
    state = json.loads(path.read_text())
    return [state["manager_pid"]] + [p["handle"].get("pid", 0) for p in state["processes"]]


@contextlib.contextmanager
def managed_deployment(deployment: str, model: str, state_dir: Path, *extra: str):
    """Yields the first JE's base URL; the deployment is taken down (and any survivor killed) on exit."""
    port = free_tcp_port()
    pids: set[int] = set()
    try:
        up(deployment, model, state_dir, port, *extra)
        pids.update(recorded_pids(state_dir))
        yield f"http://127.0.0.1:{port}"
    finally:
        pids.update(recorded_pids(state_dir))
        if (state_dir / "state.json").exists():
            cli("cluster", "down", "--state-dir", str(state_dir), timeout_s=120)
        for pid in pids:  # whatever the teardown missed, and the ranks of those processes
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                for child in process_tree(pid):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
                proc.kill()


def complete(base_url: str, prompt: str = "the cluster manager", max_tokens: int = 4, timeout_s: float = 120.0,
             api_key: str | None = None):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        return client.post(f"{base_url}/v1/completions", json={
            "model": client.get(f"{base_url}/v1/models").json()["data"][0]["id"], "prompt": prompt,
            "max_tokens": max_tokens, "temperature": 0.0})


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what} not within {timeout_s:.0f} s (last: {last!r})")


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
