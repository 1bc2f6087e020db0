"""Qwen3 and Qwen3-MoE through the paged cache against HF transformers on the same random weights."""
from __future__ import annotations

import pytest
import torch
import transformers

from meshserve.layers.attention import PagedGQAAttention
from meshserve.layers.metadata import AttentionMetadata
from meshserve.layers.paged import write_to_cache
from meshserve.models.loader import load_model
from meshserve.models.qwen3 import Qwen3ForCausalLM
from meshserve.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseBlock
from tests.models.paged_harness import PagedHarness
from tests.models.qwen3_checkpoints import BASE, MOE, hf_logits, make_checkpoint

TOL = 1e-3
DECODE_STEPS = 32


def random_prompts(lengths: list[int], seed: int, vocab: int = BASE["vocab_size"]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def generate_greedy(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """One batched prefill, then `steps` batched decode steps. Returns tokens and the logits of every position."""
    harness = PagedHarness(model)
    seq_ids = list(range(len(prompts)))
    logits = harness.step(seq_ids, prompts)
    tokens = [list(p) for p in prompts]
    per_seq = [[x] for x in logits]
    for _ in range(steps):
        nxt = [int(chunks[-1][-1].argmax()) for chunks in per_seq]
        for seq, t in zip(tokens, nxt):
            seq.append(t)
        for chunks, x in zip(per_seq, harness.step(seq_ids, [[t] for t in nxt])):
            chunks.append(x)
    return tokens, [torch.cat(chunks) for chunks in per_seq]


CASES = {
    # dense, GQA 4:2, head_dim (16) != hidden / heads, q/k/v/o biases, tied embeddings
    "qwen3_gqa_bias_tied": (False, dict(attention_bias=True, tie_word_embeddings=True)),
    # dense, plain multi-head attention, separate lm_head
    "qwen3_mha": (False, dict(num_key_value_heads=4, head_dim=32, num_hidden_layers=3)),
    # MoE layers 1 and 2, dense layer 0 through mlp_only_layers, renormalised top-k
    "moe_mlp_only_layers": (True, dict(num_hidden_layers=3, mlp_only_layers=[0], norm_topk_prob=True)),
    # MoE only where (layer + 1) % 2 == 0, multi-query attention, raw softmax weights
    "moe_sparse_step": (True, dict(num_hidden_layers=3, decoder_sparse_step=2, num_key_value_heads=1,
                                   norm_topk_prob=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_greedy_decode_match_hf(case, tmp_path):
    moe, overrides = CASES[case]
    reference = make_checkpoint(tmp_path, moe=moe, seed=list(CASES).index(case), **overrides)
    model = load_model(tmp_path)
    assert isinstance(model, Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)
    ours_sparse = [isinstance(layer.mlp, Qwen3MoeSparseBlock) for layer in model.model.layers]
    hf_sparse = [isinstance(layer.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock)
                 for layer in reference.model.layers]
    assert ours_sparse == hf_sparse
    if moe:
        assert any(ours_sparse) and not all(ours_sparse)

    prompts = random_prompts([7, 12, 3, 10], seed=1)
    tokens, logits = generate_greedy(model, prompts, DECODE_STEPS)
    for seq_tokens, seq_logits in zip(tokens, logits):
        assert seq_logits.dtype == torch.float32
        assert seq_logits.shape == (len(seq_tokens), BASE["vocab_size"])
        expected = hf_logits(reference, seq_tokens)
        assert (seq_logits - expected).abs().max().item() <= TOL
    # the generations differ between prompts, so decode rows of the batch were not mixed up
    assert len({tuple(t[-DECODE_STEPS:]) for t in tokens}) > 1


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    reference = make_checkpoint(path, moe=True, seed=3, num_hidden_layers=2, mlp_only_layers=[1],
                                norm_topk_prob=True)
    return path, reference


def test_chunked_prefill_matches_one_shot_prefill(moe_checkpoint):
    path, reference = moe_checkpoint
    model = load_model(path)
    prompt, other = random_prompts([13, 5], seed=2)

    one_shot = PagedHarness(model).step([0], [prompt])[0]

    chunked = PagedHarness(model)
    first = chunked.step([0, 1], [prompt[:6], other])[0]
    # second chunk runs beside a decode of the other sequence, starting after 6 cached tokens
    decode_logits, second = chunked.step([1, 0], [[3], prompt[6:]])
    assert torch.allclose(torch.cat([first, second]), one_shot, atol=1e-5, rtol=0)
    assert (one_shot - hf_logits(reference, prompt)).abs().max().item() <= TOL
    assert (decode_logits - hf_logits(reference, other + [3])[-1:]).abs().max().item() <= TOL

    # and decoding continues from the chunked cache like from the one-shot cache
    nxt = int(second[-1].argmax())
    after = chunked.step([0], [[nxt]])[0]
    assert (after - hf_logits(reference, prompt + [nxt])[-1:]).abs().max().item() <= TOL


def reference_attention(q, k, v, context_len, scale):
    """Plain softmax attention with repeated KV heads; q [Lq, Hq, D], k/v [S, Hk, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(k.shape[0]).unsqueeze(0) <= (context_len + torch.arange(q.shape[0])).unsqueeze(1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_paged_attention_matches_dense_reference(num_heads, num_kv_heads):
    head_dim, block_size, num_blocks = 8, 4, 32
    g = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    # (context already cached, new tokens): two decodes (one with no context), then prefills with and without context
    shapes = [(9, 1), (0, 1), (0, 6), (7, 5), (4, 1)]
    # the last "prefill" has one new token but sits after prefills: it must still go through the prefill path
    num_decodes = 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for ctx, new in shapes:
        n = -(-(ctx + new) // block_size)
        tables.append([perm.pop() for _ in range(n)])
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=g)  # garbage everywhere
    full_k, full_v = [], []
    for (ctx, new), table in zip(shapes, tables):
        full_k.append(torch.randn(ctx + new, num_kv_heads, head_dim, generator=g))
        full_v.append(torch.randn(ctx + new, num_kv_heads, head_dim, generator=g))
        if ctx:
            ctx_meta = AttentionMetadata.build([ctx], [0], [table], block_size)
            write_to_cache(cache, ctx_meta.slot_mapping, torch.stack((full_k[-1][:ctx], full_v[-1][:ctx]), dim=1))
    meta = AttentionMetadata.build([n for _, n in shapes], [c for c, _ in shapes], tables, block_size,
                                   num_decodes=num_decodes)
    q_all = [torch.randn(new, num_heads, head_dim, generator=g) for _, new in shapes]
    q = torch.cat(q_all)
    k = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, shapes)])
    v = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, shapes)])
    scale = head_dim ** -0.5

    out = PagedGQAAttention(num_heads, num_kv_heads, head_dim, scale)(q, k, v, meta, cache)

    expected = torch.cat([reference_attention(qi, fk, fv, c, scale)
                          for qi, fk, fv, (c, _) in zip(q_all, full_k, full_v, shapes)])
    assert out.shape == (q.shape[0], num_heads, head_dim)
    assert torch.allclose(out, expected, atol=1e-5, rtol=0)
    flat = cache.view(-1, 2, num_kv_heads, head_dim)
    assert torch.equal(flat[meta.slot_mapping, 0], k) and torch.equal(flat[meta.slot_mapping, 1], v)


def test_attention_rejects_cache_of_wrong_shape():
    attention = PagedGQAAttention(4, 2, 8, 0.5)
    meta = AttentionMetadata.build([1], [0], [[0]], 4)
    q, kv = torch.zeros(1, 4, 8), torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="kv cache entries"):
        attention(q, kv, kv, meta, torch.zeros(2, 4, 2, 4, 8))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PagedGQAAttention(4, 3, 8, 0.5)


def test_packed_expert_tensors_load_like_per_expert_files(moe_checkpoint):
    """HF's in-memory state dict keeps experts packed (`experts.gate_up_proj` [E, 2I, H]); both forms load."""
    path, reference = moe_checkpoint
    from_files = load_model(path)
    packed = Qwen3MoeForCausalLM(reference.config.to_dict())
    state = reference.state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    loaded = packed.load_weights(state.items())
    assert loaded == {name for name, _ in packed.named_parameters()}
    assert from_files.dims == packed.dims
    for (name, a), (_, b) in zip(from_files.state_dict().items(), packed.state_dict().items()):
        assert torch.equal(a, b), name


def test_load_weights_reports_incomplete_fused_parameters(moe_checkpoint):
    path, reference = moe_checkpoint
    model = Qwen3MoeForCausalLM(reference.config.to_dict())
    state = {k: v for k, v in reference.state_dict().items()
             if not k.endswith(("layers.0.self_attn.k_proj.weight", "layers.1.mlp.up_proj.weight"))}
    loaded = model.load_weights(state.items())
    missing = {name for name, _ in model.named_parameters()} - loaded
    assert missing == {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"}


def test_load_weights_rejects_bad_names_and_shapes(moe_checkpoint):
    _, reference = moe_checkpoint
    config = reference.config.to_dict()
    model = Qwen3MoeForCausalLM(config)
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    bad = [
        ("model.layers.0.self_attn.rope.weight", torch.zeros(1), "unknown weight"),
        ("model.layers.7.input_layernorm.weight", torch.zeros(hidden), "unknown weight"),
        ("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(inter, hidden), "expert 8"),
        ("model.layers.1.mlp.experts.0.up_proj.weight", torch.zeros(inter, hidden), "not an MoE layer"),
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.zeros(hidden, inter), "shape"),
        ("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, hidden), "shape"),
        ("model.norm.weight", torch.zeros(hidden + 1), "shape"),
    ]
    for name, tensor, message in bad:
        with pytest.raises(ValueError, match=message):
            model.load_weights([(name, tensor)])


def test_kv_cache_layout_and_config_errors():
    config = {**BASE, "model_type": "qwen3"}
    model = Qwen3ForCausalLM(config)
    layout = model.kv_cache_layout()
    assert layout.num_layers == BASE["num_hidden_layers"]
    assert layout.entry_shape == (2, BASE["num_key_value_heads"], BASE["head_dim"])
    assert layout.dtype == torch.float32 and model.kv_cache_layout(torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="sliding"):
        Qwen3ForCausalLM({**config, "use_sliding_window": True})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        Qwen3ForCausalLM({**config, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_size"):
        Qwen3ForCausalLM({k: v for k, v in config.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3MoeForCausalLM({**config, **MOE, "num_experts_per_tok": 9})
