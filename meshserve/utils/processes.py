"""Starting and stopping meshserve's processes, and the table of their entry points.

Each process is a fresh interpreter running `python -m meshserve.utils.processes MODULE:FUNCTION '<json>'`:
the function is called with the JSON object as keyword arguments. Nothing depends on the caller's
`__main__` (no multiprocessing re-import), the same command line starts a process on another host, and
`ps` names the code a process runs. Entry points are named in one table, so a moved file fails the
entry-point test, not a start-up; this module imports nothing of meshserve (the table holds strings).
"""
from __future__ import annotations

import importlib
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

# name -> "module:function"; the function takes the JSON-able keyword arguments `launch` was given
PROCESS_ENTRY_POINTS: dict[str, str] = {
    "master": "meshserve.core.master:run_master",  # one engine's master (scheduler, KV cache manager)
    "worker": "meshserve.worker.worker:run_worker",  # one rank of an engine, started by its master
    "te": "meshserve.core.te_process:run_te",  # an engine that registers with routers (`meshserve te`)
    "frontend": "meshserve.entrypoints.openai.frontend:run_frontend",  # a further HTTP server + router
    "pool-controller": "meshserve.pool.controller:run_controller_process",  # the memory pool's controller
    "pool-server": "meshserve.pool.server:run_server",  # one memory pool server
    "warm-te": "meshserve.cluster.warm:run_warm_te",  # a pre-warmed TE shell, handed a model and role later
    "warm-worker": "meshserve.cluster.warm:run_warm_worker",  # a spare rank of a pre-warmed TE
    "cluster-manager": "meshserve.cluster.manager:run_manager",  # `meshserve cluster up` in the background
}
RUNNER_MODULE = "meshserve.utils.processes"  # this module, run as `python -m`
# a process that ends because it was told to (SIGTERM) exits with the shell's code for that signal
STOPPED_BY_SIGNAL_EXIT_CODE = 128 + signal.SIGTERM


def stopped_on_request(returncode: int | None) -> bool:
    """Whether an exit status says the process was stopped on purpose (SIGTERM, handled or not): an owner
    that restarts crashed processes leaves this one stopped."""
    return returncode in (-signal.SIGTERM, STOPPED_BY_SIGNAL_EXIT_CODE)


def launch(name: str, **kwargs: Any) -> subprocess.Popen:
    """Start the process `name` of PROCESS_ENTRY_POINTS with `kwargs` (JSON-able) as its arguments."""
    target = PROCESS_ENTRY_POINTS[name]
    return subprocess.Popen([sys.executable, "-m", RUNNER_MODULE, target, json.dumps(kwargs)], stdin=subprocess.DEVNULL)


def entry_point(target: str) -> Callable[..., Any]:
    """The function a "module:function" entry of PROCESS_ENTRY_POINTS names (importing its module)."""
    if target not in PROCESS_ENTRY_POINTS.values():
        raise SystemExit(f"not a meshserve entry point: {target!r}")
    module_name, function_name = target.split(":")
    return getattr(importlib.import_module(module_name), function_name)


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
    """A port that is free on `host` now (for the workers' torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def main(argv: list[str]) -> None:
    """`python -m meshserve.utils.processes MODULE:FUNCTION '<json arguments>'` (what `launch` runs)."""
    if len(argv) != 3:
        raise SystemExit("usage: python -m meshserve.utils.processes MODULE:FUNCTION '<json arguments>'")
    entry_point(argv[1])(**json.loads(argv[2]))


if __name__ == "__main__":
    main(sys.argv)
