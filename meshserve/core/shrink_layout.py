"""A TE's layout on the ranks left after some die: decode vertical shrink (xdeepserve §6.2 stage 2).

"In failure cases, we reduce the number of DP groups and EP ranks, allowing decode to proceed with
fewer NPUs. Each expert maintains at least one replica, while excess replicas are gracefully removed."

`shrink_layout` turns a TE's config, its current expert placement and recorded load into the config
of the same TE on the ranks left: in a DP=EP layout (`attn=TP1+DPn moe=TP1+EPn`) every rank is its own
DP group and EP rank, so removing ranks removes as many DP groups and EP ranks. A shared o_proj
(`oproj=TPk`) is kept where k divides the ranks left and dropped (oproj=TP1) where it does not. The ranks left keep
their slots per rank and are renumbered in rank order; their placement is planned by
`meshserve.moe.shrink` (every expert keeps a replica on them, excess replicas give way) and travels
inline in the new config (`eplb_placement` holds its JSON), so no file has to reach the ranks. The
new ranks start with their share of the experts and load the planned placement before they serve
(`ModelRunner._apply_initial_placement`); where the experts no longer split evenly over the ranks
(8 experts on 3), the engine runs an uneven shape (meshserve/moe/placement.py `engine_shape`).

Growing back needs nothing from here: the master keeps the original config and starts the full
layout from it, optionally with the placement it had before the failure (`grown_layout`).

No torch: the master imports this.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from meshserve.config import EngineConfig
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import ExpertPlacement, engine_redundant, engine_shape, placement_json
from meshserve.moe.shrink import plan_shrink
from meshserve.parallel.strategy import ParallelStrategy


class ShrunkLayout(NamedTuple):
    config: EngineConfig  # the same TE on the ranks left
    placement: ExpertPlacement | None  # what the new ranks load (None: the model has no MoE layers)
    kept_ranks: list[int]  # the old rank of each new rank (new rank i was kept_ranks[i])


def shrink_layout(config: EngineConfig, placement: ExpertPlacement | None, record: ExpertLoadRecord | None,
                  removed_ranks: Iterable[int], *, replan: bool = False) -> ShrunkLayout:
    """The TE of `config` on its ranks but `removed_ranks`, with an expert placement for them.

    `placement` is the placement the TE serves with now (`EplbController.placement`; None for a model
    without MoE layers), `record` its recorded expert load (`EplbController.record()`; None: plan for a
    uniform load). `replan=True` plans every slot afresh instead of keeping the copies the ranks left
    hold. ValueError for a layout that cannot shrink: attention or MoE TP, every rank removed, or fewer
    slots left than experts."""
    strategy = config.parallel_config.strategy
    world = strategy.world_size
    removed = sorted(set(removed_ranks))
    if not removed:
        raise ValueError("a shrink needs at least one rank to remove")
    outside = [rank for rank in removed if not 0 <= rank < world]
    if outside:
        raise ValueError(f"ranks {outside} are not ranks of this TE (world size {world})")
    if strategy.attn_tp != 1 or strategy.moe_tp != 1:
        raise ValueError(f"only a DP=EP layout (attn=TP1+DPn moe=TP1+EPn, each rank its own DP group and EP rank) "
                         f"can shrink; {strategy} has attention TP {strategy.attn_tp} and MoE TP {strategy.moe_tp}")
    if strategy.shared_ep:
        raise ValueError(f"{strategy} keeps the shared experts on ranks of their own (shared=EP{strategy.shared_ep}); "
                         "such a layout restarts its ranks instead of shrinking")
    kept = [rank for rank in range(world) if rank not in set(removed)]
    if not kept:
        raise ValueError(f"removing ranks {removed} leaves no rank of this TE")
    # a shared o_proj (oproj=TPk) stays while k still divides the DP groups left, else each rank holds all of it
    oproj = strategy.oproj_tp if len(kept) % strategy.oproj_tp == 0 else 1
    shrunk_strategy = ParallelStrategy(attn_tp=1, attn_dp=len(kept), moe_tp=1, moe_ep=len(kept), oproj_tp=oproj)
    changes: dict = {"parallel": str(shrunk_strategy),
                     # the weight servers named are one per old rank; the new ranks read the checkpoint
                     "fork_from": None}
    local = config.parallel_config.local_ranks
    if local is not None:  # the ranks the master starts on its own host: the local ones left
        changes["local_ranks"] = sum(1 for rank in kept if rank < local)
        if not changes["local_ranks"]:
            raise ValueError(f"removing ranks {removed} leaves no rank on the master's host (rank 0 runs there)")
    shrunk = None
    if placement is not None:
        _check_placement(config, placement)
        shrunk = plan_shrink(placement, record, removed, replan=replan)
        changes["eplb_redundant_experts"] = engine_redundant(shrunk.shape)
        changes["eplb_placement"] = placement_json(shrunk)
    return ShrunkLayout(config.replace(**changes), shrunk, kept)


def grown_layout(original: EngineConfig, placement: ExpertPlacement | None = None) -> EngineConfig:
    """The full layout again: the original config, with `placement` (one for its shape, e.g. the one it served
    with before the shrink) applied before serving; None keeps the original's own placement setting."""
    if placement is None:
        return original
    _check_placement(original, placement)
    return original.replace(eplb_placement=placement_json(placement))


def _check_placement(config: EngineConfig, placement: ExpertPlacement) -> None:
    strategy = config.parallel_config.strategy
    expected = engine_shape(placement.shape.num_logical, strategy.routed_ep,
                            config.eplb_config.eplb_redundant_experts)
    if placement.shape != expected:
        raise ValueError(f"the placement's shape {placement.shape} is not this TE's ({expected}: "
                         f"{strategy.routed_ep} routed EP ranks, {config.eplb_config.eplb_redundant_experts} "
                         "redundant slots per rank)")
