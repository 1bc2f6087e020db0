"""How much of a set of files sits in the kernel's page cache, and moving files into and out of it.

A TE reads its checkpoint at DRAM speed when the files are already in the page cache and at disk speed
when they are not; the cluster manager reads the checkpoints of models it expects to scale ahead of time
("DRAM preload", `preload`) and every rank reports which of the two its load was (`resident_fraction`
before reading). `evict` drops files from the cache (posix_fadvise DONTNEED: no root needed; pages another
process has mapped or dirty pages may stay), so benchmarks and tests can measure a cold load.

Linux only (mincore, posix_fadvise); elsewhere `resident_fraction` answers 0.0 and `evict` does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from meshserve.utils.checkpoint_files import safetensors_files

_READ_CHUNK = 16 << 20
RESIDENT_THRESHOLD = 0.9  # a load whose files were at least this resident before it counts as a page-cache load

_libc = None


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        libc.mincore.restype = ctypes.c_int
        _libc = libc
    return _libc


def _os_error(what: str, path: Path) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what} failed on {path}: {os.strerror(err)}")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory (what a load reads)."""
    return safetensors_files(model_dir)


def _resident_pages(path: Path) -> tuple[int, int]:
    """(pages in the page cache, pages) of one file: mincore over a mapping that touches none of them."""
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    if size == 0:
        return 0, 0
    libc = _c()
    with open(path, "rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise _os_error("mmap", path)
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vec) != 0:
                raise _os_error("mincore", path)
        finally:
            libc.munmap(address, size)
    return sum(b & 1 for b in bytes(vec)), pages


def resident_fraction(paths: Iterable[str | Path]) -> float:
    """The share of the files' pages that sit in the page cache now, in [0, 1] (1.0 for no bytes at all)."""
    if not sys.platform.startswith("linux"):
        return 0.0
    resident = total = 0
    for path in paths:
        r, n = _resident_pages(Path(path))
        resident += r
        total += n
    return resident / total if total else 1.0


def evict(paths: Iterable[str | Path]) -> None:
    """Drop the files' pages from the page cache (the next read comes from disk). Pages not yet written back
    cannot be dropped, so a freshly written file is flushed first."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def preload(paths: Iterable[str | Path]) -> tuple[int, float]:
    """Read the files through so they sit in the page cache: (bytes read, seconds)."""
    t0 = time.perf_counter()
    total = 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):  # let the kernel read ahead in big requests
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - t0
