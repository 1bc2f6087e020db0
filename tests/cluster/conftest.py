"""Fixtures of the cluster tests: a Ray head of this machine for the Ray tests, with its own temp dir and
token, always stopped with every process under it (`ray start --head --block` on 127.0.0.1; Ray itself also
listens on the host's routable address)."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from meshserve.utils.processes import free_tcp_port

HEAD_START_S = 60.0


def _processes_of(temp_dir: str) -> list[psutil.Process]:
    """The processes of our Ray head: every Ray process names its session directory, under our temp dir."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _reread_ray_config() -> None:
    """Ray reads RAY_AUTH_MODE once per process (this one imported Ray before the test set it)."""
    from ray._raylet import Config

    Config.initialize("")


@pytest.fixture(scope="package")
def ray_address():
    """A Ray head for the package's Ray tests (started on first use, stopped after the last)."""
    temp_dir = tempfile.mkdtemp(prefix="msray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = free_tcp_port()
    # Ray's token authentication with a token of this cluster alone, for the head and for the drivers here
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {**os.environ, **auth, "RAY_USAGE_STATS_ENABLED": "0"}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                             "--port", str(port), "--num-cpus", "4", "--include-dashboard=false",
                             "--disable-usage-stats", "--temp-dir", temp_dir],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + HEAD_START_S
        while not list(Path(temp_dir).glob("session_*/sockets/raylet*")):
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.2)
        with pytest.MonkeyPatch.context() as patch:
            for key, value in auth.items():
                patch.setenv(key, value)
            _reread_ray_config()
            yield address
        _reread_ray_config()
    finally:
        head.send_signal(signal.SIGTERM)  # --block: it stops every process it started
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
        for proc in _processes_of(temp_dir):
            proc.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
