"""Where the cluster manager's processes run: one interface, two backends.

A backend starts a process (a TE, a job executor, a pre-warmed TE) from an entry of
`meshserve.utils.processes.PROCESS_ENTRY_POINTS` with JSON-able keyword arguments, and gives back a
`ProcessHandle` the manager watches and stops. Every handle has a `record()`: what the manager writes to
its state file, so a manager that restarts finds the same processes again (`adopt`) instead of starting
new ones. Processes outlive the manager that started them: the deployment keeps serving while it is down.

`LocalBackend` (this module): processes on this machine, in their own session, logging to files.
`RayBackend` (`meshserve.cluster.ray_backend`): one Ray actor per process, in a placement group with one
bundle per rank, for deployments larger than one machine.
"""
from __future__ import annotations

import abc
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshserve.utils.processes import PROCESS_ENTRY_POINTS, RUNNER_MODULE

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessResources:
    """What one process needs where it runs: a TE's ranks (one placement bundle each) and cores per rank."""

    num_ranks: int = 1
    cpus_per_rank: float = 1.0


class ProcessHandle(abc.ABC):
    """One process the manager started (or adopted after its own restart)."""

    kind: str  # "te" | "frontend" | "warm-te"
    name: str

    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the process still runs (a cheap check: the manager asks every tick)."""

    @property
    @abc.abstractmethod
    def pid(self) -> int: ...

    @property
    @abc.abstractmethod
    def host(self) -> str: ...

    def exit_code(self) -> int | None:
        """The exit status once it ended, when the backend can know it (None otherwise)."""
        return None

    @abc.abstractmethod
    def stop(self) -> None:
        """Ask for an orderly stop (SIGTERM: a TE says goodbye to its JEs and stops its ranks)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop it at once (SIGKILL)."""

    @abc.abstractmethod
    def record(self) -> dict[str, Any]:
        """JSON-able: enough for `Backend.adopt` to find this process again after a manager restart."""


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    def launch(self, kind: str, name: str, kwargs: dict[str, Any],
               resources: ProcessResources = ProcessResources()) -> ProcessHandle:
        """Start `PROCESS_ENTRY_POINTS[kind]` with `kwargs` as a process named `name` (unique in the cluster)."""

    @abc.abstractmethod
    def adopt(self, record: dict[str, Any]) -> ProcessHandle | None:
        """The process a `record()` describes, if it still runs; None when it is gone."""

    @abc.abstractmethod
    def advertise_host(self) -> str:
        """The address processes started by this backend reach the manager's sockets on."""

    def release(self, handle: ProcessHandle) -> None:  # noqa: B027 - local processes leave nothing behind
        """Free what a process that ended still holds in the backend (its actor, its placement group)."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing
        """Release what the backend holds; the processes it started keep running."""


# ---------------------------------------------------------------------- local processes
def _command(kind: str, kwargs: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", RUNNER_MODULE, PROCESS_ENTRY_POINTS[kind], json.dumps(kwargs)]


def _create_time(pid: int) -> float | None:
    # start-up: psutil only where processes are watched
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class LocalHandle(ProcessHandle):
    def __init__(self, kind: str, name: str, pid: int, create_time: float | None, log_path: str,
                 proc: subprocess.Popen | None = None) -> None:
        self.kind, self.name = kind, name
        self._pid, self._create_time, self.log_path = pid, create_time, log_path
        self._proc = proc  # None for an adopted process (not our child: no exit status)

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def host(self) -> str:
        return "localhost"

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        # an adopted process: the same pid started at the same time (a reused pid is another process)
        import psutil

        try:
            proc = psutil.Process(self._pid)
            return proc.create_time() == self._create_time and proc.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def exit_code(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def _signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self._pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        if self._proc is not None:
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def record(self) -> dict[str, Any]:
        return {"backend": "local", "kind": self.kind, "name": self.name, "pid": self._pid,
                "create_time": self._create_time, "log": self.log_path}


class LocalBackend(Backend):
    """Processes on this machine. Each runs in its own session (a Ctrl-C or the manager's death does not reach
    it) and writes its log to `<log_dir>/<name>.log`."""

    name = "local"

    def __init__(self, log_dir: str | Path, host: str = "127.0.0.1") -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.host = host

    def launch(self, kind: str, name: str, kwargs: dict[str, Any],
               resources: ProcessResources = ProcessResources()) -> LocalHandle:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(_command(kind, kwargs), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return LocalHandle(kind, name, proc.pid, _create_time(proc.pid), str(log_path), proc)

    def adopt(self, record: dict[str, Any]) -> LocalHandle | None:
        handle = LocalHandle(record["kind"], record["name"], int(record["pid"]), record.get("create_time"),
                             record.get("log", ""))
        return handle if handle.alive() else None

    def advertise_host(self) -> str:
        return self.host


def make_backend(name: str, log_dir: str | Path, host: str = "127.0.0.1", ray_address: str | None = None,
                 namespace: str = "meshserve") -> Backend:
    if name == "local":
        return LocalBackend(log_dir, host)
    if name == "ray":
        # start-up: ray only for the Ray backend
        from meshserve.cluster.ray_backend import RayBackend

        return RayBackend(address=ray_address, namespace=namespace, log_dir=log_dir)
    raise ValueError(f"unknown backend {name!r}: local or ray")
