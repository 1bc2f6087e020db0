"""`meshserve bench a2e`: the latency of A2E and E2A (meshserve/moe/a2e.py, xdeepserve §3.3) per direction,
against the tokens per attention rank and the number of expert ranks, routed directly and in two stages.

For each count of expert ranks in `--expert-ranks`, one local gloo world of `--attention` attention ranks and
that many expert ranks is started (one torch thread per rank). For each tokens-per-rank figure of `--tokens`
and each routing, every step sends each attention rank's tokens (random top-k routing over `--experts`
routed experts) to the expert ranks and back. The expert ranks' compute is a weighted copy of each row, so
what is timed is the transfer:

- A2E: from the step's start (the last rank to leave a barrier: no rank's part can finish before every rank's
  has begun) until the last expert rank holds all of its rows (after the relays' forward, two-stage);
- E2A: from the last expert rank's end of compute until the last attention rank holds its summed outputs.

Timestamps come from the host's monotonic clock, which every process of the world shares. The medians over
`--steps` steps are reported, with two-stage against direct for each point. Writes the JSON and a PNG.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from meshserve.bench.deployment_load import log, one_line_errors, run_bench_cli
from meshserve.utils import report

PROG = "meshserve bench a2e"
LOG_PREFIX = "bench a2e"
DEFAULT_JSON = "bench-results/a2e.json"
ROUTINGS = ("direct", "two-stage")
_FULL = {"attention": 4, "expert_ranks": (2, 4), "tokens": (8, 32, 96), "steps": 20}
_QUICK = {"attention": 2, "expert_ranks": (2,), "tokens": (8,), "steps": 3}
WORLD_TIMEOUT_S = 900.0


def add_a2e_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--attention", type=int, help="attention ranks (default: 4; --quick: 2)")
    parser.add_argument("--expert-ranks", type=int, nargs="+",
                        help="expert rank counts, one world each (default: 2 4; --quick: 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2,
                        help="expert ranks per node, behind one relay each (two-stage; default: 2)")
    parser.add_argument("--tokens", type=int, nargs="+",
                        help="tokens per attention rank (default: 8 32 96; --quick: 8)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default: 1024)")
    parser.add_argument("--experts", type=int, default=32, help="routed experts (default: 32)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (default: 8)")
    parser.add_argument("--steps", type=int, help="timed steps per point (default: 20; --quick: 3)")
    parser.add_argument("--int8", action="store_true", help="INT8 rows attention -> experts")
    parser.add_argument("--quick", action="store_true", help="the smallest run (for tests)")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"result file; a PNG with the same name is written next to it (default: {DEFAULT_JSON})")
    parser.set_defaults(func=a2e_main)


@dataclasses.dataclass(frozen=True)
class A2ESettings:
    attention: int
    expert_ranks: tuple[int, ...]
    ranks_per_node: int
    tokens: tuple[int, ...]
    hidden: int
    experts: int
    top_k: int
    steps: int
    int8: bool
    json_path: str


def settings_from_args(args: argparse.Namespace) -> A2ESettings:
    base = _QUICK if args.quick else _FULL
    pick = {key: tuple(getattr(args, key)) if isinstance(getattr(args, key), list) else getattr(args, key)
            for key in base}
    sizes = {key: base[key] if value is None else value for key, value in pick.items()}
    for key in ("attention", "steps"):
        if sizes[key] < 1:
            raise ValueError(f"--{key} must be at least 1, got {sizes[key]}")
    if any(t < 1 for t in sizes["tokens"]):
        raise ValueError("--tokens must all be at least 1")
    for count in sizes["expert_ranks"]:
        if count < 1 or count % args.ranks_per_node:
            raise ValueError(f"--expert-ranks {count} is not a whole number of nodes of --ranks-per-node "
                             f"{args.ranks_per_node}")
        if args.experts % count:
            raise ValueError(f"--experts {args.experts} do not split evenly over {count} expert ranks")
    if args.hidden < 1 or not 1 <= args.top_k <= args.experts:
        raise ValueError(f"--hidden must be at least 1 and --top-k between 1 and --experts ({args.experts})")
    return A2ESettings(ranks_per_node=args.ranks_per_node, hidden=args.hidden, experts=args.experts,
                       top_k=args.top_k, int8=args.int8, json_path=args.json, **sizes)


def a2e_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_a2e_benchmark, (OSError, RuntimeError, TimeoutError),
                         _report)


# ---------------------------------------------------------------- the run
def run_a2e_benchmark(settings: A2ESettings) -> dict:
    from meshserve.parallel.topology import spawn_local_world  # torch: only when the benchmark runs

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_experts_ranks in settings.expert_ranks:
            world = settings.attention + num_experts_ranks
            log(LOG_PREFIX, f"{settings.attention} attention + {num_experts_ranks} expert ranks: starting")
            out = Path(tmp) / f"rows-{num_experts_ranks}.json"
            spawn_local_world(_world, world, args=(settings, num_experts_ranks, str(out)),
                              timeout_s=WORLD_TIMEOUT_S)
            rows.extend(json.loads(out.read_text())["rows"])
    for row in rows:
        direct = next(r for r in rows if r["expert_ranks"] == row["expert_ranks"] and r["tokens"] == row["tokens"]
                      and r["routing"] == "direct")
        row["a2e_vs_direct"] = row["a2e_ms"] / max(1e-9, direct["a2e_ms"])
        row["e2a_vs_direct"] = row["e2a_ms"] / max(1e-9, direct["e2a_ms"])
    return {"config": {k: v for k, v in dataclasses.asdict(settings).items() if k != "json_path"}, "rows": rows}


def _world(rank: int, world: int, settings: A2ESettings, num_expert_ranks: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from meshserve.moe.a2e import A2EComm, A2ELayout

    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
    torch.set_num_threads(1)  # the ranks share the host's cores
    layout = A2ELayout(attention_ranks=tuple(range(settings.attention)),
                       expert_ranks=tuple(range(settings.attention, world)), num_experts=settings.experts,
                       top_k=settings.top_k, ranks_per_node=settings.ranks_per_node)
    node_groups = [dist.new_group(list(layout.node_members(node))) for node in range(layout.num_nodes)]
    rows = []
    for tokens in settings.tokens:
        for routing in ROUTINGS:
            comm = A2EComm(dist.group.WORLD, layout, settings.hidden, tokens, torch.float32,
                           two_stage=routing == "two-stage", node_groups=node_groups, int8=settings.int8)
            gen = torch.Generator().manual_seed(rank)
            hidden = torch.randn(tokens, settings.hidden, generator=gen)
            weights, ids = torch.softmax(torch.randn(tokens, settings.experts, generator=gen), -1).topk(
                settings.top_k, dim=-1)
            a2e, e2a = [], []
            for step in range(settings.steps + 2):  # two untimed steps first
                stamps = _step(comm, dist, torch, hidden, ids, weights)
                table = torch.zeros(world * 4, dtype=torch.float64)
                all_gather_single(table, torch.tensor(stamps, dtype=torch.float64))
                if step >= 2:
                    start, ready, computed, done = table.view(world, 4).unbind(1)
                    a2e.append(1e3 * (ready.max() - start.max()).item())
                    e2a.append(1e3 * (done.max() - computed.max()).item())
            rows.append({"expert_ranks": len(layout.expert_ranks), "tokens": tokens, "routing": routing,
                         "a2e_ms": statistics.median(a2e), "e2a_ms": statistics.median(e2a),
                         "a2e_steps_ms": a2e, "e2a_steps_ms": e2a})
            if rank == 0:
                log(LOG_PREFIX, f"{len(layout.expert_ranks)} expert ranks, {tokens} tokens, {routing}: A2E "
                                f"{rows[-1]['a2e_ms']:.3f} ms, E2A {rows[-1]['e2a_ms']:.3f} ms")
    if rank == 0:
        report.write_json(out_path, {"rows": rows})


def _step(comm, dist, torch, hidden, ids, weights) -> list[float]:
    """One A2E + E2A; this rank's [start, rows ready, compute done, outputs summed] (0 where not its part)."""
    stamps = [0.0, 0.0, 0.0, 0.0]

    def compute(rows, row_ids, row_weights):
        stamps[1] = time.perf_counter()
        out = rows * row_weights.sum(dim=1, keepdim=True)  # a stand-in for the experts: the transfer is timed
        stamps[2] = time.perf_counter()
        return out

    dist.barrier()
    stamps[0] = time.perf_counter()
    if comm.is_attention:
        comm.e2a(comm.a2e(hidden, ids, weights))
        stamps[3] = time.perf_counter()
    else:
        comm.serve_layer(compute)
        if not stamps[1]:  # no row came here: ready (and done) when its share of the exchange was
            stamps[1] = stamps[2] = time.perf_counter()
    return stamps


# ---------------------------------------------------------------- the report
def table_lines(result: dict) -> list[str]:
    lines = [f"{'expert ranks':>12}{'tokens':>8} {'routing':<11}{'A2E ms':>9}{'vs direct':>10}{'E2A ms':>9}"
             f"{'vs direct':>10}"]
    for row in result["rows"]:
        lines.append(f"{row['expert_ranks']:>12}{row['tokens']:>8} {row['routing']:<11}{row['a2e_ms']:>9.3f}"
                     f"{row['a2e_vs_direct']:>10.2f}{row['e2a_ms']:>9.3f}{row['e2a_vs_direct']:>10.2f}")
    config = result["config"]
    lines.append(f"(medians over {config['steps']} steps; {config['attention']} attention ranks; hidden "
                 f"{config['hidden']}, {config['experts']} experts, top-{config['top_k']}; two-stage: "
                 f"{config['ranks_per_node']} expert ranks per node behind a relay; "
                 f"{'INT8' if config['int8'] else 'fp32'} rows; gloo on this host's CPU cores)")
    return lines


def plot_a2e(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2)
    for ax, key, title in ((axes[0][0], "a2e_ms", "A2E (attention -> experts)"),
                           (axes[0][1], "e2a_ms", "E2A (experts -> attention)")):
        for count in sorted({r["expert_ranks"] for r in result["rows"]}):
            for routing, style in zip(ROUTINGS, ("-o", "--s")):
                rows = [r for r in result["rows"] if r["expert_ranks"] == count and r["routing"] == routing]
                ax.plot([r["tokens"] for r in rows], [r[key] for r in rows], style,
                        label=f"{count} expert ranks, {routing}")
        ax.set_xlabel("tokens per attention rank")
        ax.set_ylabel("ms (median)")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    return report.save_figure(fig, path)


def _report(settings: A2ESettings, result: dict) -> None:
    report.publish(settings.json_path, result, plot_a2e, table_lines(result))
