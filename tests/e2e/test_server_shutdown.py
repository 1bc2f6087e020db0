"""A signal to a real `meshserve serve`'s whole process group mid-stream ends every process, with no respawn.

`kill -TERM -- -PGID` reaches the server, its engine's master and the master's workers at once. The master's
death by that signal is a stop, not a crash: the engine client must not start a new master (it did in 2 of 4
tries, and the new engine outlived the server). Each try starts a server in its own session, streams a long
completion, signals the group, and waits a bounded time for every process of the group (and any child of
the server, wherever its group) to end, checking meanwhile that no process joined the group after the signal.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from meshserve.utils.processes import process_tree
from tests.e2e.server_process import free_port, log_tail, wait_healthy

STARTUP_TIMEOUT_S = 120
SHUTDOWN_GRACE_S = 2.0  # the server's --shutdown-grace-s
# the longest a group may take to end: the grace period, then the engine stopped in order (SIGINT: the master
# and its workers ignore it, the server stops them), with room for a loaded machine's slow interpreter exits.
# A respawned engine fails the test whatever the time (a process that appears after the signal).
STOP_WAIT_S = SHUTDOWN_GRACE_S + 18.0
TRIES = (signal.SIGTERM, signal.SIGTERM, signal.SIGINT)


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("deepseek_v3", seed=3, name="tiny-dsv3")


def _start_server(model_dir: Path, log_path: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "meshserve.entrypoints.cli", "serve", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--shutdown-grace-s", str(SHUTDOWN_GRACE_S),
               "--num-threads", "1"]
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _group_members(pgid: int, server_pid: int) -> set[tuple[int, float]]:
    """(pid, start time) of every live process in the group `pgid` or below the server."""
    members = set()
    for process in psutil.process_iter(["pid", "create_time", "status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(process.pid) == pgid:
                members.add((process.pid, process.info["create_time"]))
        except (ProcessLookupError, psutil.Error):
            continue
    try:
        # below the server: with a rank template (the test session's), the forkserver and ranks of its master
        members |= {(child.pid, child.create_time()) for child in process_tree(server_pid)
                    if child.status() != psutil.STATUS_ZOMBIE}
    except psutil.Error:
        pass  # the server has ended
    return members


def _stream_until_cut(base: str, started: threading.Event) -> None:
    """A completion far longer than the test; `started` once its first tokens arrived."""
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "The stream goes on", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    started.set()
    except httpx.HTTPError:
        pass  # the server went away: what this test does to it


def _wait_until_gone(pgid: int, server_pid: int, before: set[tuple[int, float]]) -> tuple[set, set]:
    """Poll the group for up to STOP_WAIT_S: (processes still alive at the end, processes that appeared)."""
    appeared: set[tuple[int, float]] = set()
    deadline = time.monotonic() + STOP_WAIT_S
    while True:
        alive = _group_members(pgid, server_pid)
        appeared |= alive - before
        if not alive or time.monotonic() > deadline:
            return alive, appeared
        time.sleep(0.1)


@pytest.mark.parametrize("sig", TRIES, ids=[f"{signal.Signals(s).name}-{i}" for i, s in enumerate(TRIES)])
def test_a_signal_to_the_process_group_mid_stream_ends_every_process_without_a_respawn(model_dir, tmp_path, sig):
    log_path, port = tmp_path / "server.log", free_port()
    proc = _start_server(model_dir, log_path, port)
    pgid = proc.pid  # a session leader: its group is its own
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log_path, STARTUP_TIMEOUT_S)
        started = threading.Event()
        stream = threading.Thread(target=_stream_until_cut, args=(base, started), daemon=True)
        stream.start()
        assert started.wait(60), log_tail(log_path)
        before = _group_members(pgid, proc.pid)
        assert len(before) >= 3, f"expected server, master and worker in the group: {before}"
        os.killpg(pgid, sig)
        alive, appeared = _wait_until_gone(pgid, proc.pid, before)
        assert not appeared, f"processes started after the signal: {appeared}\n{log_tail(log_path)}"
        assert not alive, f"still running {STOP_WAIT_S} s after the signal: {alive}\n{log_tail(log_path)}"
        assert proc.wait(timeout=5) == 0, log_tail(log_path)
        assert "starting a new one" not in log_path.read_text(errors="replace")
        stream.join(30)
    finally:
        _kill_group(pgid, proc)


def _kill_group(pgid: int, proc: subprocess.Popen) -> None:
    """Leave nothing running whatever the test found."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def test_a_deployments_te_leaves_no_socket_directory_behind(model_dir, tmp_path):
    """Each TE keeps its ranks' sockets in a temporary directory; a stopped TE removes it (a host that restarts
    TEs all day would otherwise collect one per start)."""
    log_path, port = tmp_path / "server.log", free_port()
    sockets_root = Path(tempfile.mkdtemp(prefix="ms-", dir="/tmp"))  # short: a socket's path must fit 107 bytes
    command = [sys.executable, "-m", "meshserve.entrypoints.cli", "serve", "--model", str(model_dir),
               "--deployment", "colocated", "--host", "127.0.0.1", "--port", str(port),
               "--shutdown-grace-s", str(SHUTDOWN_GRACE_S), "--num-threads", "1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "TMPDIR": str(sockets_root)})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log_path, STARTUP_TIMEOUT_S)
        te_dirs = list(sockets_root.glob("meshserve-te-*"))
        assert len(te_dirs) == 1, f"expected the TE's socket directory in {sockets_root}: {te_dirs}"
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=STOP_WAIT_S) == 0, log_tail(log_path)
        alive, _ = _wait_until_gone(proc.pid, proc.pid, set())
        assert not alive, f"still running after the server ended: {alive}"
        assert not list(sockets_root.glob("meshserve-te-*")), log_tail(log_path)
    finally:
        _kill_group(proc.pid, proc)
        shutil.rmtree(sockets_root, ignore_errors=True)
