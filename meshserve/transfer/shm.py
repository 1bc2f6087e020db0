"""KV-cache regions in POSIX shared memory.

Each layer of a region is one `SharedMemory` segment viewed as a torch tensor
(`torch.frombuffer`), so another process on the same host that attaches to the
segment names sees the same pages and a block transfer is a plain memcpy.
The creating process owns the segments and unlinks them on close.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# data_ptr of a shm-backed layer tensor -> its segment name, so `TransferEngine.register`
# can tell that plain tensors it is handed live in shared memory.
_SEGMENT_OF_PTR: dict[int, ShmLayerSpec] = {}
_PTR_LOCK = threading.Lock()
_TRACKER_PATCH_LOCK = threading.Lock()


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def layer_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@contextlib.contextmanager
def _untracked():
    """Attach without registering with the resource tracker.

    On Python < 3.13 every `SharedMemory(name=...)` registers the segment, and
    the attaching process's tracker would unlink the owner's segment when the
    attacher exits. Only the owner should ever unlink.
    """
    with _TRACKER_PATCH_LOCK:
        original = resource_tracker.register
        resource_tracker.register = lambda name, rtype: None
        try:
            yield
        finally:
            resource_tracker.register = original


def _open_segment(name: str, size: int) -> SharedMemory:
    try:
        with _untracked():
            seg = SharedMemory(name=name, create=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"shared-memory segment {name!r} does not exist (owner closed?)") from None
    if seg.size < size:
        seg.close()
        raise ValueError(f"shared-memory segment {name!r} holds {seg.size} bytes, descriptor needs {size}")
    return seg


@dataclass(frozen=True)
class ShmLayerSpec:
    shm_name: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"shm_name": self.shm_name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShmLayerSpec:
        return cls(shm_name=str(d["shm_name"]), shape=tuple(int(x) for x in d["shape"]), dtype=str(d["dtype"]))


class ShmKVRegion:
    """A list of per-layer tensors backed by shared-memory segments."""

    def __init__(self, segments: list[SharedMemory], specs: list[ShmLayerSpec], owner: bool):
        self._segments = segments
        self.specs = specs
        self.owner = owner
        self.tensors: list[torch.Tensor] = []
        for seg, spec in zip(segments, specs):
            dtype = dtype_from_str(spec.dtype)
            count = math.prod(spec.shape)
            self.tensors.append(torch.frombuffer(seg.buf, dtype=dtype, count=count).view(spec.shape))
        if owner:
            with _PTR_LOCK:
                for t, spec in zip(self.tensors, specs):
                    _SEGMENT_OF_PTR[t.data_ptr()] = spec
        self.closed = False

    @property
    def shm_names(self) -> list[str]:
        return [s.shm_name for s in self.specs]

    def layer_specs(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.specs]

    def close(self) -> None:
        """Drop the mappings; the owner also unlinks the segments."""
        if self.closed:
            return
        self.closed = True
        with _PTR_LOCK:
            for t in self.tensors:
                _SEGMENT_OF_PTR.pop(t.data_ptr(), None)
        # The tensors export the mmap buffer; they must go before the mmap can close.
        self.tensors = []
        for seg in self._segments:
            try:
                seg.close()
            except BufferError:
                # A caller still holds a view of the tensor; the mapping lives until it is freed.
                pass
            if self.owner:
                with contextlib.suppress(FileNotFoundError):
                    seg.unlink()
        self._segments = []

    def __enter__(self) -> ShmKVRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SEGMENT_NAME = re.compile(r"^meshserve_kv_(\d+)_[0-9a-f]{12}_\d+$")
_SHM_DIR = Path("/dev/shm")


def sweep_orphans() -> int:
    """Unlink the segments of owners that are gone. An owner killed with SIGKILL never unlinks its regions
    (KV caches, served weights: up to the model's size in RAM each), and its resource tracker may have died
    with it; the next region allocated on the host cleans up after it. Returns the segments removed."""
    removed = 0
    try:
        names = [p.name for p in _SHM_DIR.iterdir()]
    except OSError:
        return 0  # no /dev/shm (not Linux): nothing this code created can be there
    for name in names:
        match = _SEGMENT_NAME.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            (_SHM_DIR / name).unlink()
            removed += 1
    if removed:
        logger.info("removed %d shared-memory segment(s) of processes that are gone", removed)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def allocate_shm_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    entry_shape: tuple[int, ...],
    dtype: torch.dtype,
    name_prefix: str = "meshserve_kv",
) -> ShmKVRegion:
    """Zero-filled KV cache, one shm segment per layer shaped [num_blocks, block_size, *entry_shape]."""
    if num_layers <= 0 or num_blocks <= 0 or block_size <= 0:
        raise ValueError("num_layers, num_blocks and block_size must be positive, "
                         f"got {num_layers}, {num_blocks}, {block_size}")
    if not entry_shape or any(int(d) <= 0 for d in entry_shape):
        raise ValueError(f"entry_shape must be non-empty with positive dims, got {entry_shape}")
    shape = (num_blocks, block_size, *(int(d) for d in entry_shape))
    nbytes = layer_nbytes(shape, dtype)
    sweep_orphans()
    tag = uuid.uuid4().hex[:12]
    segments: list[SharedMemory] = []
    specs: list[ShmLayerSpec] = []
    try:
        for layer in range(num_layers):
            name = f"{name_prefix}_{os.getpid()}_{tag}_{layer}"
            seg = SharedMemory(name=name, create=True, size=nbytes)  # fresh pages read as zero
            segments.append(seg)
            specs.append(ShmLayerSpec(seg.name, shape, dtype_to_str(dtype)))
    except BaseException:
        for seg in segments:
            seg.close()
            seg.unlink()
        raise
    return ShmKVRegion(segments, specs, owner=True)


def attach_shm_kv_cache(layer_specs: list[dict[str, Any]]) -> ShmKVRegion:
    """Map a region another process allocated (from its descriptor's `shm` layer specs)."""
    specs = [ShmLayerSpec.from_dict(d) for d in layer_specs]
    segments: list[SharedMemory] = []
    try:
        for spec in specs:
            segments.append(_open_segment(spec.shm_name, layer_nbytes(spec.shape, dtype_from_str(spec.dtype))))
    except BaseException:
        for seg in segments:
            seg.close()
        raise
    return ShmKVRegion(segments, specs, owner=False)


def shm_spec_of(tensor: torch.Tensor) -> ShmLayerSpec | None:
    """The layer spec when `tensor` is a whole layer of a shm region this process owns, else None."""
    with _PTR_LOCK:
        spec = _SEGMENT_OF_PTR.get(tensor.data_ptr())
    if spec is None or tuple(tensor.shape) != spec.shape or dtype_to_str(tensor.dtype) != spec.dtype:
        return None
    return spec
