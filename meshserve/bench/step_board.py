"""`meshserve bench step-board`: what one round of the step board (meshserve/parallel/step_board.py) costs rank 0
as the world grows, with every rank on a host of its own (rank 0 holds one connection per rank) against ranks
grouped by host (rank 0 holds one per other host, and its own host's ranks; each host's leader gathers the rest).

The ranks are threads of this process, each with its own sockets (TCP over loopback between hosts, Unix sockets
within one), meeting in one in-process store. For each world size and layout the ranks run `--rounds` rounds of
rows as wide as the step agreement's (5 integers) after `--warmup` rounds, `--repeats` times; reported are the
medians of rank 0's CPU time per round (its thread's own, `time.thread_time`) and of the round's wall time. All
threads share one interpreter here, so the wall time grows with the world whatever the layout; rank 0's CPU is
what a host with a core per rank pays on the critical path of every step.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshserve.bench.deployment_load import log, one_line_errors, run_bench_cli
from meshserve.utils import report

PROG = "meshserve bench step-board"
LOG_PREFIX = "bench step-board"
DEFAULT_JSON = "bench-results/step_board.json"
ROW_WIDTH = 5  # the step agreement's row (worker/step_agreement.py)
MEET_S = 120.0


def add_step_board_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 128, 320],
                        help="world sizes (default: 8 64 128 320)")
    parser.add_argument("--ranks-per-host", type=int, default=8,
                        help="ranks per host in the grouped layout (default: 8, a SuperPod server's dies)")
    parser.add_argument("--rounds", type=int, default=200, help="measured rounds per repeat (default: 200)")
    parser.add_argument("--warmup", type=int, default=20, help="rounds before measuring (default: 20)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per point, medians reported (default: 3)")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"result file; a PNG with the same name is written next to it (default: {DEFAULT_JSON})")
    parser.set_defaults(func=step_board_main)


@dataclasses.dataclass(frozen=True)
class StepBoardSettings:
    worlds: tuple[int, ...]
    ranks_per_host: int
    rounds: int
    warmup: int
    repeats: int
    json_path: str

    def layouts(self) -> dict[str, int]:
        """Layout name -> ranks per host."""
        return {"a host per rank": 1, f"{self.ranks_per_host} ranks per host": self.ranks_per_host}


def settings_from_args(args: argparse.Namespace) -> StepBoardSettings:
    for flag in ("ranks_per_host", "rounds", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    if any(world < 2 for world in args.worlds) or len(set(args.worlds)) != len(args.worlds):
        raise ValueError(f"--worlds takes distinct sizes of at least 2, got {' '.join(map(str, args.worlds))}")
    return StepBoardSettings(worlds=tuple(sorted(args.worlds)), ranks_per_host=args.ranks_per_host,
                             rounds=args.rounds, warmup=args.warmup, repeats=args.repeats, json_path=args.json)


def step_board_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_step_board_benchmark, (OSError, TimeoutError),
                         _report)


def run_step_board_benchmark(settings: StepBoardSettings) -> dict:
    rows = []
    for world in settings.worlds:
        for layout, per_host in settings.layouts().items():
            runs = [_measure(world, per_host, settings, repeat) for repeat in range(settings.repeats)]
            rows.append({"world": world, "layout": layout, "ranks_per_host": per_host,
                         "hosts": -(-world // per_host),
                         "rank0_cpu_us_per_round": statistics.median(r[0] for r in runs),
                         "wall_us_per_round": statistics.median(r[1] for r in runs)})
            log(LOG_PREFIX, f"world {world}, {layout}: {rows[-1]['rank0_cpu_us_per_round']:.0f} us of rank 0's "
                            f"CPU per round")
    for row in rows:
        flat = next(r for r in rows if r["world"] == row["world"] and r["ranks_per_host"] == 1)
        row["rank0_cpu_vs_host_per_rank"] = row["rank0_cpu_us_per_round"] / max(1e-9, flat["rank0_cpu_us_per_round"])
    return {"config": dataclasses.asdict(settings), "rows": rows}


def _measure(world: int, per_host: int, settings: StepBoardSettings, repeat: int) -> tuple[float, float]:
    """(rank 0's CPU, the wall time) per round, in microseconds, for one board of `world` ranks."""
    # start-up: torch (the store) only when the benchmark runs
    import torch.distributed as dist

    from meshserve.parallel.step_board import StepBoard

    store = dist.HashStore()
    measured: list[tuple[float, float]] = []

    def rank_loop(rank: int) -> None:
        board = StepBoard.open(store, rank, world, repeat + 1, MEET_S, MEET_S, "127.0.0.1",
                               f"host-{rank // per_host}")
        try:
            row = [rank] * ROW_WIDTH
            for _ in range(settings.warmup):
                board.exchange(row)
            cpu, wall = time.thread_time(), time.perf_counter()
            for _ in range(settings.rounds):
                board.exchange(row)
            if rank == 0:
                measured.append((1e6 * (time.thread_time() - cpu) / settings.rounds,
                                 1e6 * (time.perf_counter() - wall) / settings.rounds))
        finally:
            board.close()

    with ThreadPoolExecutor(world) as pool:
        for future in [pool.submit(rank_loop, rank) for rank in range(world)]:
            future.result(timeout=MEET_S + 600)
    return measured[0]


def table_lines(result: dict) -> list[str]:
    lines = [f"{'world':>6} {'layout':<20}{'hosts':>6}{'rank 0 CPU us/round':>21}{'vs a host per rank':>20}"
             f"{'wall us/round':>15}"]
    for row in result["rows"]:
        lines.append(f"{row['world']:>6} {row['layout']:<20}{row['hosts']:>6}{row['rank0_cpu_us_per_round']:>21.0f}"
                     f"{row['rank0_cpu_vs_host_per_rank']:>20.2f}{row['wall_us_per_round']:>15.0f}")
    config = result["config"]
    lines.append(f"(ranks as threads of one process, TCP over loopback between hosts; medians of {config['repeats']} "
                 f"x {config['rounds']} rounds of {ROW_WIDTH}-integer rows)")
    return lines


def plot_step_board(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure()
    ax = axes[0][0]
    for layout in dict.fromkeys(row["layout"] for row in result["rows"]):
        rows = [row for row in result["rows"] if row["layout"] == layout]
        ax.plot([row["world"] for row in rows], [row["rank0_cpu_us_per_round"] for row in rows], marker="o",
                label=layout)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("rank 0's CPU per round (us)")
    ax.set_title("step board: rank 0's work per round")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return report.save_figure(fig, path)


def _report(settings: StepBoardSettings, result: dict) -> None:
    report.publish(settings.json_path, result, plot_step_board, table_lines(result))
