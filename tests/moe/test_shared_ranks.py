"""Shared experts on dedicated EP ranks (`shared=EPs`): the single-rank model's logits on a world of ranks."""
from __future__ import annotations

import pytest
import torch

from meshserve.models.factory import make_model
from meshserve.models.loader import load_model
from meshserve.moe.placement import ExpertPlacement
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import spawn_local_world
from tests.models.paged_harness import PagedHarness

TOL = 1e-4
WORLD_TIMEOUT_S = 240
# one row per step, per DP group (groups beyond the row's length are idle): (sequence id, new tokens)
SCHEDULE = [
    [[(0, 9), (1, 5)], [(3, 7)], [], [(6, 3)]],
    [[(0, 1), (1, 1)], [(3, 1), (4, 6)], [(7, 2)], []],
    [[(0, 1), (1, 1), (5, 4)], [], [(7, 1)], [(6, 1)]],
    [[], [(3, 1), (4, 1)], [(7, 1), (8, 5)], [(6, 1)]],
]


def _tokens(seq: int, step: int, count: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * seq + step)
    return torch.randint(0, 32000, (count,), generator=g).tolist()


def _check_weights(model, reference, ctx: ParallelContext, n_shared: int) -> None:
    """Routed ranks hold no shared-expert weights, shared ranks no routed experts (and read none)."""
    routed_slots = model.layers[1].mlp.runtime.placement_shape.num_slots
    blocks = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "runtime")]
    blocks.append(model.mtp[0].block.mlp)
    assert not any("shared_experts" in name for name, _ in model.named_parameters())
    if not ctx.is_shared_expert_rank:
        assert all(b.experts.first_slot + b.experts.num_slots <= routed_slots for b in blocks)
        assert not model.wants_weight("model.layers.1.mlp.shared_experts.up_proj.weight")
        return
    assert not model.wants_weight("model.layers.1.mlp.experts.0.up_proj.weight")
    assert model.wants_weight("model.layers.1.mlp.shared_experts.up_proj.weight")
    inter = reference.params.moe_intermediate_size
    for block, ref in zip(blocks, [layer.mlp for layer in reference.layers if hasattr(layer.mlp, "runtime")]
                          + [reference.mtp[0].block.mlp]):
        assert block.experts.num_slots == n_shared and block.experts.first_slot >= routed_slots
        gate_up = ref.shared_experts.gate_up_proj.weight
        for j in range(n_shared):  # column block j of the shared expert is slot j
            assert torch.equal(block.experts.w13[j, :inter], gate_up[j * inter:(j + 1) * inter])
            assert torch.equal(block.experts.w2[j], ref.shared_experts.down_proj.weight[:, j * inter:(j + 1) * inter])


def _replicate_an_expert(model) -> None:
    """EPLB on the routed ranks: each routed rank's redundant slot takes a replica of expert 3 (on every rank,
    as the engine applies a placement); a shared rank's slots stay as they are."""
    balancer = model.expert_balancer
    shape = balancer.shape
    slots = shape.default_slots()
    for rank in range(shape.num_ranks):
        slots[(rank + 1) * shape.slots_per_rank - 1] = 3
    before = [block.experts.w13.clone() for block in balancer._blocks]
    balancer.reconfigure(ExpertPlacement(shape, {layer: list(slots) for layer in balancer.moe_layers}), offline=True)
    if model.parallel.is_shared_expert_rank:
        assert all(torch.equal(b.experts.w13, w) for b, w in zip(balancer._blocks, before))
    else:
        assert all(b.experts.slot_experts[-1] == 3 for b in balancer._blocks)


def _world_worker(rank: int, world_size: int, model_dir: str, strategy: str, n_shared: int, redundant: int) -> None:
    torch.set_num_threads(1)
    reference = load_model(model_dir)
    ctx = ParallelContext.build(ParallelStrategy.parse(strategy), max_tokens_per_step=64,
                                redundant_experts_per_rank=redundant)
    model = load_model(model_dir, parallel=ctx)
    _check_weights(model, reference, ctx, n_shared)
    if redundant:
        _replicate_an_expert(model)
    ref, one, two = PagedHarness(reference), PagedHarness(model), PagedHarness(model)
    for step, row in enumerate(SCHEDULE):
        mine = row[ctx.dp_rank] if ctx.dp_rank < len(row) else []
        seqs = [seq for seq, _ in mine]
        tokens = [_tokens(seq, step, n) for seq, n in mine]
        expected = ref.step(seqs, tokens)
        for microbatches, harness in ((1, one), (2, two)):
            for a, b in zip(expected, harness.step(seqs, tokens, microbatches=microbatches)):
                assert (a - b).abs().max().item() <= TOL, f"rank {rank} step {step} microbatches {microbatches}"
    # the MTP layer's MoE block dispatches to the shared ranks too
    x = torch.randn(3 + rank, reference.params.hidden_size, generator=torch.Generator().manual_seed(rank))
    with torch.inference_mode():
        got, want = model.mtp[0].block.mlp(x), reference.mtp[0].block.mlp(x)
    assert (got - want).abs().max().item() <= TOL, f"rank {rank} MTP block"


@pytest.mark.parametrize("world, strategy, n_shared, redundant", [
    # one routed rank holds all 16 experts and a replica (EPLB); two shared blocks
    (2, "attn=TP1+DP2 moe=TP1+EP2 shared=EP1", 2, 1),
    (4, "attn=TP1+DP4 moe=TP1+EP4 shared=EP1", 1, 0),  # 16 experts over 3 routed ranks: an uneven split
])
def test_shared_expert_ranks_give_the_single_rank_logits(tmp_path, world, strategy, n_shared, redundant):
    model_dir = str(make_model("deepseek_v3", "tiny", tmp_path / "model", seed=3,
                               overrides={"n_shared_experts": n_shared}))
    spawn_local_world(_world_worker, world, args=(model_dir, strategy, n_shared, redundant),
                      timeout_s=WORLD_TIMEOUT_S)


def test_a_model_without_shared_experts_is_refused_on_shared_ranks(tmp_path):
    model_dir = str(make_model("qwen3_moe", "tiny", tmp_path / "model"))
    spawn_local_world(_refusal_worker, 2, args=(model_dir,), timeout_s=WORLD_TIMEOUT_S)


def _refusal_worker(rank: int, world_size: int, model_dir: str) -> None:
    ctx = ParallelContext.build(ParallelStrategy.parse("attn=TP1+DP2 moe=TP1+EP2 shared=EP1"))
    with pytest.raises(ValueError, match="shared") as err:
        load_model(model_dir, parallel=ctx)
    assert "\n" not in str(err.value)
