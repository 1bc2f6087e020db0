"""The board self-contained DP groups agree on each step over (`ParallelContext.agree_on_step`): every rank's
row of a few integers, gathered to rank 0 and sent back to every rank.

It runs once before every forward of every rank, so it must cost next to nothing. A gloo gather and broadcast
went through torch.distributed's Python layer and gloo's transport threads: 0.6-1.2 ms of CPU per rank and round
at 8 ranks, which on a host with fewer cores than processes became the wall time of every step. Here the rows
travel over Unix-domain `SOCK_SEQPACKET` connections from each rank to rank 0 (one message per rank and
direction, message boundaries kept, a blocking receive that the kernel wakes): about 0.1 ms of CPU per rank.
The sockets live in Linux's abstract namespace, so nothing is left on disk by a killed rank. When the world spans
hosts (`host`: rank 0's address as the others reach it), the rows travel over TCP instead (Nagle off, each
message led by its length, since a stream keeps no boundaries), and every connection opens with the cluster
secret's challenge-response (`cluster_auth.handshake_server`), so only the TE's own ranks take part.

Failures are those of a collective: a rank that dies closes its connection, and the peers' next round fails at
once (`ConnectionError`); one that hangs fails the round after the context's collective timeout
(`TimeoutError`). Either ends the rank's loop, and its group's master restarts the world.
"""
from __future__ import annotations

import secrets
import socket
import struct
from datetime import timedelta

import torch.distributed as dist

from meshserve.utils import cluster_auth

_RANK = struct.Struct("<q")
_LENGTH = struct.Struct("<I")  # leads each message on TCP
_KEY_PREFIX = "meshserve/step-board"


class StepBoard:
    """One rank's side of the board. Rank 0 holds a connection to every other rank; the others one to rank 0."""

    def __init__(self, rank: int, world_size: int, peers: list[socket.socket]) -> None:
        self.rank, self.world_size = rank, world_size
        self._peers = peers  # rank 0: the connections of ranks 1..world-1, in rank order; else [rank 0's]

    @classmethod
    def open(cls, store: dist.Store, rank: int, world_size: int, generation: int, round_timeout_s: float,
             meet_timeout_s: float, host: str | None = None) -> StepBoard:
        """Collective over the world: rank 0 listens on a fresh address that it publishes in the world's store
        under `generation` (a new board after a rebuild gets a new one); every other rank connects to it. They
        meet within `meet_timeout_s`; a round then fails after waiting `round_timeout_s` for a peer. `host`:
        rank 0's host address when ranks run on other hosts (TCP), None when all share one (a Unix socket)."""
        key = f"{_KEY_PREFIX}/{generation}"
        if rank == 0:
            return cls._listen(store, key, world_size, round_timeout_s, meet_timeout_s, host)
        store.wait([key], timedelta(seconds=meet_timeout_s))
        address = store.get(key)
        try:
            if host is None:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                conn.settimeout(round_timeout_s)
                conn.connect(address)
            else:
                listen_host, port = address.decode().rsplit(":", 1)
                conn = socket.create_connection((listen_host, int(port)), timeout=meet_timeout_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                cluster_auth.handshake_client(conn)
                conn.settimeout(round_timeout_s)
            _send(conn, _RANK.pack(rank))
        except OSError:
            conn.close()
            raise
        return cls(rank, world_size, [conn])

    @classmethod
    def _listen(cls, store: dist.Store, key: str, world_size: int, round_timeout_s: float,
                meet_timeout_s: float, host: str | None) -> StepBoard:
        if host is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(b"\0meshserve-step-board-" + secrets.token_hex(8).encode())
            address = listener.getsockname()
        else:
            listener = socket.create_server((host, 0))
            address = f"{host}:{listener.getsockname()[1]}".encode()
        peers: list[socket.socket | None] = [None] * (world_size - 1)
        try:
            listener.listen(world_size)
            listener.settimeout(meet_timeout_s)
            store.set(key, address)
            while not all(peers):
                conn, _ = listener.accept()
                conn.settimeout(round_timeout_s)
                if host is not None:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    if not cluster_auth.handshake_server(conn, purpose="step board"):
                        conn.close()  # a stranger: refused and logged, the meeting goes on
                        continue
                (peer,) = _RANK.unpack(_receive(conn, _RANK.size, "a rank's greeting"))
                if not 1 <= peer < world_size or peers[peer - 1] is not None:
                    conn.close()
                    raise ConnectionError(f"step board: unexpected greeting from rank {peer}")
                peers[peer - 1] = conn
        except BaseException:
            for conn in peers:
                if conn is not None:
                    conn.close()
            raise
        finally:
            listener.close()  # every rank is connected: the address is no longer needed
        return cls(0, world_size, peers)

    def exchange(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (all of one length), in rank order. Collective over the world. A failed round
        closes the board, so the peers' rounds fail at once too instead of at their timeout."""
        if self.world_size > 1 and not self._peers:
            raise ConnectionError("step board: closed after a failed round")
        width = len(row)
        packed = struct.pack(f"<{width}q", *row)
        try:
            table = self._gather_and_send(packed) if self.rank == 0 else self._send_and_read(packed)
        except OSError:
            self.close()
            raise
        values = struct.unpack(f"<{width * self.world_size}q", table)
        return [list(values[i:i + width]) for i in range(0, len(values), width)]

    def _gather_and_send(self, packed: bytes) -> bytes:
        table = b"".join([packed, *(_receive(conn, len(packed), f"rank {peer}'s row")
                                    for peer, conn in enumerate(self._peers, start=1))])
        for conn in self._peers:
            _send(conn, table)
        return table

    def _send_and_read(self, packed: bytes) -> bytes:
        _send(self._peers[0], packed)
        return _receive(self._peers[0], len(packed) * self.world_size, "the table")

    def close(self) -> None:
        for conn in self._peers:
            conn.close()
        self._peers = []


def _send(conn: socket.socket, message: bytes) -> None:
    conn.sendall(message if conn.type == socket.SOCK_SEQPACKET else _LENGTH.pack(len(message)) + message)


def _receive(conn: socket.socket, size: int, what: str) -> bytes:
    """One message of exactly `size` bytes. On a Unix socket one byte more is asked for (a larger message would be
    cut short); on TCP the message's length comes first."""
    if conn.type == socket.SOCK_SEQPACKET:
        data = conn.recv(size + 1)
        if not data:
            raise ConnectionError(f"step board: the connection closed while waiting for {what}")
        length = len(data)
    else:
        (length,) = _LENGTH.unpack(_receive_exactly(conn, _LENGTH.size, what))
    if length != size:
        raise ConnectionError(f"step board: {what} has {length} bytes, not {size} (the ranks' rows differ)")
    return data if conn.type == socket.SOCK_SEQPACKET else _receive_exactly(conn, size, what)


def _receive_exactly(conn: socket.socket, size: int, what: str) -> bytes:
    data = b""
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            raise ConnectionError(f"step board: the connection closed while waiting for {what}")
        data += part
    return data
