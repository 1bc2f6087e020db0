"""`meshserve bench transfer`: KV block pull bandwidth of each transfer-engine backend against memcpy.

A source process (spawned, stopped by the benchmark whatever happens) allocates an MLA-shaped KV region
in shared memory (by default like the `small` DeepSeek-V3: 4 layers of 576-wide latent entries, 16-token
blocks, bfloat16), fills it with seeded random data and serves it. This process is the puller, as a
decode TE is: per backend ("shm": a copy per layer from the mapped region, "tcp": chunked + CRC32 from
the source's block server, "dist": torch.distributed send/recv over a 2-rank Gloo group) and per request
size (blocks per pull, scattered block ids as a real prompt's are), it times a whole-request pull (every
layer in one transfer) and, for the largest size, a layer-by-layer pull (one transfer per layer, all
submitted, then all waited); the median of `--repeats` each.

The baseline is the same blocks copied in this process between two local tensors, the gather and
scatter every pull ends with (`index_select` + `index_copy_` per layer), with no engine, thread or
process boundary, in one torch thread (a copy of a few MB gains little from more, and on a loaded machine
a multi-threaded copy mostly measures how late the other threads get a core); every row's GB/s is also
given as a ratio to it. Before a backend is timed, one pull
is checked bit for bit against the source (the puller rebuilds the source's data from the seed).
Writes JSON (machine, config, rows), a PNG of GB/s against request size beside it, and summary lines.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from meshserve.bench.deployment_load import one_line_errors, run_bench_cli
from meshserve.transfer import BlockRef, TransferEngine, TransferStatus
from meshserve.transfer import dist as dist_mod
from meshserve.transfer import tcp as tcp_mod
from meshserve.transfer.shm import dtype_from_str
from meshserve.utils import report

PROG = "meshserve bench transfer"
BACKENDS = ("shm", "tcp", "dist")
MEMCPY = "memcpy"
WHOLE, BY_LAYER = "whole", "by_layer"
SOURCE_ENGINE, PULLER_ENGINE, REGION = "bench-source", "bench-puller", "kv"
PULLER_WORKERS = 2  # the engine's default: by-layer pulls run two at a time
IO_TIMEOUT_S = 30.0  # a pull of a few tens of MB on a busy 2-core machine stays far below this
WAIT_S = 120.0
START_TIMEOUT_S = 60.0  # the source imports torch and allocates its region first
MEMCPY_BASELINE = "index_select + index_copy_ per layer between two local tensors, in process, one torch thread"


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"transfer backends measured, in order (default: {','.join(BACKENDS)})")
    parser.add_argument("--blocks", default="16,64,256",
                        help="request sizes, blocks per pull (default: 16,64,256; 256 x 16 tokens = 4096 tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="timed pulls per measurement, median taken (default: 5)")
    layout = parser.add_argument_group("KV layout of the source region (default: the small DeepSeek-V3's MLA cache)")
    layout.add_argument("--layers", type=int, default=4, help="layers (default: 4)")
    layout.add_argument("--entry", type=int, default=576,
                        help="elements per token and layer (default: 576, the MLA latent 512 + rope 64)")
    layout.add_argument("--block-size", dest="block_size", type=int, default=16, help="tokens per block (default: 16)")
    layout.add_argument("--dtype", default="bfloat16", help="element type (default: bfloat16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the source data and block ids (default: 0)")


@dataclass(frozen=True)
class KVLayout:
    """The source region: `blocks` blocks of `block_size` tokens x `entry` elements, per layer."""

    layers: int
    blocks: int
    block_size: int
    entry: int
    dtype: str
    seed: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_str(self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: what a pull moves per block."""
        return self.layers * self.block_size * self.entry * torch.empty((), dtype=self.torch_dtype).element_size()

    def source_layers(self) -> list[torch.Tensor]:
        """The source's contents, rebuilt bit for bit from the seed by whichever process asks."""
        g = torch.Generator().manual_seed(self.seed)
        return [torch.randn((self.blocks, self.block_size, self.entry), generator=g).to(self.torch_dtype)
                for _ in range(self.layers)]


@dataclass(frozen=True)
class TransferSettings:
    json_path: str
    backends: tuple[str, ...]
    sizes: tuple[int, ...]  # blocks per pull
    repeats: int
    layout: KVLayout


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} must be positive, got {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} repeats a value: {text!r}")
    return values


def settings_from_args(args: argparse.Namespace) -> TransferSettings:
    """Validated settings; ValueError names the bad flag."""
    backends = tuple(b.strip() for b in args.backends.split(","))
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"--backends takes some of {','.join(BACKENDS)}, got {args.backends!r}")
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backends repeats a backend: {args.backends!r}")
    if "dist" in backends and not dist_mod.available():
        raise ValueError("the dist backend needs torch.distributed with Gloo, which this torch build lacks")
    sizes = _int_list(args.blocks, "--blocks")
    for flag, value in (("--repeats", args.repeats), ("--layers", args.layers), ("--entry", args.entry),
                        ("--block-size", args.block_size)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    dtype = dtype_from_str(args.dtype)  # ValueError for an unknown name
    if not dtype.is_floating_point:
        raise ValueError(f"--dtype must be a floating-point type, got {args.dtype!r}")
    # twice the largest request, so every request's blocks are scattered over the region
    layout = KVLayout(args.layers, 2 * max(sizes), args.block_size, args.entry, args.dtype, args.seed)
    return TransferSettings(args.json, backends, sizes, args.repeats, layout)


def transfer_main(args: argparse.Namespace) -> int:
    errors = (RuntimeError, TimeoutError, OSError, ValueError)  # a failed or wrong pull, a dead source
    return run_bench_cli(PROG, args, settings_from_args, run_transfer_benchmark, errors, _report_transfer)


def _report_transfer(settings, result: dict) -> None:
    json_path = report.write_json(settings.json_path, result)
    png_path = plot_transfer(result, report.png_path_for(json_path))
    for line in summary_lines(result):
        print(line)
    print(f"wrote {json_path} and {png_path}")


# ---------------------------------------------------------------- the source process
def _source_main(conn, layout: dict) -> None:
    """Allocates and fills the region, sends its descriptor, serves until told to stop or orphaned."""
    kv = KVLayout(**layout)
    engine = TransferEngine(SOURCE_ENGINE, io_timeout=IO_TIMEOUT_S)
    try:
        tensors = engine.allocate_region(REGION, kv.layers, kv.blocks, kv.block_size, (kv.entry,), kv.torch_dtype)
        for tensor, data in zip(tensors, kv.source_layers()):
            tensor.copy_(data)
        conn.send({"descriptor": engine.descriptor(REGION).to_dict()})
        conn.recv()  # any message stops serving
    except EOFError:  # the puller is gone
        pass
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        engine.close()  # unlinks the region's shared memory


class _SourceProcess:
    def __init__(self, layout: KVLayout):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_source_main, args=(child_conn, asdict(layout)), daemon=True)
        self.proc.start()
        child_conn.close()

    def descriptor(self) -> dict:
        if not self.conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"the source process sent no region descriptor within {START_TIMEOUT_S:.0f} s")
        try:
            reply = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the source process exited before serving (exit code {self.proc.exitcode})") from None
        if "error" in reply:
            raise RuntimeError(f"the source process failed to start: {reply['error']}")
        return reply["descriptor"]

    def stop(self) -> int | None:
        """Ask it to stop, kill it if it does not; its exit code (0 after a clean stop)."""
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()
        return self.proc.exitcode


@contextlib.contextmanager
def _started_source(layout: KVLayout, record: dict) -> Iterator[dict]:
    """The source's region descriptor while it serves; `record` gets its pid, shm segments and exit code."""
    source = _SourceProcess(layout)
    record["pid"] = source.proc.pid
    try:
        descriptor = source.descriptor()
        record["shm_segments"] = [layer["shm_name"] for layer in descriptor["shm"] or []]
        yield descriptor
    finally:
        record["exitcode"] = source.stop()


# ---------------------------------------------------------------- measurements
def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _index(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def _memcpy(src: list[torch.Tensor], dst: list[torch.Tensor], src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    for s, d in zip(src, dst):
        d.index_copy_(0, dst_idx, s.index_select(0, src_idx))


def _pull(engine: TransferEngine, src_ids: list[int], dst_ids: list[int], num_layers: int, by_layer: bool,
          expected_bytes: int) -> None:
    """One request's blocks from the source; every transfer submitted before any is waited."""
    src, dst = BlockRef(REGION, src_ids, SOURCE_ENGINE), BlockRef(REGION, dst_ids)
    steps = [[layer] for layer in range(num_layers)] if by_layer else [None]
    handles = [engine.transfer(src, dst, layers=step) for step in steps]
    moved = 0
    for handle in handles:
        done = engine.wait(handle, WAIT_S)
        if done.status is not TransferStatus.DONE:
            raise RuntimeError(f"a pull of {len(src_ids)} blocks failed: {done.error}")
        moved += done.nbytes
    if moved != expected_bytes:
        raise RuntimeError(f"a pull of {len(src_ids)} blocks moved {moved} bytes, expected {expected_bytes}")


def _verify(backend: str, source: list[torch.Tensor], pulled: list[torch.Tensor], src_ids: list[int],
            dst_ids: list[int]) -> None:
    """The pulled region equals zeros with the source's blocks at the destination ids, bit for bit."""
    for layer, (s, got) in enumerate(zip(source, pulled)):
        want = torch.zeros_like(got)
        want[_index(dst_ids)] = s[_index(src_ids)]
        got_bytes, want_bytes = got.view(torch.uint8), want.view(torch.uint8)
        if not torch.equal(got_bytes, want_bytes):
            differing = int((got_bytes != want_bytes).sum())
            raise RuntimeError(f"{backend} pull of {len(src_ids)} blocks differs from the source in layer {layer}: "
                               f"{differing} of {want_bytes.numel()} bytes")


def _row(backend: str, mode: str, blocks: int, layout: KVLayout, times: list[float],
         memcpy_gbps: float | None) -> dict:
    nbytes = blocks * layout.block_bytes
    median_s = statistics.median(times)
    gbps = nbytes / median_s / 1e9
    return {"backend": backend, "mode": mode, "blocks": blocks, "tokens": blocks * layout.block_size,
            "bytes": nbytes, "median_s": median_s, "gbps": gbps,
            "vs_memcpy": gbps / memcpy_gbps if memcpy_gbps else 1.0, "times_s": times}


def _progress(row: dict) -> None:
    print(f"{row['backend']:<6} {row['mode']:<8} {row['blocks']:>5} blocks ({row['bytes'] / 1e6:7.2f} MB): "
          f"{row['median_s'] * 1e3:8.2f} ms median, {row['gbps']:6.2f} GB/s = {row['vs_memcpy']:.2f}x memcpy",
          flush=True)


def _memcpy_rows(layout: KVLayout, source: list[torch.Tensor], picks: dict[int, tuple[list[int], list[int]]],
                 repeats: int) -> list[dict]:
    """The baseline per request size, in one torch thread (see the module's docstring)."""
    rows = []
    local_dst = [torch.zeros_like(t) for t in source]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n, (src_ids, dst_ids) in picks.items():
            src_idx, dst_idx = _index(src_ids), _index(dst_ids)
            _memcpy(source, local_dst, src_idx, dst_idx)  # untimed: first touch of the destination pages
            times = _timed(functools.partial(_memcpy, source, local_dst, src_idx, dst_idx), repeats)
            rows.append(_row(MEMCPY, WHOLE, n, layout, times, None))
            _progress(rows[-1])
    finally:
        torch.set_num_threads(threads)
    return rows


def run_transfer_benchmark(settings: TransferSettings) -> dict:
    layout, repeats = settings.layout, settings.repeats
    source = layout.source_layers()
    rng = random.Random(layout.seed)
    # (source ids, destination ids) per request size, the same for every backend and the baseline
    picks = {n: (rng.sample(range(layout.blocks), n), rng.sample(range(layout.blocks), n)) for n in settings.sizes}
    rows = _memcpy_rows(layout, source, picks, repeats)
    memcpy_gbps = {row["blocks"]: row["gbps"] for row in rows}
    largest = max(settings.sizes)
    verified = {}
    source_record: dict = {}
    with _started_source(layout, source_record) as descriptor, \
            TransferEngine(PULLER_ENGINE, serve_tcp=False, io_timeout=IO_TIMEOUT_S,
                           max_workers=PULLER_WORKERS) as engine:
        pulled = [torch.zeros_like(t) for t in source]
        engine.register(REGION, pulled)
        for backend in settings.backends:
            chosen = engine.link(SOURCE_ENGINE, descriptor, backend=backend)
            if chosen != backend:
                raise RuntimeError(f"asked to link over {backend}, the engine linked over {chosen}")
            try:
                # untimed and checked: builds the dist group, maps the shm pages, then compares every byte
                src_ids, dst_ids = picks[largest]
                for tensor in pulled:
                    tensor.zero_()  # so that nothing an earlier backend landed can pass for this one's blocks
                _pull(engine, src_ids, dst_ids, layout.layers, False, largest * layout.block_bytes)
                _verify(backend, source, pulled, src_ids, dst_ids)
                verified[backend] = True
                timed = [(n, WHOLE) for n in settings.sizes] + [(largest, BY_LAYER)]
                for n, mode in timed:
                    src_ids, dst_ids = picks[n]
                    pull = functools.partial(_pull, engine, src_ids, dst_ids, layout.layers, mode == BY_LAYER,
                                             n * layout.block_bytes)
                    times = _timed(pull, repeats)
                    row = _row(backend, mode, n, layout, times, memcpy_gbps[n])
                    rows.append(row)
                    _progress(row)
            finally:
                engine.unlink(SOURCE_ENGINE)
    return {
        "machine": report.machine_info(),
        "config": {"layers": layout.layers, "entry": layout.entry, "block_size": layout.block_size,
                   "dtype": layout.dtype, "seed": layout.seed, "region_blocks": layout.blocks,
                   "block_bytes": layout.block_bytes,
                   "backends": list(settings.backends), "blocks_per_pull": list(settings.sizes),
                   "repeats": repeats, "by_layer_blocks": largest, "puller_workers": PULLER_WORKERS,
                   "tcp_chunk_bytes": tcp_mod.DEFAULT_CHUNK_BYTES, "dist_group": "gloo",
                   "memcpy_baseline": MEMCPY_BASELINE},
        "verified": verified,
        "source": source_record,
        "rows": rows,
    }


# ---------------------------------------------------------------- report
def summary_lines(result: dict) -> list[str]:
    config, rows = result["config"], result["rows"]
    sizes, largest = config["blocks_per_pull"], config["by_layer_blocks"]
    columns = [(n, WHOLE) for n in sizes] + [(largest, BY_LAYER)]
    by_key = {(r["backend"], r["blocks"], r["mode"]): r for r in rows}
    header = f"{'GB/s (x memcpy)':<16}" + "".join(
        f"{f'{n} blocks' + (' by layer' if mode == BY_LAYER else ''):>22}" for n, mode in columns)
    lines = [f"KV pulls of {config['layers']} layers x {config['block_size']} tokens x {config['entry']} "
             f"{config['dtype']} ({config['block_bytes'] / 1024:.0f} KiB per block), median of {config['repeats']}",
             header]
    for backend in [MEMCPY, *config["backends"]]:
        cells = []
        for n, mode in columns:
            row = by_key.get((backend, n, mode))
            cells.append(f"{'-':>22}" if row is None else f"{row['gbps']:.2f} ({row['vs_memcpy']:.2f}x)".rjust(22))
        lines.append(f"{backend:<16}" + "".join(cells))
    lines.append("verified bit for bit against the source: " + ", ".join(
        f"{b} {'yes' if ok else 'NO'}" for b, ok in result["verified"].items()))
    return lines


def plot_transfer(result: dict, path: Path) -> Path:
    config, rows = result["config"], result["rows"]
    fig, axes = report.new_figure(width_per_panel=7.5)  # room for the legend beside the axes
    ax = axes[0][0]
    sizes = config["blocks_per_pull"]
    for backend in [*config["backends"], MEMCPY]:
        whole = sorted((r for r in rows if r["backend"] == backend and r["mode"] == WHOLE), key=lambda r: r["blocks"])
        style = dict(color="black", linestyle="--") if backend == MEMCPY else {}
        label = f"{MEMCPY} (in process)" if backend == MEMCPY else backend
        (line,) = ax.plot([r["blocks"] for r in whole], [r["gbps"] for r in whole], marker="o", label=label, **style)
        for r in rows:
            if r["backend"] == backend and r["mode"] == BY_LAYER:
                ax.plot([r["blocks"]], [r["gbps"]], marker="x", markersize=9, linestyle="none",
                        color=line.get_color(), label=f"{backend} layer by layer")
    block_bytes = config["block_bytes"]
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(sizes, [f"{n}\n({n * block_bytes / 1e6:.1f} MB)" for n in sizes])
    ax.set_xlabel(f"blocks per pull ({config['block_size']} tokens each)")
    ax.set_yscale("log")  # the backends sit up to two orders of magnitude below the in-process copy
    # start-up: matplotlib only when plotting
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.set_ylabel("GB/s (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"KV pull: {config['layers']} layers x {config['entry']} {config['dtype']}")
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.02, 0.5))
    return report.save_figure(fig, path)
