"""`meshserve bench spec` on the tiny random model: every configuration measured at every batch size, the
acceptance counters differenced per run, the ablation table and the large-batch rule in the JSON, the PNG
beside it; the threshold rule on made-up runs; one-line argument errors."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from meshserve.bench.spec import (
    BASELINE,
    MIN_REQUESTS,
    add_spec_arguments,
    choose_rule,
    settings_from_args,
    summarize_batches,
)
from meshserve.entrypoints.cli import main

pytestmark = pytest.mark.timeout(180)

OUTPUT_LEN = 8  # --quick


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_spec_bench_on_the_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "spec"
    assert main(["bench", "spec", "--quick", "--model", str(tiny_model()), "--out", str(out)]) == 0
    result = json.loads((out / "spec.json").read_text())
    assert (out / "spec.png").stat().st_size > 0
    assert result["complete"] is True and result["runs_done"] == 1
    config = result["config"]
    assert config["batch_sizes"] == [1, 2] and config["num_speculative_tokens"] == [1]
    assert config["output_len"] == OUTPUT_LEN and config["prompt_len"] == 32 and config["runs"] == 1
    min_requests = config["min_requests"]
    assert min_requests == 2
    assert config["speculative_draft_vocab"] == 4096 and config["trained_model"] is False
    assert config["engine_args"]["enable_prefix_caching"] is False and config["engine_args"]["max_num_seqs"] == 2

    assert [b["batch_size"] for b in result["batches"]] == [1, 2]
    for row in result["batches"]:
        baseline, k1 = row["configs"][BASELINE], row["configs"]["k1"]
        assert baseline["speedup"] == 1.0 and baseline["spec_verify_steps"] == 0
        assert baseline["acceptance_rate"] is None and baseline["drafting_token_share"] == 0
        for summary in (baseline, k1):
            assert _positive(summary["decode_tokens_per_s"]) and _positive(summary["tpot_ms"])
            assert summary["mismatching_requests"] == 0  # greedy: drafts never change the tokens
        assert math.isclose(k1["speedup"], k1["decode_tokens_per_s"] / baseline["decode_tokens_per_s"])
        # one verifying step per request and decode step after the first (which has no draft yet)
        assert 0 < k1["spec_verify_steps"] <= min_requests * (OUTPUT_LEN - 1)
        assert k1["spec_drafted"] == [k1["spec_verify_steps"]]
        assert k1["spec_tokens"] == k1["spec_verify_steps"] + k1["spec_accepted"][0]  # k=1: 1 + accepted
        assert 0 <= k1["acceptance_rate"][0] <= 1
        assert math.isclose(k1["tokens_per_verify_step"], 1 + k1["acceptance_rate"][0])
    assert result["acceptance"]["k1"]["verify_steps"] == sum(b["configs"]["k1"]["spec_verify_steps"]
                                                             for b in result["batches"])

    rule = result["max_batch_rule"]
    assert rule["k"] == 1 and rule["threshold"] in (None, 1, 2) and rule["batch_sizes"] == [1, 2]
    assert {"always", "auto"} <= set(rule["verdict_at_largest"])
    assert {b["batch_size"] for b in rule["batches"]} == {1, 2}
    assert len(result["runs"]) == 2 * 2  # one per batch size and engine
    # batches below --min-requests run that many requests one batch after another
    assert [r["requests"] for r in result["runs"]] == [min_requests] * 4
    phases = [row["phase"] for row in result["table"]]
    assert phases[:4] == ["main"] * 4 and set(phases[4:]) == {"rule"}

    printed = capsys.readouterr().out
    assert "+MTP k=1" in printed and result["summary"] in printed and "wrote" in printed


def test_quick_takes_the_smallest_shape_for_the_options_not_given():
    parser = argparse.ArgumentParser()
    add_spec_arguments(parser)
    quick = settings_from_args(parser.parse_args(["--quick", "--runs", "2"]))
    assert (quick.batch_sizes, quick.ks, quick.prompt_len, quick.output_len) == ((1, 2), (1,), 32, OUTPUT_LEN)
    assert (quick.runs, quick.min_requests) == (2, 2)  # a given option wins
    full = settings_from_args(parser.parse_args([]))
    assert (full.batch_sizes, full.ks, full.prompt_len, full.output_len) == ((1, 8, 32, 64), (1, 2, 3), 64, 64)
    assert (full.runs, full.min_requests) == (3, MIN_REQUESTS)


def _records(rates: dict[str, dict[int, list[float]]]) -> list[dict]:
    """Made-up runs: config -> batch size -> decode rate per run."""
    return [{"config": name, "batch_size": batch, "requests": max(batch, MIN_REQUESTS), "run": run,
             "decode_tokens_per_s": rate, "tpot_ms": 1e3 / rate,
             "ttft_ms": 1.0, "spec_drafted": [], "spec_accepted": [], "spec_verify_steps": 0, "spec_tokens": 0}
            for name, per_batch in rates.items() for batch, runs in per_batch.items() for run, rate in enumerate(runs)]


def test_the_threshold_is_where_every_run_stops_paying():
    rates = {BASELINE: {1: [10, 10, 10], 8: [50, 50, 50], 32: [100, 100, 100], 64: [150, 150, 150]},
             "k1": {1: [13, 14, 13], 8: [60, 51, 55], 32: [101, 99, 103], 64: [160, 160, 160]},
             "k2": {1: [15, 12, 15], 8: [40, 40, 40], 32: [80, 80, 80], 64: [90, 90, 90]}}
    batches = summarize_batches(_records(rates), [BASELINE, "k1", "k2"], (1, 8, 32, 64), output_len=8)
    k1_at_8 = batches[1]["configs"]["k1"]
    assert k1_at_8["speedup"] == 1.1 and k1_at_8["speedup_low"] == 1.02 and k1_at_8["pays"]
    assert not batches[2]["configs"]["k1"]["pays"]  # one run of three was slower
    # k2's median at batch 1 is the best (1.5x); it pays only there. k1 would pay again at 64: past the first
    # size that does not pay, the threshold stops
    assert choose_rule(batches, (1, 2)) == (2, 1)
    assert choose_rule(batches, (1,)) == (1, 8)
    assert choose_rule(summarize_batches(_records({BASELINE: {1: [10]}, "k1": {1: [9]}}), [BASELINE, "k1"], (1,), 8),
                       (1,)) == (1, None)


@pytest.mark.parametrize("argv, needle", [
    (["--batch-sizes", "0,8"], "--batch-sizes"),
    (["--batch-sizes", "one"], "--batch-sizes"),
    (["--num-speculative-tokens", ""], "--num-speculative-tokens"),
    (["--output-len", "1"], "--output-len"),
    (["--runs", "0"], "--runs"),
    (["--max-num-seqs", "4"], "largest batch size"),
    (["--model", "no/such/model"], "does not exist"),
])
def test_spec_bench_bad_arguments(tmp_path, capsys, argv, needle):
    out = tmp_path / "spec"
    assert main(["bench", "spec", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshserve bench spec: error:") and needle in err[0], err
    assert not out.exists()
