"""`meshserve bench disagg`: attention-expert disaggregation against colocated DP/EP on the same processes and
cores (xdeepserve §5.2, Fig. 18-19).

With `--ranks N` and `--attention A`, the colocated layout `attn=TP1+DPN moe=TP1+EPN` and the disaggregated
`attn=DPA moe=EP(N-A) disagg domains=D` for each D of `--domains` run the same seeded workload (every request at
once, greedy, EOS ignored) through `LLM.generate`, one fresh engine at a time, in rounds (meshserve/bench/
parallel.py `measure_layouts`: start-up and a warm-up pass untimed). For each emulated link latency of
`--link-ms` (`MESHSERVE_EMULATED_LINK_LATENCY_MS`, a benchmark knob: each EP dispatch and combine, each A2E and
E2A takes at least that long) the medians of the rounds are reported: output tokens/s, the step time (mean time
between a request's tokens), their ratio to the colocated layout measured in the same rounds, and whether the
greedy tokens are the colocated layout's.

Then one more pass of the disaggregated layout with the most domains, at the largest latency, records when each
rank talks to the other role (`MESHSERVE_A2E_TIMELINE`, meshserve/moe/a2e_timeline.py): the PNG's timeline shows
the DP domains taking turns on the expert ranks while the other domain computes its attention, as in xdeepserve
Fig. 19 (one microbatch per domain). Writes the JSON and the PNG next to it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from meshserve.bench.deployment_load import check_model_dir, log, one_line_errors, run_bench_cli
from meshserve.utils import envs, report

PROG = "meshserve bench disagg"
LOG_PREFIX = "bench disagg"
DEFAULT_JSON = "bench-results/disagg.json"
_FULL = {"ranks": 4, "attention": 2, "domains": (1, 2), "link_ms": (0.0, 2.0), "requests": 16, "output_len": 32,
         "repeats": 3}
_QUICK = {"ranks": 4, "attention": 2, "domains": (1, 2), "link_ms": (0.0,), "requests": 4, "output_len": 16,
          "repeats": 1}
PROMPT_LEN = (16, 64)
LAYOUT_TIMEOUT_S = 900.0
TIMELINE_WINDOW_SPANS = 48  # the expert ranks' spans the timeline shows (a few decode steps)
COLOCATED = "colocated"
MICROBATCHED = {"microbatches": 2, "microbatch_min_tokens": 2}  # every step with two tokens in a group splits


def add_disagg_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="model directory (default: the default model, made on first use)")
    source.add_argument("--preset", choices=("tiny", "small"),
                        help="a generated random DeepSeek-V3 model of this size, made once in the model cache")
    parser.add_argument("--ranks", type=int, help="ranks of every layout (default: 4)")
    parser.add_argument("--attention", type=int, help="attention ranks of the disaggregated layouts (default: 2)")
    parser.add_argument("--domains", type=int, nargs="+", help="DP domain counts to run (default: 1 2)")
    parser.add_argument("--link-ms", type=float, nargs="+",
                        help="emulated link latencies, ms (default: 0 2; --quick: 0)")
    parser.add_argument("--requests", type=int, help="requests, all submitted at once (default: 16; --quick: 4)")
    parser.add_argument("--output-len", type=int, help="tokens per request (default: 32; --quick: 16)")
    parser.add_argument("--repeats", type=int, help="rounds; the median is reported (default: 3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="the smallest run (for tests)")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"result file; a PNG with the same name is written next to it (default: {DEFAULT_JSON})")
    parser.set_defaults(func=disagg_main)


@dataclasses.dataclass(frozen=True)
class DisaggBenchSettings:
    model_dir: str | None
    preset: str | None
    ranks: int
    attention: int
    domains: tuple[int, ...]
    link_ms: tuple[float, ...]
    requests: int
    output_len: int
    repeats: int
    json_path: str

    def layouts(self) -> dict[str, str]:
        """Label -> parallel strategy, the colocated baseline first."""
        n, a = self.ranks, self.attention
        layouts = {COLOCATED: f"attn=TP1+DP{n} moe=TP1+EP{n}"}
        for d in self.domains:
            layouts[f"disagg domains={d}"] = f"attn=DP{a} moe=EP{n - a} disagg domains={d}"
        layouts[self.microbatched] = layouts[f"disagg domains={max(self.domains)}"]
        return layouts

    @property
    def microbatched(self) -> str:
        """The label of the layout with the most domains, each running two micro-batches (and of the timeline)."""
        return f"disagg domains={max(self.domains)} microbatches=2"


def settings_from_args(args: argparse.Namespace) -> DisaggBenchSettings:
    base = _QUICK if args.quick else _FULL
    sizes = {}
    for key, default in base.items():
        value = getattr(args, key)
        sizes[key] = default if value is None else (tuple(value) if isinstance(value, list) else value)
    for key in ("ranks", "attention", "requests", "output_len", "repeats"):
        if sizes[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {sizes[key]}")
    if not 1 <= sizes["attention"] < sizes["ranks"]:
        raise ValueError(f"--attention must leave at least one of the {sizes['ranks']} ranks to the experts")
    for d in sizes["domains"]:
        if d < 1 or sizes["attention"] % d:
            raise ValueError(f"--domains {d} must divide the {sizes['attention']} attention ranks")
    if any(ms < 0 for ms in sizes["link_ms"]):
        raise ValueError("--link-ms must be zero or more")
    return DisaggBenchSettings(model_dir=args.model, preset=args.preset, json_path=args.json, **sizes)


def disagg_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_disagg_benchmark, (OSError, RuntimeError), _report)


# ---------------------------------------------------------------- the run
def run_disagg_benchmark(settings: DisaggBenchSettings) -> dict:
    # start-up: the engine (torch, the tokenizer) only when the benchmark runs
    from meshserve.bench.offline import WARMUP_SEED_OFFSET, compare_greedy
    from meshserve.bench.parallel import measure_layouts
    from meshserve.bench.workload import make_offline_workload
    from meshserve.models.factory import ensure_default_model
    from meshserve.models.loader import load_hf_config

    model = str(ensure_default_model("deepseek_v3", settings.preset)) if settings.preset \
        else check_model_dir(settings.model_dir)
    vocab = int(load_hf_config(model)["vocab_size"])
    out_len = (settings.output_len, settings.output_len)
    workload = make_offline_workload(settings.requests, PROMPT_LEN, out_len, vocab, seed=0)
    warmup = make_offline_workload(settings.requests, PROMPT_LEN, out_len, vocab, seed=WARMUP_SEED_OFFSET)
    engine = dict(max_num_seqs=settings.requests, max_num_batched_tokens=256, num_kv_blocks=1024,
                  enable_prefix_caching=False)
    layouts = settings.layouts()
    engines = {label: dict(engine, parallel=parallel, **(MICROBATCHED if label == settings.microbatched else {}))
               for label, parallel in layouts.items()}
    rows = []
    for link_ms in settings.link_ms:
        log(LOG_PREFIX, f"emulated link latency {link_ms:g} ms")
        with envs.MESHSERVE_EMULATED_LINK_LATENCY_MS.set_to(f"{link_ms:g}"):
            records = measure_layouts(engines, model, workload, warmup, settings.repeats, LAYOUT_TIMEOUT_S,
                                      progress=True)
        rows += _rows(records, link_ms, compare_greedy)
    timeline = _timeline(model, engines[settings.microbatched], settings, workload, warmup)
    return {"config": {**{k: v for k, v in dataclasses.asdict(settings).items() if k != "json_path"},
                       "model": model, "layouts": layouts, "prompt_len": list(PROMPT_LEN)},
            "machine": report.machine_info(), "rows": rows, "timeline": timeline}


def _rows(records: dict, link_ms: float, compare_greedy) -> list[dict]:
    base = records[COLOCATED]
    base_rate, base_step = base["median"]["output_tokens_per_s"], base["median"]["mean_tpot_s"]
    rows = []
    for label, record in records.items():
        median = record["median"]
        row = {"layout": label, "strategy": record["engine_args"]["parallel"], "link_ms": link_ms,
               "status": record["status"], "error": record["error"],
               "output_tokens_per_s": median.get("output_tokens_per_s"),
               "step_ms": 1e3 * median["mean_tpot_s"] if median.get("mean_tpot_s") else None}
        if record["status"] == "ok" and base_rate and row["output_tokens_per_s"]:
            row["tokens_per_s_vs_colocated"] = row["output_tokens_per_s"] / base_rate
            row["step_vs_colocated"] = median["mean_tpot_s"] / base_step if base_step else None
            row["greedy_vs_colocated"] = compare_greedy(record["tokens"][-1], base["tokens"][-1])
        rows.append(row)
    return rows


def _timeline(model: str, engine: dict, settings: DisaggBenchSettings, workload, warmup) -> dict:
    """One pass of the microbatched layout at the largest latency, each rank recording its spans."""
    from meshserve.bench.parallel import measure_pass

    domains = max(settings.domains)
    label = settings.microbatched
    link_ms = max(settings.link_ms)
    log(LOG_PREFIX, f"timeline of {label} at {link_ms:g} ms")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "timeline")
        with envs.MESHSERVE_EMULATED_LINK_LATENCY_MS.set_to(f"{link_ms:g}"), \
                envs.MESHSERVE_A2E_TIMELINE.set_to(prefix):
            result = measure_pass(model, engine, workload, warmup, LAYOUT_TIMEOUT_S)
        if result["status"] != "ok":
            raise RuntimeError(f"the timeline pass of {label} is {result['status']}: {result['error']}")
        ranks = {int(path.stem.rsplit("rank", 1)[1]): json.loads(path.read_text())["spans"]
                 for path in Path(tmp).glob("timeline-rank*.json")}
    return {"layout": label, "link_ms": link_ms, "attention_ranks": settings.attention, "domains": domains,
            "ranks": _window(ranks, settings.attention)}


def _window(ranks: dict[int, list[dict]], num_attention: int) -> dict[str, list[dict]]:
    """The spans of every rank within a window of the expert ranks' middle `TIMELINE_WINDOW_SPANS` services, in
    ms from the window's start."""
    served = sorted((s for rank, spans in ranks.items() if rank >= num_attention for s in spans
                     if s["kind"] == "serve"), key=lambda s: s["start"])
    if not served:
        raise RuntimeError("the expert ranks recorded no span (too few steps for a timeline: more requests or "
                           "tokens)")
    middle = len(served) // 2
    shown = served[max(0, middle - TIMELINE_WINDOW_SPANS // 2):middle + TIMELINE_WINDOW_SPANS // 2]
    t0, t1 = shown[0]["start"], max(s["end"] for s in shown)
    return {str(rank): [{**s, "start": 1e3 * (s["start"] - t0), "end": 1e3 * (s["end"] - t0)}
                        for s in spans if s["end"] > t0 and s["start"] < t1]
            for rank, spans in sorted(ranks.items())}


# ---------------------------------------------------------------- report
def _report(settings: DisaggBenchSettings, result: dict) -> None:
    report.publish(settings.json_path, result, plot_disagg, summary_lines(result))


def summary_lines(result: dict) -> list[str]:
    lines = [f"{'link ms':>7}  {'layout':<18} {'tok/s':>8} {'step ms':>8} {'vs colocated':>12}  greedy"]
    for row in result["rows"]:
        if row["status"] != "ok":
            lines.append(f"{row['link_ms']:>7g}  {row['layout']:<18} {row['status']}: {row['error']}")
            continue
        greedy = row.get("greedy_vs_colocated") or {}
        same = "same" if greedy.get("mismatching_requests") == 0 else f"{greedy.get('mismatching_requests')} differ"
        lines.append(f"{row['link_ms']:>7g}  {row['layout']:<18} {row['output_tokens_per_s']:>8.1f} "
                     f"{row['step_ms']:>8.1f} {row.get('tokens_per_s_vs_colocated', 0):>11.2f}x  {same}")
    return lines


def plot_disagg(result: dict, path: str | Path) -> Path:
    fig, axes = report.new_figure(ncols=2, width_per_panel=6.5, height=4.5)
    rate_ax, time_ax = axes[0]
    links = sorted({row["link_ms"] for row in result["rows"]})
    labels = list(result["config"]["layouts"])
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        rates = [next((r["output_tokens_per_s"] or 0 for r in result["rows"]
                       if r["layout"] == label and r["link_ms"] == link), 0) for link in links]
        rate_ax.bar([x + i * width for x in range(len(links))], rates, width, label=label)
    rate_ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(links))])
    rate_ax.set_xticklabels([f"{link:g} ms link" for link in links])
    rate_ax.set_ylabel("output tokens/s (median)")
    rate_ax.set_title(f"{result['config']['ranks']} ranks: colocated DP/EP vs disaggregated")
    rate_ax.legend(fontsize=8)
    _plot_timeline(time_ax, result["timeline"])
    return report.save_figure(fig, path)


def _plot_timeline(ax, timeline: dict) -> None:
    """One row per rank, coloured by DP domain. An attention rank: a lane per micro-batch, each span the time its
    rows are away (A2E, the experts, E2A); the gaps are its attention. An expert rank: grey while it waits for a
    domain's rows or sends them back, solid while it computes them."""
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    num_attention = timeline["attention_ranks"]
    ranks = sorted(timeline["ranks"], key=int)
    names = []
    for row, rank in enumerate(ranks):
        spans = timeline["ranks"][rank]
        if int(rank) >= num_attention:
            names.append(f"expert rank {int(rank) - num_attention}")
            for span in spans:
                solid = span["kind"] == "compute"
                ax.broken_barh([(span["start"], span["end"] - span["start"])], (row - 0.35, 0.7),
                               facecolors=colors[span["domain"] % len(colors)] if solid else "lightgrey",
                               zorder=2 if solid else 1)
            continue
        names.append(f"attention {rank} (domain {spans[0]['domain'] if spans else '?'})")
        for span in spans:  # micro-batch 0 in the lower lane, 1 in the upper
            lane = row - 0.4 + 0.42 * span.get("microbatch", 0)
            ax.broken_barh([(span["start"], span["end"] - span["start"])], (lane, 0.36),
                           facecolors=colors[span["domain"] % len(colors)],
                           alpha=0.45 + 0.3 * span.get("microbatch", 0))
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels(names, fontsize=8)
    ax.set_xlabel("ms")
    ax.set_title(f"{timeline['layout']}, {timeline['link_ms']:g} ms link\nattention: micro-batch 0 / 1 away; "
                 "experts: grey waiting, solid computing", fontsize=9)
