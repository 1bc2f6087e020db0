"""Starting `meshserve serve` as a user does, waiting until it is healthy, and stopping it (and its engine)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log_path: Path, lines: int = 40) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(base: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Return once `base`/health answers 200; fail the test if the server exits or stays unhealthy."""
    deadline = time.monotonic() + timeout_s
    # one client for every probe: each of httpx's one-shot calls builds a TLS context (tens of ms of CPU,
    # taken from the server starting beside it)
    with httpx.Client(timeout=2) as client:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with code {proc.returncode}:\n{log_tail(log_path)}")
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {timeout_s} s:\n{log_tail(log_path)}")
            time.sleep(0.2)


@contextlib.contextmanager
def running_server(serve_args: list[str], log_path: Path, startup_timeout_s: float) -> Iterator[str]:
    """`meshserve serve <serve_args>` on a free loopback port; yields its base URL once /health is 200."""
    port = free_port()
    command = [sys.executable, "-m", "meshserve.entrypoints.cli", "serve", *serve_args, "--host", "127.0.0.1",
               "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log_path, startup_timeout_s)
        yield base
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user would; then kill whatever is left of its process group (engine processes included)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
