import json

import pytest
import torch

from meshserve.bench import eplb_layer_time
from meshserve.bench.eplb import claim_check, parse_int_list
from meshserve.entrypoints.cli import main as meshserve_main
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import PlacementShape
from meshserve.moe.slots import SlotMap

# the measured part at toy size: 32 experts (the fewest that reach 30x), top-4, 16 tokens per rank
TINY_LAYER = ["--layer-experts", "32", "--layer-top-k", "4", "--layer-hidden", "32", "--layer-intermediate", "16",
              "--layer-tokens", "16", "--layer-batches", "2", "--layer-steps", "3", "--layer-warmup", "1",
              "--layer-redundant", "1,2"]


def _recorded_load(tmp_path):
    """A hand-made record as the engine's recorder writes it: 16 experts, 2 MoE layers, 3 slices."""
    hot = [[300, 5, 5, 5, 80, 5, 5, 5, 5, 5, 5, 5, 40, 5, 5, 5],
           [5, 5, 5, 5, 5, 5, 5, 200, 5, 5, 5, 5, 5, 5, 90, 5]]
    counts = [[[c + s * (i % 3) for i, c in enumerate(row)] for row in hot] for s in range(3)]
    record = ExpertLoadRecord(num_logical=16, moe_layers=[3, 4], slice_seconds=10.0, counts=counts,
                              slice_start_times=[0.0, 10.0, 20.0])
    return record.save(tmp_path / "recorded.json")


def test_bench_eplb_writes_json_png_and_tables(tmp_path, capsys):
    load = _recorded_load(tmp_path)
    out = tmp_path / "results" / "eplb.json"
    assert meshserve_main(["bench", "eplb", "--json", str(out), "--devices", "4,8,32", "--redundant", "0,4",
                           "--layers", "1", "--slices", "2", "--repeats", "1", "--load", str(load),
                           "--no-layer-time"]) == 0
    result = json.loads(out.read_text())
    assert "layer_time" not in result
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    synthetic, recorded = result["loads"]
    assert synthetic["name"] == "synthetic" and recorded["name"] == "recorded.json"
    assert [(c["devices"], c["redundant"]) for c in synthetic["cells"]] == [(4, 0), (4, 4), (8, 0), (8, 4),
                                                                           (32, 0), (32, 4)]
    assert recorded["skipped"] == [{"devices": 32, "reason": "16 experts do not split evenly over 32 devices"}]
    assert [c["redundant_per_device"] for c in recorded["cells"]] == [0, 1, 0, 1]
    for load, layers in ((synthetic, 1), (recorded, 2)):
        for cell in load["cells"]:
            assert set(cell["plans"]) == {"redundant/greedy-max-device", "redundant/xdeepserve",
                                          "full/greedy-max-device", "full/xdeepserve"}
            for plan in cell["plans"].values():
                assert len(plan["per_slice"]) == len(plan["total"]) == len(plan["plan_ms_per_layer"]) == layers
                assert all(0 < b <= 1 for b in plan["per_slice"] + plan["total"])
                assert ("next_window_per_slice" in plan) == (load is synthetic)
            if cell["redundant"] == 0:  # nothing to place: the redundant-mode plans are the default placement
                assert cell["plans"]["redundant/xdeepserve"]["per_slice"] == cell["none"]["per_slice"]
            else:
                assert cell["plans"]["redundant/greedy-max-device"]["mean_per_slice"] > cell["none"]["mean_per_slice"]
                # the full plan applied while serving: the same balance, reached in rounds
                live, full = cell["live"], cell["plans"]["full/greedy-max-device"]
                assert live["mean_per_slice"] == pytest.approx(full["mean_per_slice"], abs=0.01)
                assert live["rounds"] >= 1 and len(live["slot_writes_per_layer"]) == layers
                assert all(w >= c for w, c in zip(live["slot_writes_per_layer"], live["slots_changed_per_layer"]))
    assert result["claim"] is None  # no 32-device, 32-redundant cell was run
    printed = capsys.readouterr().out
    assert "| devices | none | R=0 | R=4 |" in printed
    assert "recorded.json: 32 devices skipped" in printed
    assert "planning time per layer" in printed and f"wrote {out}" in printed


def test_claim_check_reads_the_32_by_32_synthetic_cell():
    def loads(best):
        plans = {"full/greedy-max-device": {"mean_per_slice": best}, "redundant/xdeepserve": {"mean_per_slice": 0.6}}
        cell = {"devices": 32, "redundant": 32, "none": {"mean_per_slice": 0.2}, "plans": plans,
                "live": {"mean_per_slice": 0.965, "rounds": 9}}
        return [{"name": "synthetic", "cells": [cell]}]

    met = claim_check(loads(0.97))
    assert met["met"] and met["best_plan"] == "full/greedy-max-device" and met["none"] == 0.2
    assert met["live_within_0.01_of_full"] and met["live_rounds"] == 9
    assert not claim_check(loads(0.9))["met"] and not claim_check(loads(0.9))["live_within_0.01_of_full"]
    assert claim_check([{"name": "synthetic", "cells": []}]) is None


@pytest.mark.parametrize("extra, message", [
    (["--devices", "4,x"], "comma-separated integers"),
    (["--redundant=-1,2"], "integers >= 0"),
    (["--load", "/nonexistent/load.json"], "cannot read"),
    (["--no-synthetic", "--no-layer-time"], "nothing to run"),
    (["--layer-experts", "30"], "multiple of 4"),
    (["--layer-experts", "28"], "must exceed 30"),
    (["--layer-redundant", "1,x"], "--layer-redundant takes comma-separated integers"),
    (["--layer-steps", "0"], "--layer-steps must be >= 1"),
    (["--layer-top-k", "99"], "must not exceed --layer-experts"),
])
def test_bench_eplb_bad_arguments_exit_2_with_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "eplb.json"
    assert meshserve_main(["bench", "eplb", "--json", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
    assert not out.exists()


def test_parse_int_list_sorts_and_dedups():
    assert parse_int_list("32, 4,8,4", "--devices", 1) == [4, 8, 32]


def _expected_rows(config: dict, placement: dict, steps: int) -> list[float]:
    """Rows per rank per step (mean) that the slot map's rotation gives on the timed window."""
    shape = PlacementShape(config["experts"], 4, placement["redundant_per_rank"])
    slot_map = SlotMap.from_slots(placement["slots"], config["experts"], placement.get("disabled", ()))
    probs = eplb_layer_time.popularity(config)
    rows = torch.zeros(4, dtype=torch.float64)
    for step in range(steps):
        for rank in range(4):
            ids = eplb_layer_time.routed_batch(config, probs, eplb_layer_time.TIMED_WINDOW, rank,
                                               step % config["batches"])[1]
            slots = slot_map.route(ids, offset=rank)  # pure EP: the DP rank is the rank
            rows += torch.bincount(slots.reshape(-1) // shape.slots_per_rank, minlength=4)
    return (rows / steps).tolist()


def test_bench_eplb_layer_time_only_writes_times_rows_and_ratios(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert meshserve_main(["bench", "eplb", "--json", str(out), "--no-synthetic", *TINY_LAYER]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["loads"] == [] and result["claim"] is None
    section = result["layer_time"]
    config = section["config"]
    assert config["strategy"] == "attn=TP1+DP4 moe=TP1+EP4" and config["redundant"] == [1, 2]
    # without replacement no expert is picked by more than every token: at most experts / top-k x the mean
    assert 2.0 < section["routing"]["hottest_over_mean"] <= 32 / 4
    placements = section["placements"]
    live = [p for p in placements if p["mode"] == "live"]
    assert [p["name"] for p in placements] == ["default", "redundant R=1", "redundant R=2", "full R=1", "full R=2"] + [
        f"live {k}/{len(live)} R=2" for k in range(1, len(live) + 1)]
    assert len(live) > 1 and all(p["disabled"] for p in live)
    default = placements[0]
    assert default["ratio_vs_default"] == 1.0
    for p in placements:
        assert len(p["steps_ms"]) == 3 and all(t > 0 for t in p["steps_ms"])
        assert p["ratio_vs_default"] == pytest.approx(p["median_ms"] / default["median_ms"])
        assert len(p["rows_per_rank"]) == len(p["expert_ms_per_rank"]) == len(p["expert_cpu_ms_per_rank"]) == 4
        # a rank's thread cannot use more CPU than the wall time it took (one torch thread per rank); a rank with
        # no rows in a step (a live round can disable all the slots it would get) may use none
        assert all((cpu > 0 or rows == 0) and cpu <= wall + 0.05 for cpu, wall, rows in zip(
            p["expert_cpu_ms_per_rank"], p["expert_ms_per_rank"], p["rows_per_rank"]))
        assert p["expert_cpu_ms_total"] == pytest.approx(sum(p["expert_cpu_ms_per_rank"]))
        assert p["mean_rows"] == 16 * 4  # every (token, expert) row runs once: tokens x top-k per rank
        assert p["rows_per_rank"] == pytest.approx(_expected_rows(config, p, 3))
        assert p["max_abs_diff_vs_default"] <= 1e-5  # every placement computes the same layer
        if p is not default and p["mode"] != "live":
            assert p["max_rows"] < default["max_rows"], p["name"]  # the plan takes rows off the busiest rank
            assert p["planner_balancedness"] > default["planner_balancedness"]
    printed = capsys.readouterr().out
    assert "| placement | median ms | p90 ms | vs default | rows per rank max / mean |" in printed
    assert "| full R=2 |" in printed and f"wrote {out}" in printed
    assert f"live move to full R=2 in {len(live)} rounds" in printed


def test_layer_time_routing_is_seeded_and_without_replacement():
    config = {"experts": 32, "top_k": 4, "tokens": 64, "hidden": 8, "batches": 2, "seed": 3,
              "zipf_exponent": 1.2, "redundant": [0, 1]}
    probs = eplb_layer_time.popularity(config)
    assert probs.sum().item() == pytest.approx(1.0)
    first = eplb_layer_time.routed_batch(config, probs, 1, 2, 0)
    again = eplb_layer_time.routed_batch(config, probs, 1, 2, 0)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[1], eplb_layer_time.routed_batch(config, probs, 0, 2, 0)[1])  # another window
    ids = first[1]
    assert ids.shape == (64, 4) and all(len(set(row)) == 4 for row in ids.tolist())
    counts = eplb_layer_time.window_counts(config, probs, 1)
    assert len(counts) == 2 and all(sum(c) == 4 * 64 * 4 for c in counts)
    plans = eplb_layer_time.placements(config, counts)
    # R = 0 has no redundant plan (it would be the default); the full plan at R = 0 re-places the primaries
    assert [p["name"] for p in plans][:4] == ["default", "redundant R=1", "full R=0", "full R=1"]
    assert all(p["name"].startswith("live ") and p["name"].endswith(" R=1") for p in plans[4:])
    assert sorted(plans[2]["slots"]) == list(range(32)) and plans[2]["slots"] != plans[0]["slots"]
