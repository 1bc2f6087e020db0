"""FP8 block-quantized checkpoints (the published DeepSeek-V3/R1 and Kimi-K2 format) load and serve.

Oracles: HF transformers loading the same FP8 directory (it dequantizes on CPU) for the model math; a copy
of the checkpoint with every FP8 weight dequantized to float32 (no quantization_config) for the engine,
whose greedy tokens must then be identical on one rank and on DP2+EP2; and the float32 model the FP8
checkpoint was made from, within a stated logit tolerance.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from meshserve import LLM, SamplingParams
from meshserve.layers import fp8
from meshserve.models.factory import make_model
from meshserve.models.loader import load_model
from meshserve.moe.expert_checkpoint import ExpertCheckpoint
from tests.models.paged_harness import prefill_logits, short_random_prompts

HF_TOL = 1e-3
# e4m3 keeps 3 mantissa bits: each weight within 1/16 of its magnitude (plus the block's underflow); through
# the tiny random model (logits up to ~45) the logits move by about 12% of their norm
RELATIVE_LOGIT_TOL = 0.25
ENGINE_ARGS = dict(max_num_batched_tokens=64, block_size=8, max_num_seqs=8, num_kv_blocks=128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
OVERRIDES = {"num_hidden_layers": 3}


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the float32 original, its FP8 conversion, the FP8 weights dequantized back to float32)."""
    original = tiny_model("deepseek_v3", seed=4, overrides=OVERRIDES)
    quantized = fp8.write_fp8_checkpoint(original, tmp_path_factory.mktemp("fp8") / "model")
    dequantized = tmp_path_factory.mktemp("dequantized") / "model"
    shutil.copytree(quantized, dequantized)
    config = json.loads((dequantized / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    (dequantized / "config.json").write_text(json.dumps(config))
    for path in dequantized.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            tensors = [(name, f.get_tensor(name)) for name in f.keys()]
        save_file(dict(fp8.dequantize_weights(tensors, block, torch.float32)), str(path))
    return original, quantized, dequantized


def test_block_round_trip_keeps_each_weight_within_fp8_precision():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=g) * torch.linspace(0.01, 3, 200)  # edge blocks are partial
    q, scale_inv = fp8.quantize_block(weight)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    back = fp8.dequantize_block(q, scale_inv, fp8.DEFAULT_BLOCK)
    block_max = fp8._expand(scale_inv * fp8.FP8_MAX, weight.shape, fp8.DEFAULT_BLOCK)
    # relative rounding error 2^-4 for normal values; values under the block's smallest normal are absolute
    assert ((back - weight).abs() <= weight.abs() / 16 + block_max * 2.0 ** -9).all()
    assert (back.abs().amax() - weight.abs().amax()).abs() < 1e-5  # each block's largest value is exact


def test_a_weight_without_its_scale_is_refused():
    q, _ = fp8.quantize_block(torch.ones(4, 4))
    with pytest.raises(ValueError, match="no partner"):
        list(fp8.dequantize_weights([("a.q_proj.weight", q)], fp8.DEFAULT_BLOCK, torch.float32))


@pytest.mark.parametrize("quant", [{"quant_method": "awq"}, {"quant_method": "fp8", "fmt": "e5m2"},
                                   {"quant_method": "fp8", "activation_scheme": "static"},
                                   {"quant_method": "fp8"}])
def test_other_quantization_formats_are_refused_by_name(quant):
    with pytest.raises(ValueError, match="not supported"):
        fp8.fp8_block_size({"quantization_config": quant})


def test_make_model_writes_the_published_format(tmp_path):
    out = make_model("deepseek_v3", "tiny", tmp_path / "m", overrides={"num_hidden_layers": 2}, fp8=True)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.self_attn.q_b_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32  # the router stays
    assert "model.layers.1.self_attn.o_proj.weight_scale_inv" in names
    assert "lm_head.weight_scale_inv" not in names


def test_fp8_checkpoint_matches_hf_transformers_on_the_same_directory(checkpoints):
    _, quantized, _ = checkpoints
    hf = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32).eval()
    ours = load_model(quantized)
    for tokens in short_random_prompts():
        with torch.inference_mode():
            ref = hf(torch.tensor([tokens])).logits[0]
        assert (prefill_logits(ours, tokens) - ref).abs().max().item() <= HF_TOL


def test_fp8_checkpoint_stays_close_to_the_float32_model_it_was_made_from(checkpoints):
    original, quantized, _ = checkpoints
    ours, theirs = load_model(quantized), load_model(original)
    for tokens in short_random_prompts():
        a, b = prefill_logits(ours, tokens), prefill_logits(theirs, tokens)
        assert ((a - b).norm() / b.norm()).item() <= RELATIVE_LOGIT_TOL
        assert not torch.equal(a, b)  # it really was quantized


def test_expert_slot_loads_read_dequantized_experts(checkpoints):
    """EPLB moves experts by reading them from the checkpoint: an FP8 expert arrives dequantized."""
    _, quantized, dequantized = checkpoints
    prefix = "model.layers.1.mlp.experts"
    with ExpertCheckpoint(quantized) as a, ExpertCheckpoint(dequantized) as b:
        for expert, columns in ((0, (0, 64)), (5, (32, 96))):
            for x, y in zip(a.read(prefix, expert, columns, 128, torch.float32),
                            b.read(prefix, expert, columns, 128, torch.float32)):
                assert torch.equal(x, y)


@pytest.fixture(scope="module")
def dequantized_reference(checkpoints):
    _, _, dequantized = checkpoints
    with LLM(model=str(dequantized), **ENGINE_ARGS) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(short_random_prompts(), GREEDY)]


@pytest.mark.parametrize("parallel", ["attn=TP1+DP1 moe=TP1+EP1", "attn=TP1+DP2 moe=TP1+EP2",
                                      "attn=TP2+DP1 moe=TP2+EP1"])
def test_engine_serves_an_fp8_checkpoint_as_its_dequantized_weights(checkpoints, dequantized_reference, parallel):
    _, quantized, _ = checkpoints
    with LLM(model=str(quantized), parallel=parallel, **ENGINE_ARGS) as llm:
        outs = [out.outputs[0].token_ids for out in llm.generate(short_random_prompts(), GREEDY)]
    assert outs == dequantized_reference
