"""The analyzer's ranking of parallel strategies against the simulator's, at world sizes nobody here can run.

For one hardware profile and world size, the analyzer (`meshserve plan`: MixServe's cost model,
meshserve/parallel/analyzer.py) prices every strategy of the grammar on a cluster made of the profile's figures (GEMM
rate, device memory, node size, the links inside and across nodes) and keeps those that fit in memory. The simulator
then serves the same workload on each of them: a colocated TE whose DP groups run meshserve's own schedulers, steps
timed by the op model (meshserve/sim/op_model.py) from the same profile. Both orders are compared by Spearman's rank
correlation, and the analyzer's first choice by its simulated throughput against the simulator's best.

The workload is a closed batch, as the analyzer's is: `batch_per_device` requests per device, all arriving at once,
of fixed prompt and output lengths. Throughput is prompt and output tokens per second per device, as the analyzer's
Eq. 11 counts them. A group's chunked-prefill budget grows with its devices (`TOKENS_PER_DEVICE`), and it holds the
KV of every request it serves (the analyzer's memory check includes that KV).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from meshserve.parallel.analyzer import Cluster, StrategyEstimate, Workload, analyze
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.sim.hardware import Hardware, HardwareError
from meshserve.sim.op_model import WEIGHT_FORMATS, MLAShape, OpStepModel, deployment_of
from meshserve.sim.run import simulate
from meshserve.sim.te import SimTE, SimTESettings
from meshserve.sim.trace import TraceRequest
from meshserve.utils.rank_stats import spearman_rank_correlation

BLOCK_SIZE = 16
TOKENS_PER_DEVICE = 4096  # a DP group's prompt tokens per step, per device it spans


@dataclass(frozen=True)
class RankingWorkload:
    batch_per_device: int = 16
    input_len: int = 1024
    output_len: int = 128

    def __post_init__(self) -> None:
        for name in ("batch_per_device", "input_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def analyzer_cluster(hardware: Hardware, world: int, weight_format: str = "int8",
                     weight_reads: bool = True) -> Cluster:
    """The analyzer's cluster of `world` devices of `hardware`: its GEMM rate for the weight format, memory, node
    size and links, the same figures the op model reads, its HBM bandwidth with `weight_reads` (the analyzer then
    prices a layer's weights read once per step; without, Eq. 4's FLOPs alone, as MixServe), and its EP
    all-to-alls as the kernels the profile measured run them: one latency a call (Table 7's dispatch barely grows
    from EP8 to EP256)."""
    per_node = hardware.value("devices_per_node")
    intra, inter = hardware.value("intra_node_link"), hardware.value("inter_node_link")
    per_node = min(per_node, world)
    if world % per_node:
        raise HardwareError(f"world {world} is not a whole number of {hardware.name} nodes of {per_node} devices")
    return Cluster(name=f"{hardware.name} x{world}", nodes=world // per_node, devices_per_node=per_node,
                   device_memory_bytes=1e9 * hardware.value("device_memory_gb"),
                   flops=1e12 * hardware.value(WEIGHT_FORMATS[weight_format][1]),
                   intra_bandwidth=1e9 * intra.gbps, inter_bandwidth=1e9 * inter.gbps,
                   intra_latency=1e-6 * intra.latency_us, inter_latency=1e-6 * inter.latency_us,
                   memory_bandwidth=1e9 * hardware.value("hbm_read_gbps") if weight_reads else None,
                   a2a_concurrent=True)


def simulate_strategy(config: Mapping, hardware: Hardware, strategy: ParallelStrategy, workload: RankingWorkload,
                      groups: int = 4, weight_format: str = "int8", seed: int = 0) -> dict:
    """Serve the workload on a colocated TE of `strategy`, simulating up to `groups` of its DP groups (each stands
    for dp / groups of them: every group carries the same work)."""
    shape = MLAShape.from_config(config)
    deployment = deployment_of(strategy, shape.experts, weight_format=weight_format)
    model = OpStepModel(config, hardware, deployment)
    simulated = min(groups, deployment.dp)
    per_group = workload.batch_per_device * deployment.attn_tp  # the world's batch over its DP groups
    length = workload.input_len + workload.output_len
    settings = SimTESettings(dp=simulated, max_num_seqs=per_group,
                             max_num_batched_tokens=TOKENS_PER_DEVICE * deployment.attn_tp,
                             max_model_len=length + BLOCK_SIZE,
                             num_kv_blocks=per_group * (-(-length // BLOCK_SIZE) + 1) + 16, block_size=BLOCK_SIZE,
                             prefix_caching=False)
    trace = [TraceRequest(0.0, workload.input_len, workload.output_len) for _ in range(simulated * per_group)]
    metrics = simulate(trace, SimTE(settings, model, seed=seed), progress=False)
    tokens = len(trace) * length * deployment.dp / simulated
    return {"tokens_per_s_per_device": tokens / metrics["virtual_s"] / deployment.devices,
            "tpot_ms": 1e3 * metrics["tpot_s"]["p50"], "ttft_ms": 1e3 * metrics["ttft_s"]["p50"],
            "steps": metrics["steps"], "wall_s": metrics["wall_s"]}


def rank_world(config: Mapping, hardware: Hardware, world: int, workload: RankingWorkload, groups: int = 4,
               weight_format: str = "int8", weight_reads: bool = True,
               progress: Callable[[int, int, StrategyEstimate], None] | None = None) -> dict:
    """Every strategy the analyzer finds fit at `world`, with its analyzer and simulated throughput and rank."""
    hardware.check_devices(world)
    cluster = analyzer_cluster(hardware, world, weight_format, weight_reads)
    estimates = analyze(config, cluster, Workload(batch=workload.batch_per_device * world,
                                                  input_len=workload.input_len, output_len=workload.output_len,
                                                  arrival_rate=0.0))
    if not estimates:
        raise HardwareError(f"no strategy of world {world} fits {hardware.name}'s memory")
    rows = []
    for i, est in enumerate(estimates):
        if progress is not None:
            progress(i, len(estimates), est)
        simulated = simulate_strategy(config, hardware, est.strategy, workload, groups, weight_format)
        rows.append({"strategy": str(est.strategy), "comm_model": est.comm_model,
                     "analyzer_tokens_per_s_per_device": est.throughput_tok_s / world,
                     "analyzer_itl_ms": 1e3 * est.itl_s, "analyzer_ttft_ms": 1e3 * est.ttft_s,
                     "analyzer_rank": i + 1, **simulated})
    by_simulation = sorted(rows, key=lambda r: -r["tokens_per_s_per_device"])
    for rank, row in enumerate(by_simulation, 1):
        row["simulated_rank"] = rank
    best, picked = by_simulation[0], rows[0]
    return {
        "world": world, "cluster": {"nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node},
        "strategies": len(rows),
        "spearman_rho": spearman_rank_correlation([r["analyzer_tokens_per_s_per_device"] for r in rows],
                                                  [r["tokens_per_s_per_device"] for r in rows]),
        "analyzer_pick": picked["strategy"], "simulated_best": best["strategy"],
        # what following the analyzer costs, by the simulator's account
        "pick_vs_best": picked["tokens_per_s_per_device"] / best["tokens_per_s_per_device"],
        "top5_overlap": len({r["strategy"] for r in rows[:5]} & {r["strategy"] for r in by_simulation[:5]}),
        "rows": rows,
    }


def world_sizes(text: str) -> list[int]:
    """`32,64,...,320`: device counts from 2 (each a whole number of the profile's nodes, checked with the
    profile)."""
    try:
        worlds = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--worlds must be comma-separated integers, got {text!r}") from None
    bad = [w for w in worlds if w < 2]
    if bad:
        raise ValueError(f"--worlds must be device counts from 2, got {bad[0]}")
    return worlds
