"""`meshserve bench control-plane`: the control plane's cost per decode step as the DP degree grows, with every DP
group driven by one master (`lockstep`, the baseline) and with self-contained DP groups (xdeepserve §4.2).

For each DP degree d of `--dp` and each way of running the groups, one engine `attn=TP1+DPd moe=TP1+EPd` is
started (tiny model, real ranks) and sent `--requests-per-group` x d concurrent greedy requests (EOS ignored, so
every group decodes its share together, one token per step) `--repeats` times. Per repeat:

- control CPU per step: the CPU time (every thread's, from the kernel's scheduler statistics) of the processes
  that drive the steps, divided by the decode steps. Lockstep: the master, which schedules every group, sends every rank
  every group's part and takes every group's output. Self-contained: the shell plus the busiest group master
  (the groups' masters run side by side, each on its own group). CPU time, unlike wall time, does not grow
  when the ranks and masters of DP 8 share a few cores, so it shows what a host with a core per process would
  see on its critical path; the sum over every group master is reported too.
- wall time per step (the run's wall time over its steps), on this host's cores.

The medians over repeats are reported, with each DP degree's ratio against DP 1 of the same way of running (the
goal: self-contained DP 8 within 1.2x of DP 1). With `--remote-ranks`, each engine of DP > 1 runs a second time
with its ranks 1..d-1 started the way ranks on other hosts are (`meshserve worker --engine tcp://HOST:PORT --rank
R`, here over loopback): every message between the masters and the ranks, and the self-contained ranks' step
board, then go over authenticated TCP; those rows are compared with the same engine's ranks on one host. Writes
the JSON and a PNG (control CPU per step against the DP degree, both ways).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from meshserve.bench.deployment_load import check_model_dir, log, one_line_errors, run_bench_cli
from meshserve.config.base import ConfigError
from meshserve.engine.core_client import EngineStartupError
from meshserve.utils import envs, report
from meshserve.utils.processes import free_tcp_port, process_tree, stop_process
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

PROG = "meshserve bench control-plane"
LOG_PREFIX = "bench control-plane"
DEFAULT_JSON = "bench-results/control_plane.json"
LOCKSTEP, SELF_CONTAINED = "lockstep", "self-contained"
MODES = (LOCKSTEP, SELF_CONTAINED)
LOCAL, REMOTE = "local", "remote"  # where a row's ranks 1..d-1 run: started by the master, or joined over TCP
_FULL = {"requests_per_group": 8, "output_len": 128, "prompt_len": 8, "repeats": 3}
_QUICK = {"requests_per_group": 2, "output_len": 8, "prompt_len": 4, "repeats": 1}
_ERRORS = (ConfigError, EngineStartupError, EngineDeadError, OSError, RuntimeError, TimeoutError)


def add_control_plane_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format model directory (default: the tiny default model)")
    parser.add_argument("--dp", type=int, nargs="+", default=None,
                        help="DP degrees, each with as many EP ranks (default: 1 2 4 8; --quick: 1 2)")
    parser.add_argument("--model-ms", type=float, default=20.0,
                        help="the ranks run without a model (MESHSERVE_NULL_MODEL_MS), each forward sleeping this "
                             "long, so a step's wall time beyond it is its non-model time (default: 20)")
    parser.add_argument("--real-model", action="store_true",
                        help="run the model's forward on every rank instead (wall times then include it)")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest run (for tests): the --quick value of every option below not given")
    parser.add_argument("--requests-per-group", type=int,
                        help="concurrent requests per DP group (default: 8; --quick: 2)")
    parser.add_argument("--output-len", type=int, help="tokens per request (default: 128; --quick: 8)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per request (default: 8; --quick: 4)")
    parser.add_argument("--repeats", type=int, help="runs per engine, medians reported (default: 3; --quick: 1)")
    parser.add_argument("--remote-ranks", action="store_true",
                        help="also run each engine of DP > 1 with ranks 1..d-1 joining over TCP as ranks on other "
                             "hosts do (`meshserve worker`, loopback here)")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"result file; a PNG with the same name is written next to it (default: {DEFAULT_JSON})")
    parser.set_defaults(func=control_plane_main)


@dataclasses.dataclass(frozen=True)
class ControlPlaneSettings:
    model_dir: str | None
    model_ms: float | None  # the null ranks' forward time; None: the real model
    dp: tuple[int, ...]
    requests_per_group: int
    output_len: int
    prompt_len: int
    repeats: int
    json_path: str
    remote_ranks: bool = False

    def engine_args(self, dp: int, mode: str) -> dict:
        return {"parallel": f"attn=TP1+DP{dp} moe=TP1+EP{dp}", "dp_groups": mode,
                "max_num_seqs": max(8, self.requests_per_group), "enable_prefix_caching": False,
                "kv_cache_memory_gb": 0.05, "num_threads": 1}


def settings_from_args(args: argparse.Namespace) -> ControlPlaneSettings:
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else (_QUICK if args.quick else _FULL)[key]
             for key in _FULL}
    for key, value in sizes.items():
        if value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    dp = tuple(args.dp) if args.dp else ((1, 2) if args.quick else (1, 2, 4, 8))
    if any(d < 1 for d in dp) or len(set(dp)) != len(dp):
        raise ValueError(f"--dp takes distinct degrees of at least 1, got {' '.join(map(str, dp))}")
    if 1 not in dp:
        raise ValueError("--dp must include 1: every ratio is against DP 1")
    if args.model_ms < 0:
        raise ValueError(f"--model-ms must be at least 0, got {args.model_ms:g}")
    return ControlPlaneSettings(model_dir=args.model, model_ms=None if args.real_model else args.model_ms,
                                dp=tuple(sorted(dp)), json_path=args.json, remote_ranks=args.remote_ranks, **sizes)


def control_plane_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_control_plane_benchmark, _ERRORS, _report)


# ---------------------------------------------------------------- the run
def run_control_plane_benchmark(settings: ControlPlaneSettings) -> dict:
    model = check_model_dir(settings.model_dir)
    rows = []
    for dp in settings.dp:
        for mode in MODES:
            for ranks in (LOCAL, REMOTE) if settings.remote_ranks and dp > 1 else (LOCAL,):
                name = f"DP{dp} {mode}" + (", remote ranks" if ranks == REMOTE else "")
                log(LOG_PREFIX, f"{name}: starting")
                rows.append({"dp": dp, "mode": mode, "ranks": ranks, **_measure(model, dp, mode, ranks, settings)})
                log(LOG_PREFIX, f"{name}: {rows[-1]['control_cpu_ms_per_step']:.3f} ms control CPU per step")
    return _result(settings, model, rows)


def _measure(model: str, dp: int, mode: str, ranks: str, settings: ControlPlaneSettings) -> dict:
    """The medians over repeats of one engine's figures per decode step."""
    null = envs.MESHSERVE_NULL_MODEL_MS.set_to(f"{settings.model_ms:g}") if settings.model_ms is not None \
        else contextlib.nullcontext()
    with null:  # the engine's processes (the remote ranks too) read it as they start
        return _measure_engine(model, dp, mode, ranks, settings)


@contextlib.contextmanager
def _remote_workers(port: int, ranks: range) -> Iterator[list[subprocess.Popen]]:
    """Ranks started as on other hosts, each knocking at the TE's engine port until it answers; the TE's
    shutdown ends them."""
    # each on a host of its own as the step board sees it (its rows go to rank 0 over TCP)
    workers = [subprocess.Popen([sys.executable, "-m", "meshserve.entrypoints.cli", "--log-level", "warning",
                                 "worker", "--engine", f"tcp://127.0.0.1:{port}", "--rank", str(rank),
                                 "--timeout", "300"], stdin=subprocess.DEVNULL,
                                env={**os.environ, envs.MESHSERVE_HOST_ID.name: f"remote-host-{rank}"})
               for rank in ranks]
    try:
        yield workers
    finally:
        for worker in workers:
            stop_process(worker, grace_s=15.0)


def _measure_engine(model: str, dp: int, mode: str, ranks: str, settings: ControlPlaneSettings) -> dict:
    # start-up: the engine (torch, the tokenizer) only when the benchmark runs
    import torch

    from meshserve import LLM

    g = torch.Generator().manual_seed(dp)
    prompts = [torch.randint(100, 1000, (settings.prompt_len,), generator=g).tolist()
               for _ in range(settings.requests_per_group * dp)]
    params = SamplingParams(temperature=0.0, max_tokens=settings.output_len, ignore_eos=True)
    runs = []
    engine_args = settings.engine_args(dp, mode)
    with contextlib.ExitStack() as stack:
        workers = []
        if ranks == REMOTE:
            port = free_tcp_port("127.0.0.1")
            engine_args |= {"local_ranks": 1, "engine_port": port}
            workers = stack.enter_context(_remote_workers(port, range(1, dp)))
        llm = stack.enter_context(LLM(model=model, log_level=logging.WARNING, **engine_args))
        llm.generate(prompts[:dp], SamplingParams(temperature=0.0, max_tokens=2))  # first-call costs, not measured
        processes = _processes(llm.engine.proc.pid, mode, workers)
        for _ in range(settings.repeats):
            before = {name: _cpu_s(procs) for name, procs in processes.items()}
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            if any(len(out.outputs[0].token_ids) != settings.output_len for out in outs):
                raise RuntimeError(f"DP{dp} {mode}: a request ended early")
            used = {name: [after - then for after, then in zip(_cpu_s(procs), before[name])]
                    for name, procs in processes.items()}
            runs.append(_per_step(used, wall, settings.output_len, settings.model_ms))
    return medians(runs) | {"runs": runs}


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs (None where the runs have none: non-model time with the real model)."""
    return {key: None if runs[0][key] is None else statistics.median(run[key] for run in runs) for key in runs[0]}


def _processes(te_pid: int, mode: str, remote: list[subprocess.Popen]) -> dict[str, list]:
    """The TE's processes by part: the lockstep master, or the shell and each group's master; the ranks (those
    the masters started, and the `remote` ones)."""
    import psutil

    te = psutil.Process(te_pid)
    ranks = [p for p in process_tree(te_pid) if "run_worker" in " ".join(p.cmdline())]
    ranks += [psutil.Process(worker.pid) for worker in remote]
    if mode == LOCKSTEP:
        return {"master": [te], "ranks": ranks}
    masters = [p for p in te.children() if "run_group_master" in " ".join(p.cmdline())]
    return {"shell": [te], "group_masters": masters, "ranks": ranks}


def _cpu_s(procs: list) -> list[float]:
    """Each process's CPU time so far, all its threads (the sockets' I/O threads too), to the nanosecond where
    the kernel keeps scheduler statistics (the clock-tick counts elsewhere are too coarse for short runs)."""
    return [_schedstat_cpu_s(p.pid) or sum(p.cpu_times()[:2]) for p in procs]


def _schedstat_cpu_s(pid: int) -> float | None:
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def _per_step(used: dict[str, list[float]], wall_s: float, steps: int, model_ms: float | None) -> dict:
    """Milliseconds per decode step: wall time and, with null ranks, what of it is not the model's; the CPU of
    the step-driving processes on the critical path (the master; or the shell and the busiest group) and in
    all of them together; the busiest rank's CPU (with null ranks: all of it outside the model)."""
    if "master" in used:
        critical = total = used["master"][0]
    else:
        critical = used["shell"][0] + max(used["group_masters"])
        total = used["shell"][0] + sum(used["group_masters"])
    wall_ms = 1000 * wall_s / steps
    ranks = used["ranks"]
    # null ranks do all their work between forwards, at the same time: their CPU spread over the cores they can
    # use is the least non-model time this host allows
    floor_ms = None if model_ms is None or not ranks else \
        1000 * sum(ranks) / steps / min(len(ranks), os.cpu_count() or 1)
    return {"wall_ms_per_step": wall_ms,
            "non_model_ms_per_step": None if model_ms is None else max(0.0, wall_ms - model_ms),
            "cpu_floor_ms_per_step": floor_ms,
            "control_cpu_ms_per_step": 1000 * critical / steps, "control_cpu_total_ms_per_step": 1000 * total / steps,
            "rank_cpu_ms_per_step": 1000 * max(ranks, default=0.0) / steps}


def _result(settings: ControlPlaneSettings, model: str, rows: list[dict]) -> dict:
    """Each row's ratios against DP 1 of the same way of running; the headline: self-contained at the largest DP
    degree in control-plane CPU on the critical path (and, with null ranks, in non-model wall time)."""
    for row in rows:
        base = next(r for r in rows if r["mode"] == row["mode"] and r["dp"] == 1)  # DP 1 has one rank: local
        for key in ("control_cpu_ms_per_step", "wall_ms_per_step", "non_model_ms_per_step", "rank_cpu_ms_per_step"):
            if row[key] is not None:
                row[key.removesuffix("_ms_per_step") + "_vs_dp1"] = row[key] / max(1e-9, base[key])
    largest = max(settings.dp)
    flat = next(r for r in rows if r["mode"] == SELF_CONTAINED and r["dp"] == largest and r["ranks"] == LOCAL)
    remote = next((r for r in rows if r["mode"] == SELF_CONTAINED and r["dp"] == largest and r["ranks"] == REMOTE),
                  None)
    return {"config": {"model": model, **{k: v for k, v in dataclasses.asdict(settings).items()
                                          if k not in ("model_dir", "json_path")}},
            "rows": rows, "largest_dp": largest, "self_contained_largest_vs_dp1": flat["control_cpu_vs_dp1"],
            "self_contained_largest_non_model_vs_dp1": flat.get("non_model_vs_dp1"),
            "self_contained_largest_rank_cpu_vs_dp1": flat["rank_cpu_vs_dp1"], "cpu_count": os.cpu_count(),
            # ranks joined over TCP against the same engine's ranks on one host, at the largest DP degree
            "self_contained_remote_vs_local": None if remote is None else {
                key: remote[key] / max(1e-9, flat[key]) for key in ("wall_ms_per_step", "rank_cpu_ms_per_step",
                                                                    "control_cpu_ms_per_step")},
            "goal": 1.2}


# ---------------------------------------------------------------- the report
def table_lines(result: dict) -> list[str]:
    lines = [f"{'DP':>3} {'groups':<23}{'non-model ms':>13}{'vs DP1':>8}{'floor':>7}{'ctl CPU ms':>11}{'vs DP1':>8}"
             f"{'all masters':>12}{'rank CPU':>10}{'vs DP1':>8}{'wall ms':>9}"]
    for row in result["rows"]:
        non_model, floor = row["non_model_ms_per_step"], row["cpu_floor_ms_per_step"]
        shown = (f"{non_model:>13.2f}{row['non_model_vs_dp1']:>8.2f}{floor:>7.2f}" if non_model is not None
                 else f"{'-':>13}{'-':>8}{'-':>7}")
        groups = row["mode"] + (", remote" if row["ranks"] == REMOTE else "")
        lines.append(f"{row['dp']:>3} {groups:<23}{shown}{row['control_cpu_ms_per_step']:>11.3f}"
                     f"{row['control_cpu_vs_dp1']:>8.2f}{row['control_cpu_total_ms_per_step']:>12.3f}"
                     f"{row['rank_cpu_ms_per_step']:>10.3f}{row['rank_cpu_vs_dp1']:>8.2f}{row['wall_ms_per_step']:>9.2f}")
    config = result["config"]
    ranks = "the real model" if config["model_ms"] is None else f"null ranks, {config['model_ms']:g} ms forwards"
    non_model = result["self_contained_largest_non_model_vs_dp1"]
    lines.append(f"(per decode step; {ranks}; medians over {config['repeats']} run(s) of "
                 f"{config['requests_per_group']} requests per group x {config['output_len']} tokens; ctl CPU: the "
                 f"lockstep master, or the shell plus the busiest group master; floor: the ranks' CPU over the "
                 f"{result['cpu_count']} cores they share; self-contained DP{result['largest_dp']} against DP1: "
                 f"{result['self_contained_largest_vs_dp1']:.2f}x in control CPU, "
                 f"{result['self_contained_largest_rank_cpu_vs_dp1']:.2f}x in the busiest rank's CPU"
                 + ("" if non_model is None else f", {non_model:.2f}x in non-model time")
                 + f"; goal {result['goal']}x)")
    remote = result["self_contained_remote_vs_local"]
    if remote is not None:
        lines.append(f"(self-contained DP{result['largest_dp']} with ranks 1.. joined over TCP against the same "
                     f"ranks on one host: {remote['wall_ms_per_step']:.2f}x in wall time, "
                     f"{remote['rank_cpu_ms_per_step']:.2f}x in the busiest rank's CPU)")
    return lines


def plot_control_plane(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2)
    time_ax, cpu = axes[0][0], axes[0][1]
    key = "non_model_ms_per_step" if result["config"]["model_ms"] is not None else "wall_ms_per_step"
    for mode in MODES:
        for ranks in (LOCAL, REMOTE):
            # the remote line starts from DP 1, which has no rank to join from elsewhere
            rows = [r for r in result["rows"] if r["mode"] == mode and (r["ranks"] == ranks or r["dp"] == 1)]
            if ranks == REMOTE and len(rows) < 2:
                continue
            dps = [r["dp"] for r in rows]
            label = mode + (", remote ranks" if ranks == REMOTE else "")
            style = "--" if ranks == REMOTE else "-"
            time_ax.plot(dps, [r[key] for r in rows], style, marker="o", label=label)
            cpu.plot(dps, [r["control_cpu_ms_per_step"] for r in rows], style, marker="o", label=label)
    for ax, title in ((time_ax, f"{key.removesuffix('_ms_per_step').replace('_', '-')} time per decode step"),
                      (cpu, "control-plane CPU per decode step (critical path)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("DP degree (= EP degree)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
        ax.grid(True, alpha=0.3)
    return report.save_figure(fig, path)


def _report(settings: ControlPlaneSettings, result: dict) -> None:
    report.publish(settings.json_path, result, plot_control_plane, table_lines(result))
