"""What a TE shell and its self-contained DP groups' masters tell each other (core/te_shell.py)."""
from __future__ import annotations

from meshserve.wire.base import Message
from meshserve.wire.eplb import EplbCommand


class WorldRestart(Message):
    """The ranks of every DP group restart into a new torch.distributed world. From a group master to the shell:
    its ranks failed, it asks for world `generation` (`dist_init` empty). From the shell to every group master:
    the new world's rendezvous address; a group whose ranks still run restarts them too."""

    generation: int
    dist_init: str = ""
    reason: str = ""


class GroupExpertLoad(Message):
    """From a group master to the shell: its ranks' tokens per logical expert of each MoE layer since its last
    report ([layer][expert]); the shell's expert-load recorder sums the groups'."""

    counts: list[list[int]]


class EplbRelay(Message):
    """From the shell to every group master, which hands it to its ranks: a phase of an expert-placement
    reconfiguration. The ranks apply each phase at the same forward (worker/step_agreement.py)."""

    command: EplbCommand
