"""The cluster manager's state file: what it started, so a restarted manager takes the deployment over.

The manager is "highly available" the way deepserve §3 needs it to be: its processes do not depend on
it (they run in their own sessions or as detached Ray actors, and the JEs keep serving while it is down),
and everything it knows that cannot be asked again lives in `<state_dir>/state.json`: the deployment it
runs, the ports of its own sockets (the TEs and JEs keep sending to them), each process's backend record
and each pool's target. A manager starting on a state directory whose manager is gone adopts every
recorded process that still runs and restarts only the ones that do not; one whose manager still runs
refuses to start a second. Writes are atomic (a temporary file renamed over the old one).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

STATE_FILE = "state.json"


class ProcessRecord(msgspec.Struct, forbid_unknown_fields=True):
    kind: str  # te | frontend | warm-te
    name: str
    handle: dict[str, Any]  # the backend's record (`ProcessHandle.record()`)
    pool: str = ""  # a TE's pool ("GROUP/ROLE")
    port: int = 0  # a frontend's HTTP port
    register_port: int = 0  # a frontend's TE registration port
    started_at: float = 0.0
    restarts: int = 0
    source: str = ""  # how a TE started: cold | prewarmed, + fork


class ClusterState(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    backend: str
    deployment: str  # the deployment file or preset it runs
    model: str
    manager_pid: int
    manager_create_time: float
    host: str
    control_port: int  # `meshserve status` and `cluster down` ask here
    register_port: int  # TEs' heartbeats, JEs' reports and warm TEs' announcements arrive here
    metrics_port: int = 0
    base_port: int = 8000  # the first JE's HTTP port
    ray_address: str | None = None
    processes: list[ProcessRecord] = msgspec.field(default_factory=list)
    targets: dict[str, int] = msgspec.field(default_factory=dict)  # pool -> TEs wanted
    next_index: dict[str, int] = msgspec.field(default_factory=dict)  # pool -> index of its next new TE


def state_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / STATE_FILE


def load_state(state_dir: str | Path) -> ClusterState | None:
    path = state_path(state_dir)
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=ClusterState)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path} is not a meshserve cluster state file: {exc}") from None


def save_state(state_dir: str | Path, state: ClusterState, unchanged_from: bytes = b"") -> bytes:
    """Write the state (atomically) unless it equals `unchanged_from`; returns what the file holds."""
    data = msgspec.json.format(msgspec.json.encode(state))
    if data == unchanged_from:
        return data
    path = state_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return data


def manager_running(state: ClusterState) -> bool:
    """Whether the manager that wrote `state` still runs (the same pid started at the same time)."""
    # start-up: psutil only where processes are checked
    import psutil

    try:
        proc = psutil.Process(state.manager_pid)
        return abs(proc.create_time() - state.manager_create_time) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
