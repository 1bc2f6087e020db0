"""TransferEngine: moves KV blocks between regions of this engine and linked peers.

A region is a KV cache: one tensor per layer shaped [num_blocks, block_size, *entry]. Transfers
are pulls: the engine holding the destination initiates and reads the source blocks, by memcpy
from a peer's shared-memory region (same host, "shm"), over TCP from the peer's block server
("tcp"), or with torch.distributed send/recv in a 2-rank group per linked pair ("dist": Gloo
between CPU regions, NCCL between CUDA regions; see `dist.py`).
Transfers run on worker threads; results arrive on a completion queue (`poll`) and per handle
(`status`, `wait`), and `on_complete` (if given) is called as each arrives, so a loop waiting on other things can
poll at once.

Link probing (xdeepserve §6.1): `probe(peer)` sends a tiny dummy payload to a linked peer's block server,
the end a pull from it reaches, and times the round trip under a short timeout of its own; it reads no
region, so it never occupies a KV cache.
`meshserve.transfer.probe.LinkProber` runs probes periodically. Injected link faults are hooked around an
engine's pulls and probes only once one is armed (`meshserve.transfer.fault_hooks`).
"""
from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgspec
import torch

from meshserve.transfer import dist as dist_mod
from meshserve.transfer import shm as shm_mod
from meshserve.transfer import tcp as tcp_mod
from meshserve.transfer.probe import PROBE_TIMEOUT_S
from meshserve.transfer.shm import ShmKVRegion, dtype_from_str, dtype_to_str
from meshserve.transfer.wire import MAX_CHUNK_BYTES, RegionDescriptor, RegionLayer, ShmSegment

PROBE_BYTES = 64


def host_id() -> str:
    """Identifies this host's shared-memory namespace: hostname plus boot id where known."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _gpu_id(device: torch.device) -> str | None:
    """The UUID of the GPU behind a CUDA device (None for other devices)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else f"cuda:{index}"


class TransferStatus(StrEnum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class BlockRef:
    """Blocks of a region: `engine` None means this engine, else a linked peer's name."""

    region: str
    block_ids: tuple[int, ...]
    engine: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))


@dataclass(frozen=True)
class TransferHandle:
    id: int


@dataclass(frozen=True)
class Completion:
    handle_id: int
    status: TransferStatus
    nbytes: int
    error: str | None = None


@dataclass
class _Peer:
    name: str
    backend: str  # "shm", "tcp" or "dist"
    regions: dict[str, RegionDescriptor] = field(default_factory=dict)
    attached: dict[str, ShmKVRegion] = field(default_factory=dict)


@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    completion: Completion | None = None


def peer_address(peer: _Peer) -> tuple[str, int] | None:
    """The peer's TCP block server (its regions all name the same one), or None."""
    return next((tuple(d.tcp_address) for d in peer.regions.values() if d.tcp_address is not None), None)


def _parse_address(address: str | tuple[str, int] | list) -> tuple[str, int]:
    if isinstance(address, str):
        rest = address.removeprefix("tcp://")
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"address must look like tcp://host:port, got {address!r}")
        return host, int(port)
    host, port = address
    return str(host), int(port)


class TransferEngine:
    """One engine's transfer endpoint: its regions, its TCP block server, its linked peers."""

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        serve_tcp: bool = True,
        force_tcp: bool = False,
        chunk_size: int = tcp_mod.DEFAULT_CHUNK_BYTES,
        io_timeout: float = 10.0,
        max_workers: int = 2,
        on_complete: Callable[[], None] | None = None,
    ):
        if not name:
            raise ValueError("TransferEngine needs a non-empty name")
        if not 0 < chunk_size <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_size must be in (0, {MAX_CHUNK_BYTES}], got {chunk_size}")
        self.name = name
        self.host = host
        self.host_id = host_id()
        self.force_tcp = force_tcp
        self.chunk_size = chunk_size
        self.io_timeout = io_timeout
        self.on_complete = on_complete  # told, from the finishing thread, that `poll` has something
        self._lock = threading.Lock()
        self._regions: dict[str, list[torch.Tensor]] = {}
        self._descriptors: dict[str, RegionDescriptor] = {}
        self._owned_shm: dict[str, ShmKVRegion] = {}
        self._peers: dict[str, _Peer] = {}
        self._pending: dict[int, _Pending] = {}
        self._completions: queue.Queue[Completion] = queue.Queue()
        self._ids = itertools.count(1)
        self._workers = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"transfer-{name}")
        self._closed = False
        self._dist = dist_mod.DistPuller(host, io_timeout)
        # serves "dist" pulls of this engine's regions, through the TCP server (None without one)
        self.dist_source = (dist_mod.DistSource(self._region_tensors, host, io_timeout)
                            if serve_tcp and dist_mod.available() else None)
        self.server = (
            tcp_mod.TcpBlockServer(self._region_tensors, self._describe_all, host=host, io_timeout=io_timeout,
                                   extra_ops=self.dist_source.handlers() if self.dist_source else None)
            if serve_tcp else None
        )

    # ------------------------------------------------------------------ regions
    @property
    def tcp_address(self) -> tuple[str, int] | None:
        return self.server.address if self.server else None

    def allocate_region(
        self,
        region_name: str,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        entry_shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        """A zeroed KV cache in shared memory, registered here and unlinked by `close()`."""
        region = shm_mod.allocate_shm_kv_cache(num_layers, num_blocks, block_size, entry_shape, dtype)
        try:
            self.register(region_name, region.tensors)
        except BaseException:
            region.close()
            raise
        self._owned_shm[region_name] = region
        return region.tensors

    def register(self, region_name: str, tensors: list[torch.Tensor]) -> RegionDescriptor:
        """Expose `tensors` (one per layer, [num_blocks, block_size, *entry]) as `region_name`.

        Layers that live in shared memory this process allocated are reachable by peers on
        this host through shm; every region is reachable through the TCP server and "dist".
        """
        self._check_open()
        if not region_name:
            raise ValueError("region name must be non-empty")
        tensors = list(tensors)
        if not tensors:
            raise ValueError(f"region {region_name!r} needs at least one layer tensor")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() < 3:
                raise ValueError(f"layer {i} of region {region_name!r} must be a tensor "
                                 "[num_blocks, block_size, *entry]")
            if t.shape[0] != tensors[0].shape[0]:
                raise ValueError(f"layer {i} of region {region_name!r} has {t.shape[0]} blocks, "
                                 f"layer 0 has {tensors[0].shape[0]}")
            if t.device != tensors[0].device:
                raise ValueError(f"layer {i} of region {region_name!r} is on {t.device}, "
                                 f"layer 0 on {tensors[0].device}")
        specs = [shm_mod.shm_spec_of(t) for t in tensors]
        with self._lock:
            if region_name in self._regions:
                raise ValueError(f"region {region_name!r} is already registered on engine {self.name!r}")
            desc = RegionDescriptor(
                engine=self.name,
                region=region_name,
                layers=[RegionLayer(list(t.shape), dtype_to_str(t.dtype)) for t in tensors],
                host_id=self.host_id,
                tcp_address=self.tcp_address,
                shm=[ShmSegment(s.shm_name, list(s.shape), s.dtype) for s in specs]
                if all(s is not None for s in specs) else None,
                device=tensors[0].device.type,
                device_id=_gpu_id(tensors[0].device),
            )
            self._regions[region_name] = tensors
            self._descriptors[region_name] = desc
        return desc

    def descriptor(self, region_name: str) -> RegionDescriptor:
        with self._lock:
            if region_name not in self._descriptors:
                raise KeyError(f"no region {region_name!r} on engine {self.name!r}")
            return self._descriptors[region_name]

    def _region_tensors(self, region_name: str) -> list[torch.Tensor]:
        with self._lock:
            if region_name not in self._regions:
                raise KeyError(f"no region {region_name!r} on engine {self.name!r}")
            return self._regions[region_name]

    def _describe_all(self) -> list[RegionDescriptor]:
        with self._lock:
            return list(self._descriptors.values())

    # ------------------------------------------------------------------ peers
    def link(
        self,
        peer_name: str,
        descriptor_or_address: RegionDescriptor | dict[str, Any] | str | tuple[str, int],
        backend: str | None = None,
    ) -> str:
        """Make a peer's regions reachable; returns the backend chosen ("shm", "tcp" or "dist").

        Pass a region descriptor (object or dict), or the peer's TCP address to fetch all of its
        descriptors. With `backend=None`, shared memory is used when the peer is on this host and
        its region is in shm, else TCP, which `force_tcp` always picks. "dist" must be asked for:
        NCCL when this engine's regions and the peer's are on different GPUs, else Gloo; it
        connects lazily, on the first transfer from the peer.
        """
        self._check_open()
        if peer_name == self.name:
            raise ValueError(f"engine {self.name!r} cannot link to itself; use engine=None in BlockRef")
        if backend not in (None, "shm", "tcp", "dist"):
            raise ValueError(f"backend must be 'shm', 'tcp', 'dist' or None, got {backend!r}")
        descriptors = self._peer_descriptors(peer_name, descriptor_or_address)
        chosen = self._choose_backend(peer_name, descriptors, backend)
        if chosen == "dist":
            group_backend, local_device = self._dist_plan(peer_name, descriptors)
        with self._lock:
            peer = self._peers.get(peer_name)
            if peer is not None and peer.backend != chosen:
                raise ValueError(f"peer {peer_name!r} is already linked over {peer.backend}, not {chosen}")
            if peer is None:
                peer = self._peers[peer_name] = _Peer(peer_name, chosen)
        if chosen == "dist" and descriptors:
            self._dist.add(peer_name, descriptors[0].tcp_address, group_backend, local_device)
        for d in descriptors:
            if chosen == "shm" and d.region not in peer.attached:
                peer.attached[d.region] = shm_mod.attach_shm_kv_cache(msgspec.to_builtins(d.shm))
            peer.regions[d.region] = d
        return chosen

    def _peer_descriptors(self, peer_name: str, descriptor_or_address: RegionDescriptor | dict[str, Any] | str
                          | tuple[str, int]) -> list[RegionDescriptor]:
        """The peer's region descriptors: the one given, or all of them asked from its TCP address."""
        if isinstance(descriptor_or_address, RegionDescriptor):
            descriptors = [descriptor_or_address]
        elif isinstance(descriptor_or_address, dict):
            descriptors = [RegionDescriptor.from_dict(descriptor_or_address)]
        else:
            address = _parse_address(descriptor_or_address)
            descriptors = tcp_mod.describe_remote(address, self.io_timeout)
        for d in descriptors:
            if d.engine != peer_name:
                raise ValueError(f"descriptor of region {d.region!r} belongs to engine {d.engine!r}, not {peer_name!r}")
        return descriptors

    def _choose_backend(self, peer_name: str, descriptors: list[RegionDescriptor], backend: str | None) -> str:
        """The backend asked for, or shm for a peer on this host with its regions in shm, else TCP; checked
        against what the peer's regions offer."""
        chosen = backend or ("tcp" if self.force_tcp else None)
        if chosen is None:
            same_host = all(d.host_id == self.host_id and d.shm is not None for d in descriptors)
            chosen = "shm" if same_host and descriptors else "tcp"
        for d in descriptors:
            if chosen == "shm" and (d.shm is None or d.host_id != self.host_id):
                raise ValueError(f"region {d.region!r} of {peer_name!r} is not in shared memory on this host")
            if chosen in ("tcp", "dist") and d.tcp_address is None:
                raise ValueError(f"region {d.region!r} of {peer_name!r} has no TCP address")
        return chosen

    def _dist_plan(self, peer_name: str, descriptors: list[RegionDescriptor]) -> tuple[str, Any]:
        """A "dist" link's process-group backend and this engine's device."""
        if not dist_mod.available():
            raise ValueError("the dist backend needs torch.distributed with Gloo, which this torch build lacks")
        if len({d.tcp_address for d in descriptors}) > 1:
            raise ValueError(f"regions of {peer_name!r} name different TCP servers")
        # NCCL between distinct GPUs; anything else goes through CPU tensors over Gloo
        group_backend = "nccl" if self._gpu_pair(descriptors) and dist_mod.nccl_usable() else "gloo"
        with self._lock:
            local_device = next((ts[0].device for ts in self._regions.values()), None)
        return group_backend, local_device

    def _gpu_pair(self, descriptors: list[RegionDescriptor]) -> bool:
        """The peer's regions and this engine's are all on GPUs, never the same GPU (which NCCL refuses)."""
        with self._lock:
            mine = list(self._descriptors.values())
        return (bool(mine) and bool(descriptors) and all(d.device == "cuda" and d.tcp_address for d in descriptors)
                and all(m.device == "cuda" for m in mine)
                and not any(d.device_id == m.device_id and d.host_id == m.host_id for d in descriptors for m in mine))

    def unlink(self, peer_name: str) -> None:
        """Forget a peer: unmap its shm regions, or drop its "dist" group (telling the peer, best effort)."""
        with self._lock:
            peer = self._peers.pop(peer_name, None)
        if peer is not None:
            for region in peer.attached.values():
                region.close()
            if peer.backend == "dist":
                self._dist.remove(peer_name)

    # ------------------------------------------------------------------ transfers
    def transfer(self, src: BlockRef, dst: BlockRef, layers: list[int] | None = None) -> TransferHandle:
        """Copy src blocks into dst blocks (pairwise, in order) for `layers` (default: all).

        The destination must be a region of this engine; the source may be local or on a linked peer.
        Bad arguments raise ValueError here; failures while moving data end as a FAILED completion.
        """
        self._check_open()
        if dst.engine not in (None, self.name):
            raise ValueError(f"transfers are pulls: destination must be on engine {self.name!r}, got {dst.engine!r}")
        dst_tensors = self._region_tensors(dst.region)
        src_layers, fetch = self._source(src)
        if len(src_layers) != len(dst_tensors):
            raise ValueError(f"source has {len(src_layers)} layers, destination {dst.region!r} has {len(dst_tensors)}")
        if len(src.block_ids) != len(dst.block_ids) or not dst.block_ids:
            raise ValueError(f"need equal, non-empty block id lists; got {len(src.block_ids)} source and "
                             f"{len(dst.block_ids)} destination")
        if len(set(dst.block_ids)) != len(dst.block_ids):
            raise ValueError(f"destination block ids repeat: {list(dst.block_ids)}")
        layer_ids = list(range(len(dst_tensors))) if layers is None else [int(x) for x in layers]
        num_layers = len(dst_tensors)
        if not layer_ids or len(set(layer_ids)) != len(layer_ids) or any(not 0 <= x < num_layers for x in layer_ids):
            raise ValueError(f"layers must be distinct indices in [0, {len(dst_tensors)}), got {layers}")
        for i in layer_ids:
            s_shape, s_dtype = src_layers[i]
            d = dst_tensors[i]
            if tuple(s_shape[1:]) != tuple(d.shape[1:]) or s_dtype != d.dtype:
                raise ValueError(
                    f"layer {i}: source blocks {tuple(s_shape[1:])} {s_dtype} do not match destination "
                    f"{tuple(d.shape[1:])} {d.dtype}"
                )
            for ref, n in ((src, s_shape[0]), (dst, d.shape[0])):
                bad = [b for b in ref.block_ids if not 0 <= b < n]
                if bad:
                    raise ValueError(f"block ids {bad} out of range for region {ref.region!r} with {n} blocks")
        handle = TransferHandle(next(self._ids))
        with self._lock:
            self._pending[handle.id] = _Pending()
        self._workers.submit(self._run, handle, fetch, src, dst_tensors, dst.block_ids, layer_ids)
        return handle

    def _source(self, src: BlockRef):
        """Per-layer (shape, dtype) of the source and a function that reads its blocks."""
        if src.engine in (None, self.name):
            tensors = self._region_tensors(src.region)
            return [(tuple(t.shape), t.dtype) for t in tensors], self._read_local(tensors)
        with self._lock:
            peer = self._peers.get(src.engine)
        if peer is None:
            raise ValueError(f"engine {src.engine!r} is not linked to {self.name!r}")
        desc = peer.regions.get(src.region)
        if desc is None:
            raise ValueError(f"peer {src.engine!r} has no linked region {src.region!r}")
        shapes = [(tuple(layer.shape), dtype_from_str(layer.dtype)) for layer in desc.layers]
        if peer.backend == "shm":
            return shapes, self._read_local(peer.attached[src.region].tensors)
        if peer.backend == "dist":
            return shapes, self._dist.reader(peer.name, src.region, shapes)
        return shapes, self._read_tcp(desc, shapes)

    # A source reader is prepare(block_ids, layer_ids) -> read(layer, device) -> blocks tensor.
    @staticmethod
    def _read_local(tensors: list[torch.Tensor]):
        def prepare(block_ids: tuple[int, ...], layer_ids: list[int]):
            def read(layer: int, device: torch.device) -> torch.Tensor:
                t = tensors[layer]
                return t.index_select(0, torch.tensor(block_ids, dtype=torch.long, device=t.device)).to(device)

            return read

        return prepare

    def _read_tcp(self, desc: RegionDescriptor, shapes):
        # One round trip fetches every requested layer; `read` then views slices of the buffer.
        def prepare(block_ids: tuple[int, ...], layer_ids: list[int]):
            sizes = [len(block_ids) * shm_mod.layer_nbytes(shapes[i][0][1:], shapes[i][1]) for i in layer_ids]
            buf = tcp_mod.read_blocks(
                desc.tcp_address, desc.region, layer_ids, list(block_ids), sum(sizes), self.chunk_size, self.io_timeout
            )
            offsets = itertools.accumulate([0] + sizes)
            spans = {layer: (off, size) for layer, off, size in zip(layer_ids, offsets, sizes)}

            def read(layer: int, device: torch.device) -> torch.Tensor:
                shape, dtype = shapes[layer]
                offset, size = spans[layer]
                raw = torch.frombuffer(buf, dtype=torch.uint8, offset=offset, count=size)
                return raw.view(dtype).view(len(block_ids), *shape[1:]).to(device)

            return read

        return prepare

    def _run(self, handle, fetch, src: BlockRef, dst_tensors, dst_ids, layer_ids) -> None:
        nbytes = 0
        try:
            read = fetch(src.block_ids, layer_ids)
            for layer in layer_ids:
                d = dst_tensors[layer]
                blocks = read(layer, d.device)
                d.index_copy_(0, torch.tensor(dst_ids, dtype=torch.long, device=d.device), blocks)
                nbytes += blocks.numel() * blocks.element_size()
            completion = Completion(handle.id, TransferStatus.DONE, nbytes)
        except Exception as e:  # any failure ends this transfer only
            completion = Completion(handle.id, TransferStatus.FAILED, 0, f"{type(e).__name__}: {e}")
        self._finish(completion)

    # ------------------------------------------------------------------ link probing
    def probe(self, peer_name: str, timeout: float = PROBE_TIMEOUT_S, nbytes: int = PROBE_BYTES) -> float:
        """Time a tiny dummy transfer from a linked peer over the path its pulls take; the round trip in
        seconds. TransferError when it fails or outlasts `timeout` (a broken link, a dead peer)."""
        self._check_open()
        with self._lock:
            peer = self._peers.get(peer_name)
        if peer is None:
            raise ValueError(f"engine {peer_name!r} is not linked to {self.name!r}")
        start = time.monotonic()
        # the peer's block server: pulls over tcp and dist start there; over shm a mapped segment cannot
        # fail, but the process behind it can, and its server answers for it
        address = peer_address(peer)
        if address is not None:
            tcp_mod.probe(address, nbytes, timeout)
        elif peer.backend != "shm":
            raise ValueError(f"peer {peer_name!r} has no TCP address to probe")
        return time.monotonic() - start

    def _finish(self, completion: Completion) -> None:
        with self._lock:
            pending = self._pending.get(completion.handle_id)
        if pending is None or pending.completion is not None:
            return
        pending.completion = completion
        self._completions.put(completion)
        pending.done.set()
        if self.on_complete is not None:
            self.on_complete()

    def poll(self) -> list[Completion]:
        """Completions since the last poll, in finishing order."""
        out = []
        while True:
            try:
                out.append(self._completions.get_nowait())
            except queue.Empty:
                return out

    def _pending_of(self, handle: TransferHandle) -> _Pending:
        with self._lock:
            pending = self._pending.get(handle.id)
        if pending is None:
            raise KeyError(f"unknown transfer handle {handle.id} on engine {self.name!r}")
        return pending

    def status(self, handle: TransferHandle) -> TransferStatus:
        completion = self._pending_of(handle).completion
        return completion.status if completion else TransferStatus.PENDING

    def wait(self, handle: TransferHandle, timeout: float) -> Completion:
        """The handle's completion; TimeoutError if it is still running after `timeout` seconds."""
        pending = self._pending_of(handle)
        if not pending.done.wait(timeout):
            raise TimeoutError(f"transfer {handle.id} on engine {self.name!r} not finished after {timeout}s")
        return pending.completion

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"transfer engine {self.name!r} is closed")

    def close(self) -> None:
        """Stop serving, finish or fail in-flight transfers, drop peer mappings, unlink owned shm."""
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.stop()
        self._workers.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            unfinished = [hid for hid, p in self._pending.items() if p.completion is None]
        for hid in unfinished:
            self._finish(Completion(hid, TransferStatus.FAILED, 0, "transfer engine closed before the transfer ran"))
        for peer in list(self._peers):
            self.unlink(peer)
        if self.dist_source is not None:
            self.dist_source.close()
        with self._lock:
            self._regions.clear()
            self._descriptors.clear()
        for region in self._owned_shm.values():
            region.close()
        self._owned_shm.clear()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
