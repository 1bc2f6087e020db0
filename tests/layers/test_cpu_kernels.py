"""The native CPU kernels (cpu_kernels.py) against plain torch, op by op and through a model."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels
from meshserve.layers.linear import Linear, attach_packed, linear, pack_linears
from meshserve.layers.mla import MultiHeadLatentAttention
from meshserve.layers.moe import FusedMoEWeights, fused_experts
from meshserve.layers.rope import apply_rotary, apply_rotary_
from meshserve.models.deepseek_v3 import grouped_topk
from meshserve.models.loader import load_model
from tests.models.paged_harness import PagedHarness
from tests.models.test_deepseek_v3 import make_checkpoint, prompts

REPO_ROOT = Path(__file__).resolve().parents[2]


KERNEL_ENTRY_POINTS = ("moe_experts", "moe_forward", "grouped_linear", "mla_decode", "rms_norm", "grouped_topk",
                       "rotary_")


def routed_expert_calls(calls: dict) -> int:
    """Kernel calls that ran routed experts (grouped rows, or a whole layer's routing and combine)."""
    return calls["moe_experts"] + calls["moe_forward"]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of each kernel entry point (the layers reach them through the module)."""
    calls = {name: 0 for name in KERNEL_ENTRY_POINTS}
    for name in calls:
        original = getattr(cpu_kernels, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(cpu_kernels, name, counted)
    return calls


def random_experts(num_experts: int, hidden: int, intermediate: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) * intermediate ** -0.5
    return w13, w2


def experts_reference(xs: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """(silu(x Wg^T) * (x Wu^T)) W2^T per expert over its rows, in float64."""
    intermediate = w2.shape[2]
    out, start = [], 0
    for expert, count in enumerate(counts):
        x = xs[start:start + count].double()
        gate, up = w13[expert, :intermediate].double(), w13[expert, intermediate:].double()
        out.append((F.silu(x @ gate.T) * (x @ up.T)) @ w2[expert].double().T)
        start += count
    return torch.cat(out)


def test_kernels_build_here():
    assert cpu_kernels.enabled()
    assert hasattr(torch.ops.meshserve_cpu, "mla_decode")


def test_pack_weight_layout():
    w = torch.arange(3 * 64 * 5, dtype=torch.float32).view(3, 64, 5)  # [groups, out, in]
    packed = cpu_kernels.pack_weight(w)
    assert packed.shape == (3, 2, 5, 32)
    # block j, input k, lane c holds output column 32 j + c
    assert torch.equal(packed[1, 1, 4], w[1, 32:64, 4])
    assert cpu_kernels.packable(w) and not cpu_kernels.packable(w[:, :48])


# expert counts of one layer: empty experts (first and last too), one row, and more than one
# 12-row tile per expert (tile edges at 12, 13, 24, 25)
EXPERT_COUNTS = [
    [0, 0, 1, 0, 0, 0],
    [2, 0, 0, 3, 0, 0],
    [0, 13, 25, 0, 1, 25],
    [0, 100, 12, 24, 164, 0],
]


@pytest.mark.parametrize("counts", EXPERT_COUNTS, ids=lambda c: f"{sum(c)}rows")
def test_moe_experts_equals_per_expert_matmuls(counts):
    hidden, intermediate = 64, 96  # 2 hidden blocks, 3 intermediate blocks
    w13, w2 = random_experts(len(counts), hidden, intermediate, seed=sum(counts))
    xs = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1))
    offsets = torch.tensor([0] + counts).cumsum(0)
    got = cpu_kernels.moe_experts(xs, offsets, cpu_kernels.pack_weight(w13), cpu_kernels.pack_weight(w2))
    want = experts_reference(xs, counts, w13, w2)
    assert got.shape == (sum(counts), hidden) and got.dtype == torch.float32
    scale = want.abs().max().item()
    assert scale > 0.1
    assert (got.double() - want).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_fused_experts_native_equals_torch_path_on_an_expert_slice(num_tokens, kernel_calls):
    total_experts, first_expert, num_local, top_k, hidden, intermediate = 12, 4, 4, 3, 64, 32
    w13, w2 = random_experts(num_local, hidden, intermediate, seed=num_tokens)
    g = torch.Generator().manual_seed(num_tokens)
    hidden_states = torch.randn(num_tokens, hidden, generator=g)
    # distinct global ids per token, most of them held by other ranks
    topk_ids = torch.stack([torch.randperm(total_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    topk_ids[0] = torch.tensor([first_expert + 1, 0, total_experts - 1])  # a local expert among remote ones
    topk_weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    native = (cpu_kernels.pack_weight(w13), cpu_kernels.pack_weight(w2))

    got = fused_experts(hidden_states, topk_ids, topk_weights, w13, w2, first_expert, native=native)
    want = fused_experts(hidden_states, topk_ids, topk_weights, w13, w2, first_expert, packed=None)
    assert routed_expert_calls(kernel_calls) == 1
    local = ((topk_ids >= first_expert) & (topk_ids < first_expert + num_local)).any(1)
    assert want[local].abs().amax(1).min() > 1e-3 and not want[~local].any()
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_fused_experts_with_no_local_ids_returns_zeros():
    w13, w2 = random_experts(4, 64, 32, seed=0)
    native = (cpu_kernels.pack_weight(w13), cpu_kernels.pack_weight(w2))
    ids = torch.tensor([[0, 1], [2, 3], [9, 10]])
    out = fused_experts(torch.randn(3, 64), ids, torch.ones(3, 2), w13, w2, first_expert=4, native=native)
    assert out.shape == (3, 64) and not out.any()
    empty = fused_experts(torch.randn(0, 64), ids[:0], torch.ones(0, 2), w13, w2, first_expert=4, native=native)
    assert empty.shape == (0, 64)


def mla_reference(q, cache, block_table, seq_lens, scale, kv_lora_rank):
    """Per sequence: softmax(scale * q·entries) · latent, with the entries looked up block by block (float64)."""
    block_size = cache.shape[1]
    out = []
    for b, length in enumerate(seq_lens.tolist()):
        blocks = block_table[b, : -(-length // block_size)]
        entries = cache[blocks].reshape(-1, cache.shape[2])[:length].double()
        probs = torch.softmax(scale * q[b].double() @ entries.T, dim=-1)  # [heads, length]
        out.append(probs @ entries[:, :kv_lora_rank])
    return torch.stack(out)


def check_mla_decode(block_size: int, heads: int, kv_lora_rank: int, rope: int) -> None:
    # 1 token, exact block multiples, ragged lengths; with 24-token blocks a block spans two tiles
    seq_lens = torch.tensor([1, block_size, 3 * block_size, 2 * block_size + 3, 37, 50])
    max_blocks = -(-int(seq_lens.max()) // block_size) + 2  # the table is wider than any sequence needs
    num_blocks = len(seq_lens) * max_blocks
    g = torch.Generator().manual_seed(block_size * 1000 + heads + kv_lora_rank)
    cache = torch.randn(num_blocks, block_size, kv_lora_rank + rope, generator=g)
    # every sequence gets its own blocks in scrambled order; unused table slots point at other data
    block_table = torch.randperm(num_blocks, generator=g).view(len(seq_lens), max_blocks)
    q = torch.randn(len(seq_lens), heads, kv_lora_rank + rope, generator=g)
    scale = 3.0 / (kv_lora_rank + rope) ** 0.5  # scores spread by a few units: peaked, and the maximum moves

    got = cpu_kernels.mla_decode(q, cache, block_table, seq_lens, scale, kv_lora_rank)
    want = mla_reference(q, cache, block_table, seq_lens, scale, kv_lora_rank)
    assert got.shape == (len(seq_lens), heads, kv_lora_rank)
    # a one-token sequence attends to its only entry
    assert (got[0] - cache[block_table[0, 0], 0, :kv_lora_rank]).abs().max().item() <= 1e-6
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("heads", [12, 20])
@pytest.mark.parametrize("block_size", [4, 16, 24])
def test_mla_decode_equals_softmax_over_paged_entries(block_size, heads):
    check_mla_decode(block_size, heads, kv_lora_rank=64, rope=16)


@pytest.mark.parametrize("kv_lora_rank, rope", [(32, 8), (144, 16), (512, 64)])
def test_mla_decode_other_latent_widths_and_odd_head_groups(kv_lora_rank, rope):
    # entries of 40 numbers (not whole vectors), latent chunks of 8 and 1 vectors, DeepSeek-V3's own
    # sizes; 17 heads leave one head in the second group
    check_mla_decode(16, 17, kv_lora_rank, rope)


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("length", [5, 300, 600, 1037])
def test_mla_decode_of_one_sequence_splits_its_context_over_the_threads(length):
    """Batch 1, one head group: from 256 tokens on the context is split into parts on both threads, each part's
    softmax state combined afterwards (a part need not start on a block or a tile edge)."""
    block_size, heads, kv_lora_rank, rope = 16, 12, 64, 16
    g = torch.Generator().manual_seed(length)
    num_blocks = -(-length // block_size) + 3
    cache = torch.randn(num_blocks, block_size, kv_lora_rank + rope, generator=g)
    block_table = torch.randperm(num_blocks, generator=g).view(1, num_blocks)
    q = torch.randn(1, heads, kv_lora_rank + rope, generator=g)
    seq_lens = torch.tensor([length])
    with torch_threads(2):
        got = cpu_kernels.mla_decode(q, cache, block_table, seq_lens, 0.4, kv_lora_rank)
    want = mla_reference(q, cache, block_table, seq_lens, 0.4, kv_lora_rank)
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("rows", [1, 29])
def test_grouped_linear_reads_and_writes_strided_slices(rows):
    heads, nope, rope, n = 6, 32, 16, 64
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, heads, nope + rope, generator=g)
    weight = torch.randn(heads, n, nope, generator=g)  # W_g: [N, K] per group
    big = torch.randn(rows, heads, n + rope, generator=g)
    big_before, q_before = big.clone(), q.clone()
    x, out = q[..., :nope], big[..., :n]
    assert not x.is_contiguous() and not out.is_contiguous()

    result = cpu_kernels.grouped_linear(x, cpu_kernels.pack_weight(weight), out)
    want = torch.einsum("mgk,gnk->mgn", x.double(), weight.double())
    assert result.data_ptr() == big.data_ptr()
    assert (big[..., :n].double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(big[..., n:], big_before[..., n:])  # the columns past `out` stay as they were
    assert torch.equal(q, q_before)


@pytest.mark.parametrize("shape", [(1, 64), (7, 72), (2, 3, 5)], ids=str)
def test_rms_norm_equals_the_formula(shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g) * 3
    weight = torch.rand(shape[-1], generator=g) + 0.5
    got = cpu_kernels.rms_norm(x, weight, 1e-6)
    xd = x.double()
    want = weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert got.shape == x.shape
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_in_place_equals_apply_rotary(interleaved):
    g = torch.Generator().manual_seed(int(interleaved))
    q = torch.randn(5, 3, 24, generator=g)  # [T, heads, nope 16 + rope 8]: rotate the strided rope slice
    fused = torch.randn(5, 40, generator=g)  # [T, ...]: rotate the last 8 columns of a wider projection
    cos, sin = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    q_want = apply_rotary(q[..., 16:], cos.unsqueeze(1), sin.unsqueeze(1), interleaved)
    k_want = apply_rotary(fused[:, 32:], cos, sin, interleaved)
    q_before, fused_before = q.clone(), fused.clone()
    cpu_kernels.rotary_(q[..., 16:], cos, sin, interleaved)
    apply_rotary_(fused[:, 32:], cos, sin, interleaved)
    assert (q[..., 16:] - q_want).abs().max().item() <= 1e-5
    assert (fused[:, 32:] - k_want).abs().max().item() <= 1e-5
    assert torch.equal(q[..., :16], q_before[..., :16]) and torch.equal(fused[:, :32], fused_before[:, :32])
    with cpu_kernels.disabled():  # the torch fallback writes the same values in place
        apply_rotary_(fused_before[:, 32:], cos, sin, interleaved)
    assert (fused_before - fused).abs().max().item() <= 1e-5


@pytest.mark.parametrize("bias", [False, True])
def test_linear_runs_on_the_native_pack_and_equals_f_linear(bias, kernel_calls):
    g = torch.Generator().manual_seed(int(bias))
    layer = Linear(48, 96, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 48, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(96, generator=g))
    wide = torch.randn(2, 7, 64, generator=g)
    x = wide[..., 8:56]  # strided rows, 3-D, as a split projection output is
    want = F.linear(x, layer.weight, layer.bias)
    assert attach_packed(layer.weight)
    assert getattr(layer.weight, "_native_packed", None) is not None
    got = layer(x)
    assert kernel_calls["grouped_linear"] == 1
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-4
    with cpu_kernels.disabled():  # the torch path packs for oneDNN on first use
        torch_path = linear(x, layer.weight, layer.bias)
    assert kernel_calls["grouped_linear"] == 1
    assert getattr(layer.weight, "_onednn_packed", None) is not None
    assert (torch_path - want).abs().max().item() <= 1e-4


def test_linear_with_an_unpackable_width_keeps_onednn(kernel_calls):
    weight = torch.randn(20, 16)  # 20 outputs: not a whole 32-column block
    assert attach_packed(weight)
    assert getattr(weight, "_native_packed", None) is None and getattr(weight, "_onednn_packed", None) is not None
    x = torch.randn(3, 16)
    assert (linear(x, weight) - F.linear(x, weight)).abs().max().item() <= 1e-4
    assert kernel_calls["grouped_linear"] == 0


@pytest.mark.parametrize("n_group, topk_group, norm_topk_prob", [(1, 1, True), (4, 2, True), (4, 2, False),
                                                                 (8, 8, True)])
def test_grouped_topk_equals_the_torch_routing(n_group, topk_group, norm_topk_prob):
    num_experts, top_k = 32, 4
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    logits = torch.randn(40, num_experts, generator=g) * 2
    bias = torch.randn(num_experts, generator=g) * 0.1
    args = (logits, bias, top_k, n_group, topk_group, norm_topk_prob, 2.5)
    weights, ids = cpu_kernels.grouped_topk(*args)
    with cpu_kernels.disabled():
        want_weights, want_ids = grouped_topk(*args)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    # the same experts (the order within a token is free) with the same weights
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert (weights.gather(1, order) - want_weights.gather(1, want_order)).abs().max().item() <= 1e-5
    if n_group > topk_group:  # the group limit holds: chosen experts come from at most topk_group groups
        groups = ids // (num_experts // n_group)
        assert all(len(set(row)) <= topk_group for row in groups.tolist())


def test_disabled_switches_only_this_thread_and_nests():
    assert cpu_kernels.enabled()
    seen_by_other_thread = []
    with cpu_kernels.disabled():
        assert not cpu_kernels.enabled()
        other = threading.Thread(target=lambda: seen_by_other_thread.append(cpu_kernels.enabled()))
        other.start()
        other.join(timeout=30)
        assert not other.is_alive()
        with cpu_kernels.disabled():
            assert not cpu_kernels.enabled()
        assert not cpu_kernels.enabled()  # leaving the inner block keeps the outer one's setting
    assert seen_by_other_thread == [True]
    assert cpu_kernels.enabled()
    with pytest.raises(KeyError):
        with cpu_kernels.disabled():
            raise KeyError("leaves through an exception")
    assert cpu_kernels.enabled()


SWITCHED_OFF_SCRIPT = textwrap.dedent("""
    import json
    import torch
    from meshserve.layers import cpu_kernels
    from meshserve.layers.moe import FusedMoEWeights, fused_experts

    experts = FusedMoEWeights(4, 64, 32, torch.float32)
    g = torch.Generator().manual_seed(0)
    experts.w13.data.copy_(torch.randn(experts.w13.shape, generator=g) * 0.1)
    experts.w2.data.copy_(torch.randn(experts.w2.shape, generator=g) * 0.1)
    packs = experts.pack_weights()
    x = torch.randn(5, 64, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 3]])
    weights = torch.rand(5, 2, generator=g)
    got = experts(x, ids, weights)
    want = fused_experts(x, ids, weights, experts.w13, experts.w2, packed=None)
    try:
        cpu_kernels.moe_experts(x, torch.tensor([0, 5, 5, 5, 5]), *[torch.zeros(1)] * 2)
        refused = False
    except RuntimeError:
        refused = True
    print(json.dumps({"enabled": cpu_kernels.enabled(), "packs": packs, "native": experts._native is not None,
                      "onednn": experts._packed is not None, "diff": (got - want).abs().max().item(),
                      "scale": want.abs().max().item(), "refused": refused}))
""")


def test_environment_switch_runs_the_torch_path():
    env = {**os.environ, "MESHSERVE_CPU_KERNELS": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", SWITCHED_OFF_SCRIPT], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["enabled"] is False and result["refused"] is True
    assert result["packs"] == 2 * 4 and result["onednn"] and not result["native"]  # oneDNN: w13 and w2 per slot
    assert result["scale"] > 1e-3 and result["diff"] <= 1e-5 * result["scale"]


# every native path applies: latent and value dims in whole 32-column blocks, 20 heads span two
# 16-head groups of the attention kernel, and 16-token blocks let it take full 16-token tiles
NATIVE_MODEL = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, hidden_size=64,
                    moe_intermediate_size=32, num_attention_heads=20, num_key_value_heads=20)


@pytest.fixture(scope="module")
def native_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("native_model")
    hf = make_checkpoint(path, **NATIVE_MODEL)
    return load_model(path), hf.config.vocab_size


def run_steps(model, batch: list[list[int]], steps: int, fed: list[list[int]] | None = None):
    """Prefill the prompts in one step, then decode them together for `steps` steps, greedily or feeding the
    tokens in `fed` (step by step). Returns the logits of every step and the tokens decoded from."""
    harness = PagedHarness(model, block_size=16, num_blocks=64)
    seqs = list(range(len(batch)))
    outputs = harness.step(seqs, batch)
    logits, tokens = [torch.cat(outputs)], []
    for step in range(steps):
        step_tokens = fed[step] if fed is not None else [int(out[-1].argmax()) for out in outputs]
        tokens.append(step_tokens)
        outputs = harness.step(seqs, [[t] for t in step_tokens])
        logits.append(torch.cat(outputs))
    return logits, tokens


def test_model_decode_with_kernels_equals_torch_path(native_model, kernel_calls, monkeypatch):
    # the kernels one by one, as the per-op path calls them (the fused decode layers: tests/models/test_fused_decode.py)
    monkeypatch.setenv("MESHSERVE_FUSED_DECODE", "0")
    model, vocab = native_model
    attention = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    experts = [m for m in model.modules() if isinstance(m, FusedMoEWeights)]
    assert attention and experts
    assert all(m._absorbed_packed is not None for m in attention)
    assert all(m._native is not None for m in experts)

    batch = prompts(vocab, lens=(5, 17, 33, 1), seed=7)
    steps = 8
    native, tokens = run_steps(model, batch, steps)
    decode_steps = steps * len(attention)
    assert kernel_calls["mla_decode"] >= decode_steps
    assert kernel_calls["grouped_linear"] >= 2 * decode_steps
    assert routed_expert_calls(kernel_calls) >= (steps + 1) * len(experts)
    assert kernel_calls["rms_norm"] > 0 and kernel_calls["grouped_topk"] >= (steps + 1) * len(experts)
    assert kernel_calls["rotary_"] >= 2 * (steps + 1) * len(attention)  # q and k of every layer and step

    before = dict(kernel_calls)
    with cpu_kernels.disabled():
        torch_path, _ = run_steps(model, batch, steps, fed=tokens)  # the same tokens, so the logits compare
    assert kernel_calls == before  # the torch path ran without the kernels

    for step, (got, want) in enumerate(zip(native, torch_path)):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-4, f"step {step}"


def test_write_slot_updates_the_native_copy(kernel_calls):
    hidden, intermediate = 64, 64
    experts = FusedMoEWeights(8, hidden, intermediate, torch.float32, first_expert=4, num_local_experts=4,
                              redundant_slots=2)
    w13, w2 = random_experts(4, hidden, intermediate, seed=3)
    experts.w13.data[:4].copy_(w13)
    experts.w2.data[:4].copy_(w2)
    assert experts.pack_weights() == 2 and experts._native is not None
    first_slot = experts.first_slot
    assert first_slot == 6  # EP rank 1 of 2, six slots each

    replica13, replica2 = random_experts(1, hidden, intermediate, seed=4)
    experts.write_slot(4, 5, replica13[0], replica2[0])
    assert torch.equal(experts._native[0][4], cpu_kernels.pack_weight(replica13[0]))
    assert torch.equal(experts._native[1][4], cpu_kernels.pack_weight(replica2[0]))

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, hidden, generator=g)
    # tokens 0-2 reach the written slot only; the rest mix it with primaries and remote slots
    ids = torch.tensor([[first_slot + 4, 0], [first_slot + 4, 1], [first_slot + 4, 13],
                        [first_slot + 4, first_slot], [first_slot + 5, first_slot + 3], [2, first_slot + 4]])
    weights = torch.rand(6, 2, generator=g) + 0.1
    got = experts(x, ids, weights)
    want = fused_experts(x, ids, weights, experts.w13, experts.w2, first_slot, packed=None)
    assert routed_expert_calls(kernel_calls) == 1
    assert want[:3].abs().amax(1).min() > 1e-3
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load(tmp_path):
    """cpp_extension's lock file outlives a build killed mid-way; the next process removes it under its flock
    (which died with the killed builder) instead of waiting for it forever."""
    (tmp_path / "lock").touch()
    with cpu_kernels._builder_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    # a builder alive elsewhere keeps its flock: nobody else enters (and so nobody removes its lock file)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        handle = open({str(tmp_path / "builder.flock")!r}, "w")
        fcntl.flock(handle, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").touch()
        entered = threading.Event()

        def enter() -> None:
            with cpu_kernels._builder_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=enter, daemon=True)
        waiter.start()
        assert not entered.wait(0.5) and (tmp_path / "lock").exists()
        holder.kill()  # the builder dies: its flock goes with it, and its lock file is stale now
        assert entered.wait(10) and not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_linear_stream_benchmark_times_both_kernels_on_the_same_copies():
    """`python -m meshserve.bench.linear_stream` at its smallest: every copy called once per round by each side,
    and the two sides' products agree (timings are never compared)."""
    from meshserve.bench.linear_stream import format_table, measure

    row = measure("o_proj", 64, 96, pool_mb=0.1, rounds=2)
    assert row["copies"] == int(0.1e6 // (64 * 96 * 4)) and row["outputs_agree"]
    assert row["native_us"] > 0 and row["onednn_us"] > 0 and row["ratio"] == row["onednn_us"] / row["native_us"]
    assert format_table([row]).splitlines()[1].split()[0] == "o_proj"


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 64, 32), (3, 1152, 384), (29, 96, 130), (40, 32, 768)])
def test_the_bfloat16_linear_kernel_matches_onednn(rows, out_features, in_features):
    """With AVX512-BF16: bfloat16 inputs and weights, float32 sums, one rounding to bfloat16 at the end, as oneDNN
    does (only the order of the sums differs); strided rows read in place. Elsewhere no weight packs for it."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    wide = torch.randn(rows, in_features + 6, generator=g).bfloat16()
    x = wide[:, 3:3 + in_features]  # rows with a stride
    if not cpu_kernels.bf16_packable(weight):
        attach_packed(weight)
        assert not hasattr(weight, "_native_packed")  # oneDNN's pack (or none) instead
        return
    got = cpu_kernels.bf16_linear(x, cpu_kernels.pack_weight_bf16(weight))
    exact = x.double() @ weight.double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # one bfloat16 rounding of the float32 sum: within a step (2^-8 relative) of the exact product
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3 * exact.abs().max()).all()
    assert (got.double() - torch.nn.functional.linear(x, weight).double()).abs().max() <= 2**-7 * exact.abs().max()


def test_a_bfloat16_linear_layer_takes_the_native_kernel_and_the_switch_takes_onednn():
    layer = Linear(64, 96, bias=True, dtype=torch.bfloat16)
    x = torch.randn(5, 64).bfloat16()
    before = layer(x)
    pack_linears(layer)
    native = getattr(layer.weight, "_native_packed", None)
    assert (native is not None) == cpu_kernels.bf16_packable(layer.weight)
    after = layer(x)
    with cpu_kernels.disabled():
        torch_path = layer(x)
    for out in (after, torch_path):
        assert out.dtype == torch.bfloat16 and (out.float() - before.float()).abs().max() <= 0.02 * before.abs().max()


def test_bfloat16_experts_take_the_native_kernel_and_match_the_torch_path():
    """A bfloat16 MoE layer's slots pack for the native bfloat16 kernel where the CPU has AVX512-BF16 (one pair of
    linears per active expert), equal to the torch path's experts to bfloat16 rounding; a slot loaded later (an
    expert moved by EPLB) is packed again."""
    experts = FusedMoEWeights(4, 64, 32, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    experts.w13.data.copy_(torch.randn(experts.w13.shape, generator=g) * 0.1)
    experts.w2.data.copy_(torch.randn(experts.w2.shape, generator=g) * 0.1)
    assert experts.pack_weights() == 8
    native = cpu_kernels.bf16_packable(experts.w13[0])
    assert (experts._bf16_native is not None) == native
    x = torch.randn(5, 64, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 3]])
    weights = torch.rand(5, 2, generator=g)

    def check():
        got = experts(x, ids, weights)
        want = fused_experts(x, ids, weights, experts.w13, experts.w2)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()

    check()
    w13 = torch.randn(experts.w13.shape[1:], generator=g) * 0.1
    w2 = torch.randn(experts.w2.shape[1:], generator=g) * 0.1
    experts.write_slot(2, 7, w13.bfloat16(), w2.bfloat16())
    if native:
        assert torch.equal(experts._bf16_native[0][2], cpu_kernels.pack_weight_bf16(experts.w13[2]))
    check()


@pytest.mark.parametrize("length", [5, 40, 300, 600])
def test_mla_decode_over_a_bfloat16_cache_equals_the_reference(length):
    """A bfloat16 model's cache: the rows converted to float32 tile by tile, the float32 kernel's math after them
    (context split from 256 tokens included)."""
    block_size, heads, kv_lora_rank, rope = 16, 20, 64, 16
    g = torch.Generator().manual_seed(length)
    num_blocks = -(-length // block_size) + 3
    cache = torch.randn(num_blocks, block_size, kv_lora_rank + rope, generator=g).bfloat16()
    block_table = torch.randperm(num_blocks, generator=g).view(1, num_blocks).repeat(2, 1)
    q = torch.randn(2, heads, kv_lora_rank + rope, generator=g)
    seq_lens = torch.tensor([length, max(1, length // 3)])
    with torch_threads(2):
        got = cpu_kernels.mla_decode_bf16(q, cache, block_table, seq_lens, 0.4, kv_lora_rank)
    want = mla_reference(q, cache.float(), block_table, seq_lens, 0.4, kv_lora_rank)
    assert got.dtype == torch.float32 and got.shape == (2, heads, kv_lora_rank)
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    with pytest.raises(RuntimeError, match="bfloat16 cache"):
        cpu_kernels.mla_decode_bf16(q, cache.float(), block_table, seq_lens, 0.4, kv_lora_rank)
