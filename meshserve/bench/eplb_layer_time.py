"""Measured part of `meshserve bench eplb` (`--layer-time`, on by default): one MoE layer's step time
before and after rebalancing.

One MoE layer (routed experts only) runs on 4 local gloo ranks under pure EP
(`attn=TP1+DP4 moe=TP1+EP4`) with skewed routing, for several placements:
- `default`: the contiguous placement, no redundant slots (the engine without EPLB);
- `redundant R=r`: the planner's `redundant` plan with r redundant slots per rank
  (primaries fixed, every redundant slot filled: what the engine applies live);
- `full R=r`: the planner's `full` plan (every slot planned), loaded into the slots
  directly, as the engine applies a placement before serving;
- `live k/n R=r` (largest r): the same plan reached while serving (meshserve/moe/live_moves.py),
  timed as each of its n rounds loads: the placement before the round with the round's
  changing slots disabled, which is what a step sees meanwhile.

Routing: expert popularity is the synthetic load generator's Zipf shape (the hottest
expert `hot_ratio` x the mean popularity) over a seeded random expert order; each
token draws its top-k ids from it without replacement (so no expert can be picked
by more than every token: the realised hottest/mean is at most experts / top-k).
Two windows of `batches` steps are drawn, the same on every run: the planner plans
from the first (the "recorded" load) and the layer is timed on the second.

A step is dispatch + experts + combine, started after a barrier; its time is the
slowest rank's. Placements are timed interleaved (one step each, round robin, the
order rotating) so that machine noise spreads over all of them; warm-up steps are
not timed. Each rank also reports the token-rows its experts processed and the time
they took, as wall time and as the CPU time of its thread (one torch thread per rank):
where ranks share cores the wall time includes waiting for a core, the CPU time does
not, so the CPU time shows the compute imbalance a host with a core per rank would see.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from meshserve.bench.eplb_layer_options import STRATEGY, WORLD_SIZE
from meshserve.moe.balance import balancedness
from meshserve.moe.eplb import plan_redundancy
from meshserve.moe.live_moves import align_to_current, move_rounds
from meshserve.moe.placement import EMPTY, PlacementShape
from meshserve.moe.runtime import MoERuntime
from meshserve.moe.slots import SlotMap, changed_slots
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import spawn_local_world
from meshserve.utils import report

RECORD_WINDOW, TIMED_WINDOW = 0, 1
WORLD_TIMEOUT_S = 900.0


# ---------------------------------------------------------------- routing and weights (same in every process)

def popularity(config: dict) -> torch.Tensor:
    """Per logical expert: the Zipf weight of its popularity rank, ranks in a seeded random expert order."""
    experts = config["experts"]
    order = np.random.default_rng(config["seed"]).permutation(experts)
    weights = np.empty(experts)
    weights[order] = np.arange(1, experts + 1, dtype=np.float64) ** -config["zipf_exponent"]
    return torch.tensor(weights / weights.sum(), dtype=torch.float64)


def routed_batch(config: dict, probs: torch.Tensor, window: int, rank: int, batch: int):
    """(hidden [T, H], topk ids [T, K], topk weights [T, K]) of one rank's step; ids without replacement."""
    gen = torch.Generator().manual_seed(((config["seed"] * 7 + window) * 1009 + rank) * 10007 + batch)
    tokens = config["tokens"]
    ids = torch.multinomial(probs.expand(tokens, -1), config["top_k"], replacement=False, generator=gen)
    hidden = torch.randn(tokens, config["hidden"], generator=gen)
    weights = torch.softmax(torch.randn(tokens, config["top_k"], generator=gen), dim=-1)
    return hidden, ids, weights


def window_counts(config: dict, probs: torch.Tensor, window: int) -> list[list[int]]:
    """counts[step][expert] over all ranks, for each step of a window."""
    counts = []
    for batch in range(config["batches"]):
        ids = torch.cat([routed_batch(config, probs, window, rank, batch)[1] for rank in range(WORLD_SIZE)])
        counts.append(torch.bincount(ids.reshape(-1), minlength=config["experts"]).tolist())
    return counts


def expert_weights(config: dict, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's w13 [2I, H] (gate rows then up rows) and w2 [H, I], seeded by its id."""
    gen = torch.Generator().manual_seed(config["seed"] * 100003 + expert)
    hidden, inter = config["hidden"], config["intermediate"]
    w13 = torch.randn(2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(hidden, inter, generator=gen) * inter ** -0.5
    return w13, w2


def placements(config: dict, planned_from: list[list[int]]) -> list[dict]:
    """The default placement, then each redundant and full plan made from the recorded window's counts."""
    experts = config["experts"]
    plans = [{"name": "default", "mode": None, "redundant_per_rank": 0,
              "slots": PlacementShape(experts, WORLD_SIZE, 0).default_slots()}]
    for mode in ("redundant", "full"):
        for r in config["redundant"]:
            if mode == "redundant" and r == 0:
                continue  # nothing to plan: the default placement
            shape = PlacementShape(experts, WORLD_SIZE, r)
            slots = plan_redundancy(planned_from, shape, mode=mode)
            plans.append({"name": f"{mode} R={r}", "mode": mode, "redundant_per_rank": r, "slots": slots})
    return plans + live_rounds(config, plans[-1])


def live_rounds(config: dict, full: dict) -> list[dict]:
    """The last full plan reached while serving from the default placement: per round, the slots before it with its
    changing slots disabled."""
    r = full["redundant_per_rank"]
    if full["mode"] != "full" or r == 0:
        return []
    shape = PlacementShape(config["experts"], WORLD_SIZE, r)
    before = shape.default_slots()
    rounds = move_rounds(before, align_to_current(shape, before, full["slots"]))
    out = []
    for number, after in enumerate(rounds, 1):
        out.append({"name": f"live {number}/{len(rounds)} R={r}", "mode": "live", "redundant_per_rank": r,
                    "slots": before, "disabled": changed_slots(before, after)})
        before = after
    return out


# ---------------------------------------------------------------- one rank

class _ExpertProbe:
    """Token-rows, wall seconds and thread CPU seconds of this rank's expert compute, per step
    (forward hooks on the expert weights)."""

    def __init__(self, experts: torch.nn.Module) -> None:
        self.rows, self.seconds, self.cpu_seconds = 0, 0.0, 0.0
        self._start = self._cpu_start = 0.0
        experts.register_forward_pre_hook(self._before)
        experts.register_forward_hook(self._after)

    def _before(self, module, args) -> None:
        self.rows += args[0].shape[0]
        self._start, self._cpu_start = time.perf_counter(), time.thread_time()

    def _after(self, module, args, out) -> None:
        self.seconds += time.perf_counter() - self._start
        self.cpu_seconds += time.thread_time() - self._cpu_start

    def take(self) -> tuple[int, float, float]:
        taken = (self.rows, self.seconds, self.cpu_seconds)
        self.rows, self.seconds, self.cpu_seconds = 0, 0.0, 0.0
        return taken


def _build_layer(ctx: ParallelContext, slots: list[int], config: dict, disabled: list[int] = ()):
    """A runtime and expert weights holding this rank's slots of `slots`, routed by their slot map (without the
    `disabled` slots)."""
    runtime = MoERuntime(ctx, config["experts"], config["top_k"], config["hidden"], torch.float32)
    experts = runtime.make_weights(config["intermediate"])
    for local in range(experts.num_slots):
        expert = slots[experts.first_slot + local]
        if expert == EMPTY:
            experts.clear_slot(local)
        else:
            experts.write_slot(local, expert, *expert_weights(config, expert))
    experts.pack_weights()
    default = PlacementShape(config["experts"], WORLD_SIZE, ctx.redundant_experts_per_rank).default_slots()
    if slots != default or ctx.redundant_experts_per_rank:  # R = 0 with the default slots: no mapping, as served
        runtime.slot_map = SlotMap.from_slots(slots, config["experts"], disabled)
    return runtime, experts, _ExpertProbe(experts)


def _worker(rank: int, world: int, config: dict, plans: list[dict], result_path: str) -> None:
    torch.set_num_threads(1)  # 4 ranks share the host's cores
    strategy = ParallelStrategy.parse(STRATEGY)
    contexts = {r: ParallelContext.build(strategy, max_tokens_per_step=config["tokens"], redundant_experts_per_rank=r)
                for r in sorted({plan["redundant_per_rank"] for plan in plans})}
    layers = [_build_layer(contexts[plan["redundant_per_rank"]], plan["slots"], config, plan.get("disabled", ()))
              for plan in plans]
    probs = popularity(config)
    batches = [routed_batch(config, probs, TIMED_WINDOW, rank, b) for b in range(config["batches"])]

    def run(index: int, batch: int) -> torch.Tensor:
        runtime, experts, _ = layers[index]
        return runtime(*batches[batch % len(batches)], experts)

    # every placement computes the same layer: its output against the default placement's
    reference = run(0, 0).clone()
    diffs = torch.tensor([(run(i, 0) - reference).abs().max().item() for i in range(len(plans))], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    for i in range(len(plans)):
        for step in range(config["warmup"]):
            run(i, step)
    for _, _, probe in layers:
        probe.take()

    steps, count = config["steps"], len(plans)
    elapsed = torch.zeros(count, steps, dtype=torch.float64)
    rows = torch.zeros(count, steps, dtype=torch.float64)
    expert_s = torch.zeros(count, steps, dtype=torch.float64)
    expert_cpu_s = torch.zeros(count, steps, dtype=torch.float64)
    for step in range(steps):
        for j in range(count):
            i = (j + step) % count  # rotate the order so no placement always runs first
            dist.barrier()
            start = time.perf_counter()
            run(i, step)
            elapsed[i, step] = time.perf_counter() - start
            rows[i, step], expert_s[i, step], expert_cpu_s[i, step] = layers[i][2].take()
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
    gathered = {}
    for name, local in (("rows", rows), ("expert_ms", expert_s * 1e3), ("expert_cpu_ms", expert_cpu_s * 1e3)):
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        gathered[name] = [part.tolist() for part in parts]  # [rank][placement][step]
    if rank == 0:
        Path(result_path).write_text(json.dumps({"steps_ms": (elapsed * 1e3).tolist(), **gathered,
                                                 "max_abs_diff_vs_default": diffs.tolist()}))


# ---------------------------------------------------------------- the benchmark

def run_layer_time(config: dict, progress: bool = True) -> dict:
    """Plan from the recorded window, time every placement on the timed one; the `layer_time` JSON section."""
    probs = popularity(config)
    planned_from = window_counts(config, probs, RECORD_WINDOW)
    timed_counts = window_counts(config, probs, TIMED_WINDOW)
    plans = placements(config, planned_from)
    if progress:
        print(f"[eplb] layer time: {WORLD_SIZE} ranks ({STRATEGY}), placements: "
              f"{', '.join(plan['name'] for plan in plans)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        spawn_local_world(_worker, WORLD_SIZE, args=(config, plans, str(raw_path)), timeout_s=WORLD_TIMEOUT_S)
        raw = json.loads(raw_path.read_text())
    if progress:
        print(f"[eplb] layer time: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    totals = np.asarray(timed_counts, dtype=np.float64).sum(axis=0)
    return {
        "config": config,
        "definitions": {
            "step_ms": "dispatch + experts + combine of one step, the slowest rank's, after a barrier",
            "ratio_vs_default": "median step time / the default placement's median step time, same run",
            "rows_per_rank": "token-rows each rank's experts processed, mean per step",
            "expert_ms_per_rank": "each rank's expert compute wall time, median per step",
            "expert_cpu_ms_per_rank": "each rank's expert compute CPU time (its thread's), median per step; "
                                      "excludes waiting for a core where ranks share cores",
            "planner_balancedness": "mean/max device load the planner's load model predicts on the timed window",
        },
        "routing": {"hottest_over_mean": float(totals.max() / totals.mean()),
                    "hottest_popularity_over_mean": float(probs.max() * config["experts"])},
        "placements": summarise(raw, plans, timed_counts),
    }


def summarise(raw: dict, plans: list[dict], timed_counts: list[list[int]]) -> list[dict]:
    out = []
    base = statistics.median(raw["steps_ms"][0])
    for i, plan in enumerate(plans):
        steps = raw["steps_ms"][i]
        rows = [statistics.fmean(per_rank[i]) for per_rank in raw["rows"]]
        step_max_rows = [max(per_rank[i][s] for per_rank in raw["rows"]) for s in range(len(steps))]
        expert_ms = [statistics.median(per_rank[i]) for per_rank in raw["expert_ms"]]
        expert_cpu_ms = [statistics.median(per_rank[i]) for per_rank in raw["expert_cpu_ms"]]
        mean_rows = statistics.fmean(rows)
        median = statistics.median(steps)
        out.append({
            "name": plan["name"], "mode": plan["mode"], "redundant_per_rank": plan["redundant_per_rank"],
            "median_ms": median, "p90_ms": report.percentile(steps, 90), "mean_ms": statistics.fmean(steps),
            "ratio_vs_default": median / base,
            "rows_per_rank": rows, "max_rows": max(rows), "mean_rows": mean_rows,
            "max_over_mean_rows": max(rows) / mean_rows if mean_rows else 1.0,
            "step_max_rows": statistics.fmean(step_max_rows),
            "expert_ms_per_rank": expert_ms, "expert_ms_busiest": max(expert_ms),
            "expert_cpu_ms_per_rank": expert_cpu_ms, "expert_cpu_ms_busiest": max(expert_cpu_ms),
            "expert_cpu_ms_total": sum(expert_cpu_ms),
            "planner_balancedness": balancedness(_routed_slots(plan), timed_counts, WORLD_SIZE),
            "max_abs_diff_vs_default": raw["max_abs_diff_vs_default"][i],
            "steps_ms": steps, "slots": plan["slots"], "disabled": plan.get("disabled", []),
        })
    return out


def _routed_slots(plan: dict) -> list[int]:
    off = set(plan.get("disabled", ()))
    return [EMPTY if slot in off else expert for slot, expert in enumerate(plan["slots"])]


def summary_lines(section: dict) -> list[str]:
    cfg = section["config"]
    lines = [f"layer time: {cfg['strategy']}, {cfg['experts']} experts top-{cfg['top_k']}, hidden {cfg['hidden']}, "
             f"intermediate {cfg['intermediate']}, {cfg['tokens']} tokens per rank, realised hottest expert "
             f"{section['routing']['hottest_over_mean']:.1f}x the mean; median of {cfg['steps']} steps",
             "| placement | median ms | p90 ms | vs default | rows per rank max / mean | "
             "expert ms, busiest rank: wall / CPU | expert CPU ms, all ranks |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in section["placements"]:
        lines.append(f"| {p['name']} | {p['median_ms']:.2f} | {p['p90_ms']:.2f} | {p['ratio_vs_default']:.2f}x | "
                     f"{p['max_rows']:.0f} / {p['mean_rows']:.0f} ({p['max_over_mean_rows']:.2f}) | "
                     f"{p['expert_ms_busiest']:.2f} / {p['expert_cpu_ms_busiest']:.2f} | "
                     f"{p['expert_cpu_ms_total']:.2f} |")
    live = [p for p in section["placements"] if p["mode"] == "live"]
    if live:
        full = next(p for p in section["placements"] if p["name"] == f"full R={live[0]['redundant_per_rank']}")
        lines.append(f"live move to {full['name']} in {len(live)} rounds: step median while a round loads "
                     f"{min(p['median_ms'] for p in live):.2f}-{max(p['median_ms'] for p in live):.2f} ms "
                     f"({min(p['ratio_vs_default'] for p in live):.2f}-{max(p['ratio_vs_default'] for p in live):.2f}x "
                     f"the default), {full['median_ms']:.2f} ms ({full['ratio_vs_default']:.2f}x) once moved")
    return lines


def plot_row(section: dict, axes) -> None:
    """Two panels: median step time per placement (ratio to the default on each bar); rows per rank."""
    placements_ = section["placements"]
    names = [p["name"] for p in placements_]
    ax = axes[0]
    medians = [p["median_ms"] for p in placements_]
    whiskers = [max(0.0, p["p90_ms"] - p["median_ms"]) for p in placements_]
    bars = ax.bar(range(len(names)), medians, yerr=[[0] * len(names), whiskers], capsize=4,
                  color=[f"C{i}" for i in range(len(names))])
    for bar, p in zip(bars, placements_):
        ax.annotate(f"{p['ratio_vs_default']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2),
                    ha="center", va="center", color="white", fontweight="bold", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("MoE layer step, ms (median, whisker p90)")
    cfg = section["config"]
    ax.set_title(f"{cfg['strategy']}: E={cfg['experts']} k={cfg['top_k']} H={cfg['hidden']} "
                 f"T={cfg['tokens']}/rank", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax = axes[1]
    width = 0.8 / len(names)
    for i, p in enumerate(placements_):
        ranks = range(len(p["rows_per_rank"]))
        ax.bar([r + (i - (len(names) - 1) / 2) * width for r in ranks], p["rows_per_rank"], width,
               color=f"C{i}", label=f"{p['name']} (max/mean {p['max_over_mean_rows']:.2f})")
    ax.set_xticks(range(WORLD_SIZE), [f"rank {r}" for r in range(WORLD_SIZE)])
    ax.set_ylabel("token-rows per step (mean)")
    ax.set_title("expert rows per rank", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
