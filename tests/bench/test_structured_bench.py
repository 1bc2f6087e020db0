"""`meshserve bench structured`: one-line argument errors, and a --quick run end to end on the tiny model whose
JSON has a free and a constrained rate per batch size with their ratio, and first-token latencies (timings
themselves are never compared)."""
from __future__ import annotations

import json
import math

import pytest

from meshserve.bench.structured import CONSTRAINED, FREE, schema
from meshserve.entrypoints.cli import main


@pytest.mark.parametrize(("flags", "message"), [(["--rounds", "0"], "--rounds must be at least 1"),
                                                (["--batch-sizes", "1,x"], "--batch-sizes must be integers"),
                                                (["--batch-sizes", "0"], "--batch-sizes must be at least 1"),
                                                (["--output-len", "2"], "--output-len must be at least 3"),
                                                (["--model", "/no/such/dir"], "is not a model directory"),
                                                (["--preset", "huge"], "--preset must be tiny or small")])
def test_bad_arguments_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "structured", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_each_variant_is_a_schema_of_its_own():
    assert schema(1) != schema(2) and schema(1) == schema(1)


@pytest.mark.timeout(600)
def test_a_quick_run_on_the_tiny_model(tiny_model, tmp_path, capsys):
    path = tmp_path / "structured.json"
    assert main(["bench", "structured", "--quick", "--model", str(tiny_model()), "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    assert set(result["decode_tokens_per_s"]) == {"1", "2"}
    for row in result["decode_tokens_per_s"].values():
        assert row[FREE] > 0 and row[CONSTRAINED] > 0
        assert math.isclose(row["ratio"], row[CONSTRAINED] / row[FREE])
    first = result["first_token"]
    assert all(first[key] > 0 for key in ("free_ms", "new_schema_ms", "cached_schema_ms",
                                          "first_constrained_request_ms"))
    out = capsys.readouterr()
    assert "json_schema tok/s" in out.out and "round 1/1" in out.err
