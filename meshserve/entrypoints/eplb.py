"""`meshserve eplb ...`: expert load balancing commands.

`meshserve eplb plan` turns a recorded expert load (meshserve/moe/load_record.py)
into a placement file (meshserve/moe/placement.py), printing each layer's
balancedness before and after. `--redundant` counts redundant experts per layer
over the whole EP group, as the papers do (cloudmatrix-infer: "32 redundant
experts"); each device gets ceil(R / N) redundant slots unless
`--redundant-per-device` asks for more (the engine's `--eplb-redundant-experts`
must equal that number to apply the plan).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshserve.entrypoints.eplb_admin import add_admin_commands
from meshserve.moe.balance import balancedness, total_balancedness
from meshserve.moe.eplb import ALGORITHMS, DEFAULT_ALGORITHM, DEFAULT_MODE, MODES, plan_placement
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import ExpertPlacement, PlacementShape, load_placement_file
from meshserve.moe.shrink import plan_shrink, shrunk_shape


def add_eplb_commands(subparsers) -> None:
    """Add the `eplb` command and its subcommands to the top-level `meshserve` subparsers."""
    eplb = subparsers.add_parser("eplb", help="expert load balancing: record load, plan placements, rebalance live")
    commands = eplb.add_subparsers(dest="eplb_command", required=True)
    plan = commands.add_parser("plan", help="plan a placement of redundant experts from a recorded load")
    add_plan_arguments(plan)
    plan.set_defaults(func=plan_main)
    add_admin_commands(commands)  # record / status / rebalance against a running server


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="recorded expert load (`meshserve eplb record --out` writes it)")
    parser.add_argument("--devices", type=int, help="EP ranks N")
    parser.add_argument("--redundant", type=int,
                        help="redundant experts per MoE layer over all N devices (the replicas to place)")
    parser.add_argument("--redundant-per-device", dest="redundant_per_device", type=int, default=None,
                        help="redundant slots per device (default: ceil(redundant / devices))")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default=DEFAULT_ALGORITHM,
                        help=f"replica choice and placement (default: {DEFAULT_ALGORITHM})")
    parser.add_argument("--mode", choices=MODES, default=DEFAULT_MODE,
                        help="redundant: only redundant slots change (what the engine applies live); "
                             "full: primaries move too (default: redundant)")
    parser.add_argument("--shrink", default=None, metavar="RANKS",
                        help="then plan a shrink: EP ranks removed, comma-separated (e.g. 3,7)")
    parser.add_argument("--shrink-from", dest="shrink_from", default=None, metavar="PLACEMENT",
                        help="shrink this placement file instead of the one planned here")
    parser.add_argument("--shrink-replan", dest="shrink_replan", action="store_true",
                        help="plan the remaining ranks from scratch (better balance, more weights move)")
    parser.add_argument("--out", required=True, help="placement file to write (JSON)")


def plan_main(args: argparse.Namespace) -> int:
    record = ExpertLoadRecord.load(args.load)
    if not record.num_slices:
        raise ValueError(f"{args.load} holds no time slices")
    removed = _parse_ranks(args.shrink) if args.shrink is not None else None
    report: list[str] = []
    if args.shrink_from:
        if removed is None:
            raise ValueError("--shrink-from needs --shrink RANKS")
        if args.devices is not None or args.redundant is not None:
            raise ValueError("--shrink-from takes devices and slots from the placement file; drop --devices "
                             "and --redundant")
        placement = load_placement_file(args.shrink_from)
        shrunk_shape(placement.shape, removed)  # fail before any work on a shrink that cannot fit
    else:
        shape = _shape(record, args.devices, args.redundant, args.redundant_per_device)
        if removed is not None:
            shrunk_shape(shape, removed)
        placement = plan_placement(record, shape, budget=args.redundant, algorithm=args.algorithm, mode=args.mode)
        report.append(f"{shape.num_ranks} devices x {shape.slots_per_rank} slots ({shape.primary_per_rank} "
                      f"primary + {shape.redundant_per_rank} redundant), {args.redundant} redundant experts per "
                      f"layer, {args.algorithm}, mode {args.mode}")
        report += _changes("no replicas", ExpertPlacement.default(shape, record.moe_layers), "planned",
                           placement, record)
    if removed is not None:
        shrunk = plan_shrink(placement, record, removed, replan=args.shrink_replan, algorithm=args.algorithm)
        report.append(f"shrink: ranks {sorted(set(removed))} removed, {shrunk.shape.num_ranks} devices x "
                      f"{shrunk.shape.slots_per_rank} slots left")
        report += _changes("before", placement, "after", shrunk, record)
        placement = shrunk
    path = _write_placement(args.out, placement)
    for line in report:
        print(line)
    live = removed is None and args.mode == "redundant"  # only redundant slots changed: the engine can apply it
    hint = f"; the engine applies it with --eplb-redundant-experts {placement.shape.redundant_per_rank}" if live else ""
    print(f"wrote {path}{hint}")
    return 0


def _shape(record: ExpertLoadRecord, devices: int | None, redundant: int | None,
           per_device: int | None) -> PlacementShape:
    if devices is None or redundant is None:
        raise ValueError("give --devices N and --redundant R")
    if devices < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    if redundant < 0:
        raise ValueError(f"--redundant must be >= 0, got {redundant}")
    if record.num_logical % devices:
        raise ValueError(f"the record's {record.num_logical} experts per layer do not split evenly over "
                         f"{devices} devices")
    needed = -(-redundant // devices)
    if per_device is None:
        per_device = needed
    elif per_device < needed:
        raise ValueError(f"--redundant-per-device {per_device} x {devices} devices cannot hold {redundant} "
                         f"redundant experts")
    return PlacementShape(record.num_logical, devices, per_device)


def _parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--shrink takes comma-separated rank numbers, got {text!r}") from None
    if not ranks:
        raise ValueError("--shrink needs at least one rank")
    return ranks


def _changes(label_a: str, a: ExpertPlacement, label_b: str, b: ExpertPlacement,
             record: ExpertLoadRecord) -> list[str]:
    lines = [f"balancedness (mean / max device load), {label_a} -> {label_b}:"]
    ra, rb = a.shape.num_ranks, b.shape.num_ranks
    for layer in sorted(b.layers):
        counts, sa, sb = record.layer_counts(layer), a.layers[layer], b.layers[layer]
        lines.append(f"  layer {layer}: per slice {balancedness(sa, counts, ra):.3f} -> "
                     f"{balancedness(sb, counts, rb):.3f}, total {total_balancedness(sa, counts, ra):.3f} -> "
                     f"{total_balancedness(sb, counts, rb):.3f}")
    return lines


def _write_placement(path: str, placement: ExpertPlacement) -> Path:
    """The placement JSON, one line per layer so a person can read it."""
    lines = []
    for key, value in placement.to_dict().items():
        if isinstance(value, dict):
            inner = [f'    "{k}": {json.dumps(v)}' for k, v in value.items()]
            lines.append(f'  "{key}": {{\n' + ",\n".join(inner) + "\n  }")
        else:
            lines.append(f'  "{key}": {json.dumps(value)}')
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None
    return out
