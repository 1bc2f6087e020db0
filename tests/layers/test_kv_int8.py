"""INT8 KV cache (`--kv-cache-dtype int8`): the row format, the native MLA decode kernel, and the models on it.

Oracles: the exact float64 arithmetic of the stored numbers (int8 x bfloat16 scale) for the round trip and
the kernel; the same model on a float32 cache for the logits, within the stated tolerance.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from meshserve.config import ConfigError, EngineConfig
from meshserve.layers import cpu_kernels, kv_quant
from meshserve.layers.metadata import KVCacheLayout
from meshserve.models.loader import load_model
from meshserve.pool.context_keys import kv_layout_name
from meshserve.utils import envs
from meshserve.worker.kv_connector.pool import PoolConnectorWorker
from tests.layers.test_cpu_kernels import torch_threads
from tests.models.paged_harness import PagedHarness

MLA_PARTS = (64, 16)  # the tiny DeepSeek-V3: kv_lora_rank, qk_rope_head_dim
# logits of the tiny random models on an INT8 cache against a float32 one, teacher-forced at every position of
# a prefill, a chunked prefill and decode steps: relative error (norm of the difference over the norm) and
# top-1 agreement. The rounding is at most half a step of max|part| / 127 per number; the dense model shows it
# alone (measured 0.006, a bfloat16 cache 0.001); the MoE models amplify any KV change where a token's expert
# choice flips, a bfloat16 cache's too (measured INT8 / bfloat16: DeepSeek-V3 0.031 / 0.015, Qwen3-MoE
# 0.013 / 0.014; top-1 agreement 0.957 and 1.0).
RELATIVE_LOGIT_TOL = {"deepseek_v3": 0.06, "qwen3_moe": 0.06, "qwen3": 0.015}
TOP1_AGREEMENT = 0.9


def scales_of(rows: torch.Tensor, parts) -> torch.Tensor:
    raw = rows[..., sum(parts):]
    return torch.empty(raw.shape, dtype=torch.int8).copy_(raw).view(torch.bfloat16).float()


# ---------------------------------------------------------------- the row format


def test_round_trip_stays_within_half_a_step_of_each_parts_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, sum(MLA_PARTS), generator=g) * torch.logspace(-4, 3, 300).unsqueeze(1)
    x[7] = 0.0  # an all-zero entry
    x[8, :64] = 0.0  # a zero latent beside a rope part
    x[9, 3] = 1e4  # one outlier
    rows = kv_quant.quantize(x, MLA_PARTS)
    assert rows.dtype == torch.int8 and rows.shape == (300, 80 + 4)
    assert rows[:, :80].abs().max().item() <= 127  # -128 is never used: the range is symmetric
    scales = scales_of(rows, MLA_PARTS)  # [300, 2]: the latent's, the rope part's
    back = kv_quant.dequantize(rows, MLA_PARTS, torch.float64)
    assert torch.equal(back[7], torch.zeros(80, dtype=torch.float64))
    assert torch.equal(back[8, :64], torch.zeros(64, dtype=torch.float64))
    start = 0
    for i, part in enumerate(MLA_PARTS):
        xs, s = x[:, start:start + part].double(), scales[:, i:i + 1].double()
        amax = xs.abs().amax(-1, keepdim=True)
        nonzero = amax.squeeze(1) > 0
        # the stored scale is max|x| / 127 rounded up to bfloat16: no value clips, steps at most 2^-7 coarser
        assert (s[nonzero] >= amax[nonzero] / 127 * (1 - 1e-7)).all()
        assert (s[nonzero] <= amax[nonzero] / 127 * (1 + 2 ** -7)).all()
        assert ((back[:, start:start + part] - xs).abs() <= s / 2 * (1 + 1e-6)).all()
        start += part
    # the outlier costs its own token's latent precision only
    assert (back[10] - x[10].double()).abs().max() < (back[9] - x[9].double()).abs().max()


def test_rounding_is_half_to_even_on_the_stored_scale():
    step = 2.0 ** -4  # an exact bfloat16 scale: max 127 steps
    x = torch.tensor([[127, 0.5, 1.5, 2.5, -2.5, -0.5, 3.49]]) * step
    rows = kv_quant.quantize(x, (7,))
    assert scales_of(rows, (7,)).item() == step
    assert rows[0, :7].tolist() == [127, 0, 2, 2, -2, 0, 3]


def test_gqa_rows_carry_one_scale_per_token_kv_and_head():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(5, 2, 3, 32, generator=g) * torch.tensor([1.0, 100.0, 0.01]).view(1, 1, 3, 1)
    rows = kv_quant.quantize(kv, (32,))
    assert rows.shape == (5, 2, 3, 34)
    scales = scales_of(rows, (32,)).squeeze(-1)  # [5, 2, 3]
    assert (scales[:, :, 1] > 100 * scales[:, :, 2]).all()  # heads are scaled apart
    err = (kv_quant.dequantize(rows, (32,), torch.float32) - kv).abs()
    assert (err <= scales.unsqueeze(-1) / 2 * (1 + 1e-6)).all()


def test_layouts_count_bytes_and_keep_float_caches_as_they_were():
    mla = KVCacheLayout.mla(4, 512, 64, torch.int8)
    assert mla.entry_shape == (512 + 64 + 4,) and mla.bytes_per_token == 4 * 580
    assert KVCacheLayout.mla(4, 512, 64, torch.bfloat16).entry_shape == (576,)
    gqa = KVCacheLayout.gqa(2, 8, 128, torch.int8)
    assert gqa.entry_shape == (2, 8, 130) and gqa.bytes_per_token == 2 * 2 * 8 * 130
    assert KVCacheLayout.gqa(2, 8, 128, torch.float32).entry_shape == (2, 8, 128)
    # DeepSeek-V3's latent: 1152 bytes a token in bfloat16, 580 in INT8 (the 4 bytes are its two scales)
    assert KVCacheLayout.mla(61, 512, 64, torch.bfloat16).bytes_per_token / mla.bytes_per_token * 4 / 61 == \
        pytest.approx(1152 / 580)
    caches = mla.allocate(3, 16)
    assert caches[0].dtype == torch.int8 and caches[0].shape == (3, 16, 580)


def test_write_stores_rows_and_returns_what_reads_will_see():
    g = torch.Generator().manual_seed(2)
    cache = KVCacheLayout.mla(1, *MLA_PARTS, torch.int8).allocate(4, 8)[0]
    entries = torch.randn(5, 80, generator=g)
    slots = torch.tensor([3, 9, 10, 30, 0])
    seen = kv_quant.write(cache, slots, entries, MLA_PARTS)
    flat = cache.view(-1, 84)
    assert torch.equal(flat[slots], kv_quant.quantize(entries, MLA_PARTS))
    assert torch.equal(kv_quant.read(flat[slots], MLA_PARTS, torch.float32), seen)
    float_cache = torch.zeros(4, 8, 80)
    assert kv_quant.write(float_cache, slots, entries, MLA_PARTS) is entries
    assert torch.equal(kv_quant.read(float_cache.view(-1, 80)[slots], MLA_PARTS, torch.float32), entries)


def test_kv_cache_dtype_setting():
    assert EngineConfig.from_kwargs("m", kv_cache_dtype="int8").cache_config.kv_cache_dtype == "int8"
    assert EngineConfig.from_kwargs("m").cache_config.kv_cache_dtype == "auto"
    with pytest.raises(ConfigError):
        EngineConfig.from_kwargs("m", kv_cache_dtype="fp8")
    assert kv_quant.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.cache_dtype("int8", torch.float32) == torch.int8


def test_pool_keys_tell_number_formats_apart():
    layouts = {kv_layout_name("float32", kv, quant, mtp)
               for kv in ("auto", "int8") for quant in (None, "int8") for mtp in (False, True)}
    assert len(layouts) == 8
    # a float engine's blocks keep the names they were stored under
    assert kv_layout_name("float32") == "float32" and kv_layout_name("bfloat16", mtp=True) == "bfloat16+mtp"
    assert kv_layout_name("float32", "int8") == "float32+kv-int8"
    assert kv_layout_name("float32", quantization="int8") == "float32+w-int8"


LAYOUTS = {  # (layout, the parts of one row, the numbers of one token's entry)
    "mla": (KVCacheLayout.mla(2, *MLA_PARTS, torch.int8), MLA_PARTS, (80,)),
    "gqa": (KVCacheLayout.gqa(2, 2, 32, torch.int8), (32,), (2, 2, 32)),
}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_pool_blocks_carry_the_scales(kind):
    """The pool connector stores a block as the bytes of its rows, scales included, and writes them back."""
    layout, parts, entry = LAYOUTS[kind]
    g = torch.Generator().manual_seed(3)
    caches = layout.allocate(4, 8)
    for cache in caches:
        kv_quant.write(cache, torch.arange(32), torch.randn(32, *entry, generator=g), parts)
    source = PoolConnectorWorker(None, "ns", 0, 1, caches)
    data = source.read_block(2)
    assert len(data) == source.block_nbytes == 8 * layout.bytes_per_token
    target_caches = layout.allocate(4, 8)
    PoolConnectorWorker(None, "ns", 0, 1, target_caches).write_block(1, data)
    for cache, target in zip(caches, target_caches):
        assert torch.equal(target[1], cache[2])  # values and scales


# ---------------------------------------------------------------- the native MLA decode kernel


def reference_decode(q, cache, block_table, seq_lens, scale, kv_lora_rank):
    """softmax(scale q·entry) · latent over the dequantized entries, in float64."""
    rows = kv_quant.dequantize(cache, MLA_PARTS, torch.float64)
    out = []
    for b, length in enumerate(seq_lens.tolist()):
        entries = rows[block_table[b]].reshape(-1, rows.shape[-1])[:length]
        probs = torch.softmax(q[b].double() @ entries.T * scale, dim=-1)
        out.append(probs @ entries[:, :kv_lora_rank])
    return torch.stack(out)


def _scattered_cache(block_size: int):
    """A cache of scaled random entries in scrambled blocks; sequences of lengths inside one tile, at tile and
    block edges and across several blocks; a query of 20 heads (a full group of 16 and a padded one)."""
    g = torch.Generator().manual_seed(block_size)
    num_blocks, heads = 64, 20
    entries = torch.randn(num_blocks * block_size, 80, generator=g) * torch.linspace(0.2, 4, 80)
    cache = kv_quant.quantize(entries, MLA_PARTS).view(num_blocks, block_size, 84)
    seq_lens = torch.tensor([1, 7, 16, 17, block_size, block_size + 1, 50, 4 * block_size])
    blocks_per_seq = -(-int(seq_lens.max()) // block_size)
    table = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * blocks_per_seq].view(-1, blocks_per_seq)
    q = torch.randn(len(seq_lens), heads, 80, generator=g) * 3
    return q, cache, table, seq_lens


@pytest.mark.parametrize("block_size", [8, 32])
def test_native_int8_decode_equals_the_dequantized_reference(block_size):
    assert kv_quant.native_decode_available()
    q, cache, table, seq_lens = _scattered_cache(block_size)
    got = kv_quant.mla_decode_int8(q, cache, table, seq_lens, 0.15, 64, int8_scores=False)
    want = reference_decode(q, cache, table, seq_lens, 0.15, 64)
    assert got.shape == (len(seq_lens), q.shape[1], 64) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("block_size", [8, 32])
def test_integer_scores_equal_the_reference_with_the_rounded_query(block_size):
    """With AVX512-VNNI the scores are integer dot products against the query rounded per head and part: the
    result is the exact attention of that rounded query; elsewhere the float scores run."""
    q, cache, table, seq_lens = _scattered_cache(block_size)
    q[2, 3] = 0.0  # a head whose query rounds to nothing
    got = kv_quant.mla_decode_int8(q, cache, table, seq_lens, 0.15, 64, int8_scores=True)
    if kv_quant.int8_scores_available():
        rounded = kv_quant.quantized_query(q, 64)
        want = reference_decode(rounded, cache, table, seq_lens, 0.15, 64)
        assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        # the rounding is what differs from the float scores: within a step of 1/127 of each part's largest value
        assert 0 < (rounded - q).abs().max().item() <= 0.5 / 127 * q.abs().max().item() * 1.0001
    else:
        assert torch.equal(got, kv_quant.mla_decode_int8(q, cache, table, seq_lens, 0.15, 64, int8_scores=False))


@pytest.mark.parametrize("length", [300, 600, 1037])
def test_native_int8_decode_of_one_sequence_splits_its_context_over_the_threads(length):
    """Batch 1, one head group: from 256 tokens on, parts of the context on both threads, combined."""
    g = torch.Generator().manual_seed(length)
    block_size, heads = 16, 12
    num_blocks = -(-length // block_size) + 3
    entries = torch.randn(num_blocks * block_size, 80, generator=g)
    cache = kv_quant.quantize(entries, MLA_PARTS).view(num_blocks, block_size, 84)
    table = torch.randperm(num_blocks, generator=g).view(1, num_blocks)
    q, seq_lens = torch.randn(1, heads, 80, generator=g), torch.tensor([length])
    with torch_threads(2):
        got = kv_quant.mla_decode_int8(q, cache, table, seq_lens, 0.15, 64, int8_scores=False)
        integer = kv_quant.mla_decode_int8(q, cache, table, seq_lens, 0.15, 64, int8_scores=True)
    want = reference_decode(q, cache, table, seq_lens, 0.15, 64)
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    if kv_quant.int8_scores_available():
        want = reference_decode(kv_quant.quantized_query(q, 64), cache, table, seq_lens, 0.15, 64)
    assert (integer.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_native_int8_decode_refuses_mismatched_inputs():
    cache = torch.zeros(4, 8, 84, dtype=torch.int8)
    q, table, lens = torch.zeros(1, 2, 80), torch.tensor([[0, 1]]), torch.tensor([9])
    with pytest.raises(RuntimeError, match="do not match"):
        kv_quant.mla_decode_int8(q, torch.zeros(4, 8, 80, dtype=torch.int8), table, lens, 1.0, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        kv_quant.mla_decode_int8(q, cache, torch.tensor([[0, 4]]), lens, 1.0, 64)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        kv_quant.mla_decode_int8(q, cache, table, torch.tensor([17]), 1.0, 64)


def test_the_kernel_benchmark_times_both_kernels_on_the_same_entries():
    """`python -m meshserve.bench.kv_int8_kernel` at its smallest shape: both kernels timed, their outputs within
    the INT8 cache's rounding of each other (timings are never compared)."""
    from meshserve.bench.kv_int8_kernel import format_table, measure

    row = measure(batch=2, context=40, repeats=2)
    assert row["fp32_ms"] > 0 and row["int8_ms"] > 0 and row["ratio"] == row["fp32_ms"] / row["int8_ms"]
    assert 0 < row["max_abs_diff"] < 0.05  # quantized entries: close, never equal
    assert format_table([row]).splitlines()[1].split()[:2] == ["2", "40"]
    assert row["int8_integer_ms"] > 0 and 0 < row["integer_max_abs_diff"] < 0.05


def test_the_quality_part_compares_each_cache_with_the_float32_one(tiny_model):
    """`--quality` at its smallest: teacher-forced decode steps on each cache; the float32 cache against itself
    agrees fully, the INT8 ones differ by their rounding (the figures in the docs are the trained model's)."""
    from meshserve.bench.kv_int8_kernel import format_quality, measure_quality

    rows = {row["cache"]: row for row in measure_quality(str(tiny_model()), sequences=2, prefix=5, steps=4)}
    assert list(rows) == ["fp32", "int8, float scores", "int8, integer scores"]
    assert rows["fp32"]["top1_agreement"] == 1.0 and rows["fp32"]["kl"] == 0.0
    for name in ("int8, float scores", "int8, integer scores"):
        assert 0.5 <= rows[name]["top1_agreement"] <= 1.0 and rows[name]["kl"] > 0
        assert 1 < rows[name]["perplexity"] < float("inf")  # random weights: far from the trained model's
    assert len(format_quality(list(rows.values())).splitlines()) == 4


# ---------------------------------------------------------------- the models on an INT8 cache

SEQS = [7, 30, 17]  # prompt lengths; the second is prefilled in two chunks (12 + 18), then all decode


def run_teacher_forced(model, dtype, tokens, decode_tokens, kernels: bool = True):
    """Logits [positions, vocab] of a prefill, a chunked prefill and decode steps on a cache of `dtype`."""
    harness = PagedHarness(model, block_size=8, num_blocks=64)
    harness.kv_caches = model.kv_cache_layout(dtype).allocate(64, 8)
    logits = []
    with contextlib.nullcontext() if kernels else cpu_kernels.disabled():
        out = harness.step([0, 1, 2], [tokens[0], tokens[1][:12], tokens[2]])
        logits += [out[0], out[1], out[2]]
        logits.append(harness.step([1], [tokens[1][12:]])[0])
        for step in decode_tokens:
            logits += harness.step([0, 1, 2], [[t] for t in step])
    return torch.cat(logits)


@pytest.fixture(scope="module")
def models(tiny_model):
    return {arch: load_model(str(tiny_model(arch, seed=3))) for arch in RELATIVE_LOGIT_TOL}


def _inputs(vocab_low=100, vocab_high=30000):
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(vocab_low, vocab_high, (n,), generator=g).tolist() for n in SEQS]
    decode = [torch.randint(vocab_low, vocab_high, (3,), generator=g).tolist() for _ in range(5)]
    return tokens, decode


@pytest.mark.parametrize("arch", list(RELATIVE_LOGIT_TOL))
def test_logits_on_an_int8_cache_stay_within_the_tolerance(models, arch):
    model = models[arch]
    tokens, decode = _inputs()
    exact = run_teacher_forced(model, torch.float32, tokens, decode)
    int8 = run_teacher_forced(model, torch.int8, tokens, decode)
    relative = ((int8 - exact).norm() / exact.norm()).item()
    assert 0 < relative <= RELATIVE_LOGIT_TOL[arch]
    agreement = (int8.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agreement >= TOP1_AGREEMENT


def _mla_decode_reference(q, cache, block_table, seq_lens, scale, kv_lora_rank) -> torch.Tensor:
    """The torch path of `kv_quant.mla_decode_int8`: each sequence's rows dequantized, then softmax(q c^T) c."""
    out = torch.zeros(*q.shape[:2], kv_lora_rank)
    parts = (kv_lora_rank, q.shape[-1] - kv_lora_rank)
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = cache[block_table[b]].reshape(-1, cache.shape[-1])[:seq_len]
        context = kv_quant.read(rows, parts, torch.float32)
        probs = ((q[b] @ context.T) * scale).softmax(-1)
        out[b] = probs @ context[:, :kv_lora_rank]
    return out


def test_mla_decode_runs_natively_on_the_int8_cache_and_equals_the_torch_path(models, monkeypatch):
    """Every decode the model runs on an INT8 cache goes through the native kernel, which equals the torch path on
    those very inputs (with integer scores, on the rounded query); and the model's logits with the torch decode
    instead differ by float rounding only (float scores; a relative norm: one MoE routing near-tie flipped by
    that rounding moves a single position, not the whole)."""
    model = models["deepseek_v3"]
    checked = []
    original = kv_quant.mla_decode_int8

    def checked_decode(q, *args, int8_scores):
        out = original(q, *args, int8_scores=int8_scores)
        if int8_scores and kv_quant.int8_scores_available():
            q = kv_quant.quantized_query(q, args[-1])
        reference = _mla_decode_reference(q, *args)
        checked.append((out - reference).abs().max().item() <= 1e-4 * reference.abs().max().item())
        return out

    monkeypatch.setattr(kv_quant, "mla_decode_int8", checked_decode)
    tokens, decode = _inputs()
    run_teacher_forced(model, torch.int8, tokens, decode)  # integer scores (the default)
    assert len(checked) == len(decode) * model.kv_cache_layout().num_layers and all(checked)
    checked.clear()
    monkeypatch.setenv(envs.MESHSERVE_INT8_KV_SCORES.name, "0")
    native = run_teacher_forced(model, torch.int8, tokens, decode)
    assert len(checked) == len(decode) * model.kv_cache_layout().num_layers and all(checked)
    checked.clear()
    monkeypatch.setattr(kv_quant, "native_decode_available", lambda: False)
    torch_decode = run_teacher_forced(model, torch.int8, tokens, decode)
    assert not checked
    assert ((native - torch_decode).norm() / torch_decode.norm()).item() <= 1e-4


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3"])
def test_int8_outputs_do_not_depend_on_how_the_prefix_was_computed(models, arch):
    """A prompt prefilled whole, or after its prefix was cached (a prefix hit, a pool fetch, a P/D pull all
    start from cached blocks), attends to the same dequantized numbers: the same logits."""
    model = models[arch]
    prompt = _inputs()[0][1]
    whole = PagedHarness(model, block_size=8, num_blocks=16)
    whole.kv_caches = model.kv_cache_layout(torch.int8).allocate(16, 8)
    split = PagedHarness(model, block_size=8, num_blocks=16)
    split.kv_caches = model.kv_cache_layout(torch.int8).allocate(16, 8)
    a = whole.step([0], [prompt])[0][-1]
    split.step([0], [prompt[:16]])
    b = split.step([0], [prompt[16:]])[0][-1]
    assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item()
