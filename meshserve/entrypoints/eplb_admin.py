"""`meshserve eplb record|status|rebalance`: a running server's expert load and placement, over its admin API.

The server (`meshserve serve`) records tokens per logical expert of every MoE layer in
time slices (`--eplb-slice-s`); these commands read that record, show the placement
in use, and start a live reconfiguration (xdeepserve §4.5), from a planned placement
file or from the server's own plan of its recorded load.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import load_placement_file
from meshserve.utils import envs

ADMIN_KEY_ENV = envs.MESHSERVE_ADMIN_KEY.name  # the server reads the same variable

_PROGRESS_EVERY_S = 10.0


class AdminError(RuntimeError):
    """The server refused or could not be reached; printed as one line."""


def _request(method: str, url: str, path: str, body: dict | None = None, timeout_s: float = 60.0,
             admin_key: str | None = None) -> dict:
    # start-up: httpx only when an admin request is sent
    import httpx

    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    try:
        response = httpx.request(method, url.rstrip("/") + path, json=body, timeout=timeout_s, headers=headers)
    except httpx.HTTPError as exc:
        raise AdminError(f"cannot reach {url}: {exc}") from None
    try:
        data = response.json()
    except ValueError:
        raise AdminError(f"{path}: HTTP {response.status_code} without a JSON body") from None
    if response.status_code != 200:
        message = data.get("error", {}).get("message") if isinstance(data, dict) else None
        raise AdminError(f"{path}: HTTP {response.status_code}: {message or data}")
    return data


def _add_admin_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin-key", default=envs.admin_key(),
                        help=f"the server's admin key (default: ${ADMIN_KEY_ENV}; prefer the variable, a flag "
                             "shows in the process list)")


def add_admin_commands(commands) -> None:
    """Register `record`, `status` and `rebalance` on the `eplb` sub-command's subparsers."""
    record = commands.add_parser("record", help="record a running server's expert load into a load file")
    record.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    record.add_argument("--duration", type=float, default=60.0,
                        help="seconds to keep recording before the file is written (default 60)")
    record.add_argument("--out", required=True, help="load file to write (JSON, meshserve/moe/load_record.py)")
    _add_admin_key_argument(record)
    record.set_defaults(func=record_main)

    status = commands.add_parser("status", help="a running server's expert placement and reconfiguration state")
    status.add_argument("--url", required=True)
    _add_admin_key_argument(status)
    status.set_defaults(func=status_main)

    rebalance = commands.add_parser("rebalance", help="reconfigure a running server's expert placement live")
    rebalance.add_argument("--url", required=True)
    rebalance.add_argument("--placement", default=None,
                           help="placement file (`meshserve eplb plan --out`); default: the server plans from "
                                "its recorded load")
    rebalance.add_argument("--wait", type=float, default=120.0,
                           help="seconds to wait for the reconfiguration to finish (0: do not wait)")
    _add_admin_key_argument(rebalance)
    rebalance.set_defaults(func=rebalance_main)


def _fail(command: str, exc: Exception) -> int:
    print(f"meshserve eplb {command}: error: {exc}", file=sys.stderr)
    return 2 if isinstance(exc, ValueError) else 1


def record_main(args: argparse.Namespace) -> int:
    try:
        if args.duration < 0:
            raise ValueError(f"--duration must be >= 0, got {args.duration}")
        started = time.time()
        # fail now, not after the wait, if it is unreachable (or refuses the key)
        _request("GET", args.url, "/admin/eplb/status", admin_key=args.admin_key)
        deadline = time.monotonic() + args.duration
        next_log = time.monotonic() + _PROGRESS_EVERY_S
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= next_log:
                print(f"recording: {time.monotonic() - deadline + args.duration:.0f}/{args.duration:.0f} s",
                      file=sys.stderr)
                next_log += _PROGRESS_EVERY_S
        data = _request("GET", args.url, "/admin/eplb/load", admin_key=args.admin_key)
        record = ExpertLoadRecord.from_dict(data)
        # keep the slices of the recording window (the server keeps a longer history)
        keep = [i for i, t in enumerate(record.slice_start_times) if t + record.slice_seconds > started]
        record = ExpertLoadRecord(record.num_logical, record.moe_layers, record.slice_seconds,
                                  [record.counts[i] for i in keep], [record.slice_start_times[i] for i in keep])
        path = record.save(args.out)
    except (AdminError, ValueError, OSError) as exc:
        return _fail("record", exc)
    tokens = sum(sum(row) for per_layer in record.counts for row in per_layer[:1])
    print(f"wrote {path}: {record.num_slices} slices of {record.slice_seconds:g} s, {len(record.moe_layers)} MoE "
          f"layers x {record.num_logical} experts, {tokens} routed tokens in the first MoE layer")
    return 0


def status_main(args: argparse.Namespace) -> int:
    try:
        status = _request("GET", args.url, "/admin/eplb/status", admin_key=args.admin_key)
    except AdminError as exc:
        return _fail("status", exc)
    placement = status.pop("placement", None)
    print(json.dumps(status, indent=2))
    if placement is not None:
        replicated = {layer: [e for e, slots in enumerate(table) if len(slots) > 1]
                      for layer, table in placement["replicas"].items()}
        print("replicated experts per layer: " + json.dumps(replicated))
    return 0


def rebalance_main(args: argparse.Namespace) -> int:
    try:
        body = {}
        if args.placement:
            body["placement"] = load_placement_file(args.placement).to_dict()
        status = _request("POST", args.url, "/admin/eplb/rebalance", body, admin_key=args.admin_key)
        deadline = time.monotonic() + args.wait
        while args.wait > 0 and status["phase"] != "idle":
            if time.monotonic() > deadline:
                raise AdminError(f"still in phase {status['phase']} after {args.wait:.0f} s")
            time.sleep(0.2)
            status = _request("GET", args.url, "/admin/eplb/status", admin_key=args.admin_key)
        if status.get("last_error"):
            raise AdminError(f"reconfiguration failed: {status['last_error']}")
    except (AdminError, ValueError) as exc:
        return _fail("rebalance", exc)
    if args.wait > 0:
        took = status["last_finished_at"] - status["last_started_at"]
        print(f"reconfigured in {took:.2f} s (reconfiguration {status['num_reconfigurations']} of this server)")
    else:
        print(f"reconfiguration started (phase {status['phase']}, round {status.get('round', 1)} of "
              f"{status.get('rounds', 1)})")
    return 0
