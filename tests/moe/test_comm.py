"""MoE dispatch/combine on real gloo worlds (2 and 4 local processes) against the single-rank layer."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshserve.moe.comm import (
    EPDispatcher,
    HybridMoEComm,
    moe_layer_reference,
    quantize_per_token_int8,
    run_local_experts,
    shard_expert_weights,
)
from meshserve.parallel.topology import Topology, build_groups, spawn_local_world

HIDDEN = 32
INTERMEDIATE = 16
TOP_K = 2
WORLD_TIMEOUT_S = 45
# INT8 dispatch: per-token symmetric codes lose at most max|x|/254 per element, which
# leaves the layer output well inside this relative (Frobenius) error.
INT8_REL_TOL = 2e-2


def _layer(num_experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=gen) * 0.2
    return w13, w2


def _tokens(num_tokens: int, allowed_experts: list[int], seed: int):
    """Hidden states and a top-k routing that only uses `allowed_experts` (distinct per token)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    allowed = torch.tensor(allowed_experts)
    picks = [allowed[torch.randperm(len(allowed_experts), generator=gen)[:TOP_K]] for _ in range(num_tokens)]
    topk_ids = torch.stack(picks) if picks else torch.empty(0, TOP_K, dtype=torch.int64)
    topk_weights = torch.softmax(torch.randn(num_tokens, TOP_K, generator=gen), dim=-1)
    return hidden, topk_ids, topk_weights


# ---------------------------------------------------------------- topology

def test_topology_layout_and_bad_input():
    topo = Topology(num_nodes=2, ranks_per_node=3)
    assert topo.world_size == 6
    assert [topo.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [topo.local_rank(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert topo.intra_node_ranks(1) == [3, 4, 5]
    assert topo.inter_node_ranks(2) == [2, 5]
    with pytest.raises(ValueError):
        topo.node_of(6)
    with pytest.raises(ValueError):
        Topology(0, 2)


def _groups_worker(rank: int, world: int) -> None:
    topo = Topology(2, 2)
    groups = build_groups(topo)
    assert dist.get_process_group_ranks(groups.intra_node) == topo.intra_node_ranks(topo.node_of(rank))
    assert dist.get_process_group_ranks(groups.inter_node) == topo.inter_node_ranks(topo.local_rank(rank))
    # The groups carry traffic among exactly those ranks.
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=groups.intra_node)
    assert value.item() == sum(topo.intra_node_ranks(topo.node_of(rank)))
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=groups.inter_node)
    assert value.item() == sum(topo.inter_node_ranks(topo.local_rank(rank)))


def test_topology_groups_on_four_ranks():
    spawn_local_world(_groups_worker, 4, timeout_s=WORLD_TIMEOUT_S)


# ---------------------------------------------------------------- pure EP

def _ep_worker(rank: int, world: int) -> None:
    num_experts = 2 * world
    w13, w2 = _layer(num_experts)
    tokens_per_rank = [5, 0, 3, 6][:world]
    # Only the experts of the first half of the ranks are used: the rest receive nothing.
    allowed = list(range(num_experts // 2))
    dispatcher = EPDispatcher(dist.group.WORLD, num_experts, TOP_K, HIDDEN, max_tokens_per_rank=8,
                              dtype=torch.float32)
    assert dispatcher.int8 is False  # INT8 dispatch is opt-in
    assert dispatcher.max_recv_rows == world * 8 * min(TOP_K, 2)  # CloudMatrix Eq. 1-2 in rows
    local_w13, local_w2 = shard_expert_weights(w13, w2, dispatcher.first_expert, dispatcher.experts_per_rank)
    ptrs = dispatcher.buffer_data_ptrs()

    # Two steps in flight (both dispatched before either combines) use the two buffer sets.
    steps = []
    for step in range(4):
        hidden, ids, weights = _tokens(tokens_per_rank[rank], allowed, seed=100 * step + rank)
        recv_hidden, recv_ids, handle = dispatcher.dispatch(hidden, ids)
        assert handle.buffer_index == step % 2
        if rank >= world // 2:
            assert recv_hidden.shape[0] == 0
        steps.append((hidden, ids, weights, recv_hidden, recv_ids, handle))
        if step % 2 == 0:
            continue
        for hidden, ids, weights, recv_hidden, recv_ids, handle in steps:
            expert_out = run_local_experts(recv_hidden, recv_ids, local_w13, local_w2, dispatcher.first_expert)
            out = dispatcher.combine(expert_out, handle, weights)
            expected = moe_layer_reference(hidden, ids, weights, w13, w2)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        steps.clear()
    assert dispatcher.buffer_data_ptrs() == ptrs

    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        dispatcher.dispatch(torch.zeros(9, HIDDEN), torch.zeros(9, TOP_K, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert ids"):
        dispatcher.dispatch(torch.zeros(1, HIDDEN), torch.full((1, TOP_K), num_experts))
    with pytest.raises(ValueError, match="split evenly"):
        EPDispatcher(dist.group.WORLD, num_experts + 1, TOP_K, HIDDEN, 8, torch.float32)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_dispatch_combine_matches_reference(world):
    spawn_local_world(_ep_worker, world, timeout_s=WORLD_TIMEOUT_S)


def _int8_worker(rank: int, world: int) -> None:
    num_experts = 4
    w13, w2 = _layer(num_experts)
    exact = EPDispatcher(dist.group.WORLD, num_experts, TOP_K, HIDDEN, 16, torch.float32)
    quant = EPDispatcher(dist.group.WORLD, num_experts, TOP_K, HIDDEN, 16, torch.float32, int8=True)
    assert quant.msg_bytes < exact.msg_bytes  # codes + fp32 scale instead of fp32 rows
    hidden, ids, weights = _tokens(16, list(range(num_experts)), seed=7 + rank)
    expected = moe_layer_reference(hidden, ids, weights, w13, w2)
    outputs = {}
    for name, dispatcher in (("exact", exact), ("int8", quant)):
        lw13, lw2 = shard_expert_weights(w13, w2, dispatcher.first_expert, dispatcher.experts_per_rank)
        recv_hidden, recv_ids, handle = dispatcher.dispatch(hidden, ids)
        outputs[name] = (recv_hidden, dispatcher.combine(
            run_local_experts(recv_hidden, recv_ids, lw13, lw2, dispatcher.first_expert), handle, weights))
    torch.testing.assert_close(outputs["exact"][1], expected, atol=1e-5, rtol=1e-5)
    # The dispatched rows are the dequantized codes: within half a quantization step of the exact rows.
    exact_rows, int8_rows = outputs["exact"][0], outputs["int8"][0]
    assert not torch.equal(exact_rows, int8_rows)
    _, scale = quantize_per_token_int8(exact_rows)
    assert bool(((int8_rows - exact_rows).abs() <= scale.unsqueeze(1) / 2 + 1e-6).all())
    rel = (outputs["int8"][1] - expected).norm() / expected.norm()
    assert 0 < rel.item() < INT8_REL_TOL


def test_int8_dispatch_within_tolerance():
    spawn_local_world(_int8_worker, 2, timeout_s=WORLD_TIMEOUT_S)


# ---------------------------------------------------------------- hybrid TP-EP

def _hybrid_worker(rank: int, world: int) -> None:
    topo = Topology(num_nodes=2, ranks_per_node=2)
    groups = build_groups(topo)
    num_experts = 6
    w13, w2 = _layer(num_experts)
    node, local = topo.node_of(rank), topo.local_rank(rank)
    # Node 0 routes only to its own experts (nothing crosses from it); node 1 routes everywhere.
    allowed = [0, 1, 2] if node == 0 else list(range(num_experts))
    hidden, ids, weights = _tokens([5, 7][node], allowed, seed=50 + node)  # replicated inside the node
    expected = moe_layer_reference(hidden, ids, weights, w13, w2)
    shard_cols = slice(local * HIDDEN // 2, (local + 1) * HIDDEN // 2)
    results = {}
    for fused in (False, True):
        comm = HybridMoEComm(groups, num_experts, TOP_K, HIDDEN, fused=fused)
        lw13, lw2 = shard_expert_weights(w13, w2, comm.first_expert, comm.experts_per_node, local, 2)
        for _ in range(2):
            recv, recv_ids, handle = comm.dispatch(hidden[:, shard_cols].contiguous(), ids)
            partial = run_local_experts(recv, recv_ids, lw13, lw2, comm.first_expert)
            out = comm.combine(partial, handle, weights)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        results[fused] = (recv, out)
    torch.testing.assert_close(results[True][0], results[False][0], atol=0, rtol=0)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="hidden_shard"):
        HybridMoEComm(groups, num_experts, TOP_K, HIDDEN).dispatch(hidden, ids)


def test_hybrid_sync_and_fused_match_reference():
    spawn_local_world(_hybrid_worker, 4, timeout_s=WORLD_TIMEOUT_S)


# ---------------------------------------------------------------- bench entry point (argument checks only)

def test_bench_rejects_bad_arguments(tmp_path, capsys):
    import argparse

    from meshserve.bench.moe_comm import add_moe_comm_arguments, moe_comm_main

    parser = argparse.ArgumentParser()
    add_moe_comm_arguments(parser)
    out = tmp_path / "r.json"
    assert moe_comm_main(parser.parse_args(["--experts", "30", "--json", str(out)])) == 2
    assert "multiple of 4" in capsys.readouterr().out
    assert moe_comm_main(parser.parse_args(["--top-k", "64", "--json", str(out)])) == 2
    assert not out.exists()
