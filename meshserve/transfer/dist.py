"""Block reads over torch.distributed point-to-point send/recv (the transfer engine's "dist" backend).

Each (puller, source) pair linked over "dist" gets its own standalone 2-rank process group: NCCL
when both engines keep their regions on GPUs (two different ones), else Gloo over CPU tensors. The
source is rank 0, the puller rank 1. No global `init_process_group` state is touched, and no
`TCPStore` is started: the rendezvous store lives in the source engine (one `HashStore`) and the puller
reaches it through the source's TCP block server, so the only listening sockets are that server and the
group's own, both bound to the engine's host.

Requests this module adds to the source's TCP block server (headers in `wire.py`, framing in `tcp.py`,
one request per connection):
  Store*      a rendezvous store call of the puller's group (StoreSet, StoreGet, StoreWait, ...)
  DistLink    the source starts building rank 0 of a group (`backend` gloo or nccl)
  DistRead    reply ReadReply(nbytes) (or a refusal); then the selected blocks of the i-th requested
              layer go to the puller with send(tag + i)
  DistUnlink  the source drops the link's group
A puller links lazily, on its first transfer from a peer, and moves one transfer at a time per link;
any failure fails that transfer and drops the link on both sides, so the next transfer links afresh.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from meshserve.transfer import shm as shm_mod
from meshserve.transfer import tcp as tcp_mod
from meshserve.transfer import wire
from meshserve.transfer.tcp import TransferError
from meshserve.transfer.wire import GroupBackend

try:
    import torch.distributed as dist
except ImportError:  # a torch build without distributed support
    dist = None

logger = logging.getLogger(__name__)

GROUP_BACKENDS = tuple(b.value for b in GroupBackend)
SOURCE_RANK, PULLER_RANK = 0, 1

# (layer position in the read, blocks about to be sent) -> blocks actually sent; a test hook to stall a read.
LayerFaultHook = Callable[[int, torch.Tensor], torch.Tensor]


def available() -> bool:
    """torch.distributed with Gloo is present (Gloo links are always possible then)."""
    return dist is not None and dist.is_available() and dist.is_gloo_available()


def nccl_usable() -> bool:
    """NCCL groups can be built here: a CUDA build with a GPU. CPU-only processes never touch NCCL."""
    return (available() and dist.is_nccl_available() and hasattr(dist, "ProcessGroupNCCL")
            and torch.cuda.is_available())


def new_group(backend: str, store, rank: int, host: str, timeout: float):
    """A standalone 2-rank process group; blocks until the other rank has joined (Gloo)."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # listen on `host` only
        opts._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        if not nccl_usable():
            raise RuntimeError("NCCL is not usable in this process (no CUDA device or no NCCL in this torch build)")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"group backend must be one of {GROUP_BACKENDS}, got {backend!r}")


def wire_device(backend: str, preferred: torch.device | None = None) -> torch.device:
    """Where tensors of a group's send/recv live: CPU for Gloo, a CUDA device for NCCL."""
    if backend == "gloo":
        return torch.device("cpu")
    if preferred is not None and preferred.type == "cuda":
        return preferred
    return torch.device("cuda", torch.cuda.current_device())


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _error_text(e: BaseException) -> str:
    """One line: KeyError without its quotes, c10d/gloo errors without their source-location prefix."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else "")
    return text or type(e).__name__


# ---------------------------------------------------------------------------------------------- source
@dataclass
class _SourceLink:
    id: str
    backend: GroupBackend
    ready: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one read at a time per link
    group: Any = None
    error: str | None = None


class DistSource:
    """The source side: serves the groups pullers linked to this engine, from its TCP block server."""

    def __init__(self, regions: Callable[[str], list[torch.Tensor]], host: str = "127.0.0.1", io_timeout: float = 10.0):
        self._regions = regions
        self.host = host
        self.io_timeout = io_timeout
        self._store = dist.HashStore()
        self._store.set_timeout(timedelta(seconds=io_timeout))  # a rendezvous key that never comes fails the link
        self._links: dict[str, _SourceLink] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.links_made = 0  # groups built since start, to tell reuse from re-linking
        self.fault_hook: LayerFaultHook | None = None

    def handlers(self) -> dict[type[wire.Request], tcp_mod.OpHandler]:
        store_ops = dict.fromkeys(wire.STORE_REQUESTS, self._serve_store)
        return {wire.DistLink: self._serve_link, wire.DistRead: self._serve_read, wire.DistUnlink: self._serve_unlink,
                **store_ops}

    @property
    def link_count(self) -> int:
        """Links currently open (being built or built)."""
        with self._lock:
            return len(self._links)

    def close(self) -> None:
        """Drop every group; reads in flight fail on their next send."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            self._forget(link)

    # -- links
    def _serve_link(self, conn: socket.socket, request: wire.DistLink) -> None:
        link_id, backend = request.link, request.backend  # the id's form and the backend checked on decode
        error = None
        if backend == GroupBackend.NCCL and not nccl_usable():
            error = "this engine cannot build NCCL groups (no CUDA device or no NCCL)"
        link = _SourceLink(link_id, backend)
        with self._lock:
            if error is None and self._closed:
                error = "engine is closing"
            elif error is None and link_id in self._links:
                error = f"link {link_id!r} already exists"
            if error is None:
                self._links[link_id] = link
        if error is not None:
            tcp_mod.refuse(conn, error)
            return
        # The group constructor blocks until the puller joins, so it runs beside this connection.
        threading.Thread(target=self._build, args=(link,), name=f"dist-link-{link_id[:8]}", daemon=True).start()
        tcp_mod.send_header(conn, wire.Reply())

    def _build(self, link: _SourceLink) -> None:
        try:
            group = new_group(link.backend, dist.PrefixStore(link.id, self._store), SOURCE_RANK, self.host,
                              self.io_timeout)
        except Exception as e:  # timed out or refused: this link is gone, the engine keeps serving
            link.error = f"building the {link.backend} group failed: {_error_text(e)}"
            logger.warning("dist link %s: %s", link.id, link.error)
            self._drop(link.id)
            link.ready.set()
            return
        with self._lock:
            kept = self._links.get(link.id) is link
            if kept:
                link.group = group
                self.links_made += 1
        if not kept:  # unlinked or closed while the group was being built
            link.error = "link was dropped"
        link.ready.set()

    def _drop(self, link_id: str) -> None:
        with self._lock:
            link = self._links.pop(link_id, None)
        if link is not None:
            self._forget(link)

    def _forget(self, link: _SourceLink) -> None:
        link.group = None  # the last reference: the group's sockets close with it
        prefix = link.id + "/"
        try:
            for key in self._store.list_keys():
                if key.startswith(prefix):
                    self._store.delete_key(key)
        except RuntimeError:
            pass  # only housekeeping; the keys are a few bytes

    def _serve_unlink(self, conn: socket.socket, request: wire.DistUnlink) -> None:
        self._drop(request.link)
        tcp_mod.send_header(conn, wire.Reply())

    # -- rendezvous store of the puller's rank
    def _serve_store(self, conn: socket.socket, request: wire.Request) -> None:
        try:
            reply = self._STORE_CALLS[type(request)](self, request)
        except Exception as e:  # a missing key past the timeout, a key of no link: the puller's rendezvous fails
            reply = wire.Reply(ok=False, error=_error_text(e))
        tcp_mod.send_header(conn, reply)

    def _check_keys(self, keys: list[str]) -> list[str]:
        with self._lock:
            links = set(self._links)
        for key in keys:
            if key.partition("/")[0] not in links:
                raise KeyError(f"store key {key!r} belongs to no open link")
        return keys

    def _key(self, key: str) -> str:
        return self._check_keys([key])[0]

    def _store_set(self, r: wire.StoreSet) -> wire.Reply:
        self._store.set(self._key(r.key), r.value)
        return wire.Reply()

    def _store_get(self, r: wire.StoreGet) -> wire.Reply:
        return wire.BytesReply(value=bytes(self._store.get(self._key(r.key))))

    def _store_add(self, r: wire.StoreAdd) -> wire.Reply:
        return wire.IntReply(value=int(self._store.add(self._key(r.key), r.amount)))

    def _store_compare_set(self, r: wire.StoreCompareSet) -> wire.Reply:
        return wire.BytesReply(value=bytes(self._store.compare_set(self._key(r.key), r.expected, r.desired)))

    def _store_delete_key(self, r: wire.StoreDeleteKey) -> wire.Reply:
        return wire.BoolReply(value=bool(self._store.delete_key(self._key(r.key))))

    def _store_wait(self, r: wire.StoreWait) -> wire.Reply:
        timeout = self.io_timeout if r.timeout is None else min(r.timeout, self.io_timeout)
        self._store.wait(self._check_keys(r.keys), timedelta(seconds=timeout))
        return wire.Reply()

    def _store_check(self, r: wire.StoreCheck) -> wire.Reply:
        return wire.BoolReply(value=bool(self._store.check(self._check_keys(r.keys))))

    def _store_num_keys(self, r: wire.StoreNumKeys) -> wire.Reply:
        return wire.IntReply(value=int(self._store.num_keys()))

    _STORE_CALLS = {wire.StoreSet: _store_set, wire.StoreGet: _store_get, wire.StoreAdd: _store_add,
                    wire.StoreCompareSet: _store_compare_set, wire.StoreDeleteKey: _store_delete_key,
                    wire.StoreWait: _store_wait, wire.StoreCheck: _store_check, wire.StoreNumKeys: _store_num_keys}

    # -- reads
    def _serve_read(self, conn: socket.socket, request: wire.DistRead) -> None:
        link_id, tag = request.link, request.tag
        with self._lock:
            link = self._links.get(link_id)
        try:
            if link is None:
                raise KeyError(f"no open link {link_id!r} (dropped after a failure, or never made)")
            blocks = tcp_mod.select_blocks(self._regions, request)
        except (KeyError, ValueError, IndexError, TypeError) as e:
            tcp_mod.refuse(conn, _error_text(e))
            return
        with link.lock:
            group = link.group if link.ready.wait(self.io_timeout) else None
            if group is None:
                error = link.error or f"group of link {link_id!r} not ready after {self.io_timeout}s"
                tcp_mod.refuse(conn, error)
                self._drop(link_id)
                return
            tcp_mod.send_header(conn, wire.ReadReply(nbytes=sum(b.numel() * b.element_size() for b in blocks)))
            try:
                for i, layer_blocks in enumerate(blocks):
                    sent = layer_blocks.to(wire_device(link.backend, layer_blocks.device)).contiguous()
                    hook = self.fault_hook
                    if hook is not None:
                        sent = hook(i, sent)
                    group.send([sent], PULLER_RANK, tag + i).wait(timedelta(seconds=self.io_timeout))
            except Exception as e:  # the puller died or stopped receiving: drop the link, keep serving others
                logger.warning("dist link %s: send failed, dropping the link: %s", link_id, _error_text(e))
                self._drop(link_id)


# ---------------------------------------------------------------------------------------------- puller
class _RemoteStore(dist.Store if dist is not None else object):
    """The puller's view of the source's rendezvous store: each call is one request to its TCP server."""

    def __init__(self, address: tuple[str, int], timeout: float):
        super().__init__()
        self._address = address
        self._timeout = timeout

    def _call(self, request: wire.Request) -> wire.Reply:
        # A wait or get may block on the source for up to `timeout`: give the reply that long and more.
        reply = tcp_mod.request(self._address, request, 2 * self._timeout + 1.0)
        if not reply.ok:
            raise RuntimeError(f"rendezvous store {wire.op_of(type(request))} refused: {reply.error}")
        return reply

    def set(self, key, value) -> None:
        self._call(wire.StoreSet(key=str(key), value=_as_bytes(value)))

    def get(self, key) -> bytes:
        return self._call(wire.StoreGet(key=str(key))).value

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        seconds = self._timeout if timeout is None else min(timeout.total_seconds(), self._timeout)
        self._call(wire.StoreWait(keys=[str(k) for k in keys], timeout=max(seconds, 0.0)))

    def check(self, keys) -> bool:
        return self._call(wire.StoreCheck(keys=[str(k) for k in keys])).value

    def add(self, key, amount) -> int:
        return self._call(wire.StoreAdd(key=str(key), amount=int(amount))).value

    def compare_set(self, key, expected, desired) -> bytes:
        request = wire.StoreCompareSet(key=str(key), expected=_as_bytes(expected), desired=_as_bytes(desired))
        return self._call(request).value

    def delete_key(self, key) -> bool:
        return self._call(wire.StoreDeleteKey(key=str(key))).value

    def num_keys(self) -> int:
        return self._call(wire.StoreNumKeys()).value

    def clone(self) -> _RemoteStore:
        return self  # stateless between calls: every call opens its own connection


@dataclass
class _PullLink:
    peer: str
    address: tuple[str, int]
    backend: GroupBackend
    device: torch.device  # where received blocks land: CPU for Gloo, this engine's GPU for NCCL
    lock: threading.Lock = field(default_factory=threading.Lock)  # one transfer at a time per link
    id: str | None = None
    group: Any = None
    store: Any = None  # the Python store object must outlive the group that calls back into it
    next_tag: int = 0
    removed: bool = False  # unlinked while a transfer was in flight: that transfer disconnects


class DistPuller:
    """The puller side: one lazily built group per linked source engine."""

    def __init__(self, host: str = "127.0.0.1", io_timeout: float = 10.0):
        self.host = host
        self.io_timeout = io_timeout
        self._links: dict[str, _PullLink] = {}
        self._lock = threading.Lock()

    def add(self, peer: str, address: tuple[str, int], backend: str, device: torch.device | None = None) -> None:
        """Register a peer; nothing is connected until its first transfer.

        `device` is this engine's GPU for an NCCL link (worker threads do not share a current device).
        """
        if not available():
            raise ValueError("the dist backend needs torch.distributed with Gloo, which this torch build lacks")
        if backend not in GROUP_BACKENDS:
            raise ValueError(f"group backend must be one of {GROUP_BACKENDS}, got {backend!r}")
        with self._lock:
            self._links.setdefault(peer, _PullLink(peer, tuple(address), GroupBackend(backend),
                                                   wire_device(backend, device)))

    def remove(self, peer: str) -> None:
        """Forget a peer and tell its engine to drop the group (best effort)."""
        with self._lock:
            link = self._links.pop(peer, None)
        if link is None:
            return
        link.removed = True
        if link.lock.acquire(blocking=False):
            try:
                self._disconnect(link)
            finally:
                link.lock.release()

    def reader(self, peer: str, region: str, shapes: list[tuple[tuple[int, ...], torch.dtype]]):
        """A source reader (see `TransferEngine._read_local`) pulling `region` of `peer` over its group."""

        def prepare(block_ids: tuple[int, ...], layer_ids: list[int]):
            with self._lock:
                link = self._links.get(peer)
            if link is None:
                raise TransferError(f"peer {peer!r} is not linked over dist")
            where = f"peer {peer!r} at {link.address[0]}:{link.address[1]}"
            with link.lock:
                try:
                    if link.group is None:
                        self._connect(link)
                    received = self._pull(link, region, block_ids, layer_ids, shapes)
                except Exception as e:  # refused, timed out, peer died: this transfer fails, the next re-links
                    self._disconnect(link)
                    raise TransferError(f"dist pull of region {region!r} from {where} failed: {_error_text(e)}") from e
                if link.removed:
                    self._disconnect(link)

            def read(layer: int, device: torch.device) -> torch.Tensor:
                return received[layer].to(device)

            return read

        return prepare

    def _connect(self, link: _PullLink) -> None:
        link_id = uuid.uuid4().hex
        reply = tcp_mod.request(link.address, wire.DistLink(link=link_id, backend=link.backend), self.io_timeout)
        if not reply.ok:
            raise TransferError(f"{link.backend} link refused: {reply.error}")
        store = _RemoteStore(link.address, self.io_timeout)
        link.id = link_id  # set first, so a failed build below is still unlinked at the source
        try:
            group = new_group(link.backend, dist.PrefixStore(link_id, store), PULLER_RANK, self.host, self.io_timeout)
        except Exception as e:
            raise TransferError(f"building the {link.backend} group failed: {_error_text(e)}") from e
        link.group, link.store, link.next_tag = group, store, 0

    def _pull(self, link: _PullLink, region: str, block_ids, layer_ids, shapes) -> dict[int, torch.Tensor]:
        group, first_tag = link.group, link.next_tag
        link.next_tag += len(layer_ids)  # tags increase per link, one per layer sent
        sizes = [len(block_ids) * shm_mod.layer_nbytes(shapes[i][0][1:], shapes[i][1]) for i in layer_ids]
        read = wire.DistRead(link=link.id, region=region, layers=list(layer_ids), block_ids=list(block_ids),
                             tag=first_tag)
        reply = tcp_mod.request(link.address, read, self.io_timeout)
        if not reply.ok:
            raise TransferError(f"read refused: {reply.error}")
        if reply.nbytes != sum(sizes):
            raise TransferError(f"peer offers {reply.nbytes} bytes, expected {sum(sizes)}")
        received = {}
        for i, layer in enumerate(layer_ids):
            shape, dtype = shapes[layer]
            blocks = torch.empty((len(block_ids), *shape[1:]), dtype=dtype, device=link.device)
            group.recv([blocks], SOURCE_RANK, first_tag + i).wait(timedelta(seconds=self.io_timeout))
            received[layer] = blocks
        return received

    def _disconnect(self, link: _PullLink) -> None:
        link_id, link.id, link.group, link.store = link.id, None, None, None
        if link_id is None:
            return
        try:  # the source also drops a link whose send fails or whose group never forms
            tcp_mod.request(link.address, wire.DistUnlink(link=link_id), min(self.io_timeout, 2.0))
        except TransferError:
            pass
