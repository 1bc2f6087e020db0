"""INT8 W8A8 kernels (int8.py, csrc/int8_kernels.cpp) against exact integer references and the torch path."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels, int8
from meshserve.layers.moe import fused_experts


def exact_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """dequant(quant(x) q^T) with the integer products summed exactly (int64)."""
    xq, xscale = int8.quantize_activation(x)
    out = (xq.long() @ q.long().t()).float() * xscale.unsqueeze(1) * scale
    return out if bias is None else out + bias


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """|actual - expected| <= rtol * max|expected| everywhere (integer sums are exact: only float rounding)."""
    assert actual.shape == expected.shape
    if expected.numel():
        limit = rtol * expected.abs().max().clamp_min(1e-30)
        assert (actual - expected).abs().max() <= limit


def test_quantize_weight_rounds_half_to_even_per_row():
    w = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0], [0.0, 0.0, 0.0, 0.0, 0.0], [2.54, -1.27, 0.0, 0.0, 0.0]])
    q, scale = int8.quantize_weight(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q[0].tolist() == [127, 0, 2, -2, -127]  # scale 1: halves go to the even neighbour
    assert scale[1] == 1.0 and q[1].abs().sum() == 0  # an all-zero row
    assert q[2].tolist() == [127, -64, 0, 0, 0]  # -1.27 / 0.02 = -63.5 -> -64
    assert torch.allclose(scale, torch.tensor([1.0, 1.0, 0.02]))


def test_quantize_round_trip_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 70, generator=g) * torch.rand(3, 40, 1, generator=g)
    q, scale = int8.quantize_weight(w)
    assert q.shape == w.shape and scale.shape == (3, 40)
    assert q.abs().amax(dim=-1).eq(127).all()  # each row's largest entry uses the full range
    err = (q.float() * scale.unsqueeze(-1) - w).abs()
    assert (err <= scale.unsqueeze(-1) * (0.5 + 1e-5)).all()

    x = torch.randn(9, 70, generator=g) * 5
    xq, xscale = int8.quantize_activation(x)
    assert xq.dtype == torch.int8 and xscale.shape == (9,)
    assert torch.equal(xq, int8.quantize_weight(x)[0])  # one rule for both
    assert ((xq.float() * xscale.unsqueeze(1) - x).abs() <= xscale.unsqueeze(1) * (0.5 + 1e-5)).all()


def test_packable_and_pack_layout():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (2, 32, 6), generator=g, dtype=torch.int8)
    assert int8.packable(q)
    assert not int8.packable(q[:, :24])  # N not a multiple of 16
    assert not int8.packable(q.float())
    assert not int8.packable(torch.zeros(16, int8.MAX_K + 1, dtype=torch.int8))
    with pytest.raises(ValueError, match="not packable"):
        int8.pack(q[:, :24])
    packed = int8.pack(q)
    assert packed.blocks.shape == (2, 2, 2, 64) and packed.blocks.dtype == torch.int8
    # block b, group g, byte 4c + i = w[16b + c, 4g + i]; K padded with zeros to a multiple of 4
    assert packed.blocks[1, 1, 0, 4 * 3 + 2] == q[1, 16 + 3, 2]
    assert packed.blocks[0, 0, 1, 4 * 5 + 1] == q[0, 5, 5]
    assert packed.blocks[0, 0, 1, 4 * 5 + 2] == 0
    assert torch.equal(packed.compensation, q.sum(dim=-1, dtype=torch.int32) * 128)


def test_native_kernel_quantizes_activations_as_quantize_activation():
    # values half a step between two integers, where rounding x / scale differs from rounding
    # x * (1 / scale) or rounding half away from zero; an identity weight shows the int8 values the kernel used
    g = torch.Generator().manual_seed(6)
    rows, k = 32, 256
    step = torch.rand(rows, 1, generator=g) * 3 + 0.01
    x = (torch.randint(-127, 127, (rows, k), generator=g) + 0.5) * step
    x[:, 0] = 127 * step[:, 0]
    x[3] = 0.0  # a zero row: scale 1
    eye = torch.eye(k, dtype=torch.int8)
    out = int8.linear(x, eye, torch.ones(k), packed=int8.pack(eye))
    xq, xscale = int8.quantize_activation(x)
    assert torch.equal(out, xq.float() * xscale.unsqueeze(1))


@pytest.mark.parametrize(("rows", "n", "k"), [
    (0, 32, 64), (1, 16, 5), (1, 768, 768), (3, 48, 70), (7, 96, 130), (8, 672, 768), (12, 160, 64),
    (13, 1152, 384), (64, 768, 2048), (64, 80, 36),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_linear_matches_the_exact_reference(rows, n, k, with_bias):
    assert cpu_kernels.enabled()
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    q, scale = int8.quantize_weight(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g) * 3
    bias = torch.randn(n, generator=g) if with_bias else None
    native = int8.linear(x, q, scale, bias, packed=int8.pack(q))
    assert native.shape == (rows, n) and native.dtype == torch.float32
    expected = exact_linear(x, q, scale, bias)
    assert_close_to_scale(native, expected, 1e-6)
    assert_close_to_scale(int8.linear(x, q, scale, bias), expected, 1e-5)  # the torch path


def test_native_linear_takes_strided_and_batched_rows():
    g = torch.Generator().manual_seed(2)
    q, scale = int8.quantize_weight(torch.randn(64, 100, generator=g))
    packed = int8.pack(q)
    wide = torch.randn(5, 160, generator=g)
    x = wide[:, 30:130]  # a view: rows 160 apart
    assert_close_to_scale(int8.linear(x, q, scale, packed=packed), exact_linear(x, q, scale), 1e-6)
    batched = torch.randn(2, 3, 100, generator=g)
    out = int8.linear(batched, q, scale, packed=packed)
    assert out.shape == (2, 3, 64)
    assert_close_to_scale(out.reshape(6, 64), exact_linear(batched.reshape(6, 100), q, scale), 1e-6)
    assert int8.linear(torch.zeros(0, 4, 100), q, scale, packed=packed).shape == (0, 4, 64)


def test_torch_path_serves_unpackable_weights_and_disabled_kernels():
    g = torch.Generator().manual_seed(3)
    q, scale = int8.quantize_weight(torch.randn(40, 50, generator=g))  # 40 outputs: no native layout
    x = torch.randn(6, 50, generator=g)
    assert not int8.packable(q)
    assert_close_to_scale(int8.linear(x, q, scale), exact_linear(x, q, scale), 1e-6)
    q, scale = int8.quantize_weight(torch.randn(48, 50, generator=g))
    packed = int8.pack(q)
    with cpu_kernels.disabled():
        assert_close_to_scale(int8.linear(x, q, scale, packed=packed), exact_linear(x, q, scale), 1e-6)


def test_int8_linear_is_close_to_float_linear():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(768, 768, generator=g) * 768 ** -0.5
    x = torch.randn(16, 768, generator=g)
    q, scale = int8.quantize_weight(w)
    out = int8.linear(x, q, scale, packed=int8.pack(q))
    ref = F.linear(x, w)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 2e-2  # quantized (not the float result), and close to it


def test_native_linear_is_safe_from_several_threads():
    g = torch.Generator().manual_seed(5)
    cases = []
    for rows, n, k in ((1, 256, 768), (8, 128, 300), (64, 96, 64)):
        q, scale = int8.quantize_weight(torch.randn(n, k, generator=g))
        x = torch.randn(rows, k, generator=g)
        cases.append((x, q, scale, int8.pack(q), exact_linear(x, q, scale)))
    failures = []

    def worker(case):
        x, q, scale, packed, expected = case
        for _ in range(30):
            out = int8.linear(x, q, scale, packed=packed)
            if (out - expected).abs().max() > 1e-6 * expected.abs().max():
                failures.append(out)

    threads = [threading.Thread(target=worker, args=(case,)) for case in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def per_token_reference(hidden, ids, weights, first_slot, w13, w13_scale, w2, w2_scale):
    """The MoE layer one token and one expert at a time, integer products summed exactly."""
    out = torch.zeros_like(hidden)
    intermediate = w2.shape[2]
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - first_slot
            if not 0 <= e < w13.shape[0]:
                continue
            gate_up = exact_linear(hidden[t:t + 1], w13[e], w13_scale[e])
            act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            out[t] += weights[t, k] * exact_linear(act, w2[e], w2_scale[e])[0]
    return out


def moe_case(seed: int, tokens: int, num_experts: int = 6, hidden: int = 96, intermediate: int = 48,
             top_k: int = 3, saturated: bool = False):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) * intermediate ** -0.5
    x = torch.randn(tokens, hidden, generator=g)
    if saturated:
        # positive inputs and gate rows put every gate pre-activation far above 20, where silu(g) == g in
        # float32 whichever way exp is computed: the layer's result is then fixed to the last bit
        x = x.abs() + 0.5
        w13[:, :intermediate] = torch.rand(num_experts, intermediate, hidden, generator=g) * 0.4 + 0.1
    # global slot ids over 2 * E slots: this rank holds [E/2, 3E/2); the last local slot gets no token
    first_slot = num_experts // 2
    candidates = torch.tensor([s for s in range(2 * num_experts) if s != first_slot + num_experts - 1])
    ids = candidates[torch.rand(tokens, len(candidates), generator=g).argsort(dim=1)[:, :top_k]]
    weights = torch.rand(tokens, top_k, generator=g)
    (q13, s13), (q2, s2) = int8.quantize_weight(w13), int8.quantize_weight(w2)
    return dict(hidden=x, ids=ids, weights=weights, first_slot=first_slot, q13=q13, s13=s13, q2=q2, s2=s2,
                w13=w13, w2=w2)


def run_moe(case: dict, packed=None) -> torch.Tensor:
    return int8.moe_forward(case["hidden"], case["ids"], case["weights"], case["first_slot"], case["q13"],
                            case["s13"], case["q2"], case["s2"], packed=packed)


def reference_of(case: dict) -> torch.Tensor:
    return per_token_reference(case["hidden"], case["ids"], case["weights"], case["first_slot"], case["q13"],
                               case["s13"], case["q2"], case["s2"])


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_native_moe_matches_the_per_token_reference(tokens):
    assert cpu_kernels.enabled()
    case = moe_case(tokens, tokens, saturated=True)
    expected = reference_of(case)
    assert expected.abs().amax(dim=1).gt(0).sum() >= min(tokens, 2)  # some tokens do reach local experts
    native = run_moe(case, packed=int8.pack_moe(case["q13"], case["q2"]))
    assert_close_to_scale(native, expected, 1e-6)
    assert_close_to_scale(run_moe(case), expected, 1e-5)  # the torch path
    # tokens routed only to other ranks' slots get zeros
    local = (case["ids"] >= case["first_slot"]) & (case["ids"] < case["first_slot"] + case["q13"].shape[0])
    assert native[~local.any(dim=1)].abs().sum() == 0


def test_native_moe_matches_the_torch_path_on_the_model_shapes():
    # silu's exp differs in its last bit between the two paths, which can move an activation across a
    # rounding boundary of its quantization now and then: one int8 step of one term of a token's outputs
    case = moe_case(7, 64, num_experts=32, hidden=768, intermediate=256, top_k=4)
    case["first_slot"] = 0
    case["ids"] = torch.rand(64, 32, generator=torch.Generator().manual_seed(8)).argsort(dim=1)[:, :4]
    native = run_moe(case, packed=int8.pack_moe(case["q13"], case["q2"]))
    expected = run_moe(case)
    scale = expected.abs().max()
    token_err = (native - expected).abs().amax(dim=1)
    assert token_err.max() <= 2e-3 * scale
    assert (token_err <= 1e-5 * scale).float().mean() >= 0.75
    # and the int8 layer stays close to the float layer it quantizes
    ref = fused_experts(case["hidden"], case["ids"], case["weights"], case["w13"], case["w2"])
    rel = ((native - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 3e-2


def test_moe_without_local_work():
    case = moe_case(9, 4)
    packed = int8.pack_moe(case["q13"], case["q2"])
    case["ids"] = torch.full_like(case["ids"], 100)  # every pair routed to another rank
    assert torch.equal(run_moe(case, packed=packed), torch.zeros_like(case["hidden"]))
    case["hidden"], case["ids"], case["weights"] = case["hidden"][:0], case["ids"][:0], case["weights"][:0]
    assert run_moe(case, packed=packed).shape == (0, case["hidden"].shape[1])


def test_repack_slot_updates_one_slot_in_place():
    case = moe_case(10, 24, saturated=True)
    packed = int8.pack_moe(case["q13"], case["q2"])
    before = [t.clone() for w in packed for t in w]
    slot = 2
    new = moe_case(11, 1, saturated=True)
    for name in ("q13", "s13", "q2", "s2"):
        case[name][slot] = new[name][slot]
    int8.repack_slot(packed, slot, case["q13"][slot], case["q2"][slot])
    fresh = int8.pack_moe(case["q13"], case["q2"])
    for old, now, want in zip(before, [t for w in packed for t in w], [t for w in fresh for t in w]):
        assert torch.equal(now, want)
        assert torch.equal(now[:slot], old[:slot]) and torch.equal(now[slot + 1:], old[slot + 1:])
        assert not torch.equal(now[slot], old[slot])
    assert_close_to_scale(run_moe(case, packed=packed), reference_of(case), 1e-6)
    with pytest.raises(ValueError, match="per slot"):
        int8.repack_slot(packed, slot, case["q13"][slot, :, :32], case["q2"][slot])
