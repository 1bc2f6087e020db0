"""`meshserve bench step-board`: one-line argument errors, and the smallest run end to end (ranks as threads): a row
per world and layout with rank 0's CPU per round, each against a host per rank (timings are never compared)."""
from __future__ import annotations

import json

import pytest

from meshserve.entrypoints.cli import main


@pytest.mark.parametrize(("flags", "message"), [(["--worlds", "1"], "--worlds takes distinct sizes of at least 2"),
                                                (["--worlds", "4", "4"], "--worlds takes distinct sizes"),
                                                (["--rounds", "0"], "--rounds must be at least 1"),
                                                (["--warmup", "-1"], "--warmup must be at least 0")])
def test_bad_arguments_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "step-board", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_small_run_writes_a_row_per_world_and_layout(tmp_path, capsys):
    path = tmp_path / "step_board.json"
    assert main(["bench", "step-board", "--worlds", "2", "6", "--ranks-per-host", "3", "--rounds", "10",
                 "--warmup", "2", "--repeats", "1", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    assert [(row["world"], row["hosts"]) for row in result["rows"]] == [(2, 2), (2, 1), (6, 6), (6, 2)]
    for row in result["rows"]:
        assert row["rank0_cpu_us_per_round"] > 0 and row["wall_us_per_round"] > 0
        if row["ranks_per_host"] == 1:
            assert row["rank0_cpu_vs_host_per_rank"] == 1.0
    assert "3 ranks per host" in capsys.readouterr().out
