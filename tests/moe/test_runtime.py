"""MoERuntime over every MoE layout on real gloo worlds (2 and 4 ranks) against the single-rank layer."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshserve.layers.moe import FusedMoEWeights, fused_experts
from meshserve.moe.runtime import INT8_DISPATCH_MAX_ERROR, MoERuntime, chunk_sizes
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import spawn_local_world

NUM_EXPERTS = 8
HIDDEN = 32
INTERMEDIATE = 16
TOP_K = 3
EXACT_TOL = 1e-5
WORLD_TIMEOUT_S = 90
# Tokens of each attention DP group, per step: idle groups, fewer tokens than TP ranks, uneven splits.
STEP_TOKENS = [[5, 0, 7, 3], [1, 6, 0, 4], [0, 2, 3, 0]]


def _full_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2
    return w13, w2


def _load_hf(weights: FusedMoEWeights, w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Feed every full per-expert HF tensor, as a checkpoint loader does; returns how many were taken."""
    taken = 0
    for expert in range(NUM_EXPERTS):
        for proj, tensor in (("gate_proj", w13[expert, :INTERMEDIATE]), ("up_proj", w13[expert, INTERMEDIATE:]),
                             ("down_proj", w2[expert])):
            taken += weights.load_expert(expert, proj, tensor)
    return taken


def _routed_tokens(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    topk_ids = torch.rand(num_tokens, NUM_EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K]
    topk_weights = torch.softmax(torch.randn(num_tokens, TOP_K, generator=gen), dim=-1)
    return hidden, topk_ids, topk_weights


# ---------------------------------------------------------------- one rank

def test_sharded_weights_load_slices_and_partials_sum_to_full():
    w13, w2 = _full_weights()
    full = FusedMoEWeights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, torch.float32)
    assert (full.num_experts, full.total_experts, full.local_intermediate_size) == (NUM_EXPERTS, NUM_EXPERTS,
                                                                                    INTERMEDIATE)
    assert _load_hf(full, w13, w2) == 3 * NUM_EXPERTS
    torch.testing.assert_close(full.w13.data, w13, atol=0, rtol=0)
    hidden, ids, weights = _routed_tokens(9, seed=1)
    expected = fused_experts(hidden, ids, weights, w13, w2)
    torch.testing.assert_close(full(hidden, ids, weights), expected, atol=0, rtol=0)

    # Experts [4, 8) in two intermediate halves: each loads its slice; the partials sum to the layer.
    halves = [FusedMoEWeights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, torch.float32, first_expert=4,
                              num_local_experts=4, tp_rank=r, tp_size=2) for r in range(2)]
    for half in halves:
        assert half.num_experts == 4 and half.w13.shape == (4, INTERMEDIATE, HIDDEN)
        assert half.owns_expert(4) and half.owns_expert(7) and not half.owns_expert(3)
        assert _load_hf(half, w13, w2) == 3 * 4
        cols = slice(half.tp_rank * 8, (half.tp_rank + 1) * 8)
        torch.testing.assert_close(half.w13.data[:, :8], w13[4:, cols], atol=0, rtol=0)
        torch.testing.assert_close(half.w13.data[:, 8:], w13[4:, INTERMEDIATE + cols.start:INTERMEDIATE + cols.stop],
                                   atol=0, rtol=0)
        torch.testing.assert_close(half.w2.data, w2[4:, :, cols], atol=0, rtol=0)
    upper_ids = ids % 4 + 4
    partials = sum(half(hidden, upper_ids, weights) for half in halves)
    torch.testing.assert_close(partials, fused_experts(hidden, upper_ids, weights, w13, w2), atol=1e-6, rtol=1e-6)

    with pytest.raises(ValueError, match="shape"):
        halves[0].load_expert(4, "gate_proj", w13[4])  # [2I, H] is not one projection
    with pytest.raises(KeyError):
        halves[0].load_expert(4, "o_proj", w2[4])
    with pytest.raises(ValueError, match="split evenly"):
        FusedMoEWeights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, torch.float32, tp_size=3)
    with pytest.raises(ValueError, match="slice"):
        FusedMoEWeights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, torch.float32, first_expert=6, num_local_experts=4)


def test_single_context_calls_experts_directly():
    runtime = MoERuntime(ParallelContext.single(), NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)
    assert runtime.ep_dispatcher is None and runtime.hybrid is None
    experts = runtime.make_weights(INTERMEDIATE)
    w13, w2 = _full_weights()
    _load_hf(experts, w13, w2)
    for num_tokens in (0, 4):
        hidden, ids, weights = _routed_tokens(num_tokens, seed=2)
        torch.testing.assert_close(runtime(hidden, ids, weights, experts), experts(hidden, ids, weights),
                                   atol=0, rtol=0)
    wrong = FusedMoEWeights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, torch.float32, tp_size=2)
    with pytest.raises(ValueError, match="make_weights"):
        runtime(hidden, ids, weights, wrong)
    with pytest.raises(ValueError, match="topk_ids"):
        runtime(hidden, ids[:, :1], weights, experts)
    assert chunk_sizes(5, 2) == [len(c) for c in torch.tensor_split(torch.arange(5), 2)]
    assert chunk_sizes(1, 4) == [1, 0, 0, 0]


# ---------------------------------------------------------------- spawned worlds

def _check_strategy(text: str, moe_comm: str = "fused", int8: bool = False) -> None:
    """Every step's output on every rank against the single-rank layer over the rank's own tokens."""
    strategy = ParallelStrategy.parse(text)
    ctx = ParallelContext.build(strategy, moe_comm=moe_comm, int8_dispatch=int8, max_tokens_per_step=8)
    runtime = MoERuntime(ctx, NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)
    experts = runtime.make_weights(INTERMEDIATE)
    w13, w2 = _full_weights()
    e, c = NUM_EXPERTS // strategy.moe_ep, INTERMEDIATE // strategy.moe_tp
    assert _load_hf(experts, w13, w2) == 3 * e
    # Each rank holds exactly experts/EP x intermediate/TP of the weights.
    assert sum(p.numel() * p.element_size() for p in experts.parameters()) == e * 3 * c * HIDDEN * 4
    assert (runtime.ep_dispatcher is not None) == (strategy.moe_tp == 1)
    if runtime.ep_dispatcher is not None:
        assert runtime.ep_dispatcher.int8 is int8
    if runtime.hybrid is not None:
        assert runtime.hybrid.fused is (moe_comm == "fused")
    # Another MoE layer of the same context shares the communicator (and its pre-allocated buffers).
    other_layer = MoERuntime(ctx, NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)
    assert (other_layer.ep_dispatcher, other_layer.hybrid) == (runtime.ep_dispatcher, runtime.hybrid)
    expert_rows = []
    experts.register_forward_hook(lambda module, args, out: expert_rows.append(args[0].shape[0]))
    for step, tokens in enumerate(STEP_TOKENS):
        # The ranks of one attention TP group hold the same tokens.
        hidden, ids, weights = _routed_tokens(tokens[ctx.dp_rank], seed=1000 * step + ctx.dp_rank)
        expert_rows.clear()
        out = runtime(hidden, ids, weights, experts)
        # De-duplication: each (token, expert) row runs once per MoE TP shard in the whole world.
        rows = torch.tensor([sum(expert_rows)])
        dist.all_reduce(rows)
        assert rows.item() == strategy.moe_tp * TOP_K * sum(tokens[:strategy.attn_dp]), (text, step)
        expected = fused_experts(hidden, ids, weights, w13, w2)
        assert out.shape == expected.shape, (text, step)
        error = (out - expected).abs().max().item() if out.numel() else 0.0
        if int8:
            bound = INT8_DISPATCH_MAX_ERROR * expected.abs().max().item() if out.numel() else 0.0
            assert error <= bound, (text, step, error, bound)
        else:
            assert error <= EXACT_TOL, (text, moe_comm, step, error)
        if ctx.attn_tp_size > 1 and out.numel():  # bit-identical across the attention TP group
            assert torch.equal(ctx.attn_broadcast_from_driver(out.clone()), out), (text, step)
    if int8:
        hidden, ids, weights = _routed_tokens(8, seed=5 + ctx.rank)
        error = (runtime(hidden, ids, weights, experts) - fused_experts(hidden, ids, weights, w13, w2)).abs().max()
        assert error.item() > 0  # the dispatch really was quantized


def _world2_worker(rank: int, world: int) -> None:
    for text in ("attn=TP2+DP1 moe=TP1+EP2", "attn=TP1+DP2 moe=TP1+EP2",
                 "attn=TP1+DP2 moe=TP2+EP1", "attn=TP2+DP1 moe=TP2+EP1"):
        _check_strategy(text)
    _check_strategy("attn=TP1+DP2 moe=TP2+EP1", moe_comm="sync")


def test_moe_runtime_world_of_two():
    spawn_local_world(_world2_worker, 2, timeout_s=WORLD_TIMEOUT_S)


def _world4_worker(rank: int, world: int) -> None:
    _check_strategy("attn=TP1+DP4 moe=TP1+EP4")
    _check_strategy("attn=TP2+DP2 moe=TP2+EP2", moe_comm="fused")
    _check_strategy("attn=TP2+DP2 moe=TP2+EP2", moe_comm="sync")
    _check_strategy("attn=TP1+DP4 moe=TP2+EP2", moe_comm="fused")
    _check_strategy("attn=TP1+DP4 moe=TP2+EP2", moe_comm="sync")
    _check_strategy("attn=TP2+DP2 moe=TP1+EP4")
    _check_strategy("attn=TP4+DP1 moe=TP2+EP2")  # attention TP group spans two MoE nodes
    _check_strategy("attn=TP2+DP2 moe=TP4+EP1")  # one MoE node spans two attention TP groups
    _check_strategy("attn=TP1+DP4 moe=TP1+EP4", int8=True)
    ctx = ParallelContext.build(ParallelStrategy.parse("attn=TP2+DP2 moe=TP2+EP2"), int8_dispatch=True)
    with pytest.raises(ValueError, match="INT8"):
        MoERuntime(ctx, NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)


def test_moe_runtime_world_of_four():
    spawn_local_world(_world4_worker, 4, timeout_s=WORLD_TIMEOUT_S)
