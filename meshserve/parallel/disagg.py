"""Attention-expert disaggregation as a layout and its price (xdeepserve §5.2, Fig. 18-19): attention ranks and
expert ranks on different devices, the attention DP groups split into DP domains that take turns on the experts.

Grammar: `attn=DPa moe=EPe [shared=EPs] [moe=TPt+EPe] disagg [domains=D] [relay=R]`, e.g. xdeepserve's 768-die
deployment `attn=DP480 moe=EP256 shared=EP32 disagg domains=3`. Attention ranks run MLA at TP1 (one DP group
each), gating and the output projection; expert ranks hold only the MoE FFNs: `e` ranks the routed experts
(sharded `t` ways along the intermediate dimension with MoE TP), `s` more the shared experts. Tokens go
attention -> experts (A2E) and back (E2A) over meshserve/moe/a2e.py, through one relay per `R` expert ranks
when `relay=R` (two-stage routing).

The price (`estimate_disagg`), per decode step of the whole batch `b` (MixServe's equations where they apply):
each domain holds b/D tokens and each of its attention ranks b/a. Per layer a domain runs its attention (A, on
its own ranks), A2E (C), the experts (E, on the expert ranks) and E2A (C). The expert ranks serve the domains in
turn, so a layer takes max(A + 2C + E, D * E): domains hide each other's attention and transfers as long as the
experts are not the bottleneck (Fig. 19's inter-DP parallelism). `compare` prices the colocated DP=EP layout on
as many devices beside it.

No torch: `meshserve plan` imports this.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

from meshserve.parallel.analyzer import (
    ACTIVATION_BYTES,
    Cluster,
    ModelSpec,
    Workload,
    compute_latency_eq4,
    estimate,
    kv_cache_bytes,
)
from meshserve.parallel.strategy import ParallelStrategy, StrategyError, is_power_of_two

_TOKEN_RE = re.compile(r"^(attn|moe|shared)=(.+)$|^(domains|relay)=(\d+)$|^disagg$")
_TERM_RE = re.compile(r"^(TP|DP|EP)(\d+)$")


@dataclasses.dataclass(frozen=True)
class DisaggLayout:
    attention_ranks: int  # one attention DP group (MLA at TP1) per rank
    expert_ranks: int  # ranks of the routed experts
    shared_ranks: int = 0  # ranks of the shared experts (0: each attention rank computes its tokens' shared expert)
    expert_tp: int = 1  # MoE TP among the routed expert ranks (shards each expert's intermediate dimension)
    domains: int = 1  # DP domains: groups of attention ranks that take turns on the expert ranks
    relay: int = 1  # expert ranks behind one relay (two-stage routing); 1: direct

    def __post_init__(self) -> None:
        for name in ("attention_ranks", "expert_ranks", "expert_tp", "domains", "relay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StrategyError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.shared_ranks, bool) or not isinstance(self.shared_ranks, int) or self.shared_ranks < 0:
            raise StrategyError(f"shared=EP{self.shared_ranks!r} must count zero or more shared-expert ranks")
        if not is_power_of_two(self.expert_tp):
            raise StrategyError(f"moe=TP{self.expert_tp} must be a power of two")
        if self.expert_ranks % self.expert_tp:
            raise StrategyError(f"moe=TP{self.expert_tp} must divide the {self.expert_ranks} expert ranks")
        if self.attention_ranks % self.domains:
            raise StrategyError(f"domains={self.domains} must divide the {self.attention_ranks} attention ranks "
                                "(each domain holds as many)")
        if self.expert_ranks % self.relay:
            raise StrategyError(f"relay={self.relay} must divide the {self.expert_ranks} expert ranks (a relay "
                                "serves that many)")

    @property
    def devices(self) -> int:
        return self.attention_ranks + self.expert_ranks + self.shared_ranks

    @property
    def expert_ep(self) -> int:
        """EP degree of the routed experts: the expert ranks over the MoE TP."""
        return self.expert_ranks // self.expert_tp

    def __str__(self) -> str:
        moe = f"TP{self.expert_tp}+EP{self.expert_ep}" if self.expert_tp > 1 else f"EP{self.expert_ranks}"
        shared = f" shared=EP{self.shared_ranks}" if self.shared_ranks else ""
        domains = f" domains={self.domains}" if self.domains > 1 else ""
        relay = f" relay={self.relay}" if self.relay > 1 else ""
        return f"attn=DP{self.attention_ranks} moe={moe}{shared} disagg{domains}{relay}"

    def check_model(self, num_experts: int, intermediate_size: int) -> None:
        """StrategyError naming the setting when the expert ranks cannot host every expert of the model (each
        EP rank holds at least one; an uneven split gives each ceil(E/EP) slots), or their MoE TP does not
        divide its FFN."""
        if self.expert_ep > num_experts:
            raise StrategyError(f"moe=EP{self.expert_ep}: more expert ranks than the model's {num_experts} routed "
                                "experts (each EP rank holds at least one)")
        if intermediate_size % self.expert_tp:
            raise StrategyError(f"moe=TP{self.expert_tp} does not divide the experts' intermediate size "
                                f"{intermediate_size}")


def check_model_dir(layout: DisaggLayout, model_dir: str) -> None:
    """`layout.check_model` for the model in `model_dir` (its config.json); StrategyError for a model without
    routed experts."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # the model's load reports what is wrong with its files
    num_experts = config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts")
    if not num_experts or "moe_intermediate_size" not in config:
        raise StrategyError(f"{layout}: {config.get('model_type')!r} models have no routed experts to put on expert "
                            "ranks")
    layout.check_model(int(num_experts), int(config["moe_intermediate_size"]))
    if layout.shared_ranks and not config.get("n_shared_experts"):
        raise StrategyError(f"shared=EP{layout.shared_ranks}: {config.get('model_type')!r} models have no shared "
                            "experts to put on ranks of their own")


def parse_disagg(text: str) -> DisaggLayout:
    """`attn=DPa moe=[TPt+]EPe [shared=EPs] disagg [domains=D] [relay=R]`; StrategyError naming the bad part."""
    if not isinstance(text, str) or "disagg" not in text.split():
        raise StrategyError(f"{text!r} is not a disaggregated layout: it lacks the word 'disagg'")
    fields: dict[str, int] = {}
    for token in text.split():
        match = _TOKEN_RE.match(token)
        if not match:
            raise StrategyError(f"bad part {token!r}; expected attn=DPa, moe=EPe, shared=EPs, disagg, domains=D "
                                "or relay=R")
        if token == "disagg":
            continue
        if match.group(3):
            fields[match.group(3)] = int(match.group(4))
            continue
        block, body = match.group(1), match.group(2)
        for term in body.split("+"):
            degree = _TERM_RE.match(term)
            if not degree:
                raise StrategyError(f"bad term {term!r} in {token!r}")
            key = {("attn", "DP"): "attention_ranks", ("moe", "EP"): "expert_ep", ("moe", "TP"): "expert_tp",
                   ("shared", "EP"): "shared_ranks"}.get((block, degree.group(1)))
            if key is None:
                raise StrategyError(f"{degree.group(1)} is not allowed in the {block} block of a disaggregated "
                                    "layout (attention runs at TP1: attn=DPa)")
            fields[key] = int(degree.group(2))
    for block, key in (("attn=DPa", "attention_ranks"), ("moe=EPe", "expert_ep")):
        if key not in fields:
            raise StrategyError(f"{text!r} lacks {block}")
    expert_tp = fields.pop("expert_tp", 1)
    return DisaggLayout(expert_ranks=fields.pop("expert_ep") * expert_tp, expert_tp=expert_tp, **fields)


@dataclasses.dataclass(frozen=True)
class DisaggEstimate:
    layout: DisaggLayout
    fits_memory: bool
    attention_memory_bytes: float  # per attention rank
    expert_memory_bytes: float  # per routed expert rank
    attention_ms: float  # per layer, one domain's attention ranks (A)
    transfer_ms: float  # per layer and direction (C)
    expert_ms: float  # per layer and domain, on the expert ranks (E)
    layer_ms: float  # max(A + 2C + E, D * E)
    itl_ms: float  # one decode step of the whole batch
    tokens_per_s_per_device: float
    experts_bound: bool  # the expert ranks set the pace (D * E is the larger)


def estimate_disagg(model: ModelSpec, layout: DisaggLayout, cluster: Cluster, workload: Workload) -> DisaggEstimate:
    """Decode of `workload.batch` requests on `layout` (see the module's docstring)."""
    if layout.shared_ranks and not model.psi_shared:
        raise StrategyError(f"shared=EP{layout.shared_ranks}: {model.name} has no shared experts")
    b, layers = workload.batch, model.num_layers
    tokens_per_rank = math.ceil(b / layout.attention_ranks)
    tokens_per_domain = math.ceil(b / layout.domains)
    shared_params = model.psi_shared / layers
    attn_params = model.psi_attn / layers - (shared_params if layout.shared_ranks else 0.0)
    attention = compute_latency_eq4(attn_params, tokens_per_rank, 1, cluster.flops)
    active_expert_params = model.psi_moe / layers * model.top_k / model.num_experts
    expert = compute_latency_eq4(active_expert_params, tokens_per_domain, layout.expert_ranks, cluster.flops)
    if layout.shared_ranks:
        expert = max(expert, compute_latency_eq4(shared_params, tokens_per_domain, layout.shared_ranks, cluster.flops))
    transfer = _transfer_s(model, layout, cluster, tokens_per_rank, tokens_per_domain)
    layer = max(attention + 2 * transfer + expert, layout.domains * expert)
    itl = layers * layer
    kv = kv_cache_bytes(model, tokens_per_rank, workload.input_len + workload.output_len)
    attention_memory = (model.psi_attn - (model.psi_shared if layout.shared_ranks else 0)) * model.weight_bytes + kv
    expert_memory = model.psi_moe * model.weight_bytes / layout.expert_ranks
    fits = max(attention_memory, expert_memory) < cluster.device_memory_bytes
    return DisaggEstimate(layout, fits, attention_memory, expert_memory, 1e3 * attention, 1e3 * transfer,
                          1e3 * expert, 1e3 * layer, 1e3 * itl, b / itl / layout.devices,
                          layout.domains * expert > attention + 2 * transfer + expert)


def _transfer_s(model: ModelSpec, layout: DisaggLayout, cluster: Cluster, tokens_per_rank: int,
                tokens_per_domain: int) -> float:
    """One direction of A2E or E2A in one layer, priced as the analyzer prices an all-to-all (a latency per
    peer, then the bytes): the busier end, an attention rank sending or an expert rank (or relay) receiving
    from its domain's attention ranks, over the link spanning the roles. A token goes once to each destination
    its experts are on, plus once to the shared-expert ranks. Two-stage: the destinations are the relays, and
    each relay forwards within its node (a second hop over the node's link)."""
    destinations = layout.expert_ranks // layout.relay
    rows_per_token = min(model.top_k, destinations) + (1 if layout.shared_ranks else 0)
    row_bytes = model.hidden_size * ACTIVATION_BYTES
    peers = destinations + layout.shared_ranks
    send = tokens_per_rank * rows_per_token * row_bytes  # one attention rank's rows
    receive = tokens_per_domain * rows_per_token * row_bytes / peers  # one destination's
    link = cluster.link_for_span(layout.devices)
    senders = layout.attention_ranks // layout.domains
    first = max(peers * link.latency + send / link.bandwidth, senders * link.latency + receive / link.bandwidth)
    if layout.relay == 1:
        return first
    node = cluster.link_for_span(layout.relay)
    forwarded = receive * min(model.top_k, layout.relay)  # at most once to each rank of the node
    return first + (layout.relay - 1) * node.latency + forwarded / node.bandwidth


def compare(model: ModelSpec, layout: DisaggLayout, cluster: Cluster, workload: Workload) -> dict:
    """The layout's estimate beside the colocated DP=EP layout on as many devices (`attn=TP1+DPn
    moe=TP1+EPn`, n = its devices), with the ratio of tokens/s per device."""
    dis = estimate_disagg(model, layout, cluster, workload)
    n = layout.devices
    colocated = estimate(model, ParallelStrategy(attn_dp=n, moe_ep=n), cluster, workload)
    colocated_rate = workload.batch / (colocated.itl_s * n) if colocated.fits_memory else 0.0
    return {"disaggregated": dis, "colocated": colocated, "colocated_tokens_per_s_per_device": colocated_rate,
            "ratio": dis.tokens_per_s_per_device / colocated_rate if colocated_rate else math.inf}
