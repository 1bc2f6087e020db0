"""`meshserve bench eplb`: balancedness without and with redundant experts, and planning time.

For every load (the seeded synthetic one, then each `--load` file), device count N
and number R of redundant experts per layer (over all N devices, as in the papers;
each device gets ceil(R/N) redundant slots), the benchmark reports per MoE layer:
- no replication: the default contiguous placement;
- the planner for each algorithm (xdeepserve, greedy-max-device) and mode
  (redundant: primaries fixed; full: primaries placed too);
- live: the full greedy plan as a running engine applies it (meshserve/moe/live_moves.py):
  renumbered to keep experts where they are, then moved in rounds from the default
  placement; its balancedness, the rounds and the slots written per layer.
Balancedness is mean / max device load (meshserve/moe/balance.py): per slice,
averaged over slices, first; on the counts summed over slices second. The plan is
made from the load's slices and evaluated on them; for the synthetic load it is
also evaluated on the next window of slices (the drift continues), which a plan
cannot have seen. Planning time is per layer, the median of `--repeats` runs.

`--layer-time` (on by default) adds a measured part (meshserve/bench/eplb_layer_time.py): one MoE
layer's step time on 4 local ranks for the default placement and the planner's plans.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from meshserve.bench import eplb_layer_options
from meshserve.moe.balance import balancedness, total_balancedness
from meshserve.moe.eplb import ALGORITHMS, MODES, plan_redundancy
from meshserve.moe.live_moves import align_to_current, move_rounds
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import PlacementShape
from meshserve.moe.synthetic_load import synthetic_load, zipf_exponent
from meshserve.utils import report

DEFAULT_DEVICES = "4,8,32,64,256"
DEFAULT_REDUNDANT = "0,1,2,4,8,16,32"
SYNTHETIC_EXPERTS = 256
HOT_RATIO = 30.0
CLAIM = {"devices": 32, "redundant": 32, "min_balancedness": 0.95}  # the must-show


def add_eplb_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")
    parser.add_argument("--devices", default=DEFAULT_DEVICES, help=f"EP device counts (default: {DEFAULT_DEVICES})")
    parser.add_argument("--redundant", default=DEFAULT_REDUNDANT,
                        help=f"redundant experts per layer over all devices (default: {DEFAULT_REDUNDANT})")
    parser.add_argument("--load", nargs="*", default=[], metavar="FILE",
                        help="recorded expert loads (`meshserve eplb record` files) to run besides the synthetic one")
    parser.add_argument("--no-synthetic", dest="synthetic", action="store_false", help="only the --load files")
    parser.add_argument("--layers", type=int, default=4, help="synthetic MoE layers (default: 4)")
    parser.add_argument("--slices", type=int, default=8, help="synthetic time slices planned from (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic load seed (default: 0)")
    parser.add_argument("--repeats", type=int, default=3, help="plans timed per layer, median taken (default: 3)")
    eplb_layer_options.add_layer_time_arguments(parser)


def parse_int_list(text: str, flag: str, minimum: int) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or values[0] < minimum:
        raise ValueError(f"{flag} needs integers >= {minimum}, got {text!r}")
    return values


def synthetic_records(layers: int, slices: int, seed: int) -> tuple[ExpertLoadRecord, ExpertLoadRecord]:
    """(planned-from window, next window) of one synthetic load whose drift runs through both."""
    whole = synthetic_load(SYNTHETIC_EXPERTS, layers, 2 * slices, hot_ratio=HOT_RATIO, seed=seed)
    first = ExpertLoadRecord(whole.num_logical, whole.moe_layers, whole.slice_seconds, whole.counts[:slices],
                             whole.slice_start_times[:slices])
    second = ExpertLoadRecord(whole.num_logical, whole.moe_layers, whole.slice_seconds, whole.counts[slices:],
                              whole.slice_start_times[slices:])
    return first, second


def _scores(slots_per_layer: dict[int, list[int]], record: ExpertLoadRecord, num_ranks: int) -> dict:
    per_slice = [balancedness(slots_per_layer[layer], record.layer_counts(layer), num_ranks)
                 for layer in record.moe_layers]
    total = [total_balancedness(slots_per_layer[layer], record.layer_counts(layer), num_ranks)
             for layer in record.moe_layers]
    return {"per_slice": per_slice, "total": total, "mean_per_slice": statistics.fmean(per_slice),
            "mean_total": statistics.fmean(total)}


def run_cell(record: ExpertLoadRecord, devices: int, redundant: int, repeats: int,
             held_out: ExpertLoadRecord | None = None) -> dict:
    """No replication and every (mode, algorithm) plan for one device count and redundancy."""
    shape = PlacementShape(record.num_logical, devices, -(-redundant // devices))
    default = {layer: shape.default_slots() for layer in record.moe_layers}
    cell = {"devices": devices, "redundant": redundant, "redundant_per_device": shape.redundant_per_rank,
            "none": _scores(default, record, devices), "plans": {}}
    if held_out is not None:
        cell["none"]["next_window_per_slice"] = _scores(default, held_out, devices)["mean_per_slice"]
    for mode in MODES:
        for algorithm in ALGORITHMS:
            layers, times = {}, []
            for layer in record.moe_layers:
                counts = record.layer_counts(layer)
                runs = []
                for _ in range(max(1, repeats)):
                    start = time.perf_counter()
                    layers[layer] = plan_redundancy(counts, shape, budget=redundant, algorithm=algorithm, mode=mode)
                    runs.append((time.perf_counter() - start) * 1e3)
                times.append(statistics.median(runs))
            scores = _scores(layers, record, devices)
            scores["plan_ms_per_layer"] = times
            scores["plan_ms_median"] = statistics.median(times)
            if held_out is not None:
                scores["next_window_per_slice"] = _scores(layers, held_out, devices)["mean_per_slice"]
            cell["plans"][f"{mode}/{algorithm}"] = scores
            if (mode, algorithm) == ("full", "greedy-max-device") and shape.num_slots > shape.num_logical:
                cell["live"] = _live_move(shape, default, layers, record, held_out)
    return cell


def _live_move(shape: PlacementShape, default: dict[int, list[int]], full: dict[int, list[int]],
               record: ExpertLoadRecord, held_out: ExpertLoadRecord | None) -> dict:
    """The full plan as the engine applies it while serving, from the default placement."""
    aligned = {layer: align_to_current(shape, default[layer], slots) for layer, slots in full.items()}
    rounds = {layer: move_rounds(default[layer], slots) for layer, slots in aligned.items()}
    written = [sum(sum(a != b for a, b in zip(before, after))
                   for before, after in zip([default[layer], *steps], steps)) for layer, steps in rounds.items()]
    scores = _scores(aligned, record, shape.num_ranks)
    if held_out is not None:
        scores["next_window_per_slice"] = _scores(aligned, held_out, shape.num_ranks)["mean_per_slice"]
    return {**scores, "rounds": max(len(steps) for steps in rounds.values()),
            "slots_changed_per_layer": [sum(a != b for a, b in zip(default[layer], aligned[layer]))
                                        for layer in aligned],
            "slot_writes_per_layer": written}


def run_load(name: str, record: ExpertLoadRecord, devices: list[int], redundant: list[int], repeats: int,
             held_out: ExpertLoadRecord | None = None, progress: bool = True) -> dict:
    totals = np.asarray([record.layer_counts(layer) for layer in record.moe_layers], dtype=np.float64).sum(axis=1)
    means = totals.mean(axis=1)
    hot = np.divide(totals.max(axis=1), means, out=np.zeros_like(means), where=means > 0)
    result = {"name": name, "num_logical": record.num_logical, "moe_layers": list(record.moe_layers),
              "num_slices": record.num_slices, "hottest_over_mean": [float(x) for x in hot],
              "cells": [], "skipped": []}
    for n in devices:
        if record.num_logical % n:
            result["skipped"].append({"devices": n, "reason": f"{record.num_logical} experts do not split "
                                                              f"evenly over {n} devices"})
            continue
        for r in redundant:
            started = time.perf_counter()
            result["cells"].append(run_cell(record, n, r, repeats, held_out))
            if progress:
                print(f"[eplb] {name}: {n} devices, {r} redundant: {time.perf_counter() - started:.1f} s",
                      file=sys.stderr, flush=True)
    return result


def run_eplb_benchmark(args: argparse.Namespace) -> dict:
    devices = parse_int_list(args.devices, "--devices", 1)
    redundant = parse_int_list(args.redundant, "--redundant", 0)
    if args.layers < 1 or args.slices < 1 or args.repeats < 1:
        raise ValueError("--layers, --slices and --repeats must be >= 1")
    if not args.synthetic and not args.load and not args.layer_time:
        raise ValueError("nothing to run: give --load FILE or --layer-time, or leave the synthetic load on")
    layer_config = None
    if args.layer_time:
        layer_config = eplb_layer_options.layer_config(
            args, parse_int_list(args.layer_redundant, "--layer-redundant", 0), HOT_RATIO)
    recorded = [(path, ExpertLoadRecord.load(path)) for path in args.load]  # read them all before the long part
    for path, record in recorded:
        if not record.num_slices:
            raise ValueError(f"{path} holds no time slices")
    loads = []
    if args.synthetic:
        planned, next_window = synthetic_records(args.layers, args.slices, args.seed)
        loads.append(run_load("synthetic", planned, devices, redundant, args.repeats, next_window))
    for path, record in recorded:
        loads.append(run_load(Path(path).name, record, devices, redundant, args.repeats))
    result = {
        "benchmark": "eplb",
        "definitions": {
            "redundant": "redundant experts per MoE layer over all devices; each device has ceil(R/N) redundant "
                         "slots",
            "balancedness": "mean device load / max device load; per_slice: within each time slice, averaged over "
                            "slices; total: on the counts summed over slices",
            "modes": "redundant: primaries keep the contiguous default experts (what the engine applies live); "
                     "full: every slot is planned",
        },
        "config": {"devices": devices, "redundant": redundant, "repeats": args.repeats,
                   "synthetic": {"num_logical": SYNTHETIC_EXPERTS, "layers": args.layers, "slices": args.slices,
                                 "seed": args.seed, "hot_ratio": HOT_RATIO,
                                 "zipf_exponent": zipf_exponent(SYNTHETIC_EXPERTS, HOT_RATIO)}
                   if args.synthetic else None,
                   "loads": list(args.load)},
        "machine": report.machine_info(),
        "loads": loads,
        "claim": claim_check(loads),
    }
    if layer_config is not None:
        from meshserve.bench import eplb_layer_time  # torch: only where the measured part is used

        result["layer_time"] = eplb_layer_time.run_layer_time(layer_config)
    return result


def claim_check(loads: list[dict]) -> dict | None:
    """The issue's must-show on the synthetic load: every plan's balancedness at 32 devices x 32 redundant."""
    cell = _find_cell(loads, "synthetic", CLAIM["devices"], CLAIM["redundant"])
    if cell is None:
        return None
    best = max(cell["plans"], key=lambda key: cell["plans"][key]["mean_per_slice"])
    return {**CLAIM, "none": cell["none"]["mean_per_slice"], "best_plan": best,
            "best": cell["plans"][best]["mean_per_slice"],
            "plans": {key: plan["mean_per_slice"] for key, plan in cell["plans"].items()},
            "met": cell["plans"][best]["mean_per_slice"] >= CLAIM["min_balancedness"],
            "live": cell["live"]["mean_per_slice"], "live_rounds": cell["live"]["rounds"],
            "live_within_0.01_of_full": abs(cell["live"]["mean_per_slice"]
                                            - cell["plans"]["full/greedy-max-device"]["mean_per_slice"]) <= 0.01}


def _find_cell(loads: list[dict], name: str, devices: int, redundant: int) -> dict | None:
    for load in loads:
        if load["name"] == name:
            for cell in load["cells"]:
                if cell["devices"] == devices and cell["redundant"] == redundant:
                    return cell
    return None


def summary_lines(result: dict) -> list[str]:
    """Markdown tables: per load and mode, balancedness per slice (xdeepserve / greedy-max-device)."""
    lines = []
    for load in result["loads"]:
        redundant = sorted({cell["redundant"] for cell in load["cells"]})
        by_key = {(cell["devices"], cell["redundant"]): cell for cell in load["cells"]}
        devices = sorted({cell["devices"] for cell in load["cells"]})
        for mode in MODES:
            lines.append(f"{load['name']}, mode {mode}: balancedness per slice, xdeepserve / greedy-max-device")
            lines.append("| devices | none | " + " | ".join(f"R={r}" for r in redundant) + " |")
            lines.append("| ---: | ---: | " + " | ".join("---:" for _ in redundant) + " |")
            for n in devices:
                none = by_key[(n, redundant[0])]["none"]["mean_per_slice"]
                row = [f"{_plan(by_key[(n, r)], mode, 'xdeepserve'):.3f} / "
                       f"{_plan(by_key[(n, r)], mode, 'greedy-max-device'):.3f}" for r in redundant]
                lines.append(f"| {n} | {none:.3f} | " + " | ".join(row) + " |")
        for skipped in load["skipped"]:
            lines.append(f"{load['name']}: {skipped['devices']} devices skipped ({skipped['reason']})")
        if load["cells"]:
            top = redundant[-1]
            lines.append(f"{load['name']}: planning time per layer (ms, median of the repeats) at R={top}")
            lines.append("| plan | " + " | ".join(f"{n} devices" for n in devices) + " |")
            lines.append("| --- | " + " | ".join("---:" for _ in devices) + " |")
            for key in by_key[(devices[0], top)]["plans"]:
                row = [f"{statistics.median(by_key[(n, top)]['plans'][key]['plan_ms_per_layer']):.1f}"
                       for n in devices]
                lines.append(f"| {key} | " + " | ".join(row) + " |")
    claim = result.get("claim")
    if claim:
        lines.append(f"claim: synthetic, {claim['devices']} devices, {claim['redundant']} redundant experts: "
                     f"no replication {claim['none']:.3f}, best plan ({claim['best_plan']}) {claim['best']:.3f} "
                     f"({'meets' if claim['met'] else 'misses'} >= {claim['min_balancedness']}); applied live "
                     f"{claim['live']:.3f} in {claim['live_rounds']} rounds (within 0.01 of the full plan: "
                     f"{'yes' if claim['live_within_0.01_of_full'] else 'no'})")
    if "layer_time" in result:
        from meshserve.bench import eplb_layer_time  # torch: only where the measured part is used

        lines.extend(eplb_layer_time.summary_lines(result["layer_time"]))
    return lines


def _plan(cell: dict, mode: str, algorithm: str) -> float:
    return cell["plans"][f"{mode}/{algorithm}"]["mean_per_slice"]


def plot_eplb(result: dict, path: str | Path) -> Path:
    """One row per load, one panel per mode: balancedness vs redundant experts, one line per device count;
    a last row for the measured layer time when it ran."""
    loads = [load for load in result["loads"] if load["cells"]]
    layer_time = result.get("layer_time")
    fig, axes = report.new_figure(ncols=len(MODES), nrows=max(1, len(loads) + (layer_time is not None)))
    if layer_time is not None:
        from meshserve.bench import eplb_layer_time  # torch: only where the measured part is used

        eplb_layer_time.plot_row(layer_time, axes[len(loads)])
    for row, load in enumerate(loads):
        redundant = sorted({cell["redundant"] for cell in load["cells"]})
        for col, mode in enumerate(MODES):
            ax = axes[row][col]
            for i, n in enumerate(sorted({cell["devices"] for cell in load["cells"]})):
                cells = sorted((c for c in load["cells"] if c["devices"] == n), key=lambda c: c["redundant"])
                colour = f"C{i}"
                ax.plot(range(len(cells)), [_plan(c, mode, "greedy-max-device") for c in cells], "-o",
                        color=colour, markersize=3, label=f"{n} devices")
                ax.plot(range(len(cells)), [_plan(c, mode, "xdeepserve") for c in cells], "--", color=colour,
                        alpha=0.6)
            ax.set_xticks(range(len(redundant)), [str(r) for r in redundant])
            ax.set_xlabel("redundant experts per layer (all devices)")
            ax.set_ylabel("balancedness per slice (mean / max)")
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{load['name']}, mode {mode}\n(solid: greedy-max-device, dashed: xdeepserve)",
                         fontsize=9)
            ax.grid(True, alpha=0.3)
            if col == len(MODES) - 1:
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return report.save_figure(fig, path)


def eplb_main(args: argparse.Namespace) -> int:
    try:
        result = run_eplb_benchmark(args)
    except (ValueError, OSError) as exc:
        print(f"meshserve bench eplb: error: {exc}", file=sys.stderr)
        return 2
    json_path = report.write_json(args.json, result)
    png_path = plot_eplb(result, report.png_path_for(json_path))
    for line in summary_lines(result):
        print(line)
    print(f"wrote {json_path} and {png_path}")
    return 0
