"""The worker ranks of one engine: their processes, the sockets to reach them, and what they serve.

`WorkerGroup` starts ranks 0..num_local_ranks-1 as processes of this host, forked from the master's
forkserver (`launch_forked`: torch is imported once), or hands them to a pre-warmed
TE's spare workers, `SpareWorker`); the other ranks run on other hosts and join through `RemoteRanks`. The
master sends every rank the same message (steps, pings, shutdown) and reads their results on one socket.
`WeightServers` tracks where new TEs of this layout can fork weights from; `time_load` puts the ranks'
weight loading into the TE's start-up timeline.
"""
from __future__ import annotations

import subprocess
import time
from typing import TYPE_CHECKING, Protocol

import zmq

from meshserve.config import EngineConfig
from meshserve.core.remote_ranks import RemoteRanks, enable_heartbeats
from meshserve.utils import cluster_auth
from meshserve.utils.processes import ForkedProcess, free_tcp_port, launch_forked, stop_process
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.heartbeat import StartupTimeline
from meshserve.wire.receive import recv_message
from meshserve.wire.worker import WorkerFailure, WorkerHandshake, WorkerReady

if TYPE_CHECKING:
    from meshserve.core.dp_group import GroupPlace

RESULTS = "worker-results"  # the master's socket for the ranks' results, as dropped frames name it
DEAD_GRACE_S = 2.0  # on a failed TE the other ranks may hang in a collective: stop them sooner
# what the master's forkserver imports once for all its local ranks (and their restarts): torch, the modules
# a rank builds its model runner from, and what torch imports lazily on a rank's first ops (sympy's shapes:
# about 1.4 s of CPU a rank; the native kernels' build tooling: about 0.8 s)
RANK_PRELOAD = ("torch", "torch.fx.experimental.symbolic_shapes", "torch.utils.cpp_extension", "ninja",
                "meshserve.parallel.context", "meshserve.worker.model_runner", "meshserve.models.deepseek_v3",
                "meshserve.models.qwen3_moe")


class SpareWorker(Protocol):
    """A worker process started ahead of time (a pre-warmed TE's, `meshserve.cluster.warm`): torch imported,
    native kernels loaded, waiting to be told which rank of which TE it is."""

    proc: subprocess.Popen | ForkedProcess

    def assign(self, handshake: WorkerHandshake) -> None: ...

    def release(self) -> None: ...


class WorkerGroup:
    """The worker processes of one engine (one per rank) and the sockets to reach them.

    The master starts ranks 0..num_local_ranks-1 itself; the others run on other hosts and
    join through `RemoteRanks`. With remote ranks every socket is TCP on `master_addr`;
    otherwise IPC in the TE's private directory.
    """

    def __init__(self, ctx: zmq.Context, config: EngineConfig, ipc_dir: str, log_level: int,
                 spare_workers: list[SpareWorker] = (), place: GroupPlace | None = None) -> None:
        """`place`: the one self-contained DP group whose ranks this master starts; the other groups' masters
        start theirs into the same world."""
        parallel = config.parallel_config
        strategy = parallel.strategy
        # the world ranks this master starts and talks to: all of them, or its DP group's
        self.first_rank = 0 if place is None else place.index * strategy.attn_tp
        self.world_size = parallel.world_size if place is None else strategy.attn_tp
        # those of this host (the world's first num_local_ranks) it starts itself; the others join from theirs
        num_local = max(0, min(self.world_size, parallel.num_local_ranks - self.first_rank))
        self._tcp_host = parallel.master_addr if num_local < self.world_size else None
        self._join_at = f"tcp://{parallel.master_addr}:{parallel.engine_port}"  # the TE's address for remote ranks
        self._ipc_dir = ipc_dir
        self.works: list[zmq.Socket] = []
        self.results = ctx.socket(zmq.PULL)
        result_addr = self._bind(self.results, "results")
        # the ranks meet in torch.distributed; rank 0's store listens here (MASTER_ADDR:MASTER_PORT)
        dist_init = (place.dist_init if place is not None and parallel.world_size > 1 else
                     f"tcp://{parallel.master_addr}:{parallel.master_port or free_tcp_port(parallel.master_addr)}"
                     if self.world_size > 1 else None)
        ranks = range(self.first_rank, self.first_rank + self.world_size)
        work_addrs = []
        for rank in ranks:
            work = ctx.socket(zmq.PUSH)
            work.setsockopt(zmq.LINGER, 0)
            if rank - self.first_rank >= num_local:
                enable_heartbeats(work)
                work.setsockopt(zmq.LINGER, 1000)  # let Shutdown reach the other host
                work.setsockopt(zmq.SNDTIMEO, 1000)  # a rank that is gone must not block the master
            work_addrs.append(self._bind(work, f"work-{rank}"))
            self.works.append(work)
        self.remote = (RemoteRanks(ctx, config, ranks, self.works, work_addrs, result_addr, dist_init,
                                   parallel.engine_port if place is None else place.join_port)
                       if num_local < self.world_size else None)
        self._unreachable: list[int] = []  # remote ranks whose work socket had no connection to send on
        self.early_results: list = []  # what ready ranks sent while others were still starting
        # a pre-warmed TE's spare worker processes take the first ranks; the others start as new processes
        spares = list(spare_workers)
        self.procs = []
        for rank in range(self.first_rank, self.first_rank + num_local):
            if spares:
                spare = spares.pop(0)
                spare.assign(WorkerHandshake(rank=rank, config=config, work_addr=work_addrs[rank - self.first_rank],
                                                 result_addr=result_addr, dist_init_method=dist_init))
                self.procs.append(spare.proc)
            else:
                self.procs.append(launch_forked("worker", RANK_PRELOAD, rank=rank, config=config.to_dict(),
                                                work_addr=work_addrs[rank - self.first_rank], result_addr=result_addr,
                                                dist_init_method=dist_init, log_level=log_level))
        for spare in spares:  # more spares than this TE's ranks
            spare.release()

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        if self._tcp_host is None:
            addr = f"ipc://{self._ipc_dir}/{name}"
            sock.bind(addr)
            return addr
        cluster_auth.server(sock)  # remote ranks must hold the cluster secret
        port = sock.bind_to_random_port(f"tcp://{self._tcp_host}")
        return f"tcp://{self._tcp_host}:{port}"

    def send(self, item) -> None:
        data = codec.encode(item)
        for rank, work in enumerate(self.works):
            try:
                work.send(data)
            except zmq.Again:  # only remote ranks' sockets time out: no connection left to send on
                self._unreachable.append(rank)

    def wait_ready(self, timeout_s: float, on_wait=None) -> list[WorkerReady]:
        """Every rank's WorkerReady, in rank order; `on_wait()` runs between polls (a recovering master
        keeps heartbeating)."""
        deadline = time.monotonic() + timeout_s
        ready: dict[int, WorkerReady] = {}
        while time.monotonic() < deadline:
            if on_wait is not None:
                on_wait()
            if self.results.poll(200):
                item = recv_message(self.results, RESULTS)
                if isinstance(item, WorkerReady):
                    ready[item.rank] = item
                    if len(ready) == self.world_size:
                        return [ready[rank] for rank in sorted(ready)]
                elif isinstance(item, WorkerFailure):
                    raise RuntimeError(f"worker {item.rank} failed to start: {item.message}{self._not_joined()}")
                elif item is not None:  # a ready rank's background news (its weight server): handled after start
                    self.early_results.append(item)
            gone = self._gone_rank(starting=True)
            if gone is not None:
                raise RuntimeError(gone[1])
        if self.remote is not None and self.remote.missing():
            raise RuntimeError(f"remote worker rank(s) {self.remote.missing()} did not join within "
                               f"{timeout_s:.0f}s; start each on its host with "
                               f"`meshserve worker --engine {self._join_at} --rank R`")
        missing = sorted(set(range(self.first_rank, self.first_rank + self.world_size)) - set(ready))
        raise RuntimeError(f"worker(s) {missing} not ready after {timeout_s:.0f}s")

    def _not_joined(self) -> str:
        missing = self.remote.missing() if self.remote is not None else []
        return f" (remote rank(s) {missing} never joined)" if missing else ""

    def failure(self) -> str | None:
        """Answer remote ranks knocking, then say which rank is gone, if one is."""
        gone = self._gone_rank()
        return None if gone is None else gone[1]

    def explain(self, report: WorkerFailure) -> str:
        """A rank's failure report, led by another rank's death when one is seen: a rank that
        fails inside a collective is often only the echo of a peer that died."""
        text = f"worker {report.rank} failed: {report.message}"
        gone = self._gone_rank()
        return text if gone is None or gone[0] == report.rank else f"{gone[1]}; then {text}"

    def dead_ranks(self) -> list[int]:
        """The ranks whose process has ended (or whose remote connection is lost)."""
        dead = [rank for rank, p in enumerate(self.procs, self.first_rank) if p.poll() is not None]
        if self.remote is not None:
            lost = self.remote.lost_rank()
            if lost is not None:
                dead.append(lost)
        return sorted(set(dead))

    def killed_ranks(self) -> list[int]:
        """The ranks whose process a signal ended (kill -9, the OOM killer): lost, unlike one that failed with an
        error and exited (a peer's death fails every rank's next collective, and each of those exits too)."""
        return [rank for rank, p in enumerate(self.procs, self.first_rank)
                if p.poll() is not None and p.returncode < 0]

    def _gone_rank(self, starting: bool = False) -> tuple[int, str] | None:
        for rank, p in enumerate(self.procs, self.first_rank):
            if p.poll() is not None:
                return rank, (f"worker {rank} exited during start-up (exit code {p.returncode})" if starting
                              else f"worker {rank} died (exit code {p.returncode})")
        if self.remote is None:
            return None
        self.remote.answer_handshakes()
        lost = self.remote.lost_rank()
        if lost is None and self._unreachable:
            lost = self._unreachable[0]
        if lost is not None:
            return lost, (f"remote worker {lost} disconnected during start-up" if starting
                          else f"remote worker {lost} disconnected (its process or host is gone)")
        return None

    def shutdown(self, grace_s: float = 10.0) -> None:
        for work in self.works:
            try:
                work.send(codec.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for p in self.procs:
            stop_process(p, grace_s=grace_s)
        if self.remote is not None:
            self.remote.close()
        for work in self.works:
            work.close()  # remote ranks' sockets linger a moment to deliver Shutdown
        self.results.close(0)



class WeightServers:
    """Where new TEs of this layout can fork weights from: each rank's weight server, as its snapshot becomes
    whole (WorkerReady, or a later WEIGHTS_SERVED event); `addrs` names them once every rank serves."""

    def __init__(self, ready: list[WorkerReady]) -> None:
        self._of_rank = {r.rank: r.weights_addr for r in ready if r.weights_addr}
        self.addrs = [r.weights_addr for r in ready] if all(r.weights_addr for r in ready) else []

    def on_served(self, rank: int, addr: str, world_size: int) -> None:
        self._of_rank[rank] = addr
        if len(self._of_rank) == world_size:  # new TEs may fork from this one now
            self.addrs = [self._of_rank[r] for r in sorted(self._of_rank)]


def time_load(startup: StartupTimeline, ready: list[WorkerReady]) -> None:
    """The TE-Load step of the start-up timeline, from its ranks' reports."""
    loaded = [r for r in ready if r.load_end]
    started = [r.rank_start for r in ready if r.rank_start]
    if started:
        startup.rank_start = min(started)
    if loaded:
        startup.load_start = min(r.load_start for r in loaded)
        startup.load_end = max(r.load_end for r in loaded)
        startup.load_source = "+".join(sorted({r.load_source for r in loaded if r.load_source}))
        startup.load_bytes = sum(r.load_bytes for r in loaded)
