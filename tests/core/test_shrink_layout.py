"""`shrink_layout`: the config of a DP=EP TE on the ranks left after some die, and the layouts it refuses."""
from __future__ import annotations

import pytest

from meshserve.config import EngineConfig
from meshserve.core.shrink_layout import grown_layout, shrink_layout
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import (
    ExpertPlacement,
    PlacementShape,
    engine_redundant,
    engine_shape,
    load_placement_file,
)

LAYERS = [1, 2, 3]
DP4_EP4 = "attn=TP1+DP4 moe=TP1+EP4"


def _config(parallel: str = DP4_EP4, redundant: int = 1, **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs("model-dir", parallel=parallel, eplb_redundant_experts=redundant, **kwargs)


def _placement(redundant: int = 1, num_ranks: int = 4, experts: int = 8) -> ExpertPlacement:
    """The default placement with each rank's redundant slots holding replicas of other ranks' experts."""
    shape = PlacementShape(experts, num_ranks, redundant)
    layers = {}
    for layer in LAYERS:
        slots = shape.default_slots()
        for rank in range(num_ranks):
            for extra in range(redundant):
                slots[rank * shape.slots_per_rank + shape.primary_per_rank + extra] = (2 * rank + 3 + extra) % experts
        layers[layer] = slots
    return ExpertPlacement(shape, layers)


def _record(experts: int = 8) -> ExpertLoadRecord:
    hot = [[[100 if e == 2 else 10 + e for e in range(experts)] for _ in LAYERS]]
    return ExpertLoadRecord(num_logical=experts, moe_layers=LAYERS, slice_seconds=10.0, counts=hot,
                            slice_start_times=[0.0])


def test_removing_a_rank_of_dp4_ep4_gives_dp3_ep3_with_every_expert_kept():
    config = _config(max_num_seqs=8, serve_weights=True)
    placement = _placement()
    shrunk = shrink_layout(config, placement, _record(), [1])

    assert shrunk.kept_ranks == [0, 2, 3]
    strategy = shrunk.config.parallel_config.strategy
    assert (strategy.attn_tp, strategy.attn_dp, strategy.moe_tp, strategy.moe_ep) == (1, 3, 1, 3)
    # each rank left keeps its 3 slots; 8 experts on 3 ranks do not split evenly
    assert shrunk.placement.shape == PlacementShape(8, 3, 0, uneven_slots_per_rank=3)
    assert shrunk.config.eplb_config.eplb_redundant_experts == 0
    assert engine_shape(8, 3, 0) == shrunk.placement.shape
    # the placement travels inline in the config, and loads back as planned
    inline = shrunk.config.eplb_config.eplb_placement
    assert inline.startswith("{")
    assert load_placement_file(inline) == shrunk.placement
    for layer in LAYERS:
        replicas = shrunk.placement.replicas(layer)
        assert all(replicas), f"layer {layer}: an expert lost every replica"
        # the surviving ranks' copies stay where they were (rank 2's slots are now rank 1's, ...)
        old = placement.layers[layer]
        for new_rank, old_rank in enumerate(shrunk.kept_ranks):
            kept = set(old[old_rank * 3:(old_rank + 1) * 3]) & set(shrunk.placement.layers[layer][new_rank * 3:
                                                                                                 (new_rank + 1) * 3])
            assert kept, f"layer {layer}: rank {old_rank} kept none of its experts"
    # everything else of the TE stays as it was
    assert shrunk.config.scheduler_config == config.scheduler_config
    assert shrunk.config.te_name == config.te_name
    assert shrunk.config.model_config.serve_weights
    # growing back: the original config, optionally with the placement it had
    assert grown_layout(config) is config
    grown = grown_layout(config, placement)
    assert grown.parallel_config == config.parallel_config
    assert load_placement_file(grown.eplb_config.eplb_placement) == placement


def test_an_even_shrink_and_the_old_weight_servers_and_local_ranks():
    config = _config(redundant=2, fork_from="a,b,c,d", local_ranks=2)
    shrunk = shrink_layout(config, _placement(redundant=2), None, [0, 3])
    assert shrunk.kept_ranks == [1, 2]
    assert shrunk.placement.shape == PlacementShape(8, 2, 0)  # 2 ranks x 4 slots: the experts split evenly
    assert engine_redundant(shrunk.placement.shape) == 0
    assert shrunk.config.model_config.fork_from is None  # one weight server per old rank: they no longer match
    assert shrunk.config.parallel_config.local_ranks == 1  # rank 1 was local, rank 2 remote


def test_a_model_without_moe_layers_shrinks_its_dp_groups_only():
    config = _config(redundant=0)
    shrunk = shrink_layout(config, None, None, [3])
    assert shrunk.placement is None and shrunk.config.eplb_config.eplb_placement is None
    assert shrunk.config.parallel_config.parallel == "attn=TP1+DP3 moe=TP1+EP3"


@pytest.mark.parametrize("parallel, redundant, removed, message", [
    ("attn=TP2+DP2 moe=TP1+EP4", 1, [1], "only a DP=EP layout .* attention TP 2"),
    ("attn=TP1+DP4 moe=TP2+EP2", 1, [1], "only a DP=EP layout .* MoE TP 2"),
    (DP4_EP4, 0, [1], r"3 ranks x 2 slots = 6 slots for 8 experts; at least 4 ranks must remain"),
    (DP4_EP4, 1, [1, 2], r"2 ranks x 3 slots = 6 slots for 8 experts; at least 3 ranks must remain"),
    (DP4_EP4, 1, [], "at least one rank to remove"),
    (DP4_EP4, 1, [4], r"ranks \[4\] are not ranks of this TE \(world size 4\)"),
    (DP4_EP4, 1, [0, 1, 2, 3], "leaves no rank of this TE"),
])
def test_layouts_that_cannot_shrink_are_refused(parallel, redundant, removed, message):
    placement = _placement(redundant) if parallel == DP4_EP4 else None
    config = _config(parallel, redundant)
    with pytest.raises(ValueError, match=message):
        shrink_layout(config, placement, None, removed)


def test_refusals_for_the_master_host_and_for_a_foreign_placement():
    with pytest.raises(ValueError, match="leaves no rank on the master's host"):
        shrink_layout(_config(redundant=0, local_ranks=1), None, None, [0])
    with pytest.raises(ValueError, match="is not this TE's"):
        shrink_layout(_config(redundant=2), _placement(redundant=1), None, [1])
    with pytest.raises(ValueError, match="is not this TE's"):
        grown_layout(_config(redundant=1), _placement(redundant=1, num_ranks=2))


def test_engine_shapes_of_uneven_expert_counts():
    shape = engine_shape(8, 3, 1)  # ceil(8/3) + 1 = 4 slots per rank, the first 8 mod 3 = 2 ranks one expert more
    assert shape == PlacementShape(8, 3, 0, uneven_slots_per_rank=4)
    assert [shape.initial_experts(rank) for rank in range(3)] == [(0, 3), (3, 3), (6, 2)]
    assert shape.default_slots() == [0, 1, 2, -1, 3, 4, 5, -1, 6, 7, -1, -1]
    assert engine_redundant(shape) == 1
    assert engine_shape(8, 4, 1) == PlacementShape(8, 4, 1)
    with pytest.raises(ValueError, match="has primary slots"):
        engine_redundant(PlacementShape(8, 4, 0, uneven_slots_per_rank=3))


def test_a_shared_oproj_stays_while_it_divides_the_ranks_left_and_falls_back_to_one_otherwise():
    config = _config("attn=TP1+DP4 oproj=TP2 moe=TP1+EP4")
    assert shrink_layout(config, None, None, [1, 2]).config.parallel_config.parallel == \
        "attn=TP1+DP2 oproj=TP2 moe=TP1+EP2"
    assert shrink_layout(config, None, None, [3]).config.parallel_config.parallel == "attn=TP1+DP3 moe=TP1+EP3"
