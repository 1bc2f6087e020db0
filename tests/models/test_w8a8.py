"""INT8 W8A8 serving: which weights turn INT8, their values, and the engine on every layout.

Oracles: the float32 model the INT8 one was rounded from (within a stated logit tolerance); the torch
path of the same INT8 math (the native kernels must agree with it); the single-rank INT8 engine for the
parallel layouts (greedy tokens identical); the model rounded at load (`--quantization int8`) for a
compressed-tensors checkpoint holding the same INT8 values.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from meshserve import LLM, SamplingParams
from meshserve.layers import cpu_kernels, fp8, int8, w8a8
from meshserve.models import compressed_tensors
from meshserve.models.loader import load_hf_config, load_model
from meshserve.moe.expert_checkpoint import ExpertCheckpoint
from meshserve.utils.checkpoint_files import safetensors_files
from tests.models.paged_harness import prefill_logits, short_random_prompts

# W8A8 rounds each weight and each activation to 1/254 of its row's range; through the tiny random model, whose
# routers flip experts on small changes, the logits move by 3-15% of their norm (measured on these prompts);
# the trained model's figures are `meshserve bench quant`'s
RELATIVE_LOGIT_TOL = 0.25
ENGINE_ARGS = dict(max_num_batched_tokens=64, block_size=8, max_num_seqs=8, num_kv_blocks=128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
TP_LOGPROB_TOL = 0.5  # nats; measured up to 0.19 on these prompts (the random model's router amplifies changes)
OVERRIDES = {"num_hidden_layers": 3}


@pytest.fixture(scope="module")
def original(tiny_model):
    return tiny_model("deepseek_v3", seed=4, overrides=OVERRIDES)


@pytest.fixture(scope="module")
def rounded_checkpoint(original, tmp_path_factory):
    """A compressed-tensors W8A8 checkpoint of `original` by plain per-channel rounding (what
    `--quantization int8` does at load), written as the format's writer writes it."""
    config = load_hf_config(original)
    tensors = []
    for path in safetensors_files(original):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                module = name.removesuffix(".weight")
                if name.endswith(".weight") and compressed_tensors.is_quantized_module(config, module):
                    q, scale = int8.quantize_weight(tensor)
                    tensors += [(name, q), (module + compressed_tensors.SCALE_SUFFIX, scale.reshape(-1, 1))]
                else:
                    tensors.append((name, tensor))
    out = tmp_path_factory.mktemp("w8a8") / "model"
    out.mkdir()
    compressed_tensors.write_checkpoint(original, out, config, tensors)
    return out


def test_recover_grid_keeps_int8_values_also_of_a_piece_of_a_row():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (6, 64), generator=g, dtype=torch.int8)
    q[1] = (q[1].float() * 0.3).round().to(torch.int8)  # a row whose largest value is far below 127
    q[2] = 0
    scale = torch.rand(6, generator=g) * 0.01 + 1e-4
    weight = q.float() * scale.unsqueeze(1)
    for piece in (weight, weight[:, :24]):  # a row-parallel rank holds some columns of each row
        values, scales = w8a8.recover_grid(piece)
        assert values.dtype == torch.int8
        torch.testing.assert_close(values.float() * scales.unsqueeze(1), piece, rtol=1e-6, atol=0)
    float_weight = torch.randn(4, 32, generator=g)  # not on a grid: rounded per row to absmax / 127
    values, scales = w8a8.recover_grid(float_weight)
    assert values.abs().amax(dim=1).tolist() == [127] * 4
    assert ((values.float() * scales.unsqueeze(1) - float_weight).abs() <= scales.unsqueeze(1) / 2 + 1e-7).all()


@pytest.mark.parametrize("name, quantized", [
    ("model.layers.0.self_attn.q_a_proj.weight", True), ("model.layers.1.mlp.experts.3.down_proj.weight", True),
    ("model.layers.1.mlp.shared_experts.up_proj.weight", True), ("lm_head.weight", True),
    ("model.layers.1.mlp.experts.gate_up_proj", True),
    ("model.layers.0.self_attn.kv_b_proj.weight", False), ("model.layers.1.mlp.gate.weight", False),
    ("model.embed_tokens.weight", False), ("model.layers.0.input_layernorm.weight", False)])
def test_which_checkpoint_weights_run_in_int8(name, quantized):
    assert w8a8.is_quantizable_name(name) is quantized


def test_int8_model_holds_int8_linears_and_keeps_router_kv_b_and_embedding_float(original):
    model = load_model(original, quantization="int8")
    layer = model.layers[1]
    assert layer.self_attn.fused_qkv_a_proj.weight.dtype == torch.int8
    assert layer.self_attn.o_proj.weight.dtype == torch.int8
    assert layer.mlp.experts.w13.dtype == torch.int8 and layer.mlp.experts.w2.dtype == torch.int8
    assert layer.mlp.shared_experts.down_proj.weight.dtype == torch.int8
    assert model.layers[0].mlp.gate_up_proj.weight.dtype == torch.int8
    assert model.lm_head.weight.dtype == torch.int8
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32
    assert layer.mlp.gate_weight.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.float32
    scales = getattr(layer.self_attn.o_proj.weight, w8a8.SCALE_ATTR)
    assert scales.shape == (layer.self_attn.o_proj.weight.shape[0],) and scales.dtype == torch.float32


def test_int8_logits_stay_close_to_the_float32_model(original):
    quantized, reference = load_model(original, quantization="int8"), load_model(original)
    for tokens in short_random_prompts():
        a, b = prefill_logits(quantized, tokens), prefill_logits(reference, tokens)
        assert ((a - b).norm() / b.norm()).item() <= RELATIVE_LOGIT_TOL
        assert not torch.equal(a, b)


def test_native_int8_kernels_agree_with_the_torch_path(original):
    model = load_model(original, quantization="int8")
    for tokens in short_random_prompts():
        native = prefill_logits(model, tokens)
        with cpu_kernels.disabled():
            torch_path = prefill_logits(model, tokens)
        assert ((native - torch_path).norm() / torch_path.norm()).item() <= 1e-4


def test_compressed_tensors_checkpoint_serves_its_int8_values(original, rounded_checkpoint):
    stored, at_load = load_model(rounded_checkpoint), load_model(original, quantization="int8")
    a, b = stored.layers[1].mlp.experts, at_load.layers[1].mlp.experts
    assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
    torch.testing.assert_close(a.w13_scale, b.w13_scale, rtol=1e-6, atol=0)
    for tokens in short_random_prompts():
        torch.testing.assert_close(prefill_logits(stored, tokens), prefill_logits(at_load, tokens),
                                   rtol=1e-4, atol=1e-4)


def test_fp8_checkpoint_converts_to_int8_at_load(original, tmp_path):
    converted = fp8.write_fp8_checkpoint(original, tmp_path / "fp8")
    model, reference = load_model(converted, quantization="int8"), load_model(original)
    assert model.layers[1].mlp.experts.w13.dtype == torch.int8
    for tokens in short_random_prompts():
        a, b = prefill_logits(model, tokens), prefill_logits(reference, tokens)
        assert ((a - b).norm() / b.norm()).item() <= 0.25  # FP8's rounding (see test_fp8_checkpoint) then INT8's


def test_expert_slot_writes_keep_the_checkpoints_int8_values(rounded_checkpoint):
    """Expert load balancing reads replicas from the checkpoint: written into a slot they are the same INT8
    values and scales the loader gave the expert's primary slot."""
    model = load_model(rounded_checkpoint)
    experts = model.layers[1].mlp.experts
    primary_w13, primary_w2 = experts.w13[5].clone(), experts.w2[5].clone()
    scales = experts.w13_scale[5].clone(), experts.w2_scale[5].clone()
    with ExpertCheckpoint(rounded_checkpoint) as checkpoint:
        w13, w2 = checkpoint.read("model.layers.1.mlp.experts", 5, experts.column_range(), experts.intermediate_size,
                                  experts.float_dtype, int8_grid=True)
    experts.write_slot(0, 5, w13, w2)  # slot 0 now holds a second copy of expert 5
    assert torch.equal(experts.w13[0], primary_w13) and torch.equal(experts.w2[0], primary_w2)
    torch.testing.assert_close(experts.w13_scale[0], scales[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(experts.w2_scale[0], scales[1], rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def single_rank_outputs(rounded_checkpoint):
    with LLM(model=str(rounded_checkpoint), **ENGINE_ARGS) as llm:
        greedy = [out.outputs[0].token_ids for out in llm.generate(short_random_prompts(), GREEDY)]
        first = [out.outputs[0].logprobs[0] for out in llm.generate(short_random_prompts(), FIRST_TOKEN)]
    return greedy, first


def test_engine_serves_int8_alike_on_dp2_ep2(rounded_checkpoint, single_rank_outputs):
    with LLM(model=str(rounded_checkpoint), parallel="attn=TP1+DP2 moe=TP1+EP2", **ENGINE_ARGS) as llm:
        outs = [out.outputs[0].token_ids for out in llm.generate(short_random_prompts(), GREEDY)]
    assert outs == single_rank_outputs[0]


def test_engine_serves_int8_alike_on_tp2(rounded_checkpoint, single_rank_outputs):
    """Under TP a rank quantizes each token's activation over the input columns it holds (as vLLM's W8A8 does):
    the row-parallel layers' activation scales differ from one rank's, so the logits agree within a tolerance
    rather than bit for bit (greedy continuations of the random model may then part after a few tokens)."""
    with LLM(model=str(rounded_checkpoint), parallel="attn=TP2+DP1 moe=TP2+EP1", **ENGINE_ARGS) as llm:
        first = [out.outputs[0].logprobs[0] for out in llm.generate(short_random_prompts(), FIRST_TOKEN)]
    for ours, reference in zip(first, single_rank_outputs[1]):
        assert ours.chosen.token_id == reference.chosen.token_id
        assert abs(ours.chosen.logprob - reference.chosen.logprob) <= TP_LOGPROB_TOL
        assert [t.token_id for t in ours.top[:2]] == [t.token_id for t in reference.top[:2]]


def test_engine_rounds_a_float_checkpoint_with_the_quantization_flag(original, rounded_checkpoint,
                                                                     single_rank_outputs):
    with LLM(model=str(original), quantization="int8", **ENGINE_ARGS) as llm:
        outs = [out.outputs[0].token_ids for out in llm.generate(short_random_prompts(), GREEDY)]
    assert outs == single_rank_outputs[0]


def test_mtp_drafts_on_a_w8a8_checkpoint_keep_the_greedy_tokens(rounded_checkpoint, single_rank_outputs):
    """The MTP layer (float in the checkpoint, rounded to INT8 at load) drafts; the W8A8 main model verifies."""
    with LLM(model=str(rounded_checkpoint), speculative="mtp", num_speculative_tokens=2, **ENGINE_ARGS) as llm:
        outs = [out.outputs[0].token_ids for out in llm.generate(short_random_prompts(), GREEDY)]
        drafted = sum(llm.get_stats().spec_drafted)
    assert drafted > 0
    assert outs == single_rank_outputs[0]
