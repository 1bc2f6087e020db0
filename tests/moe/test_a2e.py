"""A2E / E2A (meshserve/moe/a2e.py): attention ranks send their tokens to expert ranks that hold no tokens,
and the summed partial outputs that come back equal the single-rank MoE layer — routed directly and in two
stages through one relay per node, with full-precision and INT8 rows — with each token sent once per
destination, in buffers allocated once."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshserve.layers.moe import fused_experts
from meshserve.moe.a2e import A2EComm, A2ELayout
from meshserve.moe.comm import moe_layer_reference, shard_expert_weights
from meshserve.parallel.topology import spawn_local_world

HIDDEN = 32
INTERMEDIATE = 16
TOP_K = 3
NUM_EXPERTS = 8
WORLD_TIMEOUT_S = 60
INT8_REL_TOL = 2e-2


def _layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2,
            torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2)


def _tokens(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, TOP_K, dtype=torch.int64)
    weights = torch.softmax(torch.randn(num_tokens, TOP_K, generator=gen), dim=-1)
    return hidden, ids, weights


def _a2e_worker(rank: int, world: int, num_attention: int, ranks_per_node: int, two_stage: bool,
                int8: bool, expert_tp: int = 1) -> None:
    layout = A2ELayout(attention_ranks=tuple(range(num_attention)), expert_ranks=tuple(range(num_attention, world)),
                       num_experts=NUM_EXPERTS, top_k=TOP_K, ranks_per_node=ranks_per_node, expert_tp=expert_tp)
    # every rank creates every node's group, in node order
    node_groups = [dist.new_group(list(layout.node_members(node))) for node in range(layout.num_nodes)]
    comm = A2EComm(dist.group.WORLD, layout, HIDDEN, max_tokens_per_rank=8, dtype=torch.float32,
                   two_stage=two_stage, node_groups=node_groups, int8=int8)
    w13, w2 = _layer()
    if not comm.is_attention:  # this expert rank's slice of the experts, its compute skipping the others
        # expert rank j = g * t + r: column block r of EP group g's experts
        group, column_block = divmod(comm.expert_index, expert_tp)
        first = group * layout.experts_per_group
        local_w13, local_w2 = shard_expert_weights(w13, w2, first, layout.experts_per_group, column_block, expert_tp)

        def compute(h, ids, w):
            return fused_experts(h, ids, w, local_w13, local_w2, first_expert=first)
    ptrs = comm.buffer_data_ptrs()
    tokens_per_rank = [5, 8, 0, 3]
    for layer in range(3):
        if comm.is_attention:
            hidden, ids, weights = _tokens(tokens_per_rank[(rank + layer) % 4], seed=100 * layer + rank)
            handle = comm.a2e(hidden, ids, weights)
            destinations = layout.num_nodes if two_stage else len(layout.expert_ranks)
            owners = layout.owner_indices(ids) // (layout.ranks_per_node if two_stage else 1)
            once = sum(len(set(row.tolist())) for row in owners)  # each token once per destination
            assert handle.token_of_row.numel() == sum(handle.send_splits) == once <= hidden.shape[0] * destinations
            out = comm.e2a(handle)
            expected = moe_layer_reference(hidden, ids, weights, w13, w2)
            if int8:
                rel = (out - expected).norm() / max(expected.norm(), 1e-9)
                assert rel.item() < INT8_REL_TOL
            else:
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        else:
            comm.serve_layer(compute)
    assert comm.buffer_data_ptrs() == ptrs
    if comm.is_attention:
        with pytest.raises(ValueError, match="max_tokens_per_rank"):
            comm.a2e(torch.zeros(9, HIDDEN), torch.zeros(9, TOP_K, dtype=torch.int64), torch.ones(9, TOP_K))
        with pytest.raises(ValueError, match="expert ids"):
            comm.a2e(torch.zeros(1, HIDDEN), torch.full((1, TOP_K), NUM_EXPERTS), torch.ones(1, TOP_K))
    else:
        with pytest.raises(RuntimeError, match="expert rank"):
            comm.a2e(torch.zeros(1, HIDDEN), torch.zeros(1, TOP_K, dtype=torch.int64), torch.ones(1, TOP_K))


@pytest.mark.parametrize(("world", "num_attention", "ranks_per_node", "two_stage", "int8"), [
    (4, 2, 1, False, False),  # 2 attention + 2 expert ranks, direct
    (6, 2, 2, True, False),  # 2 attention ranks, 2 nodes of 2 expert ranks, through a relay per node
    (5, 3, 2, True, False),  # more attention ranks than a node's ranks: relays serve several
    (6, 2, 2, True, True),  # INT8 rows, forwarded by the relays as they came
])
def test_a2e_and_e2a_give_the_single_rank_layer(world, num_attention, ranks_per_node, two_stage, int8):
    spawn_local_world(_a2e_worker, world, args=(num_attention, ranks_per_node, two_stage, int8),
                      timeout_s=WORLD_TIMEOUT_S)


@pytest.mark.parametrize(("ranks_per_node", "two_stage"), [(1, False), (2, True)])
def test_moe_tp_on_the_expert_ranks_sums_their_column_blocks(ranks_per_node, two_stage):
    """moe=TP2+EP2 on 4 expert ranks: a row reaches both ranks of its expert's EP group, whose partial outputs
    (half the intermediate columns each) add up on the attention side."""
    spawn_local_world(_a2e_worker, 6, args=(2, ranks_per_node, two_stage, False, 2), timeout_s=WORLD_TIMEOUT_S)


def _shared_ranks_worker(rank: int, world: int) -> None:
    """2 attention ranks, 2 routed expert ranks (4 experts each) and 1 shared-expert rank holding the 2 column
    blocks of a shared expert: each token's k routed columns plus 2 shared ones, routed by the slot table."""
    from meshserve.moe.shared_ranks import SharedExpertSlots

    slots = SharedExpertSlots(routed_slots=NUM_EXPERTS, routed_ranks=2, shared_ranks=1, blocks=2)
    layout = A2ELayout(attention_ranks=(0, 1), expert_ranks=(2, 3, 4), num_experts=slots.num_slots,
                       top_k=TOP_K + 2, rank_of_slot=tuple(slots.rank_of_slot()))
    comm = A2EComm(dist.group.WORLD, layout, HIDDEN, max_tokens_per_rank=8, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    w13 = torch.randn(slots.num_slots, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(slots.num_slots, HIDDEN, INTERMEDIATE, generator=gen) * 0.2
    if comm.is_attention:
        hidden, ids, weights = _tokens(5 + rank, seed=rank)
        ids, weights = slots.append_columns(ids, weights, offset=rank)
        out = comm.e2a(comm.a2e(hidden, ids, weights))
        torch.testing.assert_close(out, moe_layer_reference(hidden, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)
    else:
        first = [0, 4, 8][comm.expert_index]
        count = [4, 4, 2][comm.expert_index]
        local_w13, local_w2 = shard_expert_weights(w13, w2, first, count)
        comm.serve_layer(lambda h, ids, w: fused_experts(h, ids, w, local_w13, local_w2, first_expert=first))


def test_shared_expert_ranks_take_their_columns_by_the_slot_table():
    spawn_local_world(_shared_ranks_worker, 5, timeout_s=WORLD_TIMEOUT_S)


def _out_of_step_worker(rank: int, world: int) -> None:
    layout = A2ELayout(attention_ranks=(0,), expert_ranks=(1,), num_experts=NUM_EXPERTS, top_k=TOP_K)
    comm = A2EComm(dist.group.WORLD, layout, HIDDEN, max_tokens_per_rank=4, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="A2E out of step"):
        if comm.is_attention:
            comm.a2e(*_tokens(2, seed=rank), tag=3)  # the attention rank is at layer 3
        else:
            comm.serve_layer(lambda h, ids, w: torch.zeros_like(h), tag=2)  # the expert rank serves layer 2


def test_ranks_at_different_layers_fail_at_once():
    spawn_local_world(_out_of_step_worker, 2, timeout_s=WORLD_TIMEOUT_S)


def _domains_worker(rank: int, world: int) -> None:
    """Two DP domains of one attention rank each (ranks 0 and 1) take turns on the same two expert ranks (2 and
    3): each domain's A2E group holds its attention rank and the expert ranks, and the expert ranks serve the
    domains' layers in turn, domain 0's then domain 1's, while the other domain's attention rank computes."""
    domain_groups = [dist.new_group([domain, 2, 3]) for domain in range(2)]
    w13, w2 = _layer()
    comms = {}
    for domain, group in enumerate(domain_groups):
        if rank in (domain, 2, 3):  # within the group, its attention rank is 0 and the expert ranks 1 and 2
            layout = A2ELayout(attention_ranks=(0,), expert_ranks=(1, 2), num_experts=NUM_EXPERTS, top_k=TOP_K)
            comms[domain] = A2EComm(group, layout, HIDDEN, max_tokens_per_rank=8, dtype=torch.float32)
    served = []
    for layer in range(4):
        if rank < 2:
            comm = comms[rank]
            hidden, ids, weights = _tokens(3 + layer + rank, seed=10 * layer + rank)
            out = comm.e2a(comm.a2e(hidden, ids, weights))
            torch.testing.assert_close(out, moe_layer_reference(hidden, ids, weights, w13, w2), atol=1e-5,
                                       rtol=1e-5)
        else:
            for domain in (0, 1):  # one domain at a time talks to the experts
                comm = comms[domain]
                first = comm.expert_index * comm.layout.experts_per_group
                local_w13, local_w2 = shard_expert_weights(w13, w2, first, comm.layout.experts_per_group)
                served.append(comm.serve_layer(
                    lambda h, ids, w, a=local_w13, b=local_w2, f=first: fused_experts(h, ids, w, a, b, first_expert=f)))
    if rank >= 2:
        assert len(served) == 8 and sum(served) > 0


def test_dp_domains_take_turns_on_the_expert_ranks():
    spawn_local_world(_domains_worker, 4, timeout_s=WORLD_TIMEOUT_S)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(attention_ranks=(), expert_ranks=(0, 1)), "at least one attention rank"),
    (dict(attention_ranks=(0, 1), expert_ranks=(1, 2)), "either an attention rank or an expert rank"),
    (dict(attention_ranks=(0,), expert_ranks=(2, 3)), "cover group ranks"),
    (dict(attention_ranks=(0,), expert_ranks=(1, 2, 3)), "do not split evenly"),
    (dict(attention_ranks=(0,), expert_ranks=(1, 2, 3), expert_tp=2), "EP groups of TP2"),
    (dict(attention_ranks=(0,), expert_ranks=(1, 2), rank_of_slot=(0,) * 7 + (2,)), "rank_of_slot must name"),
    (dict(attention_ranks=(0,), expert_ranks=(1, 2), expert_tp=2, rank_of_slot=(0,) * 8), "needs MoE TP1"),
    (dict(attention_ranks=(0,), expert_ranks=(1, 2), ranks_per_node=4), "do not form nodes"),
    (dict(attention_ranks=(0,), expert_ranks=(1, 2), top_k=9), "top_k"),
])
def test_a_layout_the_ranks_cannot_form_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        A2ELayout(**{"num_experts": NUM_EXPERTS, "top_k": TOP_K, **kwargs})


def test_relays_spread_over_a_node():
    layout = A2ELayout(attention_ranks=(0, 1, 2), expert_ranks=(3, 4, 5, 6), num_experts=8, top_k=2,
                       ranks_per_node=2)
    assert [layout.relay(node, a) for node in (0, 1) for a in range(3)] == [3, 4, 3, 5, 6, 5]
