"""Starting and stopping meshserve's processes, and the table of their entry points.

Each process is a fresh interpreter running `python -m meshserve.utils.processes MODULE:FUNCTION '<json>'`:
the function is called with the JSON object as keyword arguments. Nothing depends on the caller's
`__main__` (no multiprocessing re-import of a script), the same command line starts a process on another host, and
`ps` names the code a process runs. Entry points are named in one table, so a moved file fails the
entry-point test, not a start-up; this module imports nothing of meshserve (the table holds strings).

A TE's worker ranks start another way (`launch_forked`): each is forked from the master's forkserver, which
imported torch and the rank's modules once, so the second and later ranks, and every rank restarted after a
failure, start without importing torch again (about 3 s of CPU each). Their `ps` line reads as `launch`'s
would, with the rank as the only argument. Where the environment names a host's rank template
(MESHSERVE_RANK_TEMPLATE, `meshserve.core.rank_template`), the forkserver itself is forked from it, so not
even the first rank imports torch; `process_tree` then finds the forkserver and ranks below the template.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import multiprocessing
import multiprocessing.process
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

# name -> "module:function"; the function takes the JSON-able keyword arguments `launch` was given
PROCESS_ENTRY_POINTS: dict[str, str] = {
    "master": "meshserve.core.master:run_master",  # one engine's master (scheduler, KV cache manager)
    "group-master": "meshserve.core.group_master:run_group_master",  # one self-contained DP group of a TE
    "worker": "meshserve.worker.worker:run_worker",  # one rank of an engine, started by its master
    "te": "meshserve.core.te_process:run_te",  # an engine that registers with routers (`meshserve te`)
    "frontend": "meshserve.entrypoints.openai.frontend:run_frontend",  # a further HTTP server + router
    "pool-controller": "meshserve.pool.controller:run_controller_process",  # the memory pool's controller
    "pool-server": "meshserve.pool.server:run_server",  # one memory pool server
    "warm-te": "meshserve.cluster.warm:run_warm_te",  # a pre-warmed TE shell, handed a model and role later
    "warm-worker": "meshserve.cluster.warm:run_warm_worker",  # a spare rank of a pre-warmed TE
    "cluster-manager": "meshserve.cluster.run:run_manager",  # `meshserve cluster up` in the background
    "rank-template": "meshserve.core.rank_template:run_rank_template",  # forkservers for a host's TEs
}
RUNNER_MODULE = "meshserve.utils.processes"  # this module, run as `python -m`
# a process that ends because it was told to (SIGTERM) exits with the shell's code for that signal
STOPPED_BY_SIGNAL_EXIT_CODE = 128 + signal.SIGTERM
# the word in the `ps` line of a forkserver forked from a rank template, before `{"master":PID}`
FORKSERVER_TITLE = "forkserver"
_TEMPLATE_REPLY_TIMEOUT_S = 60.0  # a template still importing torch answers once it has

# A process forked by a forkserver re-runs its parent's `-m` main module as `__mp_main__`, and runpy warns that
# the forkserver's preload already imported it, once per rank. The forked process copies this filter from the
# forkserver that imported this module.
warnings.filterwarnings("ignore", message=f"'{RUNNER_MODULE}' found in sys.modules", category=RuntimeWarning)


def stopped_on_request(returncode: int | None) -> bool:
    """Whether an exit status says the process was stopped on purpose (SIGTERM, handled or not): an owner
    that restarts crashed processes leaves this one stopped."""
    return returncode in (-signal.SIGTERM, STOPPED_BY_SIGNAL_EXIT_CODE)


def launch(name: str, **kwargs: Any) -> subprocess.Popen:
    """Start the process `name` of PROCESS_ENTRY_POINTS with `kwargs` (JSON-able) as its arguments."""
    target = PROCESS_ENTRY_POINTS[name]
    return subprocess.Popen([sys.executable, "-m", RUNNER_MODULE, target, json.dumps(kwargs)], stdin=subprocess.DEVNULL)


class ForkedProcess:
    """A process forked from this process's forkserver (multiprocessing), with the part of subprocess.Popen's
    interface that owners of meshserve's processes use: pid, poll, wait, terminate, kill, returncode."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid = process.pid
        self.args = process.name

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


def launch_forked(name: str, preload: Sequence[str], **kwargs: Any) -> ForkedProcess:
    """Start the process `name` of PROCESS_ENTRY_POINTS with `kwargs`, forked from this process's forkserver;
    the first call starts that server, which imports `preload` once (later calls' `preload` is not read)."""
    target = PROCESS_ENTRY_POINTS[name]
    context = prepare_forkserver(preload)
    # it gets the environment of now, as a new interpreter would (the forkserver's is that of its start);
    # daemonic: a caller that exits without stopping it (an exception) terminates it on the way out rather
    # than waiting for it (multiprocessing joins its other children at exit)
    process = context.Process(target=_run_forked, args=(target, kwargs, dict(os.environ)), name=f"meshserve-{name}",
                              daemon=True)
    process.start()
    return ForkedProcess(process)


def prepare_forkserver(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    """The "forkserver" start method's context, its server (once started) importing `preload`, or forked from
    the host's rank template where MESHSERVE_RANK_TEMPLATE names one."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    _use_the_rank_template()
    return context


def _run_forked(target: str, kwargs: dict[str, Any], environ: dict[str, str]) -> None:
    """A forked process's body: named in `ps` as `launch` would name it (the rank, if any, its one argument)."""
    import setproctitle

    shown = {"rank": kwargs["rank"]} if "rank" in kwargs else {}
    # first: the title takes over the memory of the process's original arguments and environment
    setproctitle.setproctitle(f"{sys.executable} -m {RUNNER_MODULE} {target} "
                              f"{json.dumps(shown, separators=(',', ':'))}")
    os.environ.clear()
    os.environ.update(environ)
    _let_go_of_the_forkservers_lifeline()
    entry_point(target)(**kwargs)


def _let_go_of_the_forkservers_lifeline() -> None:
    """Close the inherited copy of the caller's end of its forkserver's liveness pipe. The forkserver ends
    when that pipe is closed (the caller is gone); held open here, it would outlive the caller, and so
    would this process, whose parent it is (a rank ends when its parent changes)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the module's own instance: what it hands its children
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _use_the_rank_template() -> None:
    """Where MESHSERVE_RANK_TEMPLATE names a rank template, have this process's forkserver forked from it
    (torch already imported) instead of started as a new interpreter. A template that cannot be reached is
    logged and passed over: multiprocessing starts a forkserver of its own, as without one."""
    from multiprocessing import forkserver

    from meshserve.utils import envs

    server = forkserver._forkserver  # the module's own instance, which `Process.start` asks
    path = envs.rank_template_socket()
    if not path or "ensure_running" in vars(server):
        return
    own_ensure_running = server.ensure_running
    template_forkserver: list = []  # the psutil.Process of the forkserver the template forked, once there is one

    def ensure_running() -> None:
        from multiprocessing import resource_tracker

        import psutil

        with server._lock:
            resource_tracker.ensure_running()
            if template_forkserver:
                process = template_forkserver.pop()
                with contextlib.suppress(psutil.Error):
                    if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                        template_forkserver.append(process)
                        return
                os.close(server._forkserver_alive_fd)  # gone: ask for another
                server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
            try:
                address, alive_w, pid = _forkserver_from_template(path)
                template_forkserver.append(psutil.Process(pid))
                server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
                return
            except (OSError, ValueError, psutil.Error) as exc:
                logging.getLogger("meshserve").warning("rank template %s: %s; starting a forkserver of our own",
                                                       path, exc)
                vars(server).pop("ensure_running", None)
        own_ensure_running()  # outside the lock, which it takes

    server.ensure_running = ensure_running


def _forkserver_from_template(path: str) -> tuple[str, int, int]:
    """Ask the rank template at `path` for a forkserver: (its address, the liveness pipe's write end, its pid).
    What multiprocessing's own `ensure_running` sets up, except that the server is forked, not spawned."""
    import array
    from multiprocessing import connection

    with socket.socket(socket.AF_UNIX) as listener, socket.socket(socket.AF_UNIX) as template:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the forkserver ends when this process's end closes
        try:
            template.settimeout(_TEMPLATE_REPLY_TIMEOUT_S)
            template.connect(path)
            request = json.dumps({"master": os.getpid(), "cwd": os.getcwd()}).encode()
            fds = array.array("i", [listener.fileno(), alive_r, 0, 1, 2])
            template.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            reply = template.recv(4096)
            pid = int(json.loads(reply.decode() or "{}")["pid"])
        except (OSError, ValueError, KeyError) as exc:
            os.close(alive_w)
            raise ValueError(f"no forkserver ({exc})") from None
        finally:
            os.close(alive_r)
    return address, alive_w, pid


def process_tree(pid: int) -> list:
    """The psutil.Process of every process below `pid`, counting as below a master the forkserver a rank
    template forked for it (its `ps` line names the master) and that forkserver's ranks."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    masters = {pid, *(p.pid for p in below)}
    for process in psutil.process_iter(["cmdline"]):
        words = " ".join(process.info["cmdline"] or ()).split()
        if len(words) < 2 or words[-2] != FORKSERVER_TITLE:
            continue
        try:
            if int(json.loads(words[-1])["master"]) not in masters:
                continue
            below += [process, *process.children(recursive=True)]
        except (ValueError, KeyError, TypeError, psutil.Error):
            continue
    return below


def rank_processes(master_pid: int) -> dict[int, int]:
    """rank -> pid of the worker ranks a master runs on this host (forked by its forkserver, so below the
    master in its `process_tree`; each one's `ps` line ends with its rank as `{"rank":N}`)."""
    import psutil

    worker = PROCESS_ENTRY_POINTS["worker"]
    ranks = {}
    for child in process_tree(master_pid):
        try:
            words = " ".join(child.cmdline()).split()  # a forked rank's title is one string
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if worker in words:
            try:
                ranks[int(json.loads(words[-1])["rank"])] = child.pid
            except (ValueError, KeyError, TypeError):
                continue
    return ranks


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


# where free_tcp_port looks when the kernel's ephemeral range cannot be read (Linux's default starts at 32768)
_FALLBACK_EPHEMERAL_START = 32768
# above Ray's default worker ports (10002-19999): `ray start` refuses a port of its own in that range, and
# Ray's workers bind there
_LOWEST_PICKED_PORT = 20000
_PORT_PICK_TRIES = 64
# not the module's generator: a test seeding `random` must not make two processes pick the same ports
_port_picker = random.SystemRandom()


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now, for a process that binds it a moment later (a rendezvous, a
    listener whose address is handed out first). Picked at random below the kernel's ephemeral range: a port
    from that range (what binding port 0 gives) is also where every outgoing connection on the host takes
    its local port, so between the pick and the bind another process's connection could take it."""
    upper = _ephemeral_range_start() - 1
    for _ in range(_PORT_PICK_TRIES):
        port = _port_picker.randint(_LOWEST_PICKED_PORT, upper)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded host: the kernel's pick
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_range_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_START
    return start if start > _LOWEST_PICKED_PORT + 1000 else _FALLBACK_EPHEMERAL_START


def main(argv: list[str]) -> None:
    """`python -m meshserve.utils.processes MODULE:FUNCTION '<json arguments>'` (what `launch` runs)."""
    if len(argv) != 3:
        raise SystemExit("usage: python -m meshserve.utils.processes MODULE:FUNCTION '<json arguments>'")
    entry_point(argv[1])(**json.loads(argv[2]))


def exit_without_teardown(code: int | str | None) -> None:
    """End the process as the interpreter would (non-daemon threads joined, exit handlers run, logs and
    streams flushed) but skip freeing every module: for a process that imported torch that teardown takes
    about a second, paid on every stop and every restart of a rank. Children of multiprocessing end so too."""
    # what the interpreter's exit does first: wake the executors' workers, then join every non-daemon thread
    threading._shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe loses nothing that a teardown would keep
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    try:
        main(sys.argv)
    except SystemExit as stop:
        exit_without_teardown(stop.code)
    exit_without_teardown(0)
