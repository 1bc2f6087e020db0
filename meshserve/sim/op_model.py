"""A step's time built from op-level hardware figures (meshserve/sim/hardware.py) and a model's shape: the
simulator's model of time where no step was ever measured (a SuperPod, an H800 cluster).

Per decoder layer of an MLA model (DeepSeek-V3/R1, Kimi-K2), every DP group (attention TP devices each):
- attention GEMMs (MLA prolog, the absorbed up-projections, o_proj) over the step's rows: the slower of their
  FLOPs at the GEMM rate of the weight format and their weights read at the HBM rate. Under attention TP the down
  projections are whole on every device and the heads' weights split; an all-reduce over the TP devices follows.
  A shared o_proj (`oproj=TPk`, attention TP1) reads 1/k of its weights and adds its two all-to-alls;
- attention proper: absorbed MLA over each decode row's context (the compressed KV read once per request, QK and
  PV in the latent space; under TP every device reads the whole latent and computes its heads), prompt tokens
  over their (token, attended token) pairs;
- a dense FFN (the first layers, split like attention) or MoE: dispatch and combine (`dispatch`, `combine` by EP
  degree, scaled by the rows each device of the busiest group sends), the experts of the busiest expert device
  (its tokens: every group's rows times top-k plus the shared experts, over the EP groups, times the EPLB
  imbalance; MoE TP splits each expert's weights and gathers and reduces the tokens over its TP devices), or
  A2E / E2A when attention and experts are disaggregated.

A step waits for its slowest DP group at every dispatch (lockstep). With two microbatches the attention stream of
one overlaps the MoE stream of the other; colocated, each stream has its share of a device's compute
(`microbatch_compute_share`), disaggregated each kind of device runs its own stream. The second microbatch's MoE of
the last layer is not overlapped. MTP: a step that drafts runs the MTP layer once per draft (one row per request)
and its LM head. Every step adds the LM head (BF16) over the rows it samples (decode and draft rows, a prompt's
last row) and the host's gap between steps.

A simulation may run fewer DP groups than the deployment has: each then stands for `dp / groups` of them in the
experts' load (the workload is the same on every group).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from meshserve.moe.balance import device_loads
from meshserve.moe.eplb import plan_all_slots
from meshserve.moe.synthetic_load import synthetic_load
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.sim.hardware import LINK_OPS, Hardware, HardwareError
from meshserve.sim.profile import GroupWork

WEIGHT_FORMATS = {"int8": (1.0, "gemm_int8_tflops"), "bf16": (2.0, "gemm_bf16_tflops")}
HEAD_BYTES = 2.0  # the LM head is priced in BF16: the INT8 figures are the decoder's linear layers
ACTIVATION_BYTES = 2.0  # BF16 rows between devices (TP collectives)


def gemm_seconds(params: float, rows: float, flops: float, weight_bytes: float, hbm: float) -> float:
    """A GEMM of `params` weights over `rows` tokens on one device: the slower of its FLOPs at `flops` per second
    and its weights (`weight_bytes` each) read at `hbm` bytes per second; nothing when no row goes through it."""
    if rows <= 0:
        return 0.0
    return max(2.0 * params * rows / flops, params * weight_bytes / hbm)


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
        return self.down_projection_params + self.head_params + self.oproj_params

    @property
    def down_projection_params(self) -> int:
        """q and kv down projections: whole on every attention TP device."""
        return self.hidden * self.q_lora + self.hidden * (self.kv_lora + self.rope)

    @property
    def head_params(self) -> int:
        """q up-projection and the absorbed kv up-projections: split by head under attention TP."""
        n = self.heads
        return self.q_lora * n * (self.nope + self.rope) + self.kv_lora * n * (self.nope + self.v_dim)

    @property
    def oproj_params(self) -> int:
        return self.heads * self.v_dim * self.hidden

    @property
    def kv_width(self) -> int:  # compressed KV per token and layer: the latent and the rotary key
        return self.kv_lora + self.rope

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_inter


@dataclass(frozen=True)
class Deployment:
    """How a decode (or colocated) TE is laid out on the devices."""

    dp: int  # attention DP groups, `attn_tp` devices each
    expert_dies: int  # EP groups holding routed experts, `moe_tp` devices each (colocated: the attention devices)
    routed_slots_per_die: int = 1  # routed expert slots per expert device (primaries + redundant copies)
    shared_dies: int = 0  # devices holding the shared experts' copies (0: every expert device computes them)
    disagg: bool = False  # attention and experts on separate devices (A2E / E2A)
    domains: int = 1  # disaggregated: DP domains the expert devices serve in turn
    microbatches: int = 1
    weight_format: str = "int8"
    kv_bytes: float = 2.0  # per element of the compressed KV cache
    expert_imbalance: float = 1.0  # busiest expert device's tokens / the mean (1: perfect EPLB)
    attn_tp: int = 1  # devices per DP group, heads split among them
    moe_tp: int = 1  # devices per EP group, each expert's weights split among them
    oproj_tp: int = 1  # attention TP1 devices sharing each layer's o_proj (xDeepServe Fig. 10)

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise HardwareError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weight_format!r}")
        if self.microbatches not in (1, 2):
            raise HardwareError(f"microbatches must be 1 or 2, got {self.microbatches}")
        if min(self.dp, self.expert_dies, self.routed_slots_per_die, self.domains) < 1 or self.shared_dies < 0:
            raise HardwareError("a deployment needs at least one DP group, expert device, slot and domain")
        if not self.expert_imbalance >= 1.0:
            raise HardwareError(f"expert imbalance is busiest / mean >= 1, got {self.expert_imbalance}")
        if min(self.attn_tp, self.moe_tp, self.oproj_tp) < 1:
            raise HardwareError("tensor-parallel degrees are 1 or more")
        if self.oproj_tp > 1 and self.attn_tp > 1:
            raise HardwareError("a shared o_proj (oproj=TPk) needs attention at TP1")
        if self.disagg and (self.attn_tp > 1 or self.moe_tp > 1):
            raise HardwareError("the op model times disaggregated attention and experts without TP")
        if not self.disagg and self.dp * self.attn_tp != self.ep * self.moe_tp:
            raise HardwareError(f"colocated attention ({self.dp} DP x TP{self.attn_tp}) and experts "
                                f"({self.ep} EP x TP{self.moe_tp}) must span the same devices")

    @property
    def devices(self) -> int:
        return self.dp * self.attn_tp + (self.expert_dies + self.shared_dies if self.disagg else 0)

    @property
    def tensor_parallel(self) -> bool:
        return max(self.attn_tp, self.moe_tp, self.oproj_tp) > 1

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
        dp, experts, shared, domains = strategy.attn_dp, strategy.moe_ep - strategy.shared_ep, strategy.shared_ep, 1
    if redundant < 0:
        raise HardwareError(f"redundant experts must be zero or more, got {redundant}")
    tp = {} if strategy.disagg else {"attn_tp": strategy.attn_tp, "moe_tp": strategy.moe_tp,
                                     "oproj_tp": strategy.oproj_tp}
    return Deployment(dp=dp, expert_dies=experts, routed_slots_per_die=-(-(num_experts + redundant) // experts),
                      shared_dies=shared, disagg=strategy.disagg, domains=domains, microbatches=microbatches,
                      weight_format=weight_format, expert_imbalance=expert_imbalance, **tp)


class OpStepModel:
    """The time of a TE's step from its DP groups' work (`GroupWork`), op by op."""

    def __init__(self, config: Mapping, hardware: Hardware, deployment: Deployment, delivery_ms: float = 0.0) -> None:
        self.shape = MLAShape.from_config(config)
        self.hw, self.deployment = hardware, deployment
        hardware.check_devices(deployment.devices)
        for op in ("a2e_us", "e2a_us") if deployment.disagg else ():
            hardware.value(op)  # a profile without them is refused now, not at the first step
        for op in ("devices_per_node", *LINK_OPS) if deployment.tensor_parallel else ():
            hardware.value(op)
        self.name = f"{hardware.name} op model"
        self.delivery_ms = delivery_ms
        self.weight_bytes, rate_op = WEIGHT_FORMATS[deployment.weight_format]
        self.gemm_flops = 1e12 * hardware.value(rate_op)
        self.attn_flops = 1e12 * hardware.value("attention_tflops")
        self.hbm = 1e9 * hardware.value("hbm_read_gbps")
        self.mb_share = hardware.value("microbatch_compute_share")

    def with_expert_imbalance(self, imbalance: float) -> OpStepModel:
        """The same model with another busiest-over-mean expert load (a live EPLB move's new placement)."""
        model = copy.copy(self)
        model.deployment = dataclasses.replace(self.deployment, expert_imbalance=imbalance)
        return model

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
        moe = self._moe_comm(rows, global_rows) + self._experts(global_rows, moe_share)
        moe_layers = s.layers - s.dense_layers
        parts = dict.fromkeys(("attention", "moe", "overlapped_layers"), 0.0)
        parts["attention"] = s.dense_layers * dense_attention
        if mbs == 2:  # each stream runs both microbatches: the slower stream sets the layer
            parts["overlapped_layers"] = moe_layers * max(attention, moe) + moe / 2  # + the last layer's second MoE
        else:
            parts["attention"] += moe_layers * attention
            parts["moe"] = moe_layers * moe
        dense_ffn = self._gemm(s.hidden * s.dense_inter * 3 / d.attn_tp, rows, 1.0) + self._tp_all_reduce(rows)
        parts["dense_ffn"] = s.dense_layers * dense_ffn
        parts["mtp"] = self._mtp(busiest, groups)
        parts["lm_head"] = self._head(max(w.sampled_rows for w in groups))
        parts["host"] = 1e-3 * self.hw.value("step_overhead_ms")
        return parts

    def kv_pull_seconds(self, tokens: int) -> float:
        """A P/D pull of `tokens` tokens' compressed KV over one device's link."""
        return tokens * self.kv_bytes_per_token() / self.kv_link_bytes_per_s()

    def kv_bytes_per_token(self) -> float:
        """One token's compressed KV over every layer, on a device of its DP group."""
        return self.shape.layers * self.shape.kv_width * self.deployment.kv_bytes

    def kv_link_bytes_per_s(self) -> float:
        """One device's KV link (P/D transfers and the memory pool)."""
        return 1e9 * self.hw.value("kv_link_gbps")

    # ------------------------------------------------------------ ops
    def _global(self, rows: int, groups: Sequence[GroupWork]) -> float:
        """Every DP group's rows: a simulation of fewer groups than the deployment has stands each simulated group
        for `dp / len(groups)` of them (a symmetric workload)."""
        return rows * self.deployment.dp / len(groups)

    def _gemm(self, params: int, rows: float, share: float) -> float:
        """A GEMM of `params` weights over `rows` tokens: compute- or weight-read-bound."""
        return gemm_seconds(params, rows, self.gemm_flops * share, self.weight_bytes, self.hbm)

    def _attention(self, work: GroupWork, share: float) -> float:
        """One layer's attention path for one DP group."""
        s = self.shape
        if work.rows == 0:
            return 0.0
        tp = self.deployment.attn_tp  # every TP device runs the down projections and its share of the heads
        gemms = (self._gemm(s.down_projection_params, work.rows, share)
                 + self._gemm(s.head_params / tp, work.rows, share) + self._oproj(work.rows, share))
        rows_per_request = work.rows_per_decode_request
        # absorbed decode: each query row scores the latent+rope keys and sums the latent values, per head
        decode_flops = 2.0 * s.heads * (s.kv_width + s.kv_lora) * work.context_tokens * rows_per_request
        # a prompt token: its (token, attended token) pairs with the full head dims
        prefill_flops = 2.0 * s.heads * (s.nope + s.rope + s.v_dim) * work.prefill_pairs
        kv_read = (work.context_tokens + work.prefill_tokens) * s.kv_width * self.deployment.kv_bytes
        # under attention TP each device computes its heads over the whole latent KV (replicated)
        core = max((decode_flops + prefill_flops) / tp / (self.attn_flops * share), kv_read / self.hbm)
        return gemms + core + self._tp_all_reduce(work.rows)

    def _oproj(self, rows: int, share: float) -> float:
        """o_proj: split by head under attention TP; shared over `oproj_tp` TP1 devices, each projecting all their
        rows with 1/k of its columns (the same FLOPs, 1/k of the weights read) between two all-to-alls (the heads'
        outputs out, the partial sums back)."""
        s, d = self.shape, self.deployment
        k = d.oproj_tp
        if k == 1:
            return self._gemm(s.oproj_params / d.attn_tp, rows, share)
        compute = max(2.0 * s.oproj_params * rows / (self.gemm_flops * share),
                      s.oproj_params / k * self.weight_bytes / self.hbm)
        link = self.hw.link(k)
        heads_out = rows * s.heads * s.v_dim * ACTIVATION_BYTES
        return compute + link.ring_seconds(heads_out, k) + link.ring_seconds(k * rows * s.hidden * ACTIVATION_BYTES, k)

    def _tp_all_reduce(self, rows: int) -> float:
        """The all-reduce of a layer's output rows over the attention TP devices."""
        tp = self.deployment.attn_tp
        if tp == 1:  # no link asked of the profile: a TP1 layout needs none
            return 0.0
        return self.hw.link(tp).ring_seconds(rows * self.shape.hidden * ACTIVATION_BYTES, tp, passes=2)

    def _moe_comm(self, rows: int, global_rows: float) -> float:
        """Dispatch + combine of the rows each device of the busiest group sends (its TP devices split them; A2E +
        E2A when disaggregated); under MoE TP, each EP group's devices gather the tokens it received and
        reduce-scatter their partial outputs (without EP: every group's rows, on every device)."""
        d, s = self.deployment, self.shape
        if d.disagg:
            return self.hw.value("a2e_us").seconds(1, rows) + self.hw.value("e2a_us").seconds(1, rows)
        seconds = 0.0
        if d.ep > 1:
            sent = rows / d.attn_tp
            seconds += self.hw.value("dispatch").seconds(d.ep, sent) + self.hw.value("combine").seconds(d.ep, sent)
        if d.moe_tp > 1:
            # a token goes once to each EP group holding one of its experts (at most top-k of them)
            received = global_rows * min(s.top_k, d.ep) / d.ep * d.expert_imbalance
            seconds += self.hw.link(d.moe_tp).ring_seconds(received * s.hidden * ACTIVATION_BYTES, d.moe_tp, passes=2)
        return seconds

    def _experts(self, global_rows: int, share: float) -> float:
        """The busiest expert device's experts for one layer (MoE TP: 1/moe_tp of each expert's weights)."""
        s, d = self.shape, self.deployment
        if global_rows == 0:
            return 0.0
        if d.shared_dies:  # shared experts on their own devices: each copy takes its share of every token
            routed = global_rows * s.top_k / d.expert_dies * d.expert_imbalance
            shared = global_rows * s.shared / d.shared_dies
            tokens, slots = max(routed, shared), d.routed_slots_per_die
        else:  # the shared experts visited by every token, spread over the EP groups like the routed ones
            tokens = global_rows * (s.top_k * d.expert_imbalance + s.shared) / d.expert_dies
            slots = d.routed_slots_per_die + s.shared
        params = s.expert_params / d.moe_tp
        serial = d.domains if d.disagg else 1  # a disaggregated expert device serves each domain in turn
        per_domain = self._gemm(params, tokens / serial, share) if tokens else 0.0
        return serial * max(per_domain, slots * params * self.weight_bytes / self.hbm / serial)

    def _mtp(self, busiest: GroupWork, groups: Sequence[GroupWork]) -> float:
        """The MTP layer's drafts: one MoE layer and an LM head per draft, one row per decode request."""
        if not busiest.draft_rows or not self.shape.mtp_layers:
            return 0.0
        drafts = max(1, round(busiest.draft_rows / max(1, busiest.decode_rows)))
        requests = max(w.decode_rows for w in groups)
        draft_work = GroupWork(decode_rows=requests, context_tokens=busiest.context_tokens)
        global_requests = self._global(sum(w.decode_rows for w in groups), groups)
        layer = (self._attention(draft_work, 1.0) + self._moe_comm(requests, global_requests)
                 + self._experts(global_requests, 1.0))
        return drafts * (layer + self._head(requests))

    def _head(self, rows: int) -> float:
        """The LM head over `rows` sampled rows, its vocabulary split over the attention TP devices (none: the
        step samples nothing, and the engine skips the head)."""
        s = self.shape
        params = s.vocab * s.hidden / self.deployment.attn_tp
        return gemm_seconds(params, rows, 1e12 * self.hw.value("gemm_bf16_tflops"), HEAD_BYTES, self.hbm)


def expert_imbalance(num_experts: int, expert_dies: int, redundant: int, top_k: int, *, hot_ratio: float = 30.0,
                     tokens: int = 16384, seed: int = 0) -> float:
    """The busiest expert device's tokens over the mean under meshserve's EPLB planner (`plan_all_slots`: every
    expert and `redundant` replicas placed on `expert_dies` devices) for a seeded Zipf expert load whose hottest
    expert takes `hot_ratio` times the mean (`synthetic_load`; xdeepserve Fig. 11a: about 30)."""
    return _imbalance(num_experts, expert_dies, redundant, top_k, hot_ratio, tokens, seed)


def recorded_imbalance(counts_per_layer: Sequence[Sequence[Sequence[int]]], expert_dies: int, redundant: int) -> float:
    """The busiest expert device's tokens over the mean under meshserve's EPLB planner for a recorded load
    (`meshserve eplb record`: counts[slice][expert] of each MoE layer), each layer placed on its own counts and the
    ratio averaged over the layers and slices."""
    if redundant < 0:
        raise HardwareError(f"redundant experts must be zero or more, got {redundant}")
    ratios = []
    for layer_counts in counts_per_layer:
        counts = np.asarray(layer_counts, dtype=np.float64)
        slots_per_die = -(-(counts.shape[1] + redundant) // expert_dies)
        placement = plan_all_slots(counts, expert_dies, slots_per_die, redundant)
        loads = device_loads(placement, counts, expert_dies)
        busy = loads.mean(axis=1) > 0
        ratios += list(loads.max(axis=1)[busy] / loads.mean(axis=1)[busy])
    if not ratios:
        raise HardwareError("the recorded expert load has no tokens")
    return float(np.mean(ratios))


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
