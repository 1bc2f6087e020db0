"""`meshserve plan calibrate`: measure this machine into a cluster file for `meshserve plan --cluster`.

A local gloo world of nodes x ranks-per-node processes (the same grouping the MoE
collectives use) times, per link:
- intra-node: all_gather, reduce_scatter and all_reduce over each node's group;
- inter-node: all_to_all_single over each local rank's cross-node group;
- the world: all_to_all_single over every rank, as EP's dispatch and combine run (the cluster file's `a2a_*`:
  one call of the collective library, which Eq. 3's d - 1 rounds of another collective's latency misprice).
Each time is the slowest rank's, the fastest of the repeats (on a shared machine noise only adds time: the
median of two runs put one world's all-to-all at 1,081 us and the next at 291). The analyzer prices every
collective as (rounds) x (latency + bytes per round / bandwidth) (Eq. 1-3), so each
sample is divided into those units before fitting: the latency comes from a small
message, the bandwidth from a least-squares line through the large messages.
Compute is dense-matmul GFLOP/s of one rank while all ranks run at once with the
threads each gets (the faster of torch.mm and the prepacked oneDNN linear), and
device memory is the RAM one rank may use.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from meshserve.layers.linear import linear, pack_weight
from meshserve.parallel import analyzer as az
from meshserve.parallel.strategy import is_power_of_two
from meshserve.parallel.topology import Topology, build_groups, spawn_local_world
from meshserve.utils.report import new_figure, save_figure

KIB, MIB = 2**10, 2**20
DEFAULT_SIZES = (256 * KIB, 1 * MIB, 4 * MIB)
LATENCY_MESSAGE_BYTES = 64  # rounded up so every rank holds a whole float32 share
MAX_MESSAGE_BYTES = 256 * MIB  # every rank allocates send and receive buffers of this size
MAX_RANKS = 64
# (tokens, in features, out features): a decode batch and a prefill chunk through a
# routed expert of the analyzer's presets (hidden 4096, expert width 1536).
DEFAULT_MATMUL_SHAPES = ((32, 4096, 1536), (512, 4096, 1536))
MATMUL_SAMPLE_S = 0.2  # the shortest timed matmul sample
INTRA_OPS = ("all_gather", "reduce_scatter", "all_reduce")
INTER_OPS = ("all_to_all",)
WORLD_OPS = ("all_to_all",)
LINKS = {"intra_node": INTRA_OPS, "inter_node": INTER_OPS}

# The analyzer's price of each collective, as a function of (size, degree, link).
ANALYZER_COST = {
    "all_gather": az.all_gather_time_eq1,
    "reduce_scatter": az.reduce_scatter_time_eq1,
    "all_reduce": az.allreduce_time,
    "all_to_all": az.all_to_all_time,
}

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CalibrationError(ValueError):
    """A bad `meshserve plan calibrate` input, reported as one line."""


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    nodes: int = 2
    ranks_per_node: int = 2
    sizes: tuple[int, ...] = DEFAULT_SIZES  # message bytes of the bandwidth fit (the analyzer's `size`)
    repeats: int = 5
    matmul_shapes: tuple[tuple[int, int, int], ...] = DEFAULT_MATMUL_SHAPES
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CalibrationError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        world = self.nodes * self.ranks_per_node
        if world < 2 or not is_power_of_two(world) or world > MAX_RANKS:
            raise CalibrationError(f"nodes x ranks per node must be a power of two from 2 to {MAX_RANKS} "
                                   f"(the worlds the analyzer plans), got {self.nodes} x {self.ranks_per_node}")
        if len(set(self.sizes)) < 2:
            raise CalibrationError(f"--sizes needs at least two different message sizes to fit a bandwidth, "
                                   f"got {list(self.sizes)}")
        for size in self.sizes:
            if not 0 < size <= MAX_MESSAGE_BYTES:
                raise CalibrationError(f"message sizes must be 1 B to {MAX_MESSAGE_BYTES // MIB} MiB, got {size}")
        for degree in {self.nodes, self.ranks_per_node} - {1}:
            if len(fit_sizes(self.sizes, degree)) < 2:
                raise CalibrationError(f"--sizes {list(self.sizes)} leave fewer than two sizes above the "
                                       f"{LATENCY_MESSAGE_BYTES} B latency message once split over {degree} ranks")
        if not self.matmul_shapes:
            raise CalibrationError("--matmul-shapes needs at least one MxKxN shape")
        for shape in self.matmul_shapes:
            if len(shape) != 3 or min(shape) < 1:
                raise CalibrationError(f"matmul shapes are three positive sizes MxKxN, got {shape!r}")
        if not self.timeout_s > 0:
            raise CalibrationError(f"timeout must be positive, got {self.timeout_s!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


# ---------------------------------------------------------------- argument parsing

_SIZE_PATTERN = re.compile(r"^(\d+)\s*([kmg]?)(i?b)?$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": KIB, "m": MIB, "g": 2**30}


def parse_size(text: str) -> int:
    """'4096', '256K', '1MiB', '4mb' -> bytes (K/M/G are binary)."""
    match = _SIZE_PATTERN.match(text.strip())
    if not match:
        raise CalibrationError(f"bad message size {text!r}; expected e.g. 4096, 256K or 1M")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def parse_matmul_shape(text: str) -> tuple[int, int, int]:
    """'32x4096x1536' -> (tokens, in features, out features)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise CalibrationError(f"bad matmul shape {text!r}; expected MxKxN, e.g. 32x4096x1536")
    shape = tuple(int(p) for p in parts)
    if min(shape) < 1:
        raise CalibrationError(f"bad matmul shape {text!r}; every size must be positive")
    return shape  # type: ignore[return-value]


def message_bytes(size: int, degree: int) -> int:
    """`size` rounded up to whole float32 elements that split evenly over `degree` ranks."""
    unit = 4 * degree
    return max(unit, -(-size // unit) * unit)


def fit_sizes(sizes: Sequence[int], degree: int) -> list[int]:
    """The distinct rounded message sizes of the bandwidth fit, above the latency message."""
    small = message_bytes(LATENCY_MESSAGE_BYTES, degree)
    return sorted({message_bytes(size, degree) for size in sizes if message_bytes(size, degree) > small})


# ---------------------------------------------------------------- fitting (pure functions)

def fit_latency_bandwidth(message_bytes_: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares line t = latency + bytes / bandwidth; returns (latency s, bandwidth B/s).

    The bandwidth is inf when the time does not grow with the size (the transfer
    time is below the noise at these sizes).
    """
    if len(message_bytes_) != len(seconds):
        raise ValueError(f"{len(message_bytes_)} sizes but {len(seconds)} times")
    if len(set(message_bytes_)) < 2:
        raise ValueError("a line needs at least two different message sizes")
    n = len(seconds)
    mean_x = sum(message_bytes_) / n
    mean_t = sum(seconds) / n
    sxx = sum((x - mean_x) ** 2 for x in message_bytes_)
    sxt = sum((x - mean_x) * (t - mean_t) for x, t in zip(message_bytes_, seconds))
    slope = sxt / sxx
    latency = mean_t - slope * mean_x
    return latency, (1.0 / slope if slope > 0 else math.inf)


def analyzer_terms(op: str, size: float, degree: int) -> tuple[float, float]:
    """(rounds, bytes per round) with which the analyzer prices `op`: time = rounds*latency + bytes/bandwidth.

    Read off the analyzer's own equations, so the fit always matches the model it feeds.
    """
    cost = ANALYZER_COST[op]
    rounds = cost(size, degree, az.Link(bandwidth=math.inf, latency=1.0))
    transfer = cost(size, degree, az.Link(bandwidth=1.0, latency=0.0))
    return rounds, transfer / rounds


def fit_link(ops: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Latency and bandwidth of one link from its collectives' raw samples.

    `ops` maps op -> {"degree", "sizes_bytes", "samples_s"} where the first size is the
    small latency message and samples_s[i] are the repeats at sizes_bytes[i]. Times are
    divided into the analyzer's rounds first; the bandwidth is fitted on the large
    messages' fastest repeats, the latency is the small message's fastest less its own transfer (the median
    over the link's collectives).
    """
    normalized = {}
    for op, raw in ops.items():
        terms = [analyzer_terms(op, size, raw["degree"]) for size in raw["sizes_bytes"]]
        (rounds, small_bytes), large = terms[0], terms[1:]
        normalized[op] = {
            "small_bytes": small_bytes,
            "small_s": [min(raw["samples_s"][0]) / rounds],
            "x": [per_round for _, per_round in large],
            "t": [min(samples) / r for (r, _), samples in zip(large, raw["samples_s"][1:])],
        }

    def latency(points: list[tuple[float, float]], bandwidth: float) -> float:
        corrected = statistics.median(t - x / bandwidth for x, t in points)
        # A noisy, too-low bandwidth can eat the whole small time: keep the time as measured then.
        return corrected if corrected > 0 else statistics.median(t for _, t in points)

    per_op = {}
    for op, n in normalized.items():
        fit_latency, bandwidth, _ = _bandwidth_with_fallback(n["x"], n["t"])
        per_op[op] = {"latency_s": latency([(n["small_bytes"], t) for t in n["small_s"]], bandwidth),
                      "bandwidth_bytes_s": bandwidth, "fit_latency_s": fit_latency}
    fit_latency, bandwidth, source = _bandwidth_with_fallback([x for n in normalized.values() for x in n["x"]],
                                                              [t for n in normalized.values() for t in n["t"]])
    small = [(n["small_bytes"], t) for n in normalized.values() for t in n["small_s"]]
    return {"latency_s": latency(small, bandwidth), "bandwidth_bytes_s": bandwidth, "fit_latency_s": fit_latency,
            "bandwidth_source": source, "ops": per_op}


def _bandwidth_with_fallback(xs: list[float], ts: list[float]) -> tuple[float, float, str]:
    latency, bandwidth = fit_latency_bandwidth(xs, ts)
    if math.isfinite(bandwidth):
        return latency, bandwidth, "fit"
    # Noise swamped the slope: count the largest message's whole time as transfer (a lower bound).
    largest = max(range(len(xs)), key=xs.__getitem__)
    return latency, xs[largest] / ts[largest], "largest message"


# ---------------------------------------------------------------- measuring (inside the world)

def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def threads_per_rank(world_size: int) -> int:
    return max(1, usable_cores() // world_size)


def _progress(message: str) -> None:
    print(f"[calibrate] {message}", file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    pass


def _slowest(run: Callable[[], object], calls: int) -> float:
    """Seconds per call of the slowest rank; all ranks start together."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    elapsed = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _collective(op: str, size: int, degree: int, group: dist.ProcessGroup) -> Callable[[], object]:
    """One call of `op` moving the analyzer's `size` bytes (zeros, so sums never overflow)."""
    elements = size // 4
    if op == "all_gather":
        shard, full = torch.zeros(elements // degree), torch.empty(elements)
        return lambda: _all_gather_single(full, shard, group=group)
    if op == "reduce_scatter":
        full, shard = torch.zeros(elements), torch.empty(elements // degree)
        return lambda: _reduce_scatter_single(shard, full, group=group)
    if op == "all_reduce":
        tensor = torch.zeros(elements)
        return lambda: dist.all_reduce(tensor, group=group)
    if op == "all_to_all":
        send, recv = torch.zeros(elements), torch.empty(elements)
        return lambda: dist.all_to_all_single(recv, send, group=group)
    raise ValueError(f"unknown collective {op!r}")


def _calls_per_sample(size: int) -> int:
    # Small messages take tens of microseconds: several back-to-back calls per sample
    # keep the barrier's exit skew out of the time.
    return max(1, min(16, MIB // size))


def _time_link(label: str, ops: Sequence[str], group: dist.ProcessGroup, degree: int,
               config: CalibrationConfig, log: Callable[[str], None]) -> dict[str, Any]:
    sizes = [message_bytes(LATENCY_MESSAGE_BYTES, degree)] + fit_sizes(config.sizes, degree)
    results = {}
    for op in ops:
        samples = []
        for size in sizes:
            run = _collective(op, size, degree, group)
            run()  # warm-up: buffers and connections
            calls = _calls_per_sample(size)
            times = [_slowest(run, calls) for _ in range(config.repeats)]
            samples.append(times)
            log(f"{label} {op} over {degree} ranks, {_format_bytes(size)}: median "
                f"{statistics.median(times) * 1e6:.1f} us ({config.repeats} x {calls} calls)")
        results[op] = {"degree": degree, "sizes_bytes": sizes, "samples_s": samples}
    return results


def _matmul_kernels(shape: tuple[int, int, int]) -> dict[str, Callable[[], object]]:
    """torch.mm and, where oneDNN is available, the engine's prepacked linear, for x[m,k] @ w[n,k]^T."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    weight_t = weight.t().contiguous()
    out = torch.empty(m, n)
    kernels: dict[str, Callable[[], object]] = {"torch.mm": lambda: torch.mm(x, weight_t, out=out)}
    packed = pack_weight(weight)
    if packed is not None:
        kernels["onednn"] = lambda: linear(x, weight, packed=packed)
    return kernels


def _shape_name(shape: tuple[int, int, int]) -> str:
    return "x".join(str(s) for s in shape)


def _measure_matmul(config: CalibrationConfig, label: str, log: Callable[[str], None],
                    in_world: bool) -> dict[str, dict[str, float]]:
    """GFLOP/s per shape and kernel, median of the repeats; in a world, of the slowest rank."""
    rates: dict[str, dict[str, float]] = {}
    for shape in config.matmul_shapes:
        flop = 2.0 * shape[0] * shape[1] * shape[2]
        rates[_shape_name(shape)] = {}
        for kernel, run in _matmul_kernels(shape).items():
            run()  # warm-up: library initialisation and page faults
            calls = _calls_per_matmul_sample(_local_time(run, 1))
            if in_world:  # the same number of calls everywhere, so the ranks compute side by side
                agreed = torch.tensor([calls])
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                calls = int(agreed.item())
            timer = _slowest if in_world else _local_time
            seconds = statistics.median(timer(run, calls) for _ in range(config.repeats))
            rates[_shape_name(shape)][kernel] = flop / seconds / 1e9
            log(f"compute {label} {_shape_name(shape)} {kernel}: {flop / seconds / 1e9:.1f} GFLOP/s "
                f"({config.repeats} x {calls} calls)")
    return rates


def _calls_per_matmul_sample(seconds_per_call: float) -> int:
    # Ranks that share cores take turns in scheduler slices of a few ms; samples much
    # longer than a slice make them overlap, so the time shows the sharing.
    return max(1, min(256, math.ceil(MATMUL_SAMPLE_S / max(seconds_per_call, 1e-9))))


def _local_time(run: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _calibration_worker(rank: int, world_size: int, config: CalibrationConfig, result_path: str) -> None:
    threads = threads_per_rank(world_size)
    torch.set_num_threads(threads)
    topology = Topology(config.nodes, config.ranks_per_node)
    groups = build_groups(topology)
    log = _progress if rank == 0 else _quiet
    raw: dict[str, Any] = {"threads_per_rank": threads}
    if topology.ranks_per_node > 1:
        raw["intra_node"] = _time_link("intra-node", INTRA_OPS, groups.intra_node, topology.ranks_per_node,
                                       config, log)
    if topology.num_nodes > 1:
        raw["inter_node"] = _time_link("inter-node", INTER_OPS, groups.inter_node, topology.num_nodes,
                                       config, log)
    if world_size > 1:
        raw["world"] = _time_link("world", WORLD_OPS, dist.group.WORLD, world_size, config, log)
    # Every rank multiplies at once, as SPMD workers do: cores and memory bandwidth are shared.
    raw["per_rank_gflops"] = _measure_matmul(config, f"per rank ({_threads(threads)}, {world_size} ranks at once)",
                                             log, in_world=True)
    if rank == 0:
        Path(result_path).write_text(json.dumps(raw))


def measure_one_process_rate(config: CalibrationConfig, log: Callable[[str], None] = _quiet) -> dict[str, Any]:
    """GFLOP/s of this process alone with every core (run it with no world alive)."""
    cores = usable_cores()
    previous = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        rates = _measure_matmul(config, f"one process ({_threads(cores)})", log, in_world=False)
    finally:
        torch.set_num_threads(previous)
    return {"one_process_threads": cores, "one_process_gflops": rates}


# ---------------------------------------------------------------- the cluster file

def _format_bytes(size: float) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} B"


def _sig(value: float, digits: int = 6) -> float:
    return float(f"{value:.{digits}g}")


def _best_rate(rates: dict[str, dict[str, float]]) -> tuple[float, str, str]:
    """(GFLOP/s, shape, kernel) of the fastest shape and kernel."""
    return max((rate, shape, kernel) for shape, kernels in rates.items() for kernel, rate in kernels.items())


def _link_record(raw_ops: dict[str, Any], fit: dict[str, Any]) -> dict[str, Any]:
    ops = {}
    for op, raw in raw_ops.items():
        op_fit = fit["ops"][op]
        ops[op] = {
            "sizes_bytes": raw["sizes_bytes"],
            "samples_s": [[_sig(t, 4) for t in times] for times in raw["samples_s"]],
            "median_s": [_sig(statistics.median(times), 4) for times in raw["samples_s"]],
            "latency_us": _sig(op_fit["latency_s"] * 1e6, 4),
            "bandwidth_gb_s": _sig(op_fit["bandwidth_bytes_s"] / 1e9, 4),
        }
    return {
        "ranks": next(iter(raw_ops.values()))["degree"],
        "latency_us": _sig(fit["latency_s"] * 1e6, 4),
        "bandwidth_gb_s": _sig(fit["bandwidth_bytes_s"] / 1e9, 4),
        "fit_latency_us": _sig(fit["fit_latency_s"] * 1e6, 4),
        "bandwidth_from": fit["bandwidth_source"],
        "ops": ops,
    }


def build_cluster_document(raw: dict[str, Any], config: CalibrationConfig, total_memory_bytes: float) -> dict:
    """The cluster YAML (what `load_cluster_file` reads, plus `measured:`) from the world's raw samples."""
    fits = {link: fit_link(raw[link]) for link in LINKS if link in raw}
    # With one rank per node (or one node) there is no such link; both are loopback on
    # this machine, so the measured one stands in and the analyzer never prices the other.
    intra = fits.get("intra_node") or fits["inter_node"]
    inter = fits.get("inter_node") or fits["intra_node"]
    per_rank, per_rank_shape, per_rank_kernel = _best_rate(raw["per_rank_gflops"])
    one_process = _best_rate(raw["one_process_gflops"])[0]
    memory_per_rank = total_memory_bytes / config.world_size
    measured: dict[str, Any] = {
        "ranks": config.world_size,
        "threads_per_rank": raw["threads_per_rank"],
        "cores": usable_cores(),
        "repeats": config.repeats,
        "time": "slowest rank, median of the repeats; latency and bandwidth in the analyzer's Eq. 1-3 units",
    }
    for link, other in (("intra_node", "inter_node"), ("inter_node", "intra_node")):
        if link in fits:
            measured[link] = _link_record(raw[link], fits[link])
        else:
            measured[link] = {"ranks": 1, "same_as": other,
                              "why": "a group of one rank has no link; the cluster file repeats the other link"}
    if "world" in raw:
        measured["world_all_to_all"] = _link_record(raw["world"], fit_link(raw["world"]))
    measured["compute"] = {
        "dtype": "float32",
        "per_rank_gflops": _sig(per_rank, 4),
        "per_rank_best": {"shape_mkn": per_rank_shape, "kernel": per_rank_kernel},
        "one_process_gflops": _sig(one_process, 4),
        "one_process_threads": raw["one_process_threads"],
        "per_rank_by_shape": {s: {k: _sig(v, 4) for k, v in ks.items()} for s, ks in raw["per_rank_gflops"].items()},
        "one_process_by_shape": {s: {k: _sig(v, 4) for k, v in ks.items()}
                                 for s, ks in raw["one_process_gflops"].items()},
    }
    measured["memory"] = {"total_gb": _sig(total_memory_bytes / 1e9, 4),
                          "per_rank_gb": _sig(memory_per_rank / 1e9, 4)}
    return {
        "name": f"local-{config.nodes}x{config.ranks_per_node}",
        "nodes": config.nodes,
        "devices_per_node": config.ranks_per_node,
        "device_memory_gb": _sig(memory_per_rank / 1e9),
        # The fastest shape's rate: like the presets' datasheet figures, a compute roof.
        "tflops": _sig(per_rank / 1e3),
        "intra_bandwidth_gb_s": _sig(intra["bandwidth_bytes_s"] / 1e9),
        "inter_bandwidth_gb_s": _sig(inter["bandwidth_bytes_s"] / 1e9),
        "intra_latency_us": _sig(intra["latency_s"] * 1e6),
        "inter_latency_us": _sig(inter["latency_s"] * 1e6),
        **_a2a_keys(raw),
        "measured": measured,
    }


def _a2a_keys(raw: dict[str, Any]) -> dict[str, float]:
    """The world's measured all-to-all, in the units Eq. 3 prices it (a latency per round, a bandwidth)."""
    if "world" not in raw:
        return {}
    fit = fit_link(raw["world"])
    return {"a2a_latency_us": _sig(fit["latency_s"] * 1e6), "a2a_bandwidth_gb_s": _sig(fit["bandwidth_bytes_s"] / 1e9)}


def format_summary(doc: dict) -> str:
    """A short table of what was measured and what the cluster file says."""
    measured = doc["measured"]
    rows = [("link", "collective", "ranks", "latency us", "bandwidth GB/s")]
    for link, label in (("intra_node", "intra-node"), ("inter_node", "inter-node")):
        record = measured[link]
        if "same_as" in record:
            rows.append((label, "(one rank: no link)", "1", "-", "-"))
            continue
        for op, op_record in record["ops"].items():
            rows.append((label, op, str(record["ranks"]), f"{op_record['latency_us']:.1f}",
                         f"{op_record['bandwidth_gb_s']:.3g}"))
    if "world_all_to_all" in measured:
        record = measured["world_all_to_all"]
        rows.append(("world", "all_to_all", str(record["ranks"]), f"{record['latency_us']:.1f}",
                     f"{record['bandwidth_gb_s']:.3g}"))
    for short in ("intra", "inter", "a2a"):
        if f"{short}_latency_us" in doc:
            rows.append((f"{short} (file)", "", "", f"{doc[f'{short}_latency_us']:.1f}",
                         f"{doc[f'{short}_bandwidth_gb_s']:.3g}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    compute = measured["compute"]
    table.append(f"compute: {compute['per_rank_gflops']:.1f} GFLOP/s per rank "
                 f"({_threads(measured['threads_per_rank'])}, {measured['ranks']} ranks at once; "
                 f"tflops {doc['tflops']:.4g}), one process {compute['one_process_gflops']:.1f} GFLOP/s "
                 f"({_threads(compute['one_process_threads'])})")
    table.append(f"memory: {doc['device_memory_gb']:.3g} GB per rank of {measured['memory']['total_gb']:.3g} GB")
    return "\n".join(table)


def plot_links(doc: dict, png_path: str | Path) -> Path:
    """Time vs message size per collective (medians, every sample faint) with the cluster file's model lines."""
    links = [(link, doc["measured"][link]) for link in LINKS if "ops" in doc["measured"][link]]
    fig, axes = new_figure(ncols=len(links))
    for ax, (link, record) in zip(axes[0], links):
        short = "intra" if link == "intra_node" else "inter"
        model = az.Link(bandwidth=doc[f"{short}_bandwidth_gb_s"] * 1e9, latency=doc[f"{short}_latency_us"] * 1e-6)
        for i, (op, op_record) in enumerate(record["ops"].items()):
            color = f"C{i}"
            sizes = op_record["sizes_bytes"]
            for size, samples in zip(sizes, op_record["samples_s"]):
                ax.scatter([size] * len(samples), [t * 1e3 for t in samples], color=color, alpha=0.25, s=10)
            ax.plot(sizes, [t * 1e3 for t in op_record["median_s"]], "o", color=color, label=f"{op} (median)")
            grid = [sizes[0] * (sizes[-1] / sizes[0]) ** (j / 40) for j in range(41)]
            ax.plot(grid, [ANALYZER_COST[op](size, record["ranks"], model) * 1e3 for size in grid], "--",
                    color=color, label=f"{op} (fitted model)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message size, bytes (the analyzer's size)")
        ax.set_ylabel("time, ms (slowest rank)")
        ax.set_title(f"{link.replace('_', '-')}, {record['ranks']} ranks: {model.latency * 1e6:.0f} us, "
                     f"{model.bandwidth / 1e9:.3g} GB/s", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, png_path)


def png_path_for(cluster_path: str | Path) -> Path:
    return Path(cluster_path).with_suffix(".png")


def calibrate(config: CalibrationConfig, out_path: str | Path,
              log: Callable[[str], None] = _progress) -> dict:
    """Measure this machine, write the cluster YAML to `out_path` and its plot beside it; returns the YAML dict."""
    # start-up: psutil only when calibrating
    import psutil

    out_path = Path(out_path)
    log(f"starting {config.world_size} ranks ({config.nodes} nodes x {config.ranks_per_node}), "
        f"{_threads(threads_per_rank(config.world_size))} each, {config.repeats} repeats")
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        spawn_local_world(_calibration_worker, config.world_size, args=(config, str(raw_path)),
                          timeout_s=config.timeout_s)
        raw = json.loads(raw_path.read_text())
    raw.update(measure_one_process_rate(config, log))
    doc = build_cluster_document(raw, config, psutil.virtual_memory().total)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120))
    plot_links(doc, png_path_for(out_path))
    return doc


# ---------------------------------------------------------------- command line

def config_from_args(args) -> CalibrationConfig:
    sizes = tuple(parse_size(s) for s in args.sizes) if args.sizes else DEFAULT_SIZES
    shapes = tuple(parse_matmul_shape(s) for s in args.matmul_shapes) if args.matmul_shapes else DEFAULT_MATMUL_SHAPES
    out = Path(args.out)
    if out.is_dir():
        raise CalibrationError(f"--out {args.out} is a directory; give a file name such as cluster.yaml")
    if out.parent.exists() and not out.parent.is_dir():
        raise CalibrationError(f"--out {args.out}: {out.parent} is not a directory")
    return CalibrationConfig(nodes=args.nodes, ranks_per_node=args.ranks_per_node, sizes=sizes,
                             repeats=args.repeats, matmul_shapes=shapes)


def calibrate_main(args) -> int:
    try:
        config = config_from_args(args)
    except CalibrationError as e:
        print(f"meshserve plan calibrate: error: {e}", file=sys.stderr)
        return 2
    try:
        doc = calibrate(config, args.out)
    except OSError as e:
        print(f"meshserve plan calibrate: error: cannot write {args.out}: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, ProcessExitedException, ProcessRaisedException) as e:
        # The ranks have printed their tracebacks; one line says why the command stopped.
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"meshserve plan calibrate: measurement failed: {reason}", file=sys.stderr)
        return 1
    print(format_summary(doc))
    print(f"wrote {args.out} and {png_path_for(args.out)}")
    return 0
