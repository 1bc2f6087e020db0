"""A TE started on a shrunk layout (xdeepserve §6.2 stage 2) serves like the single-rank engine.

A DP4+EP4 TE (8 experts, one redundant slot per rank, replicas of other ranks' experts in them) loses
rank 1: `shrink_layout` gives the same TE on 3 ranks, DP3+EP3, where the 8 experts no longer split
evenly (3 slots per rank, 9 slots in all). An engine started from that config (3 worker processes)
loads the planned placement before serving; its greedy tokens must equal the single-rank engine's,
and the placement its EPLB status reports must be the plan, with every expert on some rank.
"""
from __future__ import annotations

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.config import EngineConfig
from meshserve.core.shrink_layout import shrink_layout
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import ExpertPlacement, PlacementShape, engine_shape

NUM_EXPERTS = 8
OUTPUT_LEN = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
# small steps so prefill is chunked and decodes mix with prefills, as in serving
ENGINE_ARGS = dict(max_num_batched_tokens=64, block_size=8, max_num_seqs=8, num_kv_blocks=96)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 31900, (n,), generator=g).tolist() for n in (5, 40, 17, 2)]


def _generate(prompts, **engine_args):
    with LLM(**engine_args) as llm:
        tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
        status = llm.admin("eplb.status")
    return tokens, status


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    # layer 0 is dense, layers 1-3 hold 8 experts each (top 4)
    return tiny_model("qwen3_moe", seed=3, overrides={"num_experts": NUM_EXPERTS})


def _serving_placement(moe_layers: list[int]) -> ExpertPlacement:
    """What the DP4+EP4 TE serves with before the failure: its default primaries, and in each rank's redundant
    slot a replica of another rank's expert (as a rebalance leaves them)."""
    shape = PlacementShape(NUM_EXPERTS, 4, 1)
    layers = {}
    for layer in moe_layers:
        slots = shape.default_slots()
        for rank in range(4):
            slots[rank * 3 + 2] = (2 * rank + 3 + layer) % NUM_EXPERTS
        layers[layer] = slots
    return ExpertPlacement(shape, layers)


def test_a_te_shrunk_from_dp4_ep4_to_three_ranks_serves_like_one_rank(model_dir):
    prompts = _prompts()
    reference, _ = _generate(prompts, model=str(model_dir), **ENGINE_ARGS)

    full = EngineConfig.from_kwargs(str(model_dir), parallel="attn=TP1+DP4 moe=TP1+EP4", eplb_redundant_experts=1,
                                    **ENGINE_ARGS)
    moe_layers = [1, 2, 3]
    # a skewed recorded load: expert 5 is hot, so the free slot the shrink leaves gets a replica of it
    record = ExpertLoadRecord(num_logical=NUM_EXPERTS, moe_layers=moe_layers, slice_seconds=10.0,
                              counts=[[[400 if e == 5 else 20 + e for e in range(NUM_EXPERTS)] for _ in moe_layers]],
                              slice_start_times=[0.0])
    shrunk = shrink_layout(full, _serving_placement(moe_layers), record, [1])
    assert shrunk.config.parallel_config.world_size == 3
    assert shrunk.placement.shape == engine_shape(NUM_EXPERTS, 3, 0) == PlacementShape(NUM_EXPERTS, 3, 0, 3)
    # the plan moves experts off the contiguous split the ranks load first, so applying it matters
    assert all(slots != shrunk.placement.shape.default_slots() for slots in shrunk.placement.layers.values())

    tokens, status = _generate(prompts, **shrunk.config.flat())
    assert tokens == reference

    served = ExpertPlacement.from_dict(status["placement"])
    assert served == shrunk.placement
    for layer in moe_layers:
        missing = [expert for expert, replicas in enumerate(served.replicas(layer)) if not replicas]
        assert not missing, f"layer {layer}: experts without a replica: {missing}"
    # the free slot of some layer holds a second copy of a hot expert: tokens rotate over its replicas
    assert any(len(r) > 1 for layer in moe_layers for r in served.replicas(layer))


def test_a_span_reads_an_uneven_rank_share_of_packed_experts():
    from meshserve.layers.tensor_parallel import Span

    packed = torch.arange(8 * 2).reshape(8, 2)  # [experts, ...]: rank 2 of 8 experts on 3 ranks holds 6 and 7
    first, count = engine_shape(NUM_EXPERTS, 3, 0).initial_experts(2)
    assert torch.equal(Span(0, first, count).take(packed, "experts.down_proj"), packed[6:8])
    with pytest.raises(ValueError, match=r"rows \[6, 9\) of dimension 0 are outside its size 8"):
        Span(0, 6, 3).take(packed, "experts.down_proj")
