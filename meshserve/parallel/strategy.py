"""Parallel-strategy grammar of MixServe §III-B1: `attn=TP2+DP2 moe=TP2+EP2`.

The attention block is split by TP and DP, the MoE block by TP and EP (DP is not
used for MoE: EP already replicates nothing and partitions the experts). TP degrees
are powers of two (they split heads and columns); DP and EP may be any count (a TE
shrunk after a rank failure runs e.g. DP3 and EP3: meshserve/core/shrink_layout.py).
Both blocks must cover the same ranks.

The optional `oproj=TPk` block (xDeepServe Fig. 10) runs MLA whole per DP group at
attention TP1, so the latent KV cache is not replicated, and shares the attention
output projection over k consecutive DP groups (= k consecutive ranks): each rank
holds 1/k of the heads' o_proj columns and two all-to-alls move the heads' outputs
and the partial sums between them. k divides the attention DP degree.

An optional `shared=EPs` block puts the shared experts on the last s of the EP ranks (the seeds'
EP288 = 256 routed + 32 shared-expert dies, xdeepserve §7): the other EP ranks hold the routed experts.
Pure EP with attention TP1 only; omitted (and not printed) it is 0.

Attention-expert disaggregation (`attn=DP4 moe=EP2 disagg domains=2`, xdeepserve §5.2,
meshserve/parallel/disagg.py): the attention ranks (TP1, one DP group each) and the expert ranks are
different ranks, the expert ranks after the attention ones, so the world is their sum. `domains` split
the attention ranks into groups that take turns on the expert ranks, `relay` routes through one relay
per that many expert ranks (two-stage).
"""
from __future__ import annotations

import dataclasses
import re

_BLOCK_KINDS = {"attn": ("TP", "DP"), "oproj": ("TP",), "moe": ("TP", "EP"), "shared": ("EP",)}
_REQUIRED_BLOCKS = {"attn", "moe"}
_TERM_RE = re.compile(r"^(TP|DP|EP)(\d+)$")


class StrategyError(ValueError):
    """A strategy string or degree set that the grammar does not allow."""


def is_power_of_two(value: int) -> bool:
    return isinstance(value, int) and value >= 1 and value & (value - 1) == 0


@dataclasses.dataclass(frozen=True)
class ParallelStrategy:
    attn_tp: int = 1
    attn_dp: int = 1
    moe_tp: int = 1
    moe_ep: int = 1
    oproj_tp: int = 1  # ranks sharing each attention output projection (MLA at attention TP1)
    shared_ep: int = 0  # of the moe_ep EP ranks, the last shared_ep host only the shared experts
    # attention-expert disaggregation: the MoE ranks follow the attention ranks instead of being the same ones
    disagg: bool = False
    domains: int = 1  # disagg: DP domains taking turns on the expert ranks
    relay: int = 1  # disagg: expert ranks behind one relay (two-stage routing); 1: direct

    def __post_init__(self) -> None:
        for name in ("attn_tp", "attn_dp", "moe_tp", "moe_ep", "oproj_tp"):
            value = getattr(self, name)
            if name.endswith("_tp") and (isinstance(value, bool) or not is_power_of_two(value)):
                raise StrategyError(f"{name} must be a positive power of two, got {value!r}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StrategyError(f"{name} must be a positive integer, got {value!r}")
        if self.disagg:
            self.disagg_layout()  # checks the roles (StrategyError naming the setting)
            return
        if (self.domains, self.relay) != (1, 1):
            raise StrategyError("domains and relay belong to a disaggregated layout (add the word 'disagg')")
        attn_ranks = self.attn_tp * self.attn_dp
        moe_ranks = self.moe_tp * self.moe_ep
        if attn_ranks != moe_ranks:
            raise StrategyError(
                f"attention covers {attn_ranks} ranks (TP{self.attn_tp}*DP{self.attn_dp}) but MoE covers "
                f"{moe_ranks} (TP{self.moe_tp}*EP{self.moe_ep}); both blocks must span the same world size")
        if self.oproj_tp > 1 and self.attn_tp != 1:
            raise StrategyError(f"oproj=TP{self.oproj_tp} needs attention TP1 (MLA runs whole in each DP group), "
                                f"got attn=TP{self.attn_tp}")
        if self.attn_dp % self.oproj_tp:
            raise StrategyError(f"oproj=TP{self.oproj_tp} must divide the attention DP degree {self.attn_dp} "
                                "(an o_proj group is that many consecutive DP groups)")
        self._check_shared()

    def _check_shared(self) -> None:
        s = self.shared_ep
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise StrategyError(f"shared=EP{s!r} must count zero or more shared-expert ranks")
        if s and s >= self.moe_ep:
            raise StrategyError(f"shared=EP{s} leaves no routed-expert rank of moe EP{self.moe_ep}; "
                                f"use at most EP{self.moe_ep - 1}")
        if s and (self.attn_tp > 1 or self.moe_tp > 1):
            raise StrategyError(f"shared=EP{s} needs attention TP1 and MoE TP1 (pure EP), not "
                                f"attn TP{self.attn_tp} and moe TP{self.moe_tp}")

    @property
    def routed_ep(self) -> int:
        """EP ranks that hold routed experts (all of them without `shared=EPs`)."""
        return self.moe_ep - self.shared_ep

    @property
    def attention_ranks(self) -> int:
        """Ranks running attention (every rank unless disaggregated)."""
        return self.attn_tp * self.attn_dp

    @property
    def world_size(self) -> int:
        return self.attention_ranks + (self.moe_tp * self.moe_ep if self.disagg else 0)

    def disagg_layout(self):
        """The disaggregated layout this strategy serves (meshserve/parallel/disagg.py; its checks run)."""
        from meshserve.parallel.disagg import DisaggLayout  # it prices layouts with the analyzer, which needs us

        if not self.disagg:
            raise StrategyError(f"{self} is not a disaggregated layout")
        if self.attn_tp != 1 or self.oproj_tp != 1:
            raise StrategyError(f"a disaggregated layout runs attention at TP1 (attn=DPa), not attn=TP{self.attn_tp}"
                                + (f" oproj=TP{self.oproj_tp}" if self.oproj_tp > 1 else ""))
        return DisaggLayout(attention_ranks=self.attn_dp, expert_ranks=self.moe_tp * self.routed_ep,
                            shared_ranks=self.moe_tp * self.shared_ep, expert_tp=self.moe_tp, domains=self.domains,
                            relay=self.relay)

    def __str__(self) -> str:
        if self.disagg:
            return str(self.disagg_layout())
        oproj = f" oproj=TP{self.oproj_tp}" if self.oproj_tp > 1 else ""
        shared = f" shared=EP{self.shared_ep}" if self.shared_ep else ""
        return f"attn=TP{self.attn_tp}+DP{self.attn_dp}{oproj} moe=TP{self.moe_tp}+EP{self.moe_ep}{shared}"

    @classmethod
    def parse(cls, text: str) -> ParallelStrategy:
        return parse_strategy(text)

    @classmethod
    def from_degrees(cls, tp: int = 1, dp: int = 1, ep: int = 1) -> ParallelStrategy:
        """Shorthand of `--tp/--dp/--ep`: attention TP x DP; MoE EP with TP filling the rest."""
        for name, value in (("tp", tp), ("dp", dp), ("ep", ep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StrategyError(f"--{name} must be a positive integer, got {value!r}")
        if not is_power_of_two(tp):
            raise StrategyError(f"--tp must be a power of two, got {tp}")
        world = tp * dp
        if ep > world:
            raise StrategyError(f"--ep {ep} exceeds the world size tp*dp = {world}")
        if world % ep or not is_power_of_two(world // ep):
            raise StrategyError(f"--ep {ep} leaves MoE TP {world}/{ep} of the world size tp*dp = {world}; "
                                "it must be a power of two")
        return cls(attn_tp=tp, attn_dp=dp, moe_tp=world // ep, moe_ep=ep)


def parse_strategy(text: str) -> ParallelStrategy:
    """Parse `attn=TPa+DPb [oproj=TPk] moe=TPc+EPd [shared=EPs]`; omitted terms (and the oproj block) default to 1,
    s to 0; order of terms is free."""
    if not isinstance(text, str) or not text.strip():
        raise StrategyError("empty strategy; expected e.g. 'attn=TP2+DP2 moe=TP2+EP2'")
    if "disagg" in text.split():
        return from_disagg_text(text)
    degrees: dict[str, int] = {}
    seen_blocks: set[str] = set()
    for block in text.split():
        name, sep, body = block.partition("=")
        if not sep or name not in _BLOCK_KINDS:
            raise StrategyError(f"bad block {block!r}; expected 'attn=...', 'oproj=...', 'moe=...' or 'shared=EPs'")
        if name in seen_blocks:
            raise StrategyError(f"block {name!r} given twice")
        seen_blocks.add(name)
        allowed = _BLOCK_KINDS[name]
        seen_kinds: set[str] = set()
        for term in body.split("+"):
            match = _TERM_RE.match(term)
            if not match:
                raise StrategyError(f"bad term {term!r} in {block!r}; expected e.g. TP4")
            kind, degree = match.group(1), int(match.group(2))
            if kind not in allowed:
                raise StrategyError(f"{kind} is not allowed in the {name} block (allowed: {'/'.join(allowed)})")
            if kind in seen_kinds:
                raise StrategyError(f"{kind} given twice in {block!r}")
            seen_kinds.add(kind)
            degrees[f"{name}_{kind.lower()}"] = degree
    missing = sorted(set(_REQUIRED_BLOCKS) - seen_blocks)
    if missing:
        raise StrategyError(f"strategy {text!r} lacks the {', '.join(missing)} block")
    return ParallelStrategy(**degrees)


def from_disagg_text(text: str) -> ParallelStrategy:
    """The strategy of a disaggregated layout `attn=DPa moe=[TPt+]EPe [shared=EPs] disagg [domains=D] [relay=R]`."""
    from meshserve.parallel.disagg import parse_disagg

    layout = parse_disagg(text)
    t = layout.expert_tp
    if layout.shared_ranks % t:
        raise StrategyError(f"shared=EP{layout.shared_ranks} must be a multiple of moe=TP{t} (shared-expert ranks "
                            "split their experts the same way)")
    return ParallelStrategy(attn_dp=layout.attention_ranks, moe_tp=t,
                            moe_ep=(layout.expert_ranks + layout.shared_ranks) // t, shared_ep=layout.shared_ranks // t,
                            disagg=True, domains=layout.domains, relay=layout.relay)


def enumerate_strategies(world_size: int, oproj: bool = False) -> list[ParallelStrategy]:
    """Every grammar-valid strategy spanning `world_size` ranks: each TP degree a power of two dividing it, DP and
    EP the rest (320 ranks: TP1-64, DP/EP 320-5); with `oproj`, also the attention-TP1 ones with o_proj shared over
    2, 4, ... ranks (MLA models only)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise StrategyError(f"world size must be a positive integer, got {world_size!r}")
    divisors = [1 << i for i in range(world_size.bit_length()) if world_size % (1 << i) == 0]
    strategies = [ParallelStrategy(attn_tp=a, attn_dp=world_size // a, moe_tp=m, moe_ep=world_size // m)
                  for a in divisors for m in divisors]
    if oproj:
        strategies += [dataclasses.replace(s, oproj_tp=k) for s in strategies if s.attn_tp == 1
                       for k in divisors if k > 1]
    return strategies
