"""`meshserve profile pd`: where disaggregated prefill/decode beats colocated serving (deepserve §5.3.1, Fig. 6).

  meshserve profile pd --model DIR --out DIR [--prefill-lengths 64,256,1024] [--ratios 0.0625,0.25,1,2]
                       [--rates 2,8] [--requests-per-cell 8] [--colocated colocated2] [--disaggregated 1p1d]

A colocated deployment and a disaggregated one run on the same cores one after the other (each gets the
whole machine). The default colocated side is two TEs, like the P/D pair, so both have the same number
of ranks and threads (deepserve compares the two with the same resources); `--colocated colocated` is
one TE with all the threads instead. For each cell (prefill length, decode/prefill ratio, request rate) both serve
the same batch of identical-shape requests (random token-id prompts, ignore_eos, max_tokens = ratio x prefill, at
least 1) sent at that fixed rate through a job executor, and each request's job completion time (JCT:
completion - arrival) is measured. A cell's value is mean JCT colocated / mean JCT disaggregated - 1
(positive: disaggregation wins). Writes OUT/pd_heatmap.json (read by `routing: pd_aware | combined`
deployments through their `heatmap:` key), OUT/pd_heatmap.png and the raw measurements OUT/pd_profile.json.
Cells that do not fit the model's context are left unmeasured.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from meshserve.bench.deployment_load import (
    add_engine_flags,
    check_model_dir,
    engine_settings,
    log,
    model_max_len,
    one_line_errors,
    parse_list,
    run_fixed_rate,
    started_deployment,
    summarize_timings,
    vocabulary,
    warm_up,
)
from meshserve.bench.workload import make_offline_workload
from meshserve.config import ConfigError
from meshserve.router.pd_heatmap import PDHeatmap, measure_cell
from meshserve.utils import report

DEFAULT_PREFILL_LENGTHS = "64,256,1024"
DEFAULT_RATIOS = "0.0625,0.25,1,2"
DEFAULT_RATES = "2,8"
DEFAULT_REQUESTS_PER_CELL = 8
HEATMAP_FILE = "pd_heatmap.json"
RAW_FILE = "pd_profile.json"
LOG = "profile pd"


@dataclass(frozen=True)
class Cell:
    prefill_tokens: int
    ratio: float  # decode / prefill length
    rps: float

    @property
    def decode_tokens(self) -> int:
        return max(1, round(self.ratio * self.prefill_tokens))

    def describe(self) -> str:
        return (f"prefill {self.prefill_tokens}, ratio {self.ratio:g} ({self.decode_tokens} out), "
                f"{self.rps:g} rps")


def add_profile_commands(subparsers) -> None:
    """Add `profile` and its `pd` subcommand to the top-level `meshserve` subparsers."""
    profile = subparsers.add_parser("profile", help="profile serving setups (inputs of the routing policies)")
    commands = profile.add_subparsers(dest="profile_command", required=True)
    pd = one_line_errors(commands.add_parser(
        "pd", help="colocated vs disaggregated JCT over prefill length x decode/prefill ratio x request rate: "
                   "the PD heatmap"), "meshserve profile pd")
    pd.add_argument("--model", default=None, help="HF-format model directory (default: the tiny default model)")
    pd.add_argument("--out", required=True, help=f"output directory: {HEATMAP_FILE}, its PNG and {RAW_FILE}")
    pd.add_argument("--prefill-lengths", dest="prefill_lengths", default=DEFAULT_PREFILL_LENGTHS,
                    help=f"prompt lengths, tokens (default: {DEFAULT_PREFILL_LENGTHS})")
    pd.add_argument("--ratios", default=DEFAULT_RATIOS,
                    help=f"decode/prefill length ratios (default: {DEFAULT_RATIOS})")
    pd.add_argument("--rates", default=DEFAULT_RATES, help=f"request rates, requests/s (default: {DEFAULT_RATES})")
    pd.add_argument("--requests-per-cell", dest="requests_per_cell", type=int, default=DEFAULT_REQUESTS_PER_CELL,
                    help=f"requests sent per cell and setup (default: {DEFAULT_REQUESTS_PER_CELL})")
    pd.add_argument("--colocated", default="colocated2",
                    help="the colocated deployment: a preset or a file with colocated TEs only (default: colocated2, "
                         "as many TEs as the default P/D pair)")
    pd.add_argument("--disaggregated", default="1p1d",
                    help="the disaggregated deployment: a preset or a file with P/D TEs only (default: 1p1d)")
    pd.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    pd.add_argument("--cell-timeout", dest="cell_timeout", type=float, default=600.0,
                    help="limit on one cell's requests, seconds; unfinished ones are aborted (default: 600)")
    add_engine_flags(pd)
    pd.set_defaults(func=profile_pd_main)


def profile_pd_main(args: argparse.Namespace) -> int:
    try:
        prefill_lengths = sorted(parse_list(args.prefill_lengths, "--prefill-lengths", int))
        ratios = sorted(parse_list(args.ratios, "--ratios"))
        rates = sorted(parse_list(args.rates, "--rates"))
        if args.requests_per_cell < 1:
            raise ValueError(f"--requests-per-cell must be at least 1, got {args.requests_per_cell}")
        if not args.cell_timeout > 0:
            raise ValueError(f"--cell-timeout must be positive, got {args.cell_timeout}")
        engine = engine_settings(args)
        setups = {"colocated": _deployment(args.colocated, "--colocated", {"colocated"}),
                  "disaggregated": _deployment(args.disaggregated, "--disaggregated", {"prefill", "decode"})}
        model = check_model_dir(args.model)
        result = run_profile(model, Path(args.out), prefill_lengths, ratios, rates, args.requests_per_cell,
                             engine, setups, args.seed, args.cell_timeout)
    except (ValueError, OSError, ConfigError, RuntimeError, TimeoutError) as exc:
        print(f"meshserve profile pd: error: {exc}", file=sys.stderr)
        return 2
    for line in summary_lines(result):
        print(line)
    files = result["files"]
    print(f"wrote {files['heatmap']}, {files['heatmap_png']} and {files['raw']}")
    return 0


def _deployment(name: str, flag: str, roles: set[str]):
    # start-up: zmq only when profiling
    from meshserve.router.deployment import load_multi

    deployment = load_multi(name)
    present = set(deployment.role_counts())
    if not present or not present <= roles or (roles == {"prefill", "decode"} and present != roles):
        raise ConfigError(f"{flag} {name!r} has TEs of roles {', '.join(sorted(present)) or 'none'}; "
                          f"it needs {' and '.join(sorted(roles))} TEs only")
    return deployment


def run_profile(model: str, out_dir: Path, prefill_lengths: list[int], ratios: list[float], rates: list[float],
                requests_per_cell: int, engine: dict, setups: dict, seed: int = 0,
                cell_timeout_s: float = 600.0) -> dict:
    """Measure every cell on each setup (one deployment at a time), then write the heatmap and raw data."""
    max_len = model_max_len(model, engine)
    cells = [Cell(p, r, rps) for rps in rates for p in prefill_lengths for r in ratios]
    fits = [c for c in cells if c.prefill_tokens + c.decode_tokens <= max_len]
    if not fits:
        raise ValueError(f"no cell fits the model's context of {max_len} tokens (prefill + ratio x prefill)")
    vocab_size, special = vocabulary(model)
    workloads = {c: make_offline_workload(requests_per_cell, (c.prefill_tokens,) * 2, (c.decode_tokens,) * 2,
                                          vocab_size, seed=seed * 1000 + i, exclude_token_ids=special)
                 for i, c in enumerate(fits)}  # the same prompts for both setups, fresh ones for every cell
    timings: dict[str, dict[Cell, list]] = {}
    for setup, deployment in setups.items():
        log(LOG, f"starting the {setup} deployment ({_names(deployment)})")
        with started_deployment(model, deployment, engine) as je:
            timings[setup] = asyncio.run(_measure_setup(je, setup, fits, workloads, max(prefill_lengths),
                                                        vocab_size, special, cell_timeout_s))
    grids: dict[float, list[list[float | None]]] = {
        rps: [[None] * len(ratios) for _ in prefill_lengths] for rps in rates}
    rows = []
    for cell in cells:
        row = {"prefill_tokens": cell.prefill_tokens, "ratio": cell.ratio, "decode_tokens": cell.decode_tokens,
               "rps": cell.rps, "value": None, "skipped": None}
        if cell not in workloads:
            row["skipped"] = f"prefill + decode = {cell.prefill_tokens + cell.decode_tokens} > {max_len} tokens"
        else:
            jcts = {}
            for setup in setups:
                got = timings[setup][cell]
                row[setup] = {**summarize_timings(got), "jct_s": [t.jct_s for t in got if t.ok]}
                jcts[setup] = row[setup]["jct_s"]
            if all(jcts.values()):
                row["value"] = measure_cell(jcts["colocated"], jcts["disaggregated"])
                grids[cell.rps][prefill_lengths.index(cell.prefill_tokens)][ratios.index(cell.ratio)] = row["value"]
        rows.append(row)
    heatmap = PDHeatmap(bin_edges(prefill_lengths), bin_edges(ratios), grids)
    heatmap_path = heatmap.save(out_dir / HEATMAP_FILE)
    png_path = heatmap.plot(report.png_path_for(heatmap_path))
    result = {
        "machine": report.machine_info(),
        "model": model,
        "settings": {"prefill_lengths": prefill_lengths, "ratios": ratios, "rates": rates,
                     "requests_per_cell": requests_per_cell, "engine": engine, "seed": seed,
                     "max_model_len": max_len, "arrivals": "evenly spaced at the cell's rate"},
        "setups": {setup: _names(deployment) for setup, deployment in setups.items()},
        "cells": rows,
        "heatmap": heatmap.to_dict(),
        "combined": heatmap.combined(),
    }
    raw_path = out_dir / RAW_FILE
    result["files"] = {"heatmap": str(heatmap_path), "heatmap_png": str(png_path), "raw": str(raw_path)}
    report.write_json(raw_path, result)
    return result


async def _measure_setup(je, setup: str, cells: list[Cell], workloads: dict, longest_prompt: int, vocab_size: int,
                         special: set[int], cell_timeout_s: float) -> dict[Cell, list]:
    await warm_up(je, longest_prompt, vocab_size, special)
    out = {}
    for i, cell in enumerate(cells):
        got = await run_fixed_rate(je, workloads[cell], cell.rps, tag=f"{setup}-cell{i}", timeout_s=cell_timeout_s)
        out[cell] = got
        jcts = [t.jct_s for t in got if t.ok]
        mean = f"mean JCT {sum(jcts) / len(jcts):.3f} s" if jcts else "no request finished"
        log(LOG, f"{setup} cell {i + 1}/{len(cells)}: {cell.describe()}: {len(jcts)}/{len(got)} ok, {mean}")
    return out


def _names(deployment) -> str:
    return ", ".join(spec.name for spec in deployment.tes())


def bin_edges(points: list[float]) -> list[float]:
    """Heatmap bin edges around measured points (sorted, positive): geometric midpoints between
    neighbours, 0 below the first and as far above the last as the last midpoint is below it."""
    mids = [math.sqrt(a * b) for a, b in zip(points, points[1:])]
    edges = [0.0, *mids, points[-1] ** 2 / mids[-1] if mids else 2.0 * points[-1]]
    rounded = [float(f"{e:.4g}") for e in edges]  # readable labels, unless rounding merges two edges
    return rounded if all(b > a for a, b in zip(rounded, rounded[1:])) else edges


def summary_lines(result: dict) -> list[str]:
    """One table per rate and the combined one: rows are prefill lengths, columns ratios."""
    settings = result["settings"]
    lengths, ratios = settings["prefill_lengths"], settings["ratios"]
    values = {(c["rps"], c["prefill_tokens"], c["ratio"]): c["value"] for c in result["cells"]}
    header = "prefill \\ ratio " + "".join(f"{r:>9g}" for r in ratios)
    lines = [f"JCT colocated ({result['setups']['colocated']}) / disaggregated ({result['setups']['disaggregated']})"
             " - 1; positive: disaggregation wins"]
    fmt = lambda v: f"{v:>+9.2f}" if v is not None else f"{'-':>9}"  # noqa: E731
    for rps in settings["rates"]:
        lines += [f"RPS {rps:g}", header]
        lines += [f"{p:>15} " + "".join(fmt(values[(rps, p, r)]) for r in ratios) for p in lengths]
    lines += ["combined (sum over RPS)", header]
    lines += [f"{p:>15} " + "".join(fmt(v) for v in row) for p, row in zip(lengths, result["combined"])]
    return lines
