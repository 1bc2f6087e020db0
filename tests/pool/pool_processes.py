"""Starting `meshserve pool ...` processes as a user does, on free loopback ports, and stopping them."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from meshserve.utils.processes import free_tcp_port, stop_process


def free_address() -> str:
    return f"tcp://127.0.0.1:{free_tcp_port()}"


def start_pool(args: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "a") as log:
        return subprocess.Popen([sys.executable, "-m", "meshserve.entrypoints.cli", "pool", *args],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    stop_process(proc, grace_s=5.0)


@contextlib.contextmanager
def pool_processes() -> Iterator[list[subprocess.Popen]]:
    """A list to append started processes to; every one is stopped on exit."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for proc in procs:
            stop(proc)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
