"""How fast a new TE gets its weights, by where they come from (deepserve Fig. 10 and 11a).

`load_by_source`: TE-Load of one rank (a whole `load_model`, or `fork_model`, to a model that serves)
from a cold disk, the page cache, the memory pool's model cache and a fork from a running rank, each
next to its bound: the bytes moved over a bandwidth measured in the same run (disk: reading the evicted
files; page cache: reading them again; pool: reading every value of the model from the pool; fork: a
memcpy into fresh memory, which is what a TCP fork needs at least; on the source's host a fork maps the
snapshot copy-on-write and needs no copy at all). Every source is measured in this one process, one after
the other, after a warm-up load, so each sees the same process state (kernels loaded, allocator warm).

`fork_fanout`: N target processes fork from one source at once (the source in this process): time from
the start signal until the last target holds its weights, and the source's step latency (one prefill of
a short prompt) while they do, next to the same step with nobody forking.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from meshserve.layers.metadata import AttentionMetadata
from meshserve.models.loader import finish_model, load_hf_config, load_model, new_model, resolve_dtype
from meshserve.parallel.context import ParallelContext
from meshserve.utils import page_cache
from meshserve.utils.processes import free_tcp_port, launch, stop_process
from meshserve.worker.weight_fork import WeightServer, fork_identity, fork_model

logger = logging.getLogger(__name__)

SOURCES = ("disk", "page-cache", "pool", "fork")
_COPY_BYTES = 256 << 20


@dataclass
class SourceResult:
    source: str
    seconds: list[float]  # one TE-Load per repeat
    nbytes: int  # weight bytes the load moved
    bandwidth_gbps: float  # measured in this run for this source (GB/s)
    bound_s: float  # nbytes / bandwidth

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class LoadBySource:
    model_dir: str
    results: list[SourceResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model_dir": self.model_dir, "measured_in": "one process, sources one after the other",
                "results": [{**asdict(r), "median_s": r.median_s} for r in self.results],
                "speedup_vs_disk": {r.source: self._disk() / r.median_s for r in self.results} if self._disk() else {}}

    def _disk(self) -> float | None:
        return next((r.median_s for r in self.results if r.source == "disk"), None)


def _copy_bandwidth() -> float:
    """Bytes per second of a memcpy into freshly allocated memory (page faults included)."""
    src = torch.ones(_COPY_BYTES, dtype=torch.uint8)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        torch.empty_like(src).copy_(src)
        best = max(best, _COPY_BYTES / (time.perf_counter() - t0))
    return best


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def load_by_source(model_dir: str | Path, sources=SOURCES, repeats: int = 3, dtype: str = "auto",
                   pool_dram_bytes: int = 4 << 30) -> LoadBySource:
    """TE-Load of one rank of `model_dir` per source, each with its bound (see the module docstring)."""
    model_dir = str(model_dir)
    files = page_cache.checkpoint_files(model_dir)
    torch_dtype = resolve_dtype(dtype, load_hf_config(model_dir))
    out = LoadBySource(model_dir)
    load_model(model_dir, dtype=torch_dtype)  # warm-up: native kernels, allocator
    file_bytes = sum(f.stat().st_size for f in files)
    for source in sources:
        seconds: list[float] = []
        if source in ("disk", "page-cache"):
            for _ in range(repeats):
                page_cache.evict(files)
                nbytes, read_s = page_cache.preload(files)  # cold read speed, and it fills the cache
                bandwidth = nbytes / read_s
                if source == "disk":
                    page_cache.evict(files)
                else:
                    nbytes, read_s = page_cache.preload(files)
                    bandwidth = nbytes / read_s
                seconds.append(_timed(lambda: load_model(model_dir, dtype=torch_dtype))[0])
            nbytes = file_bytes
        elif source == "pool":
            seconds, nbytes, bandwidth = _pool_loads(model_dir, torch_dtype, repeats, pool_dram_bytes)
        elif source == "fork":
            server = WeightServer(load_model(model_dir, dtype=torch_dtype),
                                  fork_identity(model_dir, torch_dtype, None, ParallelContext.single()))
            try:
                for _ in range(repeats):
                    seconds.append(_timed(lambda s=server: fork_model(s.address, model_dir, torch_dtype))[0])
                nbytes = server.nbytes
            finally:
                server.close()
            bandwidth = _copy_bandwidth()
        else:
            raise ValueError(f"unknown load source {source!r}; use {', '.join(SOURCES)}")
        result = SourceResult(source, seconds, nbytes, bandwidth / 1e9, nbytes / bandwidth)
        logger.info("%-10s TE-Load %.3fs (median of %d), bound %.3fs (%.1f GB/s)", source, result.median_s,
                    repeats, result.bound_s, result.bandwidth_gbps)
        out.results.append(result)
    return out


def _pool_loads(model_dir: str, dtype: torch.dtype, repeats: int, dram_bytes: int) -> tuple[list[float], int, float]:
    """Loads through the pool's model cache: a controller and one server started here, the model put."""
    from meshserve.pool.sdk import PoolClient
    from meshserve.worker.model_cache import default_model_id, pool_weights, prefetch_model, put_model

    controller = f"tcp://127.0.0.1:{free_tcp_port()}"
    procs = [launch("pool-controller", bind=controller)]
    try:
        procs.append(launch("pool-server", server_id="bench-0", bind=f"tcp://127.0.0.1:{free_tcp_port()}",
                            controller=controller, dram_bytes=dram_bytes))
        with PoolClient(controller, timeout_s=30.0) as client:
            deadline = time.monotonic() + 30
            while not (client.view() and client.view().servers):
                if time.monotonic() > deadline:
                    raise RuntimeError("the pool server did not register within 30 s")
                time.sleep(0.1)
            put_model(client, model_dir)
            get_s, nbytes = _timed(lambda: prefetch_model(client, default_model_id(model_dir)))
            seconds = [_timed(lambda: load_model(model_dir, dtype=dtype,
                                                 read_weights=pool_weights(client, model_dir)))[0]
                       for _ in range(repeats)]
        return seconds, nbytes, nbytes / get_s
    finally:
        for proc in procs:
            proc.terminate()
            stop_process(proc, grace_s=5.0)


# ---------------------------------------------------------------- fan-out
@dataclass
class FanoutResult:
    count: int
    all_done_s: float  # start signal -> the last target holds its weights
    per_target_s: list[float]
    source_step_idle_ms: float  # the source's step with nobody forking
    source_step_during_ms: float  # the same step while the targets fork (median)


def _fork_target(address: str, model_dir: str, dtype: str, start, ready, results) -> None:
    torch.set_num_threads(1)
    finish_model(new_model(model_dir, dtype), model_dir)  # warm: imports, native kernels (no weights read)
    ready.put(True)
    start.wait()
    t0 = time.time()
    fork_model(address, model_dir, resolve_dtype(dtype))
    results.put((t0, time.time()))


def _step_ms(model, repeats: int = 5) -> list[float]:
    """One 16-token prefill of `model` (a short serving step), timed `repeats` times in ms."""
    layout = model.kv_cache_layout(next(model.parameters()).dtype, 0)
    caches = layout.allocate(4, 16, torch.device("cpu"))
    ids = torch.arange(16, dtype=torch.int64)
    attn = AttentionMetadata.build([16], [0], [[0]], 16, device=torch.device("cpu"))
    out = []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, ids, attn, caches)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def fork_fanout(model_dir: str | Path, counts=(1, 2, 4), dtype: str = "float32",
                timeout_s: float = 300.0) -> list[FanoutResult]:
    """N target processes forking from one source (in this process) at once, per N in `counts`."""
    model_dir = str(model_dir)
    torch_dtype = resolve_dtype(dtype)
    source = load_model(model_dir, dtype=torch_dtype)
    server = WeightServer(source, fork_identity(model_dir, torch_dtype, None, ParallelContext.single()))
    ctx = mp.get_context("spawn")
    out = []
    try:
        idle = statistics.median(_step_ms(source))
        for count in counts:
            start, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
            procs = [ctx.Process(target=_fork_target, args=(server.address, model_dir, dtype, start, ready, results))
                     for _ in range(count)]
            for proc in procs:
                proc.start()
            for _ in procs:  # the targets import and warm up; what is timed starts at the signal
                ready.get(timeout=timeout_s)
            t0 = time.time()
            start.set()
            during = _step_ms(source, repeats=3)
            spans = [results.get(timeout=timeout_s) for _ in range(count)]
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
            result = FanoutResult(count, max(end for _, end in spans) - t0, [end - begin for begin, end in spans],
                                  idle, statistics.median(during))
            logger.info("fork fan-out %d: all hold their weights after %.3fs (each %s); source step %.1f ms "
                        "idle, %.1f ms during", count, result.all_done_s,
                        ", ".join(f"{s:.3f}s" for s in result.per_target_s), idle, result.source_step_during_ms)
            out.append(result)
    finally:
        server.close()
    return out
