"""A step's time built from op-level hardware figures (meshserve/sim/hardware.py) and a model's shape: the
simulator's model of time where no step was ever measured (a SuperPod, an H800 cluster).

Per decoder layer of an MLA model (DeepSeek-V3/R1, Kimi-K2), every DP group (one device, attention TP1):
- attention GEMMs (MLA prolog, the absorbed up-projections, o_proj) over the step's rows: the slower of their
  FLOPs at the GEMM rate of the weight format and their weights read at the HBM rate;
- attention proper: absorbed MLA over each decode row's context (the compressed KV read once per request, QK and
  PV in the latent space), prompt tokens over their (token, attended token) pairs;
- a dense FFN (the first layers) or MoE: dispatch and combine (`dispatch`, `combine` by EP degree, scaled by the
  rows the busiest group sends), the experts of the busiest expert device (its tokens: every group's rows times
  top-k plus the shared experts, over the expert devices, times the EPLB imbalance), or A2E / E2A when attention
  and experts are disaggregated.

A step waits for its slowest DP group at every dispatch (lockstep). With two microbatches the attention stream of
one overlaps the MoE stream of the other; colocated, each stream has its share of a device's compute
(`microbatch_compute_share`), disaggregated each kind of device runs its own stream. The second microbatch's MoE of
the last layer is not overlapped. MTP: a step that drafts runs the MTP layer once per draft (one row per request)
and its LM head. Every step adds the LM head (BF16) and the host's gap between steps.

A simulation may run fewer DP groups than the deployment has: each then stands for `dp / groups` of them in the
experts' load (the workload is the same on every group).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from meshserve.moe.balance import device_loads
from meshserve.moe.eplb import plan_all_slots
from meshserve.moe.synthetic_load import synthetic_load
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.sim.hardware import Hardware, HardwareError
from meshserve.sim.profile import GroupWork

WEIGHT_FORMATS = {"int8": (1.0, "gemm_int8_tflops"), "bf16": (2.0, "gemm_bf16_tflops")}
HEAD_BYTES = 2.0  # the LM head is priced in BF16: the INT8 figures are the decoder's linear layers


@dataclass(frozen=True)
class MLAShape:
    """What the op model needs of an MLA model's config.json."""

    hidden: int
    layers: int
    dense_layers: int
    heads: int
    q_lora: int
    kv_lora: int
    rope: int
    nope: int
    v_dim: int
    experts: int
    top_k: int
    shared: int
    moe_inter: int
    dense_inter: int
    vocab: int
    mtp_layers: int

    @classmethod
    def from_config(cls, config: Mapping) -> MLAShape:
        if config.get("model_type") not in ("deepseek_v3", "kimi_k2"):
            raise HardwareError(f"the op model times MLA models (deepseek_v3, kimi_k2), not "
                                f"{config.get('model_type')!r}")
        keys = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                "q_lora": "q_lora_rank", "kv_lora": "kv_lora_rank", "rope": "qk_rope_head_dim",
                "nope": "qk_nope_head_dim", "v_dim": "v_head_dim", "experts": "n_routed_experts",
                "top_k": "num_experts_per_tok", "moe_inter": "moe_intermediate_size",
                "dense_inter": "intermediate_size", "vocab": "vocab_size"}
        missing = [key for key in keys.values() if not config.get(key)]
        if missing:
            raise HardwareError(f"model config lacks {', '.join(missing)}")
        return cls(dense_layers=int(config.get("first_k_dense_replace", 0)),
                   shared=int(config.get("n_shared_experts") or 0),
                   mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
                   **{field: int(config[key]) for field, key in keys.items()})

    @property
    def attention_params(self) -> int:
        """One layer's attention weights: q down/up, kv down, kv up (W_UK, W_UV: absorbed), o_proj."""
        h, n = self.hidden, self.heads
        return (h * self.q_lora + self.q_lora * n * (self.nope + self.rope) + h * (self.kv_lora + self.rope)
                + self.kv_lora * n * (self.nope + self.v_dim) + n * self.v_dim * h)

    @property
    def kv_width(self) -> int:  # compressed KV per token and layer: the latent and the rotary key
        return self.kv_lora + self.rope

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_inter


@dataclass(frozen=True)
class Deployment:
    """How a decode (or colocated) TE is laid out on the devices."""

    dp: int  # attention DP groups, one device each (TP1)
    expert_dies: int  # devices holding routed experts (colocated: the same devices as attention)
    routed_slots_per_die: int = 1  # routed expert slots per expert device (primaries + redundant copies)
    shared_dies: int = 0  # devices holding the shared experts' copies (0: every expert device computes them)
    disagg: bool = False  # attention and experts on separate devices (A2E / E2A)
    domains: int = 1  # disaggregated: DP domains the expert devices serve in turn
    microbatches: int = 1
    weight_format: str = "int8"
    kv_bytes: float = 2.0  # per element of the compressed KV cache
    expert_imbalance: float = 1.0  # busiest expert device's tokens / the mean (1: perfect EPLB)

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise HardwareError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weight_format!r}")
        if self.microbatches not in (1, 2):
            raise HardwareError(f"microbatches must be 1 or 2, got {self.microbatches}")
        if min(self.dp, self.expert_dies, self.routed_slots_per_die, self.domains) < 1 or self.shared_dies < 0:
            raise HardwareError("a deployment needs at least one DP group, expert device, slot and domain")
        if not self.expert_imbalance >= 1.0:
            raise HardwareError(f"expert imbalance is busiest / mean >= 1, got {self.expert_imbalance}")

    @property
    def devices(self) -> int:
        return self.dp + (self.expert_dies + self.shared_dies if self.disagg else 0)

    @property
    def ep(self) -> int:
        return self.expert_dies + self.shared_dies


def deployment_of(strategy: ParallelStrategy, num_experts: int, *, redundant: int = 0, microbatches: int = 1,
                  weight_format: str = "int8", expert_imbalance: float = 1.0) -> Deployment:
    """The deployment a TE's layout (`--parallel`, meshserve's grammar) makes, with `redundant` routed-expert
    replicas over its expert devices."""
    if strategy.disagg:
        layout = strategy.disagg_layout()
        if layout.expert_tp != 1:
            raise HardwareError("the op model times expert devices without MoE TP")
        dp, experts, shared, domains = layout.attention_ranks, layout.expert_ranks, layout.shared_ranks, layout.domains
    else:
        if strategy.attn_tp != 1 or strategy.moe_tp != 1:
            raise HardwareError("the op model times attention at TP1 (a DP group per device) and MoE without TP")
        dp, experts, shared, domains = strategy.attn_dp, strategy.moe_ep - strategy.shared_ep, strategy.shared_ep, 1
    if redundant < 0:
        raise HardwareError(f"redundant experts must be zero or more, got {redundant}")
    return Deployment(dp=dp, expert_dies=experts, routed_slots_per_die=-(-(num_experts + redundant) // experts),
                      shared_dies=shared, disagg=strategy.disagg, domains=domains, microbatches=microbatches,
                      weight_format=weight_format, expert_imbalance=expert_imbalance)


class OpStepModel:
    """The time of a TE's step from its DP groups' work (`GroupWork`), op by op."""

    def __init__(self, config: Mapping, hardware: Hardware, deployment: Deployment, delivery_ms: float = 0.0) -> None:
        self.shape = MLAShape.from_config(config)
        self.hw, self.deployment = hardware, deployment
        hardware.check_devices(deployment.devices)
        for op in ("a2e_us", "e2a_us") if deployment.disagg else ():
            hardware.value(op)  # a profile without them is refused now, not at the first step
        self.name = f"{hardware.name} op model"
        self.delivery_ms = delivery_ms
        self.weight_bytes, rate_op = WEIGHT_FORMATS[deployment.weight_format]
        self.gemm_flops = 1e12 * hardware.value(rate_op)
        self.attn_flops = 1e12 * hardware.value("attention_tflops")
        self.hbm = 1e9 * hardware.value("hbm_read_gbps")
        self.mb_share = hardware.value("microbatch_compute_share")

    # ------------------------------------------------------------ the step
    def step_seconds(self, groups: Sequence[GroupWork]) -> float:
        return sum(self.breakdown(groups).values())

    def breakdown(self, groups: Sequence[GroupWork]) -> dict[str, float]:
        """Seconds of the step by part: attention and MoE one after the other, the MoE layers whose two
        microbatches overlap them, the dense FFN layers, MTP, LM head, host."""
        s, d = self.shape, self.deployment
        busiest = max(groups, key=lambda w: (self._attention(w, 1.0), w.rows))
        rows = max(w.rows for w in groups)
        global_rows = self._global(sum(w.rows for w in groups), groups)
        mbs = d.microbatches if rows >= d.microbatches else 1
        # colocated microbatches split a device's compute between the streams; disaggregated, attention and
        # experts run on devices of their own
        attn_share, moe_share = self.mb_share if mbs == 2 and not d.disagg else (1.0, 1.0)
        dense_attention = self._attention(busiest, 1.0)
        attention = self._attention(busiest, attn_share)
        moe = self._moe_comm(rows) + self._experts(global_rows, moe_share)
        moe_layers = s.layers - s.dense_layers
        parts = dict.fromkeys(("attention", "moe", "overlapped_layers"), 0.0)
        parts["attention"] = s.dense_layers * dense_attention
        if mbs == 2:  # each stream runs both microbatches: the slower stream sets the layer
            parts["overlapped_layers"] = moe_layers * max(attention, moe) + moe / 2  # + the last layer's second MoE
        else:
            parts["attention"] += moe_layers * attention
            parts["moe"] = moe_layers * moe
        parts["dense_ffn"] = s.dense_layers * self._gemm(s.hidden * s.dense_inter * 3, rows, 1.0)
        parts["mtp"] = self._mtp(busiest, groups)
        parts["lm_head"] = self._head(rows)
        parts["host"] = 1e-3 * self.hw.value("step_overhead_ms")
        return parts

    def kv_pull_seconds(self, tokens: int) -> float:
        """A P/D pull of `tokens` tokens' compressed KV over one device's link."""
        s = self.shape
        return tokens * s.layers * s.kv_width * self.deployment.kv_bytes / (1e9 * self.hw.value("kv_link_gbps"))

    # ------------------------------------------------------------ ops
    def _global(self, rows: int, groups: Sequence[GroupWork]) -> float:
        """Every DP group's rows: a simulation of fewer groups than the deployment has stands each simulated group
        for `dp / len(groups)` of them (a symmetric workload)."""
        return rows * self.deployment.dp / len(groups)

    def _gemm(self, params: int, rows: float, share: float) -> float:
        """A GEMM of `params` weights over `rows` tokens: compute- or weight-read-bound."""
        if rows <= 0:
            return 0.0
        return max(2.0 * params * rows / (self.gemm_flops * share), params * self.weight_bytes / self.hbm)

    def _attention(self, work: GroupWork, share: float) -> float:
        """One layer's attention path for one DP group."""
        s = self.shape
        if work.rows == 0:
            return 0.0
        gemms = self._gemm(s.attention_params, work.rows, share)
        rows_per_request = work.rows_per_decode_request
        # absorbed decode: each query row scores the latent+rope keys and sums the latent values, per head
        decode_flops = 2.0 * s.heads * (s.kv_width + s.kv_lora) * work.context_tokens * rows_per_request
        # a prompt token: its (token, attended token) pairs with the full head dims
        prefill_flops = 2.0 * s.heads * (s.nope + s.rope + s.v_dim) * work.prefill_pairs
        kv_read = (work.context_tokens + work.prefill_tokens) * s.kv_width * self.deployment.kv_bytes
        core = max((decode_flops + prefill_flops) / (self.attn_flops * share), kv_read / self.hbm)
        return gemms + core

    def _moe_comm(self, rows: int) -> float:
        """Dispatch + combine of the busiest group's rows (A2E + E2A when disaggregated)."""
        if self.deployment.disagg:
            return self.hw.value("a2e_us").seconds(1, rows) + self.hw.value("e2a_us").seconds(1, rows)
        ep = self.deployment.ep
        return self.hw.value("dispatch").seconds(ep, rows) + self.hw.value("combine").seconds(ep, rows)

    def _experts(self, global_rows: int, share: float) -> float:
        """The busiest expert device's experts for one layer."""
        s, d = self.shape, self.deployment
        if global_rows == 0:
            return 0.0
        if d.shared_dies:  # shared experts on their own devices: each copy takes its share of every token
            routed = global_rows * s.top_k / d.expert_dies * d.expert_imbalance
            shared = global_rows * s.shared / d.shared_dies
            tokens, slots = max(routed, shared), d.routed_slots_per_die
        else:
            tokens = global_rows * s.top_k / d.expert_dies * d.expert_imbalance + global_rows * s.shared / d.dp
            slots = d.routed_slots_per_die + s.shared
        serial = d.domains if d.disagg else 1  # a disaggregated expert device serves each domain in turn
        per_domain = self._gemm(s.expert_params, tokens / serial, share) if tokens else 0.0
        return serial * max(per_domain, slots * s.expert_params * self.weight_bytes / self.hbm / serial)

    def _mtp(self, busiest: GroupWork, groups: Sequence[GroupWork]) -> float:
        """The MTP layer's drafts: one MoE layer and an LM head per draft, one row per decode request."""
        if not busiest.draft_rows or not self.shape.mtp_layers:
            return 0.0
        drafts = max(1, round(busiest.draft_rows / max(1, busiest.decode_rows)))
        requests = max(w.decode_rows for w in groups)
        draft_work = GroupWork(decode_rows=requests, context_tokens=busiest.context_tokens)
        layer = (self._attention(draft_work, 1.0) + self._moe_comm(requests)
                 + self._experts(self._global(sum(w.decode_rows for w in groups), groups), 1.0))
        return drafts * (layer + self._head(requests))

    def _head(self, rows: int) -> float:
        s = self.shape
        params = s.vocab * s.hidden
        return max(2.0 * params * rows / (1e12 * self.hw.value("gemm_bf16_tflops")), params * HEAD_BYTES / self.hbm)


def expert_imbalance(num_experts: int, expert_dies: int, redundant: int, top_k: int, *, hot_ratio: float = 30.0,
                     tokens: int = 16384, seed: int = 0) -> float:
    """The busiest expert device's tokens over the mean under meshserve's EPLB planner (`plan_all_slots`: every
    expert and `redundant` replicas placed on `expert_dies` devices) for a seeded Zipf expert load whose hottest
    expert takes `hot_ratio` times the mean (`synthetic_load`; xdeepserve Fig. 11a: about 30)."""
    return _imbalance(num_experts, expert_dies, redundant, top_k, hot_ratio, tokens, seed)


@functools.lru_cache(maxsize=64)
def _imbalance(num_experts: int, expert_dies: int, redundant: int, top_k: int, hot_ratio: float, tokens: int,
               seed: int) -> float:
    if redundant < 0:
        raise HardwareError(f"redundant experts must be zero or more, got {redundant}")
    slots_per_die = -(-(num_experts + redundant) // expert_dies)
    record = synthetic_load(num_experts, num_layers=1, num_slices=2, tokens_per_slice=tokens, top_k=top_k,
                            hot_ratio=hot_ratio, seed=seed)
    counts = np.asarray(record.layer_counts(0), dtype=np.float64)
    placement = plan_all_slots(counts, expert_dies, slots_per_die, redundant)
    loads = device_loads(placement, counts, expert_dies)
    return float(np.mean(loads.max(axis=1) / loads.mean(axis=1)))
