"""Starting and stopping the engine's processes.

Each is a fresh interpreter running `python -m <module>` with its arguments in
one JSON blob, so nothing depends on the caller's `__main__` (no multiprocessing
re-import) and the same command line starts a process on another host.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any


def launch_module(module: str, **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, json.dumps(kwargs)], stdin=subprocess.DEVNULL)


def module_arguments(argv: list[str]) -> dict[str, Any]:
    if len(argv) != 2:
        raise SystemExit(f"usage: python -m {argv[0]} '<json arguments>'")
    return json.loads(argv[1])


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """Wait up to `grace_s` for a process told to stop, then terminate, then kill."""
    for action, wait_s in ((None, grace_s), (proc.terminate, 5.0), (proc.kill, 5.0)):
        if proc.poll() is not None:
            return
        if action is not None:
            action()
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now (for the executors' torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
