"""`meshserve bench scale`: how fast the cluster manager scales, and what autoscaling buys (deepserve §6).

1. Scale-up breakdown (deepserve Fig. 9), on one in-process cluster manager (local backend) whose pool
   has no TE: a streaming request is sent (the JE holds it), then one TE is added, started as
     cold            a new process, the checkpoint evicted from the page cache (read from disk)
     prewarmed       a pre-warmed process, the checkpoint read from disk
     prewarmed+dram  a pre-warmed process, the checkpoint in the page cache (DRAM preload)
     fork            a pre-warmed process, weights forked from a running TE (page cache evicted)
   Time to first token is the held request's, from the moment the TE is asked for; the five steps come
   from the manager's record (Scaler-Pre, TE-Pre-Load, TE-Load, TE-Post-Load, Scaler-Post). Cases rotate
   between runs; medians reported, ratios of medians of the same run set.
2. TE-Load by source (Fig. 10) and fork fan-out to 1, 2, 4 TEs at once (Fig. 11a): `scale_load`.
3. Autoscaling: one bounded load that ramps up, holds, drops to zero and comes back, on an autoscaled
   pool (min 0) and on fixed deployments of the minimum serving size (1 TE) and of the maximum; TE count,
   queue, TTFT and SLO attainment over time, and TE-seconds used.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from meshserve.bench.deployment_load import log, one_line_errors, run_bench_cli
from meshserve.bench.serve import RequestRecord, send_request
from meshserve.bench.workload import WorkloadRequest
from meshserve.config import ClusterConfig
from meshserve.config.base import ConfigError
from meshserve.utils import envs, report

PROG = "meshserve bench scale"
LOG_PREFIX = "bench scale"
DEFAULT_OUT = "bench-results/scale"
RESULT_FILE = "scale.json"
POOL = "main/colocated"
CASES = ("cold", "prewarmed", "prewarmed+dram", "fork")
STEPS = ("scaler_pre", "te_pre_load", "te_load", "te_post_load", "scaler_post")
PRE_LOAD_LABELS = {"interpreter": "interpreter", "master_imports": "master imports",
                   "ranks_start": "forkserver + ranks' fork", "rank_setup": "rank set-up"}
STEP_LABELS = {"scaler_pre": "Scaler-Pre", "te_pre_load": "TE-Pre-Load", "te_load": "TE-Load",
               "te_post_load": "TE-Post-Load", "scaler_post": "Scaler-Post"}


class ScaleBenchError(RuntimeError):
    """The benchmark cannot run or a run came back wrong (one line for the user)."""


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format model directory (default: the deepseek_v3 small model, made on "
                                        "first use)")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest run (for tests and a first look): the scale-up breakdown once, every "
                             "case (unless --parts, --runs)")
    parser.add_argument("--runs", type=int, help="repetitions of each scale-up case (default: 3; --quick: 1)")
    parser.add_argument("--parts", help="what to measure: breakdown, load, fanout, autoscale (default: all; "
                                        "--quick: breakdown)")
    parser.add_argument("--max-tes", type=int, default=2, help="the autoscaled pool's max TEs and the fixed "
                                                               "maximum deployment's size (default: 2)")
    parser.add_argument("--rate", type=float, default=10.0,
                        help="the autoscaling load's peak requests/s (default: 10, more than one TE of the small "
                             "model serves on one core)")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds (default: 2)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.set_defaults(func=scale_main)


@dataclasses.dataclass(frozen=True)
class ScaleBenchSettings:
    model_dir: str
    runs: int
    parts: tuple[str, ...]
    max_tes: int
    rate: float
    slo_ttft_s: float
    out_dir: str


# the options --quick changes, for those not given
_FULL = {"parts": "breakdown,load,fanout,autoscale", "runs": 3}
_QUICK = {"parts": "breakdown", "runs": 1}


def settings_from_args(args: argparse.Namespace) -> ScaleBenchSettings:
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else (_QUICK if args.quick else _FULL)[key]
             for key in _FULL}
    parts = tuple(p.strip() for p in sizes["parts"].split(",") if p.strip())
    unknown = sorted(set(parts) - {"breakdown", "load", "fanout", "autoscale"})
    if unknown or not parts:
        raise ValueError(f"--parts: unknown {', '.join(unknown) or 'empty list'}")
    for flag, value, low in (("--runs", sizes["runs"], 1), ("--max-tes", args.max_tes, 2)):
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    if not args.rate > 0 or not args.slo_ttft > 0:
        raise ValueError("--rate and --slo-ttft must be positive")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model: directory {args.model!r} does not exist")
    return ScaleBenchSettings(model_dir=args.model or "", runs=sizes["runs"], parts=parts, max_tes=args.max_tes,
                              rate=args.rate, slo_ttft_s=args.slo_ttft, out_dir=args.out)


_ERRORS = (ScaleBenchError, ConfigError, TimeoutError, OSError, ValueError, RuntimeError)


def scale_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_scale_benchmark, _ERRORS, _report)


def _report(settings: ScaleBenchSettings, result: dict) -> None:
    json_path = report.write_json(Path(settings.out_dir) / RESULT_FILE, result)
    png_path = plot_scale(result, report.png_path_for(json_path))
    print("\n".join(result["summary"]))
    print(f"wrote {json_path} and {png_path}")


def run_scale_benchmark(settings: ScaleBenchSettings) -> dict:
    if not settings.model_dir:
        from meshserve.models.factory import ensure_default_model

        settings = dataclasses.replace(settings, model_dir=str(ensure_default_model("deepseek_v3", "small")))
        log(LOG_PREFIX, f"no --model: the deepseek_v3 small model ({settings.model_dir})")
    result: dict[str, Any] = {"machine": report.machine_info(), "model": settings.model_dir,
                              "settings": dataclasses.asdict(settings)}
    with _without_rank_template():
        _run_parts(settings, result)
    result["summary"] = summary_lines(result)
    return result


@contextlib.contextmanager
def _without_rank_template():
    """The TEs this benchmark starts start as on a host without a rank template: a `cold` TE's ranks import
    torch in a new forkserver, which is part of what the scale-up breakdown measures."""
    saved = os.environ.pop(envs.MESHSERVE_RANK_TEMPLATE.name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[envs.MESHSERVE_RANK_TEMPLATE.name] = saved


def _run_parts(settings: ScaleBenchSettings, result: dict[str, Any]) -> None:
    if "breakdown" in settings.parts:
        result["breakdown"] = run_breakdown(settings)
    if "load" in settings.parts or "fanout" in settings.parts:
        # start-up: torch and the transfer engine only for these parts
        from meshserve.bench import scale_load

        if "load" in settings.parts:
            log(LOG_PREFIX, "TE-Load by source")
            result["load_by_source"] = _plain(scale_load.load_by_source(settings.model_dir, repeats=settings.runs))
        if "fanout" in settings.parts:
            log(LOG_PREFIX, "fork fan-out")
            result["fork_fanout"] = _plain(scale_load.fork_fanout(settings.model_dir))
    if "autoscale" in settings.parts:
        result["autoscale"] = run_autoscale(settings)


def _plain(value: Any) -> Any:
    """Dataclasses (scale_load's results) as JSON-able dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- an in-process cluster manager
@contextlib.contextmanager
def managed(model: str, deployment: dict, work_dir: Path, autoscale: bool, preload: bool, hold_s: float = 300.0):
    """A ClusterManager with the local backend, its loop on a thread; everything it started is stopped on exit."""
    # start-up: the manager only when the benchmark runs
    from meshserve.cluster.backends import LocalBackend
    from meshserve.cluster.manager import ClusterManager
    from meshserve.cluster.run import serving_in_background
    from meshserve.router.deployment import MultiDeployment
    from meshserve.utils.processes import free_tcp_port

    spec = MultiDeployment.from_dict(deployment, "bench deployment")
    state_dir = Path(tempfile.mkdtemp(prefix="state-", dir=work_dir))
    config = ClusterConfig(port=free_tcp_port(), hold_s=hold_s, autoscale=autoscale, preload=preload)
    manager = ClusterManager(spec, "bench", model, LocalBackend(state_dir / "logs"), state_dir, config, log_level=30)
    with serving_in_background(manager, 600):
        yield manager


def _wait(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise ScaleBenchError(f"{what}: not within {timeout_s:.0f} s")


def _stream_one(url: str, model_name: str, prompt: list[int], max_tokens: int) -> tuple[RequestRecord, float]:
    """One streaming completion (a thread's own event loop), timed; and when its first token came
    (`time.perf_counter()`; nan without one)."""
    import httpx

    record = RequestRecord(0, len(prompt), max_tokens)
    origin = time.perf_counter()

    async def go() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            await send_request(client, model_name, WorkloadRequest(prompt, max_tokens), record, origin)

    asyncio.run(go())
    first_token = origin + record.send_time_s + record.ttft_s if record.ttft_s is not None else float("nan")
    return record, first_token


# ---------------------------------------------------------------- 1. scale-up breakdown
def run_breakdown(settings: ScaleBenchSettings) -> dict:
    """Per case and run: the held request's TTFT from the scale-up decision, and the five steps."""
    import concurrent.futures

    from meshserve.utils import page_cache

    deployment = {"te_groups": [{"group": "main", "role": "colocated", "count": 0, "min": 0, "max": 2}],
                  "prewarm": 1, "engine": {"num_kv_blocks": 256}}
    files = page_cache.checkpoint_files(settings.model_dir)
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    work_dir = Path(settings.out_dir) / "work"
    work_dir.mkdir(parents=True, exist_ok=True)
    with managed(settings.model_dir, deployment, work_dir, autoscale=False, preload=False) as manager, \
            _fork_source(manager) as source_addrs, concurrent.futures.ThreadPoolExecutor(1) as client:
        url = manager.http_addrs()[0]
        model_name = Path(settings.model_dir).name
        for run in range(settings.runs):
            order = CASES[run % len(CASES):] + CASES[:run % len(CASES)]
            for case in order:
                _wait(lambda: manager.status().warm >= 1, 300, "a pre-warmed TE")
                if case == "prewarmed+dram":
                    page_cache.preload(files)
                else:
                    page_cache.evict(files)
                time.sleep(0.5)  # the JE and manager idle, the page cache settled
                pending = client.submit(_stream_one, url, model_name, [1, 2, 3, 4, 5, 6, 7, 8], 2)
                time.sleep(0.3)  # the request is held: no TE in the pool
                t0 = time.perf_counter()
                scale_up = manager.add_te(POOL, f"bench {case}", process="cold" if case == "cold" else "prewarmed",
                                          weights="fork" if case == "fork" else "checkpoint",
                                          fork_from=source_addrs if case == "fork" else None)
                record, first_token = pending.result(timeout=600)
                if not record.ok:
                    raise ScaleBenchError(f"{case}: the held request failed: {record.error}")
                _wait(lambda s=scale_up: s.done, 120, f"{case}: the TE registered")
                # the request was sent (and held) before the decision: its first token counts from the decision
                entry = {**scale_up.to_dict(), "ttft_s": first_token - t0}
                runs[case].append(entry)
                log(LOG_PREFIX, f"run {run + 1}/{settings.runs} {case}: first token {entry['ttft_s']:.2f} s after the "
                                f"decision (" + ", ".join(f"{STEP_LABELS[k]} {v:.2f}" for k, v in entry["steps"].items()
                                                         if k in STEP_LABELS) + f"; load from {entry['load_source']})")
                manager.set_target(POOL, 0, "bench: next case")
                _wait(lambda: not manager.tes, 120, f"{case}: the TE drained")
    return _breakdown_summary(runs)


@contextlib.contextmanager
def _fork_source(manager):
    """A TE of the pool's layout that serves its weights but takes no requests (registered with no JE)."""
    import zmq

    from meshserve.utils import cluster_auth
    from meshserve.wire import codec
    from meshserve.wire.heartbeat import EngineHeartbeat

    ctx = zmq.Context()
    pull = cluster_auth.server(ctx.socket(zmq.PULL))
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    config = manager.configs[POOL].replace(te_name="fork-source")
    handle = manager.backend.launch("te", "fork-source", dict(
        config=config.to_dict(), role="colocated", group="source", listen="tcp://127.0.0.1:0",
        register=[f"tcp://127.0.0.1:{port}"], log_level=30, watch_parent=False))
    try:
        deadline = time.monotonic() + 600
        while True:
            if time.monotonic() > deadline or not handle.alive():
                raise ScaleBenchError("the fork source TE did not start")
            if pull.poll(200):
                item = codec.decode(pull.recv())
                if isinstance(item, EngineHeartbeat) and item.weights_addrs:
                    yield list(item.weights_addrs)
                    break
    finally:
        handle.stop()
        with contextlib.suppress(Exception):
            _wait(lambda: not handle.alive(), 20, "the fork source stopped")
        handle.kill()
        pull.close(0)
        ctx.term()


def _breakdown_summary(runs: dict[str, list[dict]]) -> dict:
    cases = {}
    for case, entries in runs.items():
        if not entries:
            continue
        cases[case] = {"ttft_s": statistics.median(e["ttft_s"] for e in entries),
                       "steps": {step: statistics.median(e["steps"].get(step, float("nan")) for e in entries)
                                 for step in (*STEPS, "total")},
                       "load_source": entries[0]["load_source"], "runs": entries}
        parts = [e["pre_load_parts"] for e in entries if e.get("pre_load_parts")]
        if parts:  # a new process's TE-Pre-Load, part by part
            cases[case]["pre_load_parts"] = {part: statistics.median(p[part] for p in parts) for part in parts[0]}
    ratios = {}
    if "cold" in cases:
        for case in ("prewarmed", "prewarmed+dram", "fork"):
            if case in cases:
                ratios[f"ttft_cold_over_{case}"] = cases["cold"]["ttft_s"] / cases[case]["ttft_s"]
        if "fork" in cases:
            ratios["te_load_disk_over_fork"] = cases["cold"]["steps"]["te_load"] / cases["fork"]["steps"]["te_load"]
    return {"cases": cases, "ratios": ratios}


# ---------------------------------------------------------------- 3. autoscaling
MODES = ("autoscaled", "fixed-min", "fixed-max")
# (name, seconds, share of the peak rate at its start, at its end): up, hold, nothing (the autoscaled pool scales
# to zero), and back up again
PHASES = (("ramp", 20.0, 0.0, 1.0), ("hold", 20.0, 1.0, 1.0), ("zero", 25.0, 0.0, 0.0), ("back", 15.0, 0.0, 1.0),
          ("hold again", 10.0, 1.0, 1.0))
OUTPUT_TOKENS = 64
SAMPLE_S = 0.5


def load_schedule(rate: float, seed: int = 0) -> list[float]:
    """Send times of the bounded load: Poisson arrivals whose rate ramps from 0 to `rate`, holds, drops to zero
    (long enough for the autoscaled pool to scale to zero) and ramps back (`PHASES`)."""
    import random

    rng = random.Random(seed)
    times, start = [], 0.0
    for _, length, first, last in PHASES:
        t = start
        while True:
            # thinning: candidate arrivals at the peak rate, kept with the phase's share of it at that time
            t += rng.expovariate(rate)
            if t >= start + length:
                break
            if rng.random() < first + (last - first) * (t - start) / length:
                times.append(t)
        start += length
    return times


def _autoscale_deployment(mode: str, max_tes: int, slo_ttft_s: float) -> dict:
    count, low, high = {"autoscaled": (1, 0, max_tes), "fixed-min": (1, 1, 1),
                        "fixed-max": (max_tes, max_tes, max_tes)}[mode]
    # load routing: a TE that joins takes the new requests until the others' backlog is gone
    return {"te_groups": [{"group": "main", "role": "colocated", "count": count, "min": low, "max": high}],
            "routing": "load", "prewarm": 1 if mode == "autoscaled" else 0, "engine": {"num_kv_blocks": 512},
            "autoscaler": {"interval_s": 0.5, "window_s": 5.0, "ttft_slo_s": slo_ttft_s, "queue_per_te": 1.0,
                           "running_per_te": 24, "min_slo_samples": 5, "scale_up_cooldown_s": 3.0,
                           "scale_down_cooldown_s": 5.0, "down_stable_s": 6.0, "idle_to_zero_s": 8.0}}


def run_autoscale(settings: ScaleBenchSettings) -> dict:
    """The same load on each mode: per request its send time and TTFT, and the pool over time."""
    offsets = load_schedule(settings.rate)
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(32)] for i in range(len(offsets))]
    work_dir = Path(settings.out_dir) / "work"
    work_dir.mkdir(parents=True, exist_ok=True)
    modes = {}
    for mode in MODES:
        log(LOG_PREFIX, f"autoscaling load on {mode}: {len(offsets)} requests over {sum(p[1] for p in PHASES):.0f} s "
                        f"(peak {settings.rate:g}/s, {OUTPUT_TOKENS} tokens each)")
        modes[mode] = _run_mode(settings, mode, offsets, prompts, work_dir)
        log(LOG_PREFIX, f"{mode}: SLO attainment {modes[mode]['slo_attainment']:.1%}, "
                        f"{modes[mode]['te_seconds']:.0f} TE-seconds, {modes[mode]['failed']} failed")
    return {"phases": [list(p) for p in PHASES], "output_tokens": OUTPUT_TOKENS, "rate": settings.rate,
            "slo_ttft_s": settings.slo_ttft_s, "max_tes": settings.max_tes, "modes": modes}


def _run_mode(settings: ScaleBenchSettings, mode: str, offsets: list[float], prompts: list[list[int]],
              work_dir: Path) -> dict:
    import httpx

    deployment = _autoscale_deployment(mode, settings.max_tes, settings.slo_ttft_s)
    samples: list[dict] = []
    stop = threading.Event()
    records = [RequestRecord(i, len(p), OUTPUT_TOKENS) for i, p in enumerate(prompts)]
    model_name = Path(settings.model_dir).name
    with managed(settings.model_dir, deployment, work_dir, autoscale=mode == "autoscaled", preload=True,
                 hold_s=300) as manager:
        url = manager.http_addrs()[0]
        origin = time.perf_counter()

        def sample() -> None:
            while not stop.is_set():
                tes = [t for t in manager.status().tes if t.state != "dead"]
                samples.append({"t": time.perf_counter() - origin, "tes": len(tes),
                                "serving": sum(1 for t in tes if t.state == "ready"),
                                "queue": sum(t.num_waiting for t in tes), "running": sum(t.num_running for t in tes)})
                stop.wait(SAMPLE_S)

        async def one(client: httpx.AsyncClient, i: int) -> None:
            await asyncio.sleep(max(0.0, origin + offsets[i] - time.perf_counter()))
            await send_request(client, model_name, WorkloadRequest(prompts[i], OUTPUT_TOKENS), records[i], origin)

        async def drive() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=256)) as client:
                await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(len(offsets)))), timeout=900)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            asyncio.run(drive())
        finally:
            stop.set()
            sampler.join(5)
        duration = time.perf_counter() - origin
    return _autoscale_summary(records, samples, duration, settings.slo_ttft_s)


def _autoscale_summary(records: list[RequestRecord], samples: list[dict], duration: float, slo: float) -> dict:
    te_seconds = sum(s["tes"] * SAMPLE_S for s in samples)
    ok = [r for r in records if r.ok]
    return {"requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
            "errors": sorted({r.error for r in records if r.error})[:5],
            "slo_attainment": sum(1 for r in ok if r.ttft_s <= slo) / max(1, len(records)),
            "ttft_p50_s": report.percentile([r.ttft_s for r in ok], 50) if ok else None,
            "ttft_p99_s": report.percentile([r.ttft_s for r in ok], 99) if ok else None,
            "te_seconds": te_seconds, "duration_s": duration,
            "first_after_zero": _first_after_zero(records),
            "requests_over_time": [{"t": r.send_time_s, "ttft_s": r.ttft_s, "ok": r.ok} for r in records],
            "pool_over_time": samples}


def _first_after_zero(records: list[RequestRecord]) -> dict | None:
    """The first request of the "back" phase (the autoscaled pool is at zero then): how long it waited."""
    back = sum(p[1] for p in PHASES[:[p[0] for p in PHASES].index("back")])
    later = sorted((r for r in records if r.send_time_s is not None and r.send_time_s >= back),
                   key=lambda r: r.send_time_s)
    if not later:
        return None
    first = later[0]
    return {"sent_at_s": first.send_time_s, "ok": first.ok, "ttft_s": first.ttft_s, "error": first.error}


# ---------------------------------------------------------------- summary and plot
def summary_lines(result: dict) -> list[str]:
    lines = []
    breakdown = result.get("breakdown")
    if breakdown:
        lines.append("scale-up, first token after the decision (median) and its steps:")
        for case, data in breakdown["cases"].items():
            steps = ", ".join(f"{STEP_LABELS[k]} {data['steps'][k]:.2f}" for k in STEPS)
            lines.append(f"  {case:15s} {data['ttft_s']:6.2f} s   ({steps}; weights from {data['load_source']})")
            if data.get("pre_load_parts"):
                lines.append("  " + " " * 15 + "   TE-Pre-Load: " + ", ".join(
                    f"{PRE_LOAD_LABELS[k]} {v:.2f}" for k, v in data["pre_load_parts"].items()))
        for name, value in breakdown["ratios"].items():
            lines.append(f"  {name}: {value:.2f}x")
    load = result.get("load_by_source")
    if load:
        lines.append("TE-Load of one rank by weight source (median; bound: the bytes at the bandwidth measured):")
        for row in load["results"]:
            lines.append(f"  {row['source']:11s} {statistics.median(row['seconds']):5.2f} s   bound "
                         f"{row['bound_s']:.2f} s ({row['nbytes'] / 1e9:.2f} GB at {row['bandwidth_gbps']:.2f} GB/s)")
    fanout = result.get("fork_fanout")
    if fanout:
        lines.append("fork to several TEs at once: " + ", ".join(
            f"{row['count']} in {row['all_done_s']:.2f} s" for row in fanout) + " (source step "
            f"{fanout[0]['source_step_idle_ms']:.0f} ms idle; " + ", ".join(
                f"{row['source_step_during_ms']:.0f}" for row in fanout) + " ms during)")
    auto = result.get("autoscale")
    if auto:
        lines.append(f"autoscaling (peak {auto['rate']} req/s, TTFT SLO {auto['slo_ttft_s']} s):")
        for mode, data in auto["modes"].items():
            lines.append(f"  {mode:11s} SLO attainment {data['slo_attainment']:6.1%}  TE-seconds "
                         f"{data['te_seconds']:6.0f}  TTFT p50 {data['ttft_p50_s'] or float('nan'):.2f} s  "
                         f"failed {data['failed']}")
            first = data.get("first_after_zero")
            if mode == "autoscaled" and first:
                lines.append("  first request after the pool scaled to zero: "
                             + (f"answered, first token after {first['ttft_s']:.2f} s" if first["ok"]
                                else f"failed: {first['error']}"))
    return lines


def plot_scale(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = sum(1 for p in ("breakdown", "load_by_source", "fork_fanout") if result.get(p)) + \
        (2 if result.get("autoscale") else 0)
    fig, axes = plt.subplots(1, max(1, count), figsize=(5.5 * max(1, count), 4.5), squeeze=False)
    axes = list(axes[0])
    if result.get("breakdown"):
        _plot_breakdown(axes.pop(0), result["breakdown"]["cases"])
    if result.get("load_by_source"):
        _plot_load_by_source(axes.pop(0), result["load_by_source"]["results"])
    if result.get("fork_fanout"):
        _plot_fork_fanout(axes.pop(0), result["fork_fanout"])
    if result.get("autoscale"):
        _plot_autoscale(axes.pop(0), axes.pop(0), result["autoscale"])
    fig.tight_layout()
    return report.save_figure(fig, path)


def _plot_breakdown(ax, cases: dict) -> None:
    bottom = [0.0] * len(cases)
    for step in STEPS:
        values = [max(0.0, cases[c]["steps"][step]) for c in cases]
        ax.bar(list(cases), values, bottom=bottom, label=STEP_LABELS[step])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(list(cases), [cases[c]["ttft_s"] for c in cases], "k^", label="first token")
    ax.set_ylabel("seconds after the scale-up decision")
    ax.set_title("scale-up steps (deepserve Fig. 9)")
    ax.legend(fontsize=8)


def _plot_load_by_source(ax, rows: list[dict]) -> None:
    names = [row["source"] for row in rows]
    ax.bar(names, [statistics.median(row["seconds"]) for row in rows], label="measured")
    ax.plot(names, [row["bound_s"] for row in rows], "k_", markersize=30, mew=2, label="bytes / bandwidth")
    ax.set_ylabel("TE-Load of one rank (s)")
    ax.set_title("TE-Load by weight source (Fig. 10)")
    ax.legend(fontsize=8)


def _plot_fork_fanout(ax, rows: list[dict]) -> None:
    ax.plot([row["count"] for row in rows], [row["all_done_s"] for row in rows], "o-")
    ax.set_xticks([row["count"] for row in rows])
    ax.set_xlabel("TEs forking from one source at once")
    ax.set_ylabel("seconds until all hold their weights")
    ax.set_title("fork fan-out (Fig. 11a)")


def _plot_autoscale(ax_tes, ax_ttft, auto: dict) -> None:
    for mode, data in auto["modes"].items():
        ts = [s["t"] for s in data["pool_over_time"]]
        ax_tes.plot(ts, [s["tes"] for s in data["pool_over_time"]], label=f"{mode} TEs")
        if mode == "autoscaled":
            ax_tes.plot(ts, [s["queue"] for s in data["pool_over_time"]], ":", label="autoscaled queue")
        done = [r for r in data["requests_over_time"] if r["ok"]]
        ax_ttft.scatter([r["t"] for r in done], [r["ttft_s"] for r in done], s=6,
                        label=f"{mode} ({data['slo_attainment']:.0%} in SLO, {data['te_seconds']:.0f} TE-s)")
    ax_ttft.axhline(auto["slo_ttft_s"], color="k", ls="--", lw=1)
    ax_tes.set_xlabel("seconds")
    ax_tes.set_title("TEs and queue over time")
    ax_tes.legend(fontsize=8)
    ax_ttft.set_xlabel("request sent at (s)")
    ax_ttft.set_ylabel("TTFT (s)")
    ax_ttft.set_title("TTFT over time")
    ax_ttft.legend(fontsize=8)
