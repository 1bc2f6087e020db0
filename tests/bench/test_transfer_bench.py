"""`meshserve bench transfer` at tiny sizes: a row per backend and size, a checked pull per backend, the
source process stopped cleanly with its shared memory unlinked, and one-line argument errors."""
from __future__ import annotations

import json
import math
import os

import pytest

from meshserve.entrypoints.cli import main

pytestmark = pytest.mark.timeout(60)

LAYERS, ENTRY, BLOCK_SIZE = 2, 64, 16
BLOCK_BYTES = LAYERS * BLOCK_SIZE * ENTRY * 2  # bfloat16


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_transfer_bench_measures_every_backend_and_size(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    assert main(["bench", "transfer", "--json", str(out), "--layers", str(LAYERS), "--entry", str(ENTRY),
                 "--blocks", "2,4", "--repeats", "1"]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["backends"] == ["shm", "tcp", "dist"]
    assert result["config"]["block_bytes"] == BLOCK_BYTES
    assert result["config"]["region_blocks"] == 8  # twice the largest pull
    rows = {(r["backend"], r["mode"], r["blocks"]): r for r in result["rows"]}
    expected = ({(b, "whole", n) for b in ("memcpy", "shm", "tcp", "dist") for n in (2, 4)}
                | {(b, "by_layer", 4) for b in ("shm", "tcp", "dist")})
    assert set(rows) == expected and len(result["rows"]) == len(expected)
    for (_, _, blocks), row in rows.items():
        assert row["bytes"] == blocks * BLOCK_BYTES and row["tokens"] == blocks * BLOCK_SIZE
        assert _positive(row["median_s"]) and _positive(row["gbps"]) and _positive(row["vs_memcpy"])
        assert len(row["times_s"]) == 1
        assert math.isclose(row["gbps"], row["bytes"] / row["median_s"] / 1e9)
        memcpy = rows[("memcpy", "whole", blocks)]
        assert math.isclose(row["vs_memcpy"], row["gbps"] / memcpy["gbps"])
    assert result["verified"] == {"shm": True, "tcp": True, "dist": True}
    source = result["source"]
    assert source["exitcode"] == 0 and len(source["shm_segments"]) == LAYERS
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in source["shm_segments"])
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out.splitlines()
    assert sum(" blocks (" in line and "x memcpy" in line for line in printed) == len(expected)  # one per measurement
    assert any(line.startswith("dist ") and "(" in line for line in printed)
    assert "verified bit for bit against the source: shm yes, tcp yes, dist yes" in printed


def _one_line_error(capsys, needle: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshserve bench transfer: error:") and needle in err[0], err


def test_transfer_bench_bad_arguments(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    assert main(["bench", "transfer", "--json", str(out), "--backends", "shm,foo"]) == 2
    _one_line_error(capsys, "--backends")
    assert main(["bench", "transfer", "--json", str(out), "--backends", "tcp,tcp"]) == 2
    _one_line_error(capsys, "repeats a backend")
    assert main(["bench", "transfer", "--json", str(out), "--blocks", "16,0"]) == 2
    _one_line_error(capsys, "--blocks")
    assert main(["bench", "transfer", "--json", str(out), "--repeats", "0"]) == 2
    _one_line_error(capsys, "--repeats")
    assert main(["bench", "transfer", "--json", str(out), "--dtype", "int8"]) == 2
    _one_line_error(capsys, "floating-point")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "transfer", "--json", str(out), "--layers", "four"])
    assert exc.value.code == 2
    _one_line_error(capsys, "--layers")
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_verification_names_the_layer_and_bytes_that_differ():
    import torch

    from meshserve.bench.transfer import _verify

    source = [torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3) + 100 * layer for layer in range(2)]
    pulled = [torch.zeros(3, 2, 3) for _ in range(2)]
    for s, d in zip(source, pulled):
        d[torch.tensor([2, 0])] = s[torch.tensor([1, 3])]
    _verify("shm", source, pulled, [1, 3], [2, 0])  # exact: no error
    pulled[1][1, 0, 0] = 1.0  # in a block the pull never wrote; 1.0 is 0x3f800000: two nonzero bytes
    with pytest.raises(RuntimeError, match="shm pull of 2 blocks differs from the source in layer 1: 2 of 72 bytes"):
        _verify("shm", source, pulled, [1, 3], [2, 0])
