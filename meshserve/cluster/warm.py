"""Pre-warmed TEs: processes that have paid a TE's start-up costs before anyone knows which TE they will be.

deepserve §6.1: most of a cold TE's start-up is not the model — the interpreter, importing torch and the
model code, building the native kernels, starting the ranks' processes. A pre-warmed TE (`warm-te`) has
done all of that and holds `num_workers` spare worker processes (`warm-worker`, each as far along); it is
model-agnostic and parallelism-agnostic. The warm TE itself will be the master, which never imports torch
(house rule): it imports the master's code, and the torch work is done in its spare workers. Once every
spare is warm it tells the cluster manager it is ready (`WarmReady`, repeated until it is used, so a
restarted manager finds it) and waits. Handed a `WarmAssign` (model, settings, role, group, JEs), it
becomes that TE in place: `run_te` with its spare workers as the first ranks (a TE of more ranks than
spares starts the rest the ordinary way; spares beyond its ranks exit).
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time

import zmq

from meshserve.utils import cluster_auth
from meshserve.utils.processes import launch
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.cluster import WarmAssign, WarmReady
from meshserve.wire.codec import MAX_INBOX_BYTES
from meshserve.wire.receive import recv_message
from meshserve.wire.worker import WorkerHandshake

logger = logging.getLogger(__name__)

_READY_INTERVAL_S = 1.0
_PARENT_CHECK_MS = 1000


def warm_worker_imports() -> None:
    """What every worker process imports and builds before it can load a model: torch, the model, worker and
    transfer code, the native CPU kernels, and torch's lazily imported parts a model construction pulls in."""
    # start-up: this is the work a pre-warmed process does ahead of time
    import torch

    import meshserve.worker.model_runner  # noqa: F401 - the worker's whole import tree
    from meshserve.layers import cpu_kernels

    cpu_kernels.enabled()
    torch.nn.utils.skip_init(torch.nn.Linear, 8, 8)  # imports torch._refs (a second, the first time)


class _SpareWorker:
    """The warm TE's side of one spare worker: its process and the socket its rank assignment goes on."""

    def __init__(self, ctx: zmq.Context, ipc_dir: str, index: int, ready_addr: str, log_level: int) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        addr = f"ipc://{ipc_dir}/spare-{index}"
        self.sock.bind(addr)
        self.proc: subprocess.Popen = launch("warm-worker", assign_addr=addr, ready_addr=ready_addr,
                                             log_level=log_level, parent_pid=os.getpid())

    def assign(self, handshake: WorkerHandshake) -> None:
        self.sock.send(codec.encode(handshake))

    def release(self) -> None:
        self.sock.send(codec.encode(Shutdown()))


def run_warm_worker(assign_addr: str, ready_addr: str, log_level: int = logging.INFO,
                    parent_pid: int | None = None) -> None:
    """A spare rank: warm up, say so, wait for a `WorkerHandshake` naming its rank (or Shutdown), then run it.
    It ends once its parent is no longer the warm TE `parent_pid` that launched it: one that died even before
    this process could ask for its parent (whose parent would already be init) is noticed too."""
    parent = os.getppid() if parent_pid is None else parent_pid
    logging.basicConfig(level=log_level, format="%(asctime)s warm-worker %(levelname)s %(message)s", force=True)
    # start-up: the worker module only in a process that will be one
    from meshserve.worker.worker import run_worker

    warm_worker_imports()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(assign_addr)
    ready = ctx.socket(zmq.PUSH)
    ready.setsockopt(zmq.LINGER, 1000)
    ready.connect(ready_addr)
    ready.send(codec.encode(WarmReady(name="spare", pid=os.getpid(), assign_addr=assign_addr, num_workers=0)))
    ready.close()
    try:
        while True:
            if not sock.poll(_PARENT_CHECK_MS):
                if os.getppid() != parent:
                    return  # the warm TE is gone
                continue
            item = recv_message(sock, "spare-assign")
            if isinstance(item, Shutdown):
                return
            if isinstance(item, WorkerHandshake) and item.config is not None:
                break
    finally:
        sock.close(0)
        ctx.term()
    run_worker(item.rank, item.config.to_dict(), item.work_addr, item.result_addr, item.dist_init_method, log_level)


def run_warm_te(name: str, manager_addr: str, host: str = "127.0.0.1", num_workers: int = 1,
                log_level: int = logging.INFO) -> None:
    """A pre-warmed TE: warm up, start spare workers, announce itself to the manager, become the TE it is given."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s warm[{name}] %(levelname)s %(message)s", force=True)
    ipc_dir = tempfile.mkdtemp(prefix="meshserve-warm-")
    try:
        _warm_and_become(name, manager_addr, host, num_workers, log_level, ipc_dir)
    finally:
        # the spares' sockets, there for as long as the TE they became runs
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _warm_and_become(name: str, manager_addr: str, host: str, num_workers: int, log_level: int,
                     ipc_dir: str) -> None:
    # start-up: the TE entry point only in a process that will be one
    from meshserve.core.te_process import run_te

    t0 = time.monotonic()
    ctx = zmq.Context()
    spares_ready = ctx.socket(zmq.PULL)
    spares_ready.bind(f"ipc://{ipc_dir}/spares-ready")
    spares = [_SpareWorker(ctx, ipc_dir, i, f"ipc://{ipc_dir}/spares-ready", log_level) for i in range(num_workers)]
    import meshserve.core.master  # noqa: F401 - the master's import tree (no torch)

    waiting = num_workers
    while waiting:  # announce only a TE whose every spare is warm
        if spares_ready.poll(_PARENT_CHECK_MS):
            if isinstance(recv_message(spares_ready, "spares-ready"), WarmReady):
                waiting -= 1
        elif any(spare.proc.poll() is not None for spare in spares):
            raise SystemExit("a spare worker exited while warming up")
    spares_ready.close(0)
    assign = cluster_auth.server(ctx.socket(zmq.PULL))
    assign.setsockopt(zmq.MAXMSGSIZE, MAX_INBOX_BYTES)
    port = assign.bind_to_random_port(f"tcp://{host}")
    manager = cluster_auth.client(ctx.socket(zmq.PUSH), manager_addr)
    manager.setsockopt(zmq.LINGER, 0)
    manager.setsockopt(zmq.SNDHWM, 4)
    manager.connect(manager_addr)
    ready = codec.encode(WarmReady(name=name, pid=os.getpid(), assign_addr=f"tcp://{host}:{port}",
                                     num_workers=num_workers, host=host))
    logger.info("warm in %.1f s with %d spare worker(s); waiting for a TE to become", time.monotonic() - t0,
                num_workers)
    order = None
    while order is None:
        try:
            manager.send(ready, zmq.NOBLOCK)
        except zmq.Again:
            pass  # no manager right now: the next announcement reaches the one that comes back
        if assign.poll(int(_READY_INTERVAL_S * 1000)):
            item = recv_message(assign, "warm-assign")
            if isinstance(item, Shutdown):
                break
            if isinstance(item, WarmAssign):
                order = item
    manager.close(0)
    assign.close(0)
    if order is None:
        for spare in spares:
            spare.release()
        return
    logger.info("becoming TE %s (%s, group %s)", order.config.te_name, order.role, order.group)
    run_te(order.config.to_dict(), str(order.role), order.group, order.listen, list(order.register), log_level,
           warmup=True, started_at=order.assigned_at or time.time(), spare_workers=spares)
