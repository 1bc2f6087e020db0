"""`meshserve bench moe-comm`: one MoE layer's dispatch + experts + combine on 4 local ranks (2 nodes x 2).

Three layouts of the same layer (MixServe Fig. 12 ablation):
- `ep`: pure expert parallelism over the 4 ranks; every rank holds `--tokens` tokens;
- `hybrid_sync`: MoE TP inside a node, EP across nodes; every node holds the tokens of
  its ranks (2 x `--tokens`), so the global batch is the same; collectives one after another;
- `hybrid_fused`: the same with the fused pairwise schedule (MixServe Alg. 1 and 2).
Per-step latency is the slowest rank's; medians and p90 go to the JSON, a bar chart to a PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshserve.moe.comm import (
    EPDispatcher,
    HybridMoEComm,
    moe_layer_reference,
    run_local_experts,
    shard_expert_weights,
)
from meshserve.parallel.topology import Topology, build_groups, spawn_local_world

NUM_NODES = 2
RANKS_PER_NODE = 2
MODES = ("ep", "hybrid_sync", "hybrid_fused")
WORLD_TIMEOUT_S = 900.0


def add_moe_comm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank (default: 64)")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (default: 768)")
    parser.add_argument("--intermediate", type=int, default=256, help="expert intermediate size (default: 256)")
    parser.add_argument("--experts", type=int, default=32, help="routed experts (default: 32)")
    parser.add_argument("--top-k", dest="top_k", type=int, default=4, help="experts per token (default: 4)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per layout (default: 3)")
    parser.add_argument("--int8", action="store_true", help="INT8 dispatch for the pure EP layout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")


def _validate(args: argparse.Namespace) -> str | None:
    world = NUM_NODES * RANKS_PER_NODE
    for name in ("tokens", "hidden", "intermediate", "experts", "top_k", "steps"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.warmup < 0:
        return "--warmup must be >= 0"
    if args.experts % world:
        return f"--experts must be a multiple of {world} (the EP ranks)"
    if args.top_k > args.experts:
        return "--top-k must not exceed --experts"
    if args.hidden % RANKS_PER_NODE or args.intermediate % RANKS_PER_NODE:
        return f"--hidden and --intermediate must be multiples of {RANKS_PER_NODE} (ranks per node)"
    return None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _routing(num_tokens: int, experts: int, top_k: int, hidden: int, gen: torch.Generator):
    x = torch.randn(num_tokens, hidden, generator=gen)
    scores = torch.randn(num_tokens, experts, generator=gen)
    weights, ids = torch.softmax(scores, dim=-1).topk(top_k, dim=-1)
    return x, ids, weights / weights.sum(dim=-1, keepdim=True)


def _timed(fn, steps: int, warmup: int, label: str, rank: int) -> list[float]:
    """Per-step latency of the slowest rank, in ms."""
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(elapsed.item() * 1e3)
            if rank == 0 and (len(times) == steps or len(times) % max(1, steps // 4) == 0):
                print(f"[moe-comm] {label}: step {len(times)}/{steps}, median so far "
                      f"{statistics.median(times):.2f} ms", flush=True)
    return times


def _bench_worker(rank: int, world: int, config: dict, result_path: str) -> None:
    torch.set_num_threads(1)  # 4 ranks share the host's cores
    topo = Topology(NUM_NODES, RANKS_PER_NODE)
    groups = build_groups(topo)
    node, local = topo.node_of(rank), topo.local_rank(rank)
    t, h, e, k = config["tokens"], config["hidden"], config["experts"], config["top_k"]
    gen = torch.Generator().manual_seed(config["seed"])
    w13 = torch.randn(e, 2 * config["intermediate"], h, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, config["intermediate"], generator=gen) * config["intermediate"] ** -0.5
    node_gen = torch.Generator().manual_seed(config["seed"] + 1 + node)
    node_x, node_ids, node_w = _routing(t * RANKS_PER_NODE, e, k, h, node_gen)  # the node's batch
    mine = slice(local * t, (local + 1) * t)
    x, ids, w = node_x[mine], node_ids[mine], node_w[mine]  # this rank's share for pure EP
    results = {}

    ep = EPDispatcher(dist.group.WORLD, e, k, h, t, torch.float32, int8=config["int8"])
    ep_w13, ep_w2 = shard_expert_weights(w13, w2, ep.first_expert, ep.experts_per_rank)

    def ep_step():
        recv, recv_ids, handle = ep.dispatch(x, ids)
        return ep.combine(run_local_experts(recv, recv_ids, ep_w13, ep_w2, ep.first_expert), handle, w)

    error = (ep_step() - moe_layer_reference(x, ids, w, w13, w2)).abs().max()
    results["ep"] = (_timed(ep_step, config["steps"], config["warmup"], "ep", rank), error)

    shard = slice(local * h // RANKS_PER_NODE, (local + 1) * h // RANKS_PER_NODE)
    node_x_shard = node_x[:, shard].contiguous()
    node_expected = moe_layer_reference(node_x, node_ids, node_w, w13, w2)
    for mode, fused in (("hybrid_sync", False), ("hybrid_fused", True)):
        comm = HybridMoEComm(groups, e, k, h, fused=fused)
        tp_w13, tp_w2 = shard_expert_weights(w13, w2, comm.first_expert, comm.experts_per_node, local,
                                             RANKS_PER_NODE)

        def hybrid_step(comm=comm, tp_w13=tp_w13, tp_w2=tp_w2):
            recv, recv_ids, handle = comm.dispatch(node_x_shard, node_ids)
            return comm.combine(run_local_experts(recv, recv_ids, tp_w13, tp_w2, comm.first_expert), handle, node_w)

        error = (hybrid_step() - node_expected).abs().max()
        results[mode] = (_timed(hybrid_step, config["steps"], config["warmup"], mode, rank), error)

    errors = torch.tensor([results[m][1].item() for m in MODES], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    if rank == 0:
        payload = {m: {"steps_ms": results[m][0], "max_abs_err_vs_reference": errors[i].item()}
                   for i, m in enumerate(MODES)}
        Path(result_path).write_text(json.dumps(payload))


def _summarise(raw: dict, config: dict) -> dict:
    modes = {}
    for mode in MODES:
        steps = raw[mode]["steps_ms"]
        modes[mode] = {
            "median_ms": statistics.median(steps),
            "p90_ms": _percentile(steps, 0.9),
            "mean_ms": statistics.fmean(steps),
            "steps_ms": steps,
            "max_abs_err_vs_reference": raw[mode]["max_abs_err_vs_reference"],
        }
    base = modes["ep"]["median_ms"]
    for mode in MODES:
        modes[mode]["median_ratio_vs_ep"] = modes[mode]["median_ms"] / base
    return {
        "benchmark": "moe-comm",
        "topology": {"num_nodes": NUM_NODES, "ranks_per_node": RANKS_PER_NODE},
        "backend": "gloo",
        "device": "cpu",
        "config": config,
        "note": "per-step latency = slowest rank; ep: tokens per rank; hybrid: tokens x ranks_per_node per node",
        "modes": modes,
    }


def _plot(summary: dict, png_path: Path) -> None:
    # start-up: matplotlib only when plotting
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes its backend on import

    modes = summary["modes"]
    medians = [modes[m]["median_ms"] for m in MODES]
    p90 = [modes[m]["p90_ms"] for m in MODES]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(MODES, medians, color=["#888888", "#4c72b0", "#dd8452"],
                  yerr=[[0] * len(MODES), [max(0.0, p - m) for p, m in zip(p90, medians)]], capsize=6)
    for bar, mode in zip(bars, MODES):
        ax.annotate(f"{modes[mode]['median_ratio_vs_ep']:.2f}x vs ep",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2), ha="center", va="center",
                    color="white", fontweight="bold")
    cfg = summary["config"]
    ax.set_ylabel("MoE layer step latency, ms (median, whisker p90)")
    ax.set_title(f"dispatch+experts+combine, {NUM_NODES} nodes x {RANKS_PER_NODE} ranks\n"
                 f"T={cfg['tokens']}/rank H={cfg['hidden']} E={cfg['experts']} k={cfg['top_k']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def moe_comm_main(args: argparse.Namespace) -> int:
    problem = _validate(args)
    if problem:
        print(f"meshserve bench moe-comm: {problem}")
        return 2
    config = {name: getattr(args, name) for name in
              ("tokens", "hidden", "intermediate", "experts", "top_k", "steps", "warmup", "int8", "seed")}
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[moe-comm] starting {NUM_NODES * RANKS_PER_NODE} ranks ({NUM_NODES} nodes x {RANKS_PER_NODE}), "
          f"layouts: {', '.join(MODES)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        spawn_local_world(_bench_worker, NUM_NODES * RANKS_PER_NODE, args=(config, str(raw_path)),
                          timeout_s=WORLD_TIMEOUT_S)
        raw = json.loads(raw_path.read_text())
    summary = _summarise(raw, config)
    json_path.write_text(json.dumps(summary, indent=2))
    png_path = json_path.with_suffix(".png")
    _plot(summary, png_path)
    for mode in MODES:
        r = summary["modes"][mode]
        print(f"{mode:>13}: median {r['median_ms']:8.2f} ms  p90 {r['p90_ms']:8.2f} ms  "
              f"x{r['median_ratio_vs_ep']:.2f} vs ep  (max |err| vs reference {r['max_abs_err_vs_reference']:.1e})")
    print(f"[moe-comm] wrote {json_path} and {png_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench moe-comm", description=__doc__.splitlines()[0])
    add_moe_comm_arguments(parser)
    return moe_comm_main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
