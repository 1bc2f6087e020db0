"""What a TE shell and its self-contained DP groups' masters tell each other (core/te_shell.py)."""
from __future__ import annotations

from msgspec import field

from meshserve.config import EngineConfig
from meshserve.wire.base import Message
from meshserve.wire.client import AddRequest
from meshserve.wire.eplb import EplbCommand


class WorldRestart(Message):
    """The ranks of every DP group restart into a new torch.distributed world. From a group master to the shell:
    its ranks failed, it asks for world `generation` (`dist_init` empty), naming the ranks it lost for good
    (`lost_ranks`: killed by a signal, as a lost device is). From the shell to every group master: the new
    world's rendezvous address; a group whose ranks still run restarts them too. With `on_rank_failure shrink`
    the new world may have another layout: `config` (the TE's config for it; None: the layout served now) and
    this group's `index` in it (None: unchanged), or `retire`: the group has no rank in it, hands its requests
    over (`HandOver`) and leaves."""

    generation: int
    dist_init: str = ""
    reason: str = ""
    lost_ranks: list[int] = field(default_factory=list)
    config: EngineConfig | None = None
    index: int | None = None
    retire: bool = False


class HandOver(Message):
    """From a retiring group's master to the shell: its unfinished requests, each with the tokens it has
    streamed so far (`output_token_ids`), for the groups left to go on with (token recomputation)."""

    requests: list[AddRequest]


class GroupExpertLoad(Message):
    """From a group master to the shell: its ranks' tokens per logical expert of each MoE layer since its last
    report ([layer][expert]); the shell's expert-load recorder sums the groups'."""

    counts: list[list[int]]


class EplbRelay(Message):
    """From the shell to every group master, which hands it to its ranks: a phase of an expert-placement
    reconfiguration. The ranks apply each phase at the same forward (worker/step_agreement.py)."""

    command: EplbCommand
