"""DeepSeek-V3 through the paged cache against HF transformers on the same random weights (fp32)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from meshserve.layers import cpu_kernels, mla
from meshserve.layers.metadata import AttentionMetadata
from meshserve.layers.mla import MLABatchPlan
from meshserve.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE, grouped_topk
from meshserve.models.loader import load_model
from tests.models.paged_harness import PagedHarness

TOL = 1e-3
DECODE_STEPS = 32
PROMPT_LENS = (7, 1, 12, 18)  # the 1-token prompt runs as a decode with no earlier context

BASE = dict(
    vocab_size=500, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=512,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    "q_lora": {},
    "no_q_lora": dict(q_lora_rank=None, attention_bias=True, rope_interleave=False),
    "yarn": dict(rope_parameters=YARN),
    "group_limited": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2),
    # latent and value dims in whole 32-column blocks: decode absorption runs through the native
    # grouped_linear too (the cases above absorb with bmm and only attend natively)
    "native_shapes": dict(kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=32),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights big enough for peaked attention and routing; norms and biases off their defaults."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def make_checkpoint(path, seed: int = 0, **overrides) -> transformers.DeepseekV3ForCausalLM:
    """Save a random HF DeepSeek-V3 to `path`; return it (eager attention, fp32, eval) as the oracle."""
    config = transformers.DeepseekV3Config(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config)
    randomize(model, seed)
    model.save_pretrained(path)
    return model.eval()


@torch.inference_mode()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def prompts(vocab: int, lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def generate(harness: PagedHarness, prompt_batch: list[list[int]], steps: int):
    """Prefill all prompts in one step, then greedy-decode them together; per-seq tokens and logits."""
    seqs = list(range(len(prompt_batch)))
    logits = [[x] for x in harness.step(seqs, prompt_batch)]
    tokens = [list(p) for p in prompt_batch]
    for _ in range(steps):
        nxt = [int(lg[-1][-1].argmax()) for lg in logits]
        for t, n in zip(tokens, nxt):
            t.append(n)
        for lg, out in zip(logits, harness.step(seqs, [[n] for n in nxt])):
            lg.append(out)
    return tokens, [torch.cat(lg) for lg in logits]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, **CASES[request.param])
    return request.param, path, hf


def test_prefill_and_decode_match_hf(case):
    name, path, hf = case
    model = load_model(path)
    assert isinstance(model, DeepseekV3ForCausalLM)
    # only the native_shapes case absorbs through the native grouped_linear
    absorbs_natively = [layer.self_attn._absorbed_packed is not None for layer in model.layers]
    assert absorbs_natively == [name == "native_shapes"] * len(model.layers)
    tokens, logits = generate(PagedHarness(model), prompts(BASE["vocab_size"]), DECODE_STEPS)
    for seq_tokens, seq_logits in zip(tokens, logits):
        ref = hf_logits(hf, seq_tokens)
        assert seq_logits.shape == ref.shape
        diff = (seq_logits - ref).abs().max().item()
        assert diff <= TOL, f"{name}: max |logit diff| {diff}"


def test_chunked_prefill_attends_to_earlier_chunk(case, tmp_path):
    _, path, hf = case
    model = load_model(path)
    harness = PagedHarness(model)
    long_prompt, other = prompts(BASE["vocab_size"], lens=(15, 6), seed=2)
    first = harness.step([0], [long_prompt[:5]])[0]
    harness.step([1], [other])
    # second chunk of seq 0 (5 cached tokens, not block-aligned) in one batch with a decode of seq 1
    second, decoded = harness.step([0, 1], [long_prompt[5:], [3]])
    ref = hf_logits(hf, long_prompt)
    assert (torch.cat([first, second]) - ref).abs().max().item() <= TOL
    assert (decoded[-1] - hf_logits(hf, other + [3])[-1]).abs().max().item() <= TOL


def test_absorbed_decode_equals_unabsorbed_attention(case, monkeypatch):
    _, path, _ = case
    model = load_model(path)
    harness = PagedHarness(model)
    harness.step([0, 1, 2], prompts(BASE["vocab_size"], lens=(9, 3, 14), seed=3))
    lens = list(harness.lens)
    for s in range(3):
        harness._ensure_blocks(s, lens[s] + 1)
    positions = torch.tensor(lens)
    cos, sin = model.rotary_emb.cos_sin(positions, torch.float32)
    hidden = torch.randn(3, BASE["hidden_size"], generator=torch.Generator().manual_seed(4))

    def attention_outputs(num_decodes: int) -> list[torch.Tensor]:
        # the same three one-token steps, laid out as decodes or as (single-token) prefills
        meta = AttentionMetadata.build([1, 1, 1], lens, harness.block_tables, harness.block_size,
                                       num_decodes=num_decodes)
        plan = MLABatchPlan.build(meta, torch.float32, torch.device("cpu"))
        assert plan.num_decodes == num_decodes and len(plan.prefills) == 3 - num_decodes
        with torch.inference_mode():
            return [layer.self_attn(hidden, cos, sin, plan, cache.clone())
                    for layer, cache in zip(model.layers, harness.kv_caches)]

    native_calls = []
    native_decode = cpu_kernels.mla_decode
    monkeypatch.setattr(cpu_kernels, "mla_decode", lambda *args: native_calls.append(1) or native_decode(*args))
    absorbed = attention_outputs(3)  # the native kernel reads the paged cache
    assert len(native_calls) == len(model.layers)
    unabsorbed = attention_outputs(0)
    with cpu_kernels.disabled():  # the torch path gathers the latent
        torch_path = attention_outputs(3)
        # decode attention in chunks of two sequences (the last chunk shorter) reuses one gather buffer
        monkeypatch.setattr(mla, "decode_chunk_size", lambda padded_len, kv_cache: 2)
        chunked = attention_outputs(3)
    assert len(native_calls) == len(model.layers)
    for a, u, t, c in zip(absorbed, unabsorbed, torch_path, chunked):
        assert a.abs().max() > 0.1
        assert (a - u).abs().max().item() <= 1e-5
        assert (t - a).abs().max().item() <= 1e-5
        assert (t - u).abs().max().item() <= 1e-5
        assert (c - t).abs().max().item() <= 1e-6


def test_yarn_case_changes_softmax_scale(tmp_path):
    hf = make_checkpoint(tmp_path, **CASES["yarn"])
    config = json.loads((tmp_path / "config.json").read_text())
    # the legacy spelling (rope_theta + rope_scaling with "type") must build the same model
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": rope["rope_type"]}
    model = DeepseekV3ForCausalLM(config)
    attn = model.layers[0].self_attn
    assert attn.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert attn.softmax_scale > 1.25 * attn.qk_head_dim ** -0.5  # mscale(4, 1)^2 = 1.297
    assert model.params.rope_parameters["rope_type"] == "yarn"


def test_group_limited_routing_restricts_choices(tmp_path):
    hf = make_checkpoint(tmp_path, **CASES["group_limited"])
    model = load_model(tmp_path)
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, DeepseekV3MoE))
    seen = []
    handle = moe.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    generate(PagedHarness(model), prompts(BASE["vocab_size"]), 2)
    handle.remove()
    x = torch.cat(seen)
    logits = torch.nn.functional.linear(x.float(), moe.gate_weight)
    args = (moe.e_score_correction_bias, moe.top_k, moe.n_group)
    _, limited = grouped_topk(logits, *args, 2, True, 1.0)
    _, unlimited = grouped_topk(logits, *args, 4, True, 1.0)
    differs = (limited.sort(-1).values != unlimited.sort(-1).values).any(-1)
    assert differs.float().mean() > 0.2  # the group limit changes many tokens' experts
    groups_used = (limited // (moe.num_experts // moe.n_group)).sort(-1).values
    assert ((groups_used[:, 1:] != groups_used[:, :-1]).sum(-1) <= 1).all()  # at most 2 distinct groups
    # and HF routes these tokens the same way
    hf_moe = hf.model.layers[1].mlp
    _, _, hf_ids = hf_moe.gate(x)
    assert torch.equal(hf_ids.sort(-1).values, limited.sort(-1).values)


def test_mtp_layers_load_and_unknown_names_fail(tmp_path):
    make_checkpoint(tmp_path, num_mtp_layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    weights = load_file(tmp_path / "model.safetensors")
    n = config["num_hidden_layers"]
    # an MTP layer as DeepSeek ships it: a decoder block at index n plus its own norms, projection and head
    mtp = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v.clone()
           for k, v in weights.items() if k.startswith(f"model.layers.{n - 1}.")}
    h, vocab = config["hidden_size"], config["vocab_size"]
    mtp.update({
        f"model.layers.{n}.enorm.weight": torch.rand(h), f"model.layers.{n}.hnorm.weight": torch.rand(h),
        f"model.layers.{n}.eh_proj.weight": torch.randn(h, 2 * h),
        f"model.layers.{n}.shared_head.norm.weight": torch.rand(h),
        f"model.layers.{n}.shared_head.head.weight": torch.randn(vocab, h),
        f"model.layers.{n}.embed_tokens.weight": torch.randn(vocab, h),
        "model.rotary_emb.inv_freq": torch.ones(4),
    })
    save_file({**weights, **mtp}, tmp_path / "model.safetensors")
    model = load_model(tmp_path)  # the loader fails if any parameter stayed unloaded
    assert len(model.mtp) == 1
    layer = model.mtp[0]
    assert torch.equal(layer.eh_proj.weight, mtp[f"model.layers.{n}.eh_proj.weight"])
    assert torch.equal(layer.embed_tokens.weight, mtp[f"model.layers.{n}.embed_tokens.weight"])
    assert torch.equal(layer.block.self_attn.kv_b_proj.weight, mtp[f"model.layers.{n}.self_attn.kv_b_proj.weight"])
    expert_up = mtp[f"model.layers.{n}.mlp.experts.3.up_proj.weight"]
    assert torch.equal(layer.block.mlp.experts.w13[3, config["moe_intermediate_size"]:], expert_up)
    # W_UK of the MTP block is derived too
    assert layer.block.self_attn.w_uk.abs().sum() > 0

    fresh = DeepseekV3ForCausalLM(config)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_c_proj.weight"):
        fresh.load_weights([("model.layers.0.self_attn.q_c_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="beyond"):
        fresh.load_weights([(f"model.layers.{n + 1}.enorm.weight", torch.zeros(h))])
    with pytest.raises(ValueError, match="shape"):
        fresh.load_weights([("model.norm.weight", torch.zeros(h + 1))])


def test_checkpoint_without_mtp_weights_drops_mtp(case):
    _, path, _ = case
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1  # HF counts one but never saves it
    model = load_model(path)
    assert len(model.mtp) == 0


def test_bad_config_is_rejected():
    config = {**BASE, "model_type": "deepseek_v3"}
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DeepseekV3ForCausalLM({k: v for k, v in config.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match="scoring_func"):
        DeepseekV3ForCausalLM({**config, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="n_group"):
        DeepseekV3ForCausalLM({**config, "n_group": 3})


def test_kv_cache_layout_is_the_latent():
    config = {**BASE, "model_type": "deepseek_v3"}
    layout = DeepseekV3ForCausalLM(config).kv_cache_layout()
    assert layout.entry_shape == (BASE["kv_lora_rank"] + BASE["qk_rope_head_dim"],)
    assert layout.num_layers == BASE["num_hidden_layers"]
    assert layout.dtype == torch.float32


def test_kimi_k2_config_builds_the_same_model(tmp_path):
    hf = make_checkpoint(tmp_path, **CASES["q_lora"])
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path)
    assert isinstance(model, DeepseekV3ForCausalLM)
    prompt = prompts(BASE["vocab_size"], lens=(10,), seed=5)[0]
    logits = PagedHarness(model).step([0], [prompt])[0]
    assert (logits - hf_logits(hf, prompt)).abs().max().item() <= TOL


def test_bfloat16_model_runs_prefill_and_decode(tmp_path):
    make_checkpoint(tmp_path, **CASES["q_lora"])
    reference = load_model(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert model.kv_cache_layout().dtype == torch.bfloat16
    batch = prompts(BASE["vocab_size"], lens=(6, 9), seed=6)
    tokens, ref_logits = generate(PagedHarness(reference), batch, 4)
    harness = PagedHarness(model)
    logits = harness.step([0, 1], batch)
    for k in range(4):
        steps = harness.step([0, 1], [[seq[len(p) + k]] for seq, p in zip(tokens, batch)])
        logits = [torch.cat([a, b]) for a, b in zip(logits, steps)]
    for got, want in zip(logits, ref_logits):
        assert got.shape == want.shape
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        # bf16 rounding (and the odd flipped expert choice) moves logits, but they track fp32 closely
        assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.95


def test_a_bfloat16_model_decodes_through_the_native_kernels_as_the_torch_path_does(tmp_path, monkeypatch):
    """Layer by layer (the fused layers off): bfloat16 linears, experts (AVX512-BF16) and the decode attention over
    the bfloat16 cache (float32 math) in the native kernels; the torch path on the same model: the same logits up
    to bfloat16 rounding."""
    monkeypatch.setenv("MESHSERVE_FUSED_DECODE", "0")
    make_checkpoint(tmp_path, **CASES["native_shapes"], qk_rope_head_dim=16)  # rope rows of whole vectors
    model = load_model(tmp_path, dtype=torch.bfloat16)
    attention = model.layers[0].self_attn
    assert attention._absorbed_packed is not None  # the decode attention's float32 absorption weights
    batch = prompts(BASE["vocab_size"], lens=(6, 9), seed=7)

    def run() -> list[torch.Tensor]:
        harness = PagedHarness(model)
        out = harness.step([0, 1], batch)
        for token in (5, 11, 17):
            out = [torch.cat([a, b]) for a, b in zip(out, harness.step([0, 1], [[token], [token]]))]
        return out

    native_calls = []
    original = cpu_kernels.mla_decode_bf16

    def counted(*args):
        native_calls.append(1)
        return original(*args)

    monkeypatch.setattr(cpu_kernels, "mla_decode_bf16", counted)
    native = run()
    assert len(native_calls) == 3 * BASE["num_hidden_layers"]  # every decode step, every layer
    with cpu_kernels.disabled():
        torch_path = run()
    for got, want in zip(native, torch_path):
        assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999
