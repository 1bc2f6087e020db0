"""Nodes x ranks layout of a world, its intra-/inter-node process groups, the world's rendezvous, and
a local launcher.

Rank r lives on node r // ranks_per_node with local rank r % ranks_per_node. The
intra-node group of a node holds its ranks; the inter-node group of a local rank
holds the ranks with that local rank on every node (MixServe's TP and EP groups).
On one machine the "nodes" are just a grouping of local processes: the groups are
real torch.distributed groups all the same.

`init_world` joins a world through a TCPStore whose server (rank 0) listens on the master address
only: torch's own `tcp://` and `env://` rendezvous start it on every interface.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from meshserve.utils.processes import prepare_forkserver

# what a local world's forkserver imports once for all its ranks
WORLD_PRELOAD = ("torch", "torch.distributed", "meshserve.parallel.topology")


@dataclass(frozen=True)
class Topology:
    num_nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"topology needs >= 1 node and >= 1 rank per node, got "
                             f"{self.num_nodes} x {self.ranks_per_node}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")

    def node_of(self, rank: int) -> int:
        self._check(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        self._check(rank)
        return rank % self.ranks_per_node

    def global_rank(self, node: int, local_rank: int) -> int:
        if not (0 <= node < self.num_nodes and 0 <= local_rank < self.ranks_per_node):
            raise ValueError(f"(node {node}, local rank {local_rank}) outside {self.num_nodes} x {self.ranks_per_node}")
        return node * self.ranks_per_node + local_rank

    def intra_node_ranks(self, node: int) -> list[int]:
        return [self.global_rank(node, local) for local in range(self.ranks_per_node)]

    def inter_node_ranks(self, local_rank: int) -> list[int]:
        return [self.global_rank(node, local_rank) for node in range(self.num_nodes)]


@dataclass
class TopologyGroups:
    """This rank's two groups, plus every group (new_group must be called for all of them on every rank)."""

    topology: Topology
    rank: int
    intra_node: dist.ProcessGroup
    inter_node: dist.ProcessGroup
    all_intra_node: list[dist.ProcessGroup]
    all_inter_node: list[dist.ProcessGroup]


def build_groups(topology: Topology) -> TopologyGroups:
    """Create the intra- and inter-node groups on an initialised world; collective over the world."""
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed to be initialised")
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"world size {dist.get_world_size()} != topology {topology.num_nodes} x "
                         f"{topology.ranks_per_node}")
    rank = dist.get_rank()
    # Every rank creates every group, in the same order, as new_group requires.
    intra = [dist.new_group(topology.intra_node_ranks(node)) for node in range(topology.num_nodes)]
    inter = [dist.new_group(topology.inter_node_ranks(local)) for local in range(topology.ranks_per_node)]
    return TopologyGroups(topology, rank, intra[topology.node_of(rank)], inter[topology.local_rank(rank)],
                          intra, inter)


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The world's TCPStore at host:port; rank 0 runs its server, listening on `host` alone (it binds the
    socket itself and hands it to the store, which then owns it)."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=max(128, world_size))
    try:
        store = dist.TCPStore(host, port, world_size, True, timeout=timeout, master_listen_fd=listener.fileno(),
                              use_libuv=True)
    except BaseException:
        listener.close()
        raise
    listener.detach()
    return store


def init_world(backend: str, init_method: str, rank: int, world_size: int,
               timeout: timedelta | None = None) -> None:
    """`dist.init_process_group` for a `tcp://HOST:PORT` rendezvous whose store listens on HOST only."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    if not init_method.startswith("tcp://") or not host or not port.isdigit():
        raise ValueError(f"init_method must be tcp://HOST:PORT, got {init_method!r}")
    timeout = timeout or dist.default_pg_timeout
    store = rendezvous_store(host.strip("[]"), int(port), rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_worker(rank: int, fn: Callable, world_size: int, port: int, backend: str, args: tuple,
                  environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment of now, not the forkserver's of its start
    os.environ.update(environ)
    init_world(backend, f"tcp://127.0.0.1:{port}", rank, world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # Peers of a failed rank fail too (closed connections); print the first cause per rank.
        print(f"[rank {rank}] {traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


def spawn_local_world(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 60.0,
                      backend: str = "gloo") -> None:
    """Run fn(rank, world_size, *args) in world_size processes on 127.0.0.1, forked from this process's
    forkserver (torch imported once, not in every rank; `fn` and `args` must pickle, as for spawn).

    Raises when a worker fails or the world does not finish within timeout_s; every
    process is ended either way.
    """
    prepare_forkserver(WORLD_PRELOAD)
    context = mp.start_processes(_local_worker, args=(fn, world_size, free_port(), backend, args, dict(os.environ)),
                                 nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"local world of {world_size} did not finish within {timeout_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
