"""`GroupWorld` (core/group_world.py): how a TE shell decides the next world of its self-contained DP groups
from the groups' requests — a restart on the layout served, a shrink without the lost ranks' groups (each left
renumbered, each lost one retired), the regrowth after `regrow_after_s` — and the requests it ignores."""
from __future__ import annotations

import pytest

from meshserve.config import EngineConfig
from meshserve.core.group_world import COLLECT_S, GroupWorld
from meshserve.moe.placement import ExpertPlacement, PlacementShape, load_placement_file
from meshserve.wire.dp_group import WorldRestart

DP4_EP4 = "attn=TP1+DP4 moe=TP1+EP4"
ADDR = "tcp://127.0.0.1:29999"


def _config(on_rank_failure: str = "shrink", parallel: str = DP4_EP4, **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs("model-dir", parallel=parallel, on_rank_failure=on_rank_failure,
                                    regrow_after_s=30.0, **kwargs)


def _for_groups(config: EngineConfig) -> EngineConfig:
    return config.replace(eplb_interval_s=None)


def _world(config: EngineConfig) -> GroupWorld[str]:
    groups = [f"g{i}" for i in range(config.parallel_config.strategy.attn_dp)]
    return GroupWorld(config, groups, _for_groups)


def _placement(num_ranks: int = 4, experts: int = 8, redundant: int = 1) -> ExpertPlacement:
    shape = PlacementShape(experts, num_ranks, redundant)
    slots = shape.default_slots()
    for rank in range(num_ranks):
        for extra in range(redundant):
            slots[rank * shape.slots_per_rank + shape.primary_per_rank + extra] = (2 * rank + 3) % experts
    return ExpertPlacement(shape, {1: slots})


def _ask(world: GroupWorld, index: int, lost: list[int] = (), generation: int = 1, now: float = 0.0) -> None:
    world.on_request(WorldRestart(generation=generation, index=index, lost_ranks=list(lost),
                                  reason=f"group {index} failed"), now)


def test_a_restart_names_one_address_for_every_group_at_once():
    world = _world(_config(on_rank_failure="restart"))
    assert not world.due(0.0)
    _ask(world, 1)
    assert world.due(0.0)  # nothing to wait for: the layout stays
    change = world.decide(0.0, ADDR, None, None)
    assert change.generation == 1 and world.generation == 1 and not change.relaunch
    assert [g for g, _ in change.messages] == ["g0", "g1", "g2", "g3"]
    assert all(m.dist_init == ADDR and m.index is None and not m.retire for _, m in change.messages)
    # the layout served (no expert placement to keep: placement None), in the groups' version
    assert all(m.config == _for_groups(world.config) and str(m.config.parallel_config.strategy) == DP4_EP4
               for _, m in change.messages)
    _ask(world, 2)  # a late request for the world decided already: its answer is in its inbox
    assert not world.due(100.0)


def test_a_lost_rank_shrinks_the_world_once_every_group_has_asked():
    world = _world(_config(eplb_redundant_experts=1))
    _ask(world, 2, lost=[2])
    assert not world.due(0.0)  # the other groups' ranks fail a moment later: their requests are waited for
    for index in (0, 1, 3):
        _ask(world, index)
    assert world.due(0.0)
    change = world.decide(0.0, ADDR, _placement(), None)
    by_group = dict(change.messages)
    assert by_group["g2"].retire and not by_group["g2"].dist_init
    assert [(g, by_group[g].index) for g in ("g0", "g1", "g3")] == [("g0", 0), ("g1", 1), ("g3", 2)]
    config = by_group["g0"].config
    assert str(config.parallel_config.strategy) == "attn=TP1+DP3 moe=TP1+EP3"
    assert config.eplb_config.eplb_interval_s is None  # the groups' version of the TE's config
    assert world.served == ["g0", "g1", "g3"] and world.retired() == ["g2"]
    assert world.config.parallel_config.world_size == 3 and world.shrunk_since == 0.0


def test_the_shell_decides_without_a_group_that_does_not_ask():
    world = _world(_config(eplb_redundant_experts=1))
    _ask(world, 2, lost=[2], now=10.0)
    assert not world.due(10.0 + COLLECT_S / 2)
    assert world.due(10.0 + COLLECT_S)
    assert world.decide(11.0, ADDR, _placement(), None).config.parallel_config.world_size == 3


def test_the_shrunk_world_grows_back_after_regrow_after_s():
    world = _world(_config(eplb_redundant_experts=1))
    _ask(world, 0, lost=[0])
    world.decide(5.0, ADDR, _placement(), None)
    assert world.served == ["g1", "g2", "g3"]
    assert not world.due(5.0 + 29.0) and world.due(5.0 + 30.0)
    change = world.decide(35.0, "tcp://127.0.0.1:30000", None, None)
    assert change.generation == 2 and change.relaunch == ["g0"] and change.dist_init == "tcp://127.0.0.1:30000"
    assert [(g, m.index) for g, m in change.messages] == [("g1", 1), ("g2", 2), ("g3", 3)]
    assert all(m.config.parallel_config.world_size == 4 for _, m in change.messages)
    assert world.served == ["g0", "g1", "g2", "g3"] and world.shrunk_since is None
    assert not world.due(1e9)


def test_a_second_loss_shrinks_the_shrunk_world_in_its_own_numbering():
    world = _world(_config(eplb_redundant_experts=2))
    _ask(world, 1, lost=[1])
    world.decide(0.0, ADDR, _placement(redundant=2), None)  # g0 g2 g3 are ranks 0 1 2 now
    _ask(world, 1, lost=[1], generation=2)  # rank 1 of DP3: group g2
    served = load_placement_file(world.config.eplb_config.eplb_placement)  # what the shell's controller loads
    change = world.decide(0.0, ADDR, served, None)
    assert world.served == ["g0", "g3"] and dict(change.messages)["g2"].retire


@pytest.mark.parametrize("config, placement", [
    (_config(), _placement(redundant=0)),  # 8 experts, 2 slots on each of the 3 ranks left
    (_config(parallel="attn=TP2+DP2 moe=TP1+EP4"), None),  # only DP=EP layouts shrink
])
def test_a_layout_that_cannot_shrink_restarts_every_group_instead(config, placement):
    world = _world(config)
    _ask(world, 1, lost=[2])
    change = world.decide(COLLECT_S, ADDR, placement, None)
    assert [g for g, _ in change.messages] == world.groups == world.served
    assert all(m.config.parallel_config.strategy == config.parallel_config.strategy and not m.retire
               for _, m in change.messages)
    assert world.shrunk_since is None


def test_a_restart_keeps_the_placement_served():
    """A live rebalance's placement survives a restart: the groups restart their ranks with it."""
    world = _world(_config(on_rank_failure="restart", eplb_redundant_experts=1))
    moved = _placement()
    _ask(world, 0)
    change = world.decide(0.0, ADDR, moved, None)
    kept = [load_placement_file(m.config.eplb_config.eplb_placement) for _, m in change.messages]
    assert all(placement.layers == moved.layers for placement in kept)
    assert change.config.eplb_config.eplb_placement == world.config.eplb_config.eplb_placement
    # a placement of another shape (the layout grew back meanwhile, say) is not forced on the ranks
    _ask(world, 0, generation=2)
    other = world.decide(0.0, ADDR, _placement(num_ranks=2, experts=8), None)
    assert all(load_placement_file(m.config.eplb_config.eplb_placement).layers == moved.layers
               for _, m in other.messages)
