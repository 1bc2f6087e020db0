"""Running the docs' runnable blocks: the environment they run in, one block, and the servers they talk to.

docs/development.md ("The docs are tested") describes the rules for the reader who writes a page.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, Block, server_command
from tests.e2e.server_process import free_port, log_tail, stop_server, wait_healthy

BLOCK_TIMEOUT_S = 300
SERVER_STARTUP_TIMEOUT_S = 300
OUTPUT_TAIL_LINES = 40


def docs_environment(run_dir: Path) -> dict[str, str]:
    """The environment every block runs in: the virtual environment's tools first, this checkout's code,
    a model cache of the run's own, no MESHSERVE_* setting of the caller's, and curl failing on HTTP errors."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MESHSERVE_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MESHSERVE_CACHE"] = str(run_dir / "cache")
    # the native kernels have their own tests; compiling them here would cost more than the whole run
    env["MESHSERVE_CPU_KERNELS"] = "0"
    curl_home = run_dir / "curl"
    curl_home.mkdir(parents=True, exist_ok=True)
    (curl_home / ".curlrc").write_text("fail-with-body\n")  # a 4xx or 5xx fails the block, body still shown
    env["CURL_HOME"] = str(curl_home)
    return env


def block_command(block: Block, text: str) -> list[str]:
    if block.language == "python":
        return [sys.executable, "-c", text]
    return ["bash", "-e", "-o", "pipefail", "-c", text]


def run_block(block: Block, text: str, cwd: Path, env: dict[str, str]) -> None:
    """Run one block (its text as rewritten for the test) in `cwd`; fail the test naming its file and line."""
    proc = subprocess.Popen(block_command(block, text), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s\n{_report(text, output)}")
    if proc.returncode != 0:
        pytest.fail(f"{block.where}: exit status {proc.returncode}\n{_report(text, output)}")


def _report(text: str, output: str) -> str:
    tail = "\n".join(output.splitlines()[-OUTPUT_TAIL_LINES:])
    return f"--- block ---\n{text}--- output (last {OUTPUT_TAIL_LINES} lines) ---\n{tail}"


@dataclass
class _Server:
    proc: subprocess.Popen
    port: int
    log: Path
    healthy: bool = False


class DocsServers:
    """The servers of the docs' server blocks, one per distinct command (pages whose server blocks hold the
    same command share it), started ahead by `start` while other pages run, and stopped by `stop_all`."""

    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self._dir = run_dir / "servers"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._env = env
        self._running: dict[str, _Server] = {}

    def start(self, block: Block) -> _Server:
        """The server of the block's command, started now (without waiting for it) if none runs it yet."""
        key = server_command(block, port=0)
        if key not in self._running:
            self._running[key] = self._start(block)
        return self._running[key]

    def port_for(self, block: Block) -> int:
        """The port of the server running the block's command once it is healthy."""
        server = self.start(block)
        if not server.healthy:
            self._wait_healthy(block, server)
            server.healthy = True
        if server.proc.poll() is not None:
            pytest.fail(f"{block.where}: its server exited with code {server.proc.returncode}:\n{log_tail(server.log)}")
        return server.port

    def _start(self, block: Block) -> _Server:
        port = free_port()
        log_path = self._dir / f"port-{port}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(["bash", "-c", f"exec {server_command(block, port)}"], cwd=self._dir,
                                    env=self._env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return _Server(proc, port, log_path)

    @staticmethod
    def _wait_healthy(block: Block, server: _Server) -> None:
        try:
            wait_healthy(f"http://127.0.0.1:{server.port}", server.proc, server.log, SERVER_STARTUP_TIMEOUT_S)
        except pytest.fail.Exception as exc:
            pytest.fail(f"{block.where}: {exc.msg}")

    def stop_all(self) -> None:
        for server in self._running.values():
            stop_server(server.proc)
        self._running.clear()
