"""`meshserve bench microbatch`: one decode step as one batch against two overlapped micro-batches, per link
latency (CloudMatrix-Infer §4.2.3, Fig. 14).

Two local ranks (`attn=TP1+DP2 moe=TP1+EP2`, one torch thread each) load the same DeepSeek-V3 model; each DP group
decodes `--batch` sequences with `--context` tokens in their cache, and prefills `--prefill-tokens` tokens in
prompts of `--prefill-len` (CloudMatrix-Infer §4.3.2 splits prefill the same way; 0 leaves prefill out).
Every expert-parallel dispatch and combine is
made to take at least `--latencies` ms from its launch (`InFlight` in meshserve/moe/comm.py: the wait ends no
sooner), standing in for links slower than loopback. For each latency the two schedules run in turn, `--steps`
decode steps per measurement, `--repeats` measurements each; a step's time is the slower rank's, the median taken.

- exposed: what the latency adds to a step, t1(L) - t1(0) with one batch, t2(L) - t2(0) with two;
- hideable: what overlap could remove at most, min(exposed with one batch, t1(0)) (a transfer hides behind the
  other micro-batch's compute, and there is no more compute than t1(0));
- hidden: the exposed time the split removes, and its fraction of the hideable time;
- split cost: t2(0) - t1(0), what splitting costs with no latency to hide (each half streams the weights its
  tokens use again: at decode batch sizes on a CPU most of a step); the split pays where hidden > split cost.

The PNG has the step times against the latency and a timeline of one split step at the middle latency: each
micro-batch's stages (compute, the wait for its own transfer included) and its transfers in flight.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from meshserve.bench.deployment_load import one_line_errors, run_bench_cli
from meshserve.utils import report

PROG = "meshserve bench microbatch"
STRATEGY = "attn=TP1+DP2 moe=TP1+EP2"
WORLD_SIZE = 2
PRESETS = ("tiny", "small")
WORLD_TIMEOUT_S = 1800.0
QUICK = {"preset": "tiny", "batch": 16, "context": 32, "prefill_tokens": 64, "prefill_len": 32, "latencies": "0,2",
         "steps": 2, "repeats": 1}
PHASES = ("decode", "prefill")


def add_microbatch_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")
    parser.add_argument("--preset", choices=PRESETS, default="small",
                        help="the generated random DeepSeek-V3 model (default: small)")
    parser.add_argument("--batch", type=int, default=64, help="sequences each DP group decodes (default: 64)")
    parser.add_argument("--context", type=int, default=256, help="tokens in each sequence's cache (default: 256)")
    parser.add_argument("--prefill-tokens", dest="prefill_tokens", type=int, default=512,
                        help="tokens each DP group prefills per prefill step; 0: decode only (default: 512)")
    parser.add_argument("--prefill-len", dest="prefill_len", type=int, default=128,
                        help="tokens per prompt of a prefill step (default: 128)")
    parser.add_argument("--latencies", default="0,1,2,5",
                        help="emulated dispatch/combine latencies, ms, comma-separated (default: 0,1,2,5)")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per measurement (default: 4)")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per schedule (default: 5)")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    parser.set_defaults(func=microbatch_main)


@dataclasses.dataclass(frozen=True)
class MicrobatchSettings:
    preset: str
    batch: int
    context: int
    prefill_tokens: int
    prefill_len: int
    latencies_ms: tuple[float, ...]
    steps: int
    repeats: int
    json_path: str

    @property
    def phases(self) -> tuple[str, ...]:
        return PHASES if self.prefill_tokens else PHASES[:1]

    @property
    def prefill_seqs(self) -> int:
        return self.prefill_tokens // self.prefill_len

    @property
    def timeline_latency_ms(self) -> float:
        """The latency whose split step is drawn: the middle one (2 ms of the default list)."""
        return self.latencies_ms[len(self.latencies_ms) // 2]


def settings_from_args(args: argparse.Namespace) -> MicrobatchSettings:
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    for flag, value in (("--batch", args.batch), ("--context", args.context), ("--steps", args.steps),
                        ("--repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.batch < 2:
        raise ValueError(f"--batch must be at least 2 to split in two, got {args.batch}")
    if args.prefill_tokens and (args.prefill_len < 1 or args.prefill_tokens < 2 * args.prefill_len):
        raise ValueError(f"--prefill-tokens must hold at least two prompts of --prefill-len {args.prefill_len}, got "
                         f"{args.prefill_tokens}")
    try:
        latencies = tuple(sorted({float(part) for part in str(args.latencies).split(",") if part.strip()}))
    except ValueError:
        raise ValueError(f"--latencies takes comma-separated milliseconds, got {args.latencies!r}") from None
    if not latencies or latencies[0] != 0:
        raise ValueError(f"--latencies must include 0 (the baseline) and no negative value, got {args.latencies!r}")
    return MicrobatchSettings(args.preset, args.batch, args.context, args.prefill_tokens, args.prefill_len, latencies,
                              args.steps, args.repeats, args.json)


def microbatch_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_microbatch_benchmark, (OSError, RuntimeError),
                         _report)


def _report(settings: MicrobatchSettings, result: dict) -> None:
    report.publish(settings.json_path, result, plot_microbatch, summary_lines(result))


# ---------------------------------------------------------------- one rank

def _step_inputs(s: MicrobatchSettings, tables: list[list[int]], block_size: int, gen) -> dict[str, list]:
    """(token ids, positions, attention metadata) of each measured step, per phase: `--steps` decode steps, and
    one prefill step from empty caches (it writes the same slots every time)."""
    import torch

    from meshserve.layers.metadata import AttentionMetadata

    inputs = {"decode": [], "prefill": []}
    for step in range(s.steps):
        position = s.context + step
        inputs["decode"].append((torch.randint(0, 1000, (s.batch,), generator=gen), torch.full((s.batch,), position),
                                 AttentionMetadata.build([1] * s.batch, [position] * s.batch, tables, block_size)))
    if s.prefill_tokens:
        n, length = s.prefill_seqs, s.prefill_len
        inputs["prefill"].append((torch.randint(0, 1000, (n * length,), generator=gen),
                                  torch.arange(length).repeat(n),
                                  AttentionMetadata.build([length] * n, [0] * n, tables[:n], block_size)))
    return inputs


def _world_worker(rank: int, world: int, model_dir: str, settings: MicrobatchSettings, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from meshserve.models.loader import load_model
    from meshserve.models.microbatch import StageTimeline
    from meshserve.parallel.context import ParallelContext
    from meshserve.parallel.strategy import ParallelStrategy

    torch.set_num_threads(1)
    s = settings
    ctx = ParallelContext.build(ParallelStrategy.parse(STRATEGY), max_tokens_per_step=max(s.batch, s.prefill_tokens))
    model = load_model(model_dir, parallel=ctx)
    dispatchers = {id(m.runtime.ep_dispatcher): m.runtime.ep_dispatcher for m in model.modules()
                   if getattr(getattr(m, "runtime", None), "ep_dispatcher", None) is not None}
    block_size = 16
    per_seq = -(-max(s.context + s.steps, s.prefill_len) // block_size)
    sequences = max(s.batch, s.prefill_seqs)
    caches = model.kv_cache_layout().allocate(sequences * per_seq + 1, block_size)
    blocks = list(range(sequences * per_seq))
    random.Random(rank).shuffle(blocks)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(sequences)]
    inputs = _step_inputs(s, tables, block_size, torch.Generator().manual_seed(rank))

    @torch.inference_mode()
    def measure(phase: str, microbatches: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for ids, positions, attn in inputs[phase]:
            model(ids, positions, attn, caches, microbatches=microbatches)
        took = torch.tensor([(time.perf_counter() - start) / len(inputs[phase])])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step lasts until its slower rank is done
        return float(took)

    def use_latency(latency_ms: float) -> None:
        for dispatcher in dispatchers.values():
            dispatcher.link_latency_s = latency_ms / 1e3

    for _ in range(2):  # warm-up: first-call costs, allocator growth
        for phase in s.phases:
            measure(phase, 1), measure(phase, 2)
    # every phase, latency and schedule in turn within each repeat, so that drift on a shared machine hits all
    results = {phase: {str(latency): {1: [], 2: []} for latency in s.latencies_ms} for phase in s.phases}
    for repeat in range(s.repeats):
        for phase in s.phases:
            for latency in s.latencies_ms:
                use_latency(latency)
                for microbatches in ((1, 2) if repeat % 2 == 0 else (2, 1)):
                    results[phase][str(latency)][microbatches].append(measure(phase, microbatches))
        if rank == 0:
            print(f"[microbatch] repeat {repeat + 1}/{s.repeats}: " + "; ".join(
                f"{phase} " + ", ".join(f"{latency:g} ms {times[1][-1] * 1e3:.0f} / {times[2][-1] * 1e3:.0f}"
                                        for latency, times in zip(s.latencies_ms, results[phase].values()))
                for phase in s.phases) + " ms per step (one batch / two micro-batches)", file=sys.stderr, flush=True)
    use_latency(s.timeline_latency_ms)
    model.stage_timeline = StageTimeline()
    measure("decode", 2)
    model.stage_timeline.clear()
    with torch.inference_mode():
        start = time.perf_counter()
        model(*inputs["decode"][0], caches, microbatches=2)
    timeline = [(i, stage, a - start, b - start) for i, stage, a, b in model.stage_timeline.stages]
    moe_layers = len(model.expert_balancer.moe_layers)  # the decoder's (an MTP layer's MoE does not run here)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"times": results, "timeline": timeline, "moe_layers": moe_layers}))


# ---------------------------------------------------------------- the benchmark

def run_microbatch_benchmark(settings: MicrobatchSettings) -> dict:
    from meshserve.models.factory import ensure_default_model, preset_config
    from meshserve.parallel.topology import spawn_local_world

    model_dir = ensure_default_model("deepseek_v3", settings.preset)
    print(f"[microbatch] {WORLD_SIZE} ranks ({STRATEGY}), {settings.preset} model, batch {settings.batch} per DP "
          f"group, latencies {', '.join(f'{x:g}' for x in settings.latencies_ms)} ms", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        spawn_local_world(_world_worker, WORLD_SIZE, args=(str(model_dir), settings, str(raw_path)),
                          timeout_s=WORLD_TIMEOUT_S)
        raw = json.loads(raw_path.read_text())
    rows = {phase: summarise(raw["times"][phase], settings.latencies_ms) for phase in settings.phases}
    return {
        "benchmark": "microbatch",
        "config": {**dataclasses.asdict(settings), "strategy": STRATEGY, "model": str(model_dir),
                   "layers": preset_config("deepseek_v3", settings.preset).get("num_hidden_layers"),
                   "moe_layers": raw["moe_layers"]},
        "definitions": {
            "step_ms": "one decode step's forward, the slower rank's, median of the measurements",
            "exposed_one_ms / exposed_two_ms": "what the latency adds to a step: t1(L) - t1(0), t2(L) - t2(0)",
            "hideable_ms": "min(exposed_one, t1(0)): a transfer hides only behind the other micro-batch's compute",
            "hidden_ms": "exposed_one - exposed_two; hidden_fraction = hidden / hideable",
            "split_cost_ms": "t2(0) - t1(0): what the split costs with nothing to hide",
            "net_ms": "t1(L) - t2(L): what the split saves in all (negative: it costs)",
        },
        "machine": report.machine_info(),
        "rows": rows["decode"],
        "prefill_rows": rows.get("prefill", []),
        "timeline": {"latency_ms": settings.timeline_latency_ms, "stages": raw["timeline"]},
    }


def summarise(times: dict, latencies: tuple[float, ...]) -> list[dict]:
    base_one, base_two = (statistics.median(times[str(latencies[0])][k]) for k in ("1", "2"))
    rows = []
    for latency in latencies:
        one, two = (statistics.median(times[str(latency)][k]) for k in ("1", "2"))
        exposed_one, exposed_two = max(0.0, one - base_one), max(0.0, two - base_two)
        hideable = min(exposed_one, base_one)
        hidden = exposed_one - exposed_two
        rows.append({"latency_ms": latency, "one_batch_ms": one * 1e3, "two_microbatches_ms": two * 1e3,
                     "ratio": two / one, "exposed_one_ms": exposed_one * 1e3, "exposed_two_ms": exposed_two * 1e3,
                     "hideable_ms": hideable * 1e3, "hidden_ms": hidden * 1e3,
                     "hidden_fraction": hidden / hideable if hideable > 0 else None,
                     "split_cost_ms": (base_two - base_one) * 1e3, "net_ms": (one - two) * 1e3,
                     "one_batch_all_ms": [t * 1e3 for t in times[str(latency)]["1"]],
                     "two_microbatches_all_ms": [t * 1e3 for t in times[str(latency)]["2"]]})
    return rows


def summary_lines(result: dict) -> list[str]:
    cfg = result["config"]
    lines = [f"{cfg['strategy']}, {cfg['preset']} model ({cfg['moe_layers']} MoE layers); median of "
             f"{cfg['repeats']} measurements"]
    for phase, rows, shape in (
            ("decode", result["rows"], f"{cfg['batch']} sequences per DP group, context {cfg['context']}, "
                                       f"{cfg['steps']} steps per measurement"),
            ("prefill", result["prefill_rows"], f"{cfg['prefill_tokens']} tokens per DP group in prompts of "
                                                f"{cfg['prefill_len']}")):
        if not rows:
            continue
        lines += [f"{phase}: {shape}",
                  "| latency | one batch | two micro-batches | ratio | exposed: one / two | hidden / hideable |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            fraction = "-" if r["hidden_fraction"] is None else f"{r['hidden_fraction']:.0%}"
            lines.append(f"| {r['latency_ms']:g} ms | {r['one_batch_ms']:.1f} ms | {r['two_microbatches_ms']:.1f} ms "
                         f"| {r['ratio']:.2f}x | {r['exposed_one_ms']:.1f} / {r['exposed_two_ms']:.1f} ms | "
                         f"{r['hidden_ms']:.1f} / {r['hideable_ms']:.1f} ms ({fraction}) |")
        lines.append(f"{phase}: split cost with no latency {rows[0]['split_cost_ms']:+.1f} ms per step; the split "
                     "pays where hidden exceeds it")
    return lines


def plot_microbatch(result: dict, path: str | Path) -> Path:
    phases = [(phase, rows) for phase, rows in (("decode", result["rows"]), ("prefill", result["prefill_rows"]))
              if rows]
    fig, axes = report.new_figure(ncols=len(phases) + 1, width_per_panel=5.5)
    for ax, (phase, rows) in zip(axes[0], phases):
        _plot_step_times(ax, phase, rows, result["config"])
    _plot_timeline(axes[0][-1], result["timeline"])
    return report.save_figure(fig, path)


def _plot_step_times(ax, phase: str, rows: list[dict], cfg: dict) -> None:
    latencies = [r["latency_ms"] for r in rows]
    ax.plot(latencies, [r["one_batch_ms"] for r in rows], "o-", label="one batch")
    ax.plot(latencies, [r["two_microbatches_ms"] for r in rows], "s-", label="two micro-batches")
    for r in rows:
        if r["hidden_fraction"] is not None:
            ax.annotate(f"{r['hidden_fraction']:.0%} hidden", (r["latency_ms"], r["two_microbatches_ms"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("emulated dispatch / combine latency (ms)")
    ax.set_ylabel(f"{phase} step (ms, slower rank, median)")
    size = f"batch {cfg['batch']}" if phase == "decode" else f"{cfg['prefill_tokens']} tokens"
    ax.set_title(f"{phase}: {cfg['strategy']}, {size} per DP group", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _plot_timeline(ax, timeline: dict) -> None:
    """Per micro-batch: its stages as bars on a compute lane, its transfers (launch to the start of the stage
    that waits for them) on a transfer lane."""
    stages = timeline["stages"]
    for index in (0, 1):
        own = [(stage, start, end) for i, stage, start, end in stages if i == index]
        compute_y, transfer_y = 3 - 2 * index, 2.6 - 2 * index
        for _, start, end in own:
            ax.barh(compute_y, (end - start) * 1e3, left=start * 1e3, height=0.35, color=f"C{index}",
                    edgecolor="black", linewidth=0.3)
        for (stage, _, end), (_, next_start, _) in zip(own, own[1:]):
            if stage != "finish":
                ax.barh(transfer_y, (next_start - end) * 1e3, left=end * 1e3, height=0.25, color=f"C{index}",
                        alpha=0.35, hatch="//")
    ax.set_yticks([3, 2.6, 1, 0.6], ["micro-batch 0: compute", "micro-batch 0: in flight",
                                     "micro-batch 1: compute", "micro-batch 1: in flight"], fontsize=8)
    ax.set_xlabel("ms into the step (rank 0)")
    ax.set_title(f"one split step at {timeline['latency_ms']:g} ms latency", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
