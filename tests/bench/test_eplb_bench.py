import json

import pytest

from meshserve.bench.eplb import claim_check, parse_int_list
from meshserve.cli import main as meshserve_main
from meshserve.moe.load_record import ExpertLoadRecord


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
                           "--layers", "1", "--slices", "2", "--repeats", "1", "--load", str(load)]) == 0
    result = json.loads(out.read_text())
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
    assert result["claim"] is None  # no 32-device, 32-redundant cell was run
    printed = capsys.readouterr().out
    assert "| devices | none | R=0 | R=4 |" in printed
    assert "recorded.json: 32 devices skipped" in printed
    assert "planning time per layer" in printed and f"wrote {out}" in printed


def test_claim_check_reads_the_32_by_32_synthetic_cell():
    def loads(best):
        plans = {"full/greedy-max-device": {"mean_per_slice": best}, "redundant/xdeepserve": {"mean_per_slice": 0.6}}
        cell = {"devices": 32, "redundant": 32, "none": {"mean_per_slice": 0.2}, "plans": plans}
        return [{"name": "synthetic", "cells": [cell]}]

    met = claim_check(loads(0.97))
    assert met["met"] and met["best_plan"] == "full/greedy-max-device" and met["none"] == 0.2
    assert not claim_check(loads(0.9))["met"]
    assert claim_check([{"name": "synthetic", "cells": []}]) is None


@pytest.mark.parametrize("extra, message", [
    (["--devices", "4,x"], "comma-separated integers"),
    (["--redundant=-1,2"], "integers >= 0"),
    (["--load", "/nonexistent/load.json"], "cannot read"),
    (["--no-synthetic"], "nothing to run"),
])
def test_bench_eplb_bad_arguments_exit_2_with_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "eplb.json"
    assert meshserve_main(["bench", "eplb", "--json", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
    assert not out.exists()


def test_parse_int_list_sorts_and_dedups():
    assert parse_int_list("32, 4,8,4", "--devices", 1) == [4, 8, 32]
