"""A host's rank template: one process that has imported torch and a rank's modules, from which every TE on
the host gets its forkserver by fork instead of by a fresh interpreter.

Each master forks its ranks from a forkserver (`launch_forked`), and a fresh forkserver spends about 5 s of CPU
importing torch and the rank's modules (`RANK_PRELOAD`) before the first rank can start. Where many TEs start
on one host (a pool scaling out, a failover, a test session) that import is paid once here instead: a master
whose environment names this template's socket (MESHSERVE_RANK_TEMPLATE) sends it the two ends a forkserver
runs on (its listening socket and the read end of its liveness pipe) and its standard streams; the template
forks, and the child runs multiprocessing's own forkserver loop on them. Everything after that is as without
a template: the master asks its forkserver for ranks, the ranks are the forkserver's children, the
forkserver ends when its master is gone and the ranks end when their parent is.

The template's process tree differs: the forkserver and ranks sit below the template, not below the master.
`meshserve.utils.processes.process_tree` finds them by the forkserver's title, which names its master. The
template adopts (as a child subreaper) and reaps the ranks a dead forkserver leaves behind.
"""
from __future__ import annotations

import array
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import stat
import sys

from meshserve.core.worker_group import RANK_PRELOAD
from meshserve.utils.processes import FORKSERVER_TITLE, RUNNER_MODULE

log = logging.getLogger("meshserve.rank_template")

# what a master sends: its forkserver's listening socket, the liveness pipe's read end, stdin/stdout/stderr
FORKSERVER_FDS = 5
_REQUEST_BYTES = 65536
_PARENT_CHECK_S = 1.0
_PR_SET_CHILD_SUBREAPER = 36


def run_rank_template(socket_path: str, watch_parent: bool = True, parent_pid: int | None = None,
                      log_level: int = logging.INFO) -> None:
    """Serve forkservers on the unix socket `socket_path` until stopped (SIGTERM, Ctrl-C) or, with
    `watch_parent`, until the process that started this one is gone. A launcher that passes its pid as
    `parent_pid` is watched even if it died before this process could ask for its parent."""
    parent = (os.getppid() if parent_pid is None else parent_pid) if watch_parent else None
    logging.basicConfig(level=log_level, format="%(asctime)s rank-template %(levelname)s %(message)s", force=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _become_subreaper()
    # listening first: a master that asks while the imports run waits in the backlog instead of falling back
    listener = _listen(socket_path)
    try:
        for module in RANK_PRELOAD:
            __import__(module)
        log.info("ready on %s (%s imported)", socket_path, ", ".join(RANK_PRELOAD))
        while parent is None or os.getppid() == parent:
            _reap_children()
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                _serve_request(conn, listener)
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)


def _listen(socket_path: str) -> socket.socket:
    """The template's socket, readable and writable by its user only from the moment it exists. A socket
    left by an earlier template is replaced; any other file there is an error, not something to delete."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(socket_path).st_mode):
            raise SystemExit(f"meshserve rank-template: {socket_path} exists and is not a socket")
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)
    try:
        listener.bind(socket_path)
    finally:
        os.umask(umask)
    listener.listen(64)
    listener.settimeout(_PARENT_CHECK_S)
    return listener


def _serve_request(conn: socket.socket, listener: socket.socket) -> None:
    """Fork one forkserver for the master on `conn` and send it the forkserver's pid."""
    conn.settimeout(10.0)
    try:
        request, fds = _receive_fds(conn)
    except (OSError, ValueError) as exc:
        log.warning("dropped a forkserver request: %s", exc)
        return
    try:
        if len(fds) != FORKSERVER_FDS:
            log.warning("dropped a forkserver request with %d descriptors (want %d)", len(fds), FORKSERVER_FDS)
            return
        pid = os.fork()
        if pid == 0:
            _become_forkserver(request, fds, [conn.fileno(), listener.fileno()])
        conn.sendall(json.dumps({"pid": pid}).encode())
        log.debug("forked forkserver %d for master %s", pid, request.get("master"))
    except OSError as exc:  # no fork, or the master hung up: its forkserver ends with its liveness pipe
        log.warning("a forkserver request failed: %s", exc)
    finally:
        for fd in fds:
            os.close(fd)


def _become_forkserver(request: dict, fds: list[int], own_fds: list[int]) -> None:
    """In the forked child: take the master's streams, drop the template's sockets, run the forkserver loop."""
    from multiprocessing import forkserver

    import setproctitle

    code = 1
    try:
        listener_fd, alive_r, *streams = fds
        for fd in own_fds:
            os.close(fd)
        for target, fd in enumerate(streams):
            os.dup2(fd, target)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        setproctitle.setproctitle(f"{sys.executable} -m {RUNNER_MODULE} {FORKSERVER_TITLE} "
                                  f"{json.dumps({'master': request.get('master')}, separators=(',', ':'))}")
        os.chdir(request.get("cwd") or "/")
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:  # how the forkserver loop ends once its master is gone
        code = 0
    finally:
        os._exit(code)


def _receive_fds(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request's JSON object and descriptors; ValueError (the descriptors closed) for anything else."""
    fds = array.array("i")
    message, ancillary, _, _ = conn.recvmsg(_REQUEST_BYTES, socket.CMSG_SPACE(FORKSERVER_FDS * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - (len(data) % fds.itemsize)])
    try:
        request = json.loads(message.decode() or "{}")
        if not isinstance(request, dict):
            raise ValueError(f"a request is a JSON object, not {type(request).__name__}")
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    return request, list(fds)


def _reap_children() -> None:
    """Collect the exit status of ended forkservers and of the ranks this template adopted."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _become_subreaper() -> None:
    """Adopt the orphans below (ranks whose forkserver ended first) rather than leave them to init, which on
    some hosts never reaps them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        log.debug("not a child subreaper: orphans go to init")
