"""Which DP groups of a TE with self-contained groups make up its torch.distributed world, and how that world
changes after a failure (core/te_shell.py).

A group whose ranks failed asks its shell for a new world (`WorldRestart`, naming the ranks it lost for good:
killed by a signal). The death of one rank fails every other rank's next round of step agreement, so every
group asks within moments. The shell takes the requests of one generation together (until every group of the
world has asked, or `COLLECT_S` has passed) and decides:

- a restart: every group restarts its ranks into one new rendezvous address, on the layout served now;
- with `on_rank_failure shrink` and lost ranks in a DP=EP layout, a shrink (xdeepserve §6.2 stage 2): the TE
  goes on without the lost ranks' groups. The layout left is planned by `shrink_layout` from the placement
  served and its recorded load, each group left gets its index in it, and each group out of it retires: it
  hands its requests over (`HandOver`) for the groups left to go on with, and its master leaves;
- after `regrow_after_s` on a shrunk layout, the regrowth: the retired groups' masters start again and every
  group restarts into the full layout, at its own index.

No torch, no sockets: the shell sends what `WorldChange` says and starts the masters it names.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from meshserve.config import EngineConfig
from meshserve.core.shrink_layout import grown_layout, shrink_layout
from meshserve.moe.load_record import ExpertLoadRecord
from meshserve.moe.placement import ExpertPlacement
from meshserve.wire.dp_group import WorldRestart

logger = logging.getLogger(__name__)

COLLECT_S = 1.0  # how long the shell waits for every group's request before it decides on a new world

G = TypeVar("G")  # the shell's view of a group


@dataclass
class WorldChange(Generic[G]):
    """What the shell does for a new world: each group's message, and the groups whose masters start again."""

    generation: int
    dist_init: str  # the new world's rendezvous address
    messages: list[tuple[G, WorldRestart]]
    relaunch: list[G] = field(default_factory=list)  # retired groups that rejoin (their masters start anew)
    config: EngineConfig | None = None  # the TE's layout in the new world


@dataclass
class _Pending:
    generation: int
    deadline: float
    lost: set[int] = field(default_factory=set)
    asked: set[int] = field(default_factory=set)  # the indexes of the groups that asked
    reasons: list[str] = field(default_factory=list)


class GroupWorld(Generic[G]):
    """The world's groups and layout. `groups`: every group of the full layout, by index; `for_groups`: the
    config a group's master runs with, from the TE's."""

    def __init__(self, config: EngineConfig, groups: list[G],
                 for_groups: Callable[[EngineConfig], EngineConfig]) -> None:
        self.full_config = config
        self.config = config  # the layout served now (the TE's config for it)
        self._for_groups = for_groups
        self.groups = groups
        self.served: list[G] = list(groups)  # the groups of the world served now, in its order
        self.generation = 0
        self.shrunk_since: float | None = None
        self._pending: _Pending | None = None

    @property
    def shrinks(self) -> bool:
        return self.full_config.parallel_config.on_rank_failure == "shrink"

    def retired(self) -> list[G]:
        return [g for g in self.groups if g not in self.served]

    def on_request(self, item: WorldRestart, now: float) -> None:
        """A group asks for world `item.generation` (its ranks failed)."""
        if item.generation <= self.generation:
            return  # decided already: the group has its answer in its inbox
        pending = self._pending
        if pending is None or item.generation > pending.generation:
            pending = self._pending = _Pending(item.generation, now + (COLLECT_S if self.shrinks else 0.0))
        pending.lost.update(item.lost_ranks)
        if item.index is not None:
            pending.asked.add(item.index)
        if item.reason and item.reason not in pending.reasons:
            pending.reasons.append(item.reason)

    def due(self, now: float) -> bool:
        """A new world is to be decided (`now`: time.monotonic()): every group has asked, or the wait for the
        others is over; or a shrunk layout has served long enough to grow back."""
        pending = self._pending
        if pending is not None:
            return now >= pending.deadline or len(pending.asked) >= len(self.served)
        shrunk = self.shrunk_since
        return shrunk is not None and now - shrunk >= self.full_config.parallel_config.regrow_after_s

    def decide(self, now: float, dist_init: str, placement: ExpertPlacement | None,
               record: ExpertLoadRecord | None) -> WorldChange[G]:
        """The next world at `dist_init`: a shrink, a restart or (no group asked) the regrowth. `placement` and
        `record`: the expert placement served and its recorded load (they plan a shrink)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self._regrow(dist_init)
        self.generation = pending.generation
        reason = "; ".join(pending.reasons) or "a DP group lost a rank"
        if self.shrinks and pending.lost:
            try:
                return self._shrink(now, dist_init, reason, sorted(pending.lost), placement, record)
            except ValueError as exc:
                logger.warning("cannot go on without rank(s) %s (%s): restarting every rank", sorted(pending.lost),
                               exc)
        logger.warning("the ranks of every DP group restart into world %d: %s", self.generation, reason)
        self.config = _with_placement(self.config, placement)  # a live rebalance's result survives the restart
        world = WorldRestart(generation=self.generation, dist_init=dist_init, reason=reason,
                             config=self._for_groups(self.config))
        return WorldChange(self.generation, dist_init, [(g, world) for g in self.served], config=self.config)

    def _shrink(self, now: float, dist_init: str, reason: str, lost: list[int], placement: ExpertPlacement | None,
                record: ExpertLoadRecord | None) -> WorldChange[G]:
        layout = shrink_layout(self.config, placement, record, lost)
        # a DP=EP layout (the only one that shrinks): rank i is DP group i of the world served
        kept = [self.served[rank] for rank in layout.kept_ranks]
        group_config = self._for_groups(layout.config)
        messages = [(g, WorldRestart(generation=self.generation, dist_init=dist_init, reason=reason,
                                     config=group_config, index=index)) for index, g in enumerate(kept)]
        messages += [(g, WorldRestart(generation=self.generation, reason=reason, retire=True))
                     for g in self.served if g not in kept]
        logger.warning("world %d goes on without rank(s) %s: %s on the ranks left (%s)", self.generation, lost,
                       layout.config.parallel_config.strategy, reason)
        self.served, self.config = kept, layout.config
        self.shrunk_since = now
        return WorldChange(self.generation, dist_init, messages, config=layout.config)

    def _regrow(self, dist_init: str) -> WorldChange[G]:
        self.generation += 1
        relaunch = self.retired()
        group_config = self._for_groups(self.full_config)
        messages = [(g, WorldRestart(generation=self.generation, dist_init=dist_init, reason="growing back",
                                     config=group_config, index=self.groups.index(g))) for g in self.served]
        logger.warning("world %d grows back to %s", self.generation, self.full_config.parallel_config.strategy)
        self.served, self.config, self.shrunk_since = list(self.groups), self.full_config, None
        return WorldChange(self.generation, dist_init, messages, relaunch=relaunch, config=self.full_config)


def _with_placement(config: EngineConfig, placement: ExpertPlacement | None) -> EngineConfig:
    """`config` with `placement` applied at start, where it has that placement's shape; else `config`."""
    try:
        return grown_layout(config, placement)
    except ValueError:
        return config
