"""The board self-contained DP groups agree on each step over (`ParallelContext.agree_on_step`): every rank's
row of a few integers, gathered to rank 0 and sent back to every rank.

It runs once before every forward of every rank, so it must cost next to nothing. A gloo gather and broadcast
went through torch.distributed's Python layer and gloo's transport threads: 0.6-1.2 ms of CPU per rank and round
at 8 ranks, which on a host with fewer cores than processes became the wall time of every step. Here the rows
travel over Unix-domain `SOCK_SEQPACKET` connections from each rank to rank 0 (one message per rank and
direction, message boundaries kept, a blocking receive that the kernel wakes): about 0.1 ms of CPU per rank.
The sockets live in Linux's abstract namespace, so nothing is left on disk by a killed rank.

When the world spans hosts (`host`: rank 0's address as the others reach it), the ranks meet per host: each host's
lowest rank leads it, its other ranks send their rows to it over Unix sockets, and the leaders send their host's
rows to rank 0 over TCP and pass the table back. Rank 0 then handles one connection per host and its own host's
ranks, not one per rank: at 320 ranks on 40 hosts of 8, 46 connections a round where a flat board has 319. On TCP
Nagle is off, each message is led by its length (a stream keeps no boundaries), and every connection opens with
the cluster secret's challenge-response (`cluster_auth.handshake_server`), so only the TE's own ranks take part.
Which ranks share a host comes from each rank's `host_id`, gathered through the world's store.

Failures are those of a collective: a rank that dies closes its connection, and the peers' next round fails at
once (`ConnectionError`, passed on as each failed rank closes its own connections); one that hangs fails the round
after the context's collective timeout (`TimeoutError`). Either ends the rank's loop, and its group's master
restarts the world.
"""
from __future__ import annotations

import json
import secrets
import socket
import struct
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from meshserve.utils import cluster_auth

_RANK = struct.Struct("<q")
_LENGTH = struct.Struct("<I")  # leads each message on TCP
_KEY_PREFIX = "meshserve/step-board"


def this_host_id() -> str:
    """Which host this process runs on: its hostname and the kernel's boot id (two containers of one machine have
    their own hostnames, and their own network namespaces, which Unix sockets do not cross)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class StepBoard:
    """One rank's side of the board: the connection to the rank it sends its rows to (`up`: its host's leader, or
    rank 0 for a leader; None at rank 0) and those of the ranks that send theirs to it, each with the ranks whose
    rows it carries, in rank order."""

    def __init__(self, rank: int, world_size: int, up: socket.socket | None,
                 children: list[tuple[socket.socket, list[int]]]) -> None:
        self.rank, self.world_size = rank, world_size
        self._up, self._children = up, children
        # the rows this rank gathers (its own, then its children's) come in rank order: joined as they come
        carried = [rank, *(r for _, ranks in children for r in ranks)]
        self._in_order = carried == sorted(carried)

    @classmethod
    def open(cls, store: dist.Store, rank: int, world_size: int, generation: int, round_timeout_s: float,
             meet_timeout_s: float, host: str | None = None, host_id: str | None = None) -> StepBoard:
        """Collective over the world: the ranks publish where they listen in the world's store under `generation`
        (a new board after a rebuild gets new addresses) and connect. They meet within `meet_timeout_s`; a round
        then fails after waiting `round_timeout_s` for a peer. `host`: rank 0's host address when ranks run on
        other hosts (None: every rank on one host); `host_id`: this rank's host (default: `this_host_id()`)."""
        key = f"{_KEY_PREFIX}/{generation}"
        if world_size == 1:
            return cls(0, 1, None, [])
        hosts = [list(range(world_size))] if host is None else _hosts(
            store, key, rank, world_size, host_id or this_host_id(), meet_timeout_s)
        mine = next(ranks for ranks in hosts if rank in ranks)
        leader = mine[0]
        children: list[tuple[socket.socket, list[int]]] = []
        up = None
        try:
            if rank == leader:
                other_hosts = hosts[1:] if rank == 0 else []
                children = _accept(store, key, rank, mine[1:], other_hosts, host, round_timeout_s, meet_timeout_s)
            if rank != leader:
                up = _connect(store, f"{key}/unix/{leader}", None, rank, round_timeout_s, meet_timeout_s)
            elif rank != 0:
                up = _connect(store, f"{key}/tcp", host, rank, round_timeout_s, meet_timeout_s)
        except BaseException:
            for conn, _ in children:
                conn.close()
            raise
        return cls(rank, world_size, up, children)

    def exchange(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (all of one length), in rank order. Collective over the world. A failed round
        closes the board, so the peers' rounds fail at once too instead of at their timeout."""
        if self.world_size > 1 and self._up is None and not self._children:
            raise ConnectionError("step board: closed after a failed round")
        width = len(row)
        packed = struct.pack(f"<{width}q", *row)
        try:
            carried = self._gather(packed)
            if self._up is not None:
                _send(self._up, carried)
                table = _receive(self._up, len(packed) * self.world_size, "the table")
            else:
                table = carried
            for conn, _ in self._children:
                _send(conn, table)
        except OSError:
            self.close()
            raise
        values = struct.unpack(f"<{width * self.world_size}q", table)
        return [list(values[i:i + width]) for i in range(0, len(values), width)]

    def _gather(self, packed: bytes) -> bytes:
        """This rank's row and its children's, in rank order."""
        size = len(packed)
        blocks = [_receive(conn, size * len(ranks), f"rank {ranks[0]}'s row" if len(ranks) == 1 else
                           f"the rows of rank {ranks[0]}'s host") for conn, ranks in self._children]
        if self._in_order:
            return b"".join([packed, *blocks])
        rows = {self.rank: packed}
        for (_, ranks), block in zip(self._children, blocks):
            rows.update((r, block[i * size:(i + 1) * size]) for i, r in enumerate(ranks))
        return b"".join(rows[r] for r in sorted(rows))

    def close(self) -> None:
        for conn in [*(conn for conn, _ in self._children), *([self._up] if self._up is not None else [])]:
            conn.close()
        self._up, self._children = None, []


def _hosts(store: dist.Store, key: str, rank: int, world_size: int, host_id: str, timeout_s: float) -> list[list[int]]:
    """The world's ranks by host, each host's in rank order, rank 0's host first: rank 0 gathers every rank's host
    and publishes the layout once, so the store answers 2 x world requests, not world^2."""
    store.set(f"{key}/host/{rank}", host_id)
    if rank != 0:
        _wait(store, [f"{key}/hosts"], timeout_s)
        return json.loads(store.get(f"{key}/hosts"))
    names = [f"{key}/host/{r}" for r in range(world_size)]
    _wait(store, names, timeout_s)
    by_host: dict[bytes, list[int]] = {}
    for r, name in enumerate(names):
        by_host.setdefault(store.get(name), []).append(r)
    hosts = list(by_host.values())  # first seen first: rank 0's host leads
    store.set(f"{key}/hosts", json.dumps(hosts))
    return hosts


def _accept(store: dist.Store, key: str, rank: int, members: list[int], other_hosts: list[list[int]],
            host: str | None, round_timeout_s: float, meet_timeout_s: float) -> list[tuple[socket.socket, list[int]]]:
    """A leader's children: its host's other ranks (over a Unix socket), and at rank 0 the other hosts' leaders
    (over TCP, each carrying its host's rows); members first, each kind in rank order."""
    listeners = []
    if members:
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        unix.bind(b"\0meshserve-step-board-" + secrets.token_hex(8).encode())
        listeners.append((unix, f"{key}/unix/{rank}", unix.getsockname(), members))
    if other_hosts:
        tcp = socket.create_server((host, 0))
        listeners.append((tcp, f"{key}/tcp", f"{host}:{tcp.getsockname()[1]}".encode(),
                          [ranks[0] for ranks in other_hosts]))
    accepted: dict[int, socket.socket] = {}
    try:
        for listener, name, address, expected in listeners:
            listener.listen(len(expected))
            listener.settimeout(meet_timeout_s)
            store.set(name, address)
        for listener, _, _, expected in listeners:
            _accept_from(listener, expected, accepted, round_timeout_s)
    except BaseException:
        for conn in accepted.values():
            conn.close()
        raise
    finally:
        for listener, *_ in listeners:
            listener.close()  # every child is connected: the addresses are no longer needed
    order = [*members, *(ranks[0] for ranks in other_hosts)]
    carried = {m: [m] for m in members} | {ranks[0]: ranks for ranks in other_hosts}
    return [(accepted[child], carried[child]) for child in order]


def _accept_from(listener: socket.socket, expected: list[int], accepted: dict[int, socket.socket],
                 round_timeout_s: float) -> None:
    """Take every rank of `expected` on `listener` into `accepted`; on TCP a connection without the cluster secret
    is refused (and logged) and the meeting goes on."""
    tcp = listener.family != socket.AF_UNIX
    waiting = set(expected)
    while waiting:
        conn, _ = listener.accept()
        conn.settimeout(round_timeout_s)
        if tcp:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not cluster_auth.handshake_server(conn, purpose="step board"):
                conn.close()
                continue
        (peer,) = _RANK.unpack(_receive(conn, _RANK.size, "a rank's greeting"))
        if peer not in waiting:
            conn.close()
            raise ConnectionError(f"step board: unexpected greeting from rank {peer}")
        waiting.discard(peer)
        accepted[peer] = conn


def _connect(store: dist.Store, name: str, host: str | None, rank: int, round_timeout_s: float,
             meet_timeout_s: float) -> socket.socket:
    """This rank's connection to the rank it sends its rows to: its host's leader over a Unix socket (`host`
    None), or rank 0 over TCP."""
    _wait(store, [name], meet_timeout_s)
    address = store.get(name)
    if host is None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    else:
        listen_host, port = address.decode().rsplit(":", 1)
        conn = socket.create_connection((listen_host, int(port)), timeout=meet_timeout_s)
    try:
        if host is None:
            conn.settimeout(round_timeout_s)
            conn.connect(address)
        else:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cluster_auth.handshake_client(conn)
            conn.settimeout(round_timeout_s)
        _send(conn, _RANK.pack(rank))
    except OSError:
        conn.close()
        raise
    return conn


def _wait(store: dist.Store, names: list[str], timeout_s: float) -> None:
    try:
        store.wait(names, timedelta(seconds=timeout_s))
    except dist.DistStoreError as exc:
        raise TimeoutError(f"step board: the ranks did not meet within {timeout_s:g} s ({exc})") from None


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
