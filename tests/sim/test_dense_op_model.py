"""The dense op model (meshserve/sim/dense_op_model.py): a Llama-family step from the same op-level figures as the
MLA op model, checked against the weights and FLOPs counted here from the config, and its refusals in one line."""
from __future__ import annotations

import json

import pytest

from meshserve.entrypoints.cli import main
from meshserve.parallel.strategy import parse_strategy
from meshserve.sim.dense_op_model import (
    DENSE_PRESETS,
    DenseDeployment,
    DenseOps,
    DenseShape,
    DenseStepModel,
    dense_deployment_of,
)
from meshserve.sim.hardware import Hardware, HardwareError
from meshserve.sim.profile import GroupWork

LLAMA = DENSE_PRESETS["llama-3-8b"]
H800 = Hardware.load("h800")
HBM = 1e9 * H800.value("hbm_read_gbps")
BF16_FLOPS = 1e12 * H800.value("gemm_bf16_tflops")


def _linear_params_per_layer(config: dict) -> int:
    """Q, K, V, O and the gated MLP's three matrices, counted from the config."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    return attention + 3 * hidden * config["intermediate_size"]


def test_one_decode_row_reads_every_weight_once_at_the_hbm_rate():
    model = DenseStepModel(LLAMA, H800, DenseDeployment())
    parts = model.breakdown([GroupWork(decode_rows=1, context_tokens=100)])
    weights = LLAMA["num_hidden_layers"] * _linear_params_per_layer(LLAMA)
    assert parts["linear"] == pytest.approx(2 * weights / HBM, rel=1e-9)  # BF16: 2 bytes a weight
    head = LLAMA["vocab_size"] * LLAMA["hidden_size"]
    assert parts["lm_head"] == pytest.approx(2 * head / HBM, rel=1e-9)
    assert parts["host"] == pytest.approx(1e-3 * H800.value("step_overhead_ms"))
    assert parts["all_reduce"] == 0.0  # TP1


def test_a_large_prefill_is_compute_bound_and_its_attention_grows_with_the_square():
    ops = DenseOps(DenseShape.from_config(LLAMA), H800, DenseDeployment())
    rows = 4096
    assert ops.mlp_down_proj(rows) == pytest.approx(
        2 * LLAMA["hidden_size"] * LLAMA["intermediate_size"] * rows / BF16_FLOPS, rel=1e-9)
    assert ops.attn_prefill(0, 2048) > 3.5 * ops.attn_prefill(0, 1024)  # pairs: n^2 / 2
    # decode attention reads the K and V of every attended token: twice the batch, twice the time
    assert ops.attn_decode(64, 2048) == pytest.approx(2 * ops.attn_decode(32, 2048), rel=1e-9)


def test_tensor_parallelism_splits_the_weights_and_adds_two_all_reduces_a_layer():
    work = [GroupWork(decode_rows=8, context_tokens=8 * 512)]
    tp1 = DenseStepModel(LLAMA, H800, DenseDeployment(tp=1)).breakdown(work)
    tp2 = DenseStepModel(LLAMA, H800, DenseDeployment(tp=2)).breakdown(work)
    assert tp2["linear"] == pytest.approx(tp1["linear"] / 2, rel=1e-9)
    link = H800.link(2)
    one = link.ring_seconds(8 * LLAMA["hidden_size"] * 2, 2, passes=2)
    assert tp2["all_reduce"] == pytest.approx(LLAMA["num_hidden_layers"] * 2 * one, rel=1e-9)


def test_omitted_parts_are_not_timed_and_unknown_ones_are_refused():
    work = [GroupWork(decode_rows=4, context_tokens=400)]
    full = DenseStepModel(LLAMA, H800, DenseDeployment())
    bare = DenseStepModel(LLAMA, H800, DenseDeployment(), omit=("lm_head", "host"))
    parts = full.breakdown(work)
    assert bare.step_seconds(work) == pytest.approx(full.step_seconds(work) - parts["lm_head"] - parts["host"])
    with pytest.raises(HardwareError, match="no step part gpu"):
        DenseStepModel(LLAMA, H800, DenseDeployment(), omit=("gpu",))


def test_layouts_and_models_the_dense_model_cannot_time_are_refused():
    assert dense_deployment_of(parse_strategy("attn=TP2 moe=TP2")).tp == 2
    with pytest.raises(HardwareError, match="one replica at attn=TPk moe=TPk"):
        dense_deployment_of(parse_strategy("attn=DP2 moe=EP2"))
    with pytest.raises(HardwareError, match="does not divide"):
        DenseOps(DenseShape.from_config(LLAMA), H800, DenseDeployment(tp=3))
    with pytest.raises(HardwareError, match="not 'deepseek_v3'"):
        DenseShape.from_config({"model_type": "deepseek_v3"})
    with pytest.raises(HardwareError, match="lacks intermediate_size"):
        DenseShape.from_config({**LLAMA, "intermediate_size": None})


def test_simulate_run_serves_a_dense_model_and_refuses_expert_flags(tmp_path, capsys):
    out = tmp_path / "dense.json"
    code = main(["simulate", "run", "--hardware", "h800", "--model-config", "llama-3-8b", "--weights", "bf16",
                 "--requests", "20", "--rate", "8", "--input-len", "64:256", "--output-len", "8:32",
                 "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 20
    assert result["output_tokens_per_s_per_device"] == pytest.approx(result["output_tokens_per_s"])  # one device
    assert set(result["step_breakdown_ms"]) == {"linear", "attention", "elementwise", "all_reduce", "lm_head", "host"}
    code = main(["simulate", "run", "--hardware", "h800", "--model-config", "llama-3-8b", "--redundant", "2",
                 "--json", str(out)])
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dense model has no experts" in err[0]


def test_the_lm_head_runs_over_the_sampled_rows_only():
    model = DenseStepModel(LLAMA, H800, DenseDeployment())
    chunk = GroupWork(prefill_tokens=2048, prefill_pairs=2048 * 1024)  # a prompt's middle chunk: nothing sampled
    assert model.breakdown([chunk])["lm_head"] == 0.0
    last = GroupWork(prefill_tokens=2048, prefill_pairs=2048 * 1024, sampling_prompts=1, decode_rows=8,
                     context_tokens=8 * 100)
    # nine sampled rows read the head's weights once: the same time as one row, not 2,056 rows' FLOPs
    one = model.breakdown([GroupWork(decode_rows=1, context_tokens=100)])["lm_head"]
    assert model.breakdown([last])["lm_head"] == pytest.approx(one)
