"""The API over a scripted engine that also answers operator commands and context-cache creation,
in-process (`admin_engine`) or as a real uvicorn server in a subprocess (`running_fake_server`).

Run as a module it serves until SIGTERM: `python -m tests.entrypoints.openai.fake_server PORT '<options JSON>'`
(the options are ServerOptions fields; the keys come from the environment, as in production).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from meshserve.wire.client import AdminReply, EplbStatus
from tests.entrypoints.openai.test_api import FakeEngine

REPO_ROOT = Path(__file__).resolve().parents[3]
EPLB_STATUS = EplbStatus(enabled=True, phase="idle", num_reconfigurations=0, last_error=None, last_started_at=None,
                         last_finished_at=None, num_slices=0, slice_seconds=10.0, interval_seconds=None,
                         placement=None)


class AdminFakeEngine(FakeEngine):
    """FakeEngine whose `admin` records every command and answers with an EPLB status."""

    def __init__(self) -> None:
        super().__init__()
        self.admin_calls: list[tuple[str, dict]] = []

    async def admin(self, op: str, args: dict | None = None) -> AdminReply:
        self.admin_calls.append((op, dict(args or {})))
        return AdminReply(query_id=0, data=EPLB_STATUS)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1) as client:  # one client: each one-shot httpx call builds a TLS context
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}"
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server not healthy after {timeout_s} s"
            time.sleep(0.1)


@contextlib.contextmanager
def running_fake_server(options: dict, env: dict[str, str] | None = None,
                        token_delay_s: float = 0.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, process) of a fake-engine server on a free loopback port; stopped (SIGTERM) afterwards."""
    port = free_port()
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(env or {})}
    command = [sys.executable, "-m", "tests.entrypoints.openai.fake_server", str(port), json.dumps(options),
               str(token_delay_s)]
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def main(argv: list[str]) -> None:
    from meshserve.entrypoints.openai.api_server import run_server
    from meshserve.entrypoints.openai.server_options import server_options

    engine = AdminFakeEngine()
    engine.token_delay_s = float(argv[3])
    run_server(engine, "127.0.0.1", int(argv[1]), log_level="warning", options=server_options(**json.loads(argv[2])))
    print("run_server returned", flush=True)


if __name__ == "__main__":
    main(sys.argv)
