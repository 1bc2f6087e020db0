"""Worker ranks on other hosts: how they join a TE and how each side notices the other is gone.

A remote rank (`meshserve worker --engine tcp://MASTER_ADDR:ENGINE_PORT --rank R`) sends its
rank number to the master's handshake socket and gets back the engine config and its
addresses (`WorkerHandshake`); from then on it is an ordinary rank. A TE with self-contained DP
groups answers at that address with the port of the rank's group master (`JoinDirectory`). It cannot be polled as
a child process, so liveness is the TCP connection of its work socket: ZMTP heartbeats keep
checking it while the rank computes (libzmq's I/O thread answers them, not Python), and a
socket monitor reports the disconnect when the process, or its host, goes away.
"""
from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from meshserve.config import EngineConfig, ParallelConfig
from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.receive import drop_frame
from meshserve.wire.worker import WorkerHandshake

logger = logging.getLogger(__name__)

_MAX_HANDSHAKE_BYTES = 2**16  # a handshake names one rank; anything larger is not one
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 10000  # a peer silent this long after a ping counts as gone
# a recovery binds the port its last handshake socket held, whose close libzmq completes in the background
_REBIND_WAIT_S = 2.0


def enable_heartbeats(sock: zmq.Socket) -> None:
    """Ping the peer over the connection, so a host that vanishes without closing it is noticed."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)


class PeerMonitor:
    """The one peer of a socket, watched through ZMQ monitor events: has it connected, is it gone."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.events = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.connected = False
        self.lost = False

    def update(self) -> bool:
        """Take in the events so far; True once the peer has connected and then gone."""
        while self.events.poll(0):
            event = recv_monitor_message(self.events)["event"]
            if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.lost = True
        return self.lost

    def close(self) -> None:
        self.sock.disable_monitor()
        self.events.close(0)


def rank_range(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}..{last}"


class HandshakeSocket:
    """Where remote ranks knock (`tcp://HOST:PORT`, cluster secret required): each question is a
    `WorkerHandshake` naming a rank, answered by `assign(rank, identity)`; a stranger's bytes get an error."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, _MAX_HANDSHAKE_BYTES)
        cluster_auth.server(self.sock, endpoint)  # a rank must hold the cluster secret to join
        try:
            self._bind()
        except zmq.ZMQError as exc:
            self.sock.close(0)
            raise RuntimeError(f"cannot listen for remote workers on {endpoint}: {exc}") from None

    def _bind(self) -> None:
        """Bind, waiting a moment while the port is still held (the socket of the ranks before a recovery may
        not be closed yet)."""
        deadline = time.monotonic() + _REBIND_WAIT_S
        while True:
            try:
                self.sock.bind(self.endpoint)
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def answer(self, assign: Callable[[int, bytes], WorkerHandshake]) -> None:
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if len(frames) != 2:
                drop_frame("worker-handshakes", f"{len(frames)} frames, expected 2")
                continue  # not a DEALER speaking our protocol; nothing to answer
            identity, payload = frames
            try:
                hello = codec.decode(payload)
                if not isinstance(hello, WorkerHandshake):
                    raise TypeError(type(hello).__name__)
                reply = assign(hello.rank, identity)
            except Exception as exc:  # noqa: BLE001 - a stranger's bytes must not stop the master
                drop_frame("worker-handshakes", exc)
                reply = WorkerHandshake(rank=-1, error="expected an WorkerHandshake message")
            self.sock.send_multipart([identity, codec.encode(reply)])

    def close(self) -> None:
        self.sock.close(0)


def _refusal(parallel: ParallelConfig, rank: int) -> str | None:
    """Why no master of this TE takes `rank` from another host, if none does."""
    last = parallel.world_size - 1
    if not isinstance(rank, int) or not 0 <= rank <= last:
        return f"rank {rank} is outside this engine's world of {parallel.world_size} ranks (0..{last})"
    if rank < parallel.num_local_ranks:
        return (f"rank {rank} is started by the engine itself; it expects remote rank(s) "
                f"{rank_range(parallel.num_local_ranks, last)}")
    return None


class RemoteRanks:
    """A master's side: answers handshakes and watches the work connection of every remote rank among its
    `ranks` (all the world's, or one self-contained DP group's), on `port` of the master's address."""

    def __init__(self, ctx: zmq.Context, config: EngineConfig, ranks: range, works: list[zmq.Socket],
                 work_addrs: list[str], result_addr: str, dist_init_method: str | None, port: int) -> None:
        self.parallel = parallel = config.parallel_config
        self.endpoint = f"tcp://{parallel.master_addr}:{port}"
        self.assignments = {
            rank: WorkerHandshake(rank=rank, config=config, work_addr=work_addrs[rank - ranks.start],
                                  result_addr=result_addr, dist_init_method=dist_init_method)
            for rank in ranks if rank >= parallel.num_local_ranks}
        # watch before the ranks can know the addresses, so no connection goes unseen
        self.monitors = {rank: PeerMonitor(works[rank - ranks.start]) for rank in self.assignments}
        self.joined: set[int] = set()
        self.joined_from: dict[int, bytes] = {}  # the socket identity each rank joined from
        try:
            self.handshakes = HandshakeSocket(ctx, self.endpoint)
        except RuntimeError:
            for monitor in self.monitors.values():
                monitor.close()
            raise
        logger.info("waiting for remote worker rank(s) %s on %s",
                    rank_range(min(self.assignments), max(self.assignments)), self.endpoint)

    def answer_handshakes(self) -> None:
        self.handshakes.answer(self._assign)

    def _assign(self, rank: int, identity: bytes) -> WorkerHandshake:
        error = _refusal(self.parallel, rank)
        if error is None and rank not in self.assignments:
            error = f"rank {rank} belongs to another DP group's master: join at the TE's engine port"
        if error is None:
            if rank not in self.joined:
                self.joined.add(rank)
                self.joined_from[rank] = identity
                logger.info("remote worker rank %d joined", rank)
                return self.assignments[rank]
            if self.monitors[rank].update():
                # a replacement that came before the master recovered from the loss: the next handshake
                # socket takes it
                return WorkerHandshake(rank=rank, error=f"rank {rank} is being recovered", retry=True)
            if self.joined_from.get(rank) == identity:
                return self.assignments[rank]  # the same rank asking again (it asks until answered)
            error = f"rank {rank} has already joined this engine"
        logger.warning("refused a remote worker: %s", error)
        return WorkerHandshake(rank=rank, error=error)

    def missing(self) -> list[int]:
        """Remote ranks that have not joined yet."""
        return sorted(set(self.assignments) - self.joined)

    def lost_rank(self) -> int | None:
        for rank, monitor in self.monitors.items():
            if monitor.update():
                return rank
        return None

    def close(self) -> None:
        for monitor in self.monitors.values():
            monitor.close()
        self.handshakes.close()


class JoinDirectory:
    """The one address a TE with self-contained DP groups gives ranks on other hosts (`meshserve worker --engine
    tcp://MASTER_ADDR:ENGINE_PORT --rank R`): the TE's shell sends each rank on to the master of its DP group,
    which listens on a port of its own (`group_ports`, kept across world restarts) and starts it there."""

    def __init__(self, ctx: zmq.Context, parallel: ParallelConfig, group_ports: dict[int, int]) -> None:
        self.parallel, self.group_ports = parallel, group_ports
        self.handshakes = HandshakeSocket(ctx, f"tcp://{parallel.master_addr}:{parallel.engine_port}")

    def answer(self) -> None:
        self.handshakes.answer(self._redirect)

    def _redirect(self, rank: int, identity: bytes) -> WorkerHandshake:
        error = _refusal(self.parallel, rank)
        if error is not None:
            logger.warning("refused a remote worker: %s", error)
            return WorkerHandshake(rank=rank, error=error)
        group = rank // self.parallel.strategy.attn_tp
        return WorkerHandshake(rank=rank, redirect=f"tcp://{self.parallel.master_addr}:{self.group_ports[group]}")

    def close(self) -> None:
        self.handshakes.close()
