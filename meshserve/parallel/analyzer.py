"""Offline strategy analyzer: the MixServe §III-B cost model and an exhaustive search.

Each paper equation is one small function named after it. Times are seconds, sizes
are bytes, compute is FLOP/s. Collectives use an alpha-beta model (latency +
bytes/bandwidth) on the intra-node link when the group fits in one node and on the
inter-node link otherwise. Ranks are laid out TP-innermost, so a TP group of degree
d spans d consecutive devices and a DP/EP group spans the whole world.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from meshserve.parallel.strategy import ParallelStrategy, enumerate_strategies

ACTIVATION_BYTES = 2  # hidden states and KV cache travel and live in bf16


class AnalyzerError(ValueError):
    """Inputs the analyzer cannot model (unknown architecture, bad cluster or workload)."""


# ---------------------------------------------------------------- inputs

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs from a model: parameter counts split as in Eq. 8."""
    name: str
    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    psi_attn: int  # every parameter that is not a routed expert (attention, shared/dense MLP, embeddings)
    psi_moe: int  # routed-expert parameters
    weight_bytes: float  # bytes per stored weight (1 for fp8 checkpoints)
    psi_shared: int = 0  # shared-expert parameters (counted in psi_attn; on their own ranks under shared=EPs)
    # o_proj weights of one decoder layer where it can be shared over ranks (`oproj=TPk`: MLA models); 0: never
    oproj_params: int = 0
    # KV-cache elements per token and layer: MLA's latent and rotary key, GQA's K and V heads; 0: Eq. 8's 2·h
    kv_width: int = 0

    @property
    def total_params(self) -> int:
        return self.psi_attn + self.psi_moe

    @property
    def active_params(self) -> float:
        return self.psi_attn + self.psi_moe * self.top_k / self.num_experts


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s
    latency: float  # s
    # an all-to-all over it pays one latency per peer (pairwise rounds: gloo, MPI) or one for all peers at once
    # (kernels that write to every peer together: DeepEP, CANN EP)
    latency_per_peer: bool = True


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    device_memory_bytes: float
    flops: float  # dense bf16 FLOP/s per device
    intra_bandwidth: float  # bytes/s per device
    inter_bandwidth: float  # bytes/s per device
    intra_latency: float = 5e-6
    inter_latency: float = 15e-6
    # the all-to-all of EP dispatch and combine, measured on the whole world where a calibration did (`meshserve
    # plan calibrate`); None: priced on the link its span crosses, like the other collectives
    a2a_latency: float | None = None
    a2a_bandwidth: float | None = None
    # a device's memory read bandwidth (bytes/s): where set, a layer's compute is the slower of its FLOPs (Eq. 4)
    # and its weights read once (a decode step reads every weight it holds); None: Eq. 4 alone, as in MixServe
    memory_bandwidth: float | None = None
    # EP's dispatch and combine send to every peer at once (one latency a call, not one a peer): see
    # `Link.latency_per_peer`; a shared o_proj's all-to-alls stay pairwise
    a2a_concurrent: bool = False

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node", "device_memory_bytes", "flops",
                     "intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, name) > 0:
                raise AnalyzerError(f"cluster {name} must be positive, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency"):
            if getattr(self, name) < 0:
                raise AnalyzerError(f"cluster {name} must be non-negative, got {getattr(self, name)!r}")
        if (self.a2a_latency is None) != (self.a2a_bandwidth is None):
            raise AnalyzerError("cluster a2a_latency and a2a_bandwidth come together (a measured all-to-all)")
        if self.a2a_bandwidth is not None and not (self.a2a_bandwidth > 0 and self.a2a_latency >= 0):
            raise AnalyzerError("cluster a2a_bandwidth must be positive and a2a_latency non-negative")
        if self.memory_bandwidth is not None and not self.memory_bandwidth > 0:
            raise AnalyzerError(f"cluster memory_bandwidth must be positive, got {self.memory_bandwidth!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def link_for_span(self, span: int) -> Link:
        """The link a group crossing `span` consecutive devices is bound by."""
        if span <= self.devices_per_node:
            return Link(self.intra_bandwidth, self.intra_latency)
        return Link(self.inter_bandwidth, self.inter_latency)

    def ep_link(self, span: int) -> Link:
        """`link_for_span` for EP's dispatch and combine: with `a2a_concurrent`, one latency a call."""
        return dataclasses.replace(self.link_for_span(span), latency_per_peer=not self.a2a_concurrent)

    def a2a_link(self, span: int) -> Link:
        """The link EP's all-to-all over `span` devices is priced on: the measured all-to-all where there is one
        (a dispatch is one call, not d - 1 exchanges of the other collectives' latency), else `ep_link`."""
        if self.a2a_bandwidth is not None:
            return Link(self.a2a_bandwidth, self.a2a_latency, not self.a2a_concurrent)
        return self.ep_link(span)


@dataclasses.dataclass(frozen=True)
class Workload:
    batch: int
    input_len: int
    output_len: int
    arrival_rate: float  # requests/s
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "input_len", "output_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise AnalyzerError(f"workload {name} must be a positive integer, got {value!r}")
        if not self.arrival_rate >= 0:
            raise AnalyzerError(f"arrival rate must be >= 0 requests/s, got {self.arrival_rate!r}")
        for name in ("slo_ttft_s", "slo_itl_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise AnalyzerError(f"{name} must be positive, got {value!r}")


# ---------------------------------------------------------------- model config

def _weight_bytes(config: Mapping[str, Any]) -> float:
    quant = config.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() == "fp8":
        return 1.0
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    sizes = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "float8_e4m3fn": 1.0}
    if dtype not in sizes:
        raise AnalyzerError(f"unsupported weight dtype {dtype!r}")
    return sizes[dtype]


def _require(config: Mapping[str, Any], *keys: str) -> list[int]:
    missing = [k for k in keys if k not in config]
    if missing:
        raise AnalyzerError(f"model config lacks {', '.join(missing)}")
    return [int(config[k]) for k in keys]


def _deepseek_v3_params(c: Mapping[str, Any]) -> tuple[int, int, int, int]:
    h, layers, vocab, heads = _require(c, "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
    kv_lora, nope, rope, v_dim = _require(c, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    experts, top_k, moe_inter, inter = _require(
        c, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size")
    shared = int(c.get("n_shared_experts") or 0)
    first_dense = int(c.get("first_k_dense_replace", 0))
    q_lora = c.get("q_lora_rank")
    if q_lora:  # MLA low-rank query: down-projection, its norm, up-projection
        q_params = h * q_lora + q_lora + q_lora * heads * (nope + rope)
    else:
        q_params = h * heads * (nope + rope)
    kv_params = h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim)
    attn_layer = q_params + kv_params + heads * v_dim * h + 2 * h  # + o_proj + two RMSNorms
    moe_layers = layers - first_dense
    routed = moe_layers * experts * 3 * h * moe_inter
    dense_ffn = first_dense * 3 * h * inter + moe_layers * (shared * 3 * h * moe_inter + experts * h)
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings") else 2) + h
    return layers * attn_layer + dense_ffn + embeddings, routed, experts, top_k


def _qwen3_moe_params(c: Mapping[str, Any]) -> tuple[int, int, int, int]:
    h, layers, vocab, heads, kv_heads = _require(
        c, "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads")
    experts, top_k, moe_inter = _require(c, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    head_dim = int(c.get("head_dim") or h // heads)
    attn_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 2 * head_dim + 2 * h
    step = int(c.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(c.get("mlp_only_layers") or [])
    moe_layer_ids = [i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0]
    dense_layers = layers - len(moe_layer_ids)
    routed = len(moe_layer_ids) * experts * 3 * h * moe_inter
    dense_ffn = dense_layers * 3 * h * int(c.get("intermediate_size", 0)) + len(moe_layer_ids) * experts * h
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings") else 2) + h
    return layers * attn_layer + dense_ffn + embeddings, routed, experts, top_k


_PARAM_COUNTERS = {"deepseek_v3": _deepseek_v3_params, "kimi_k2": _deepseek_v3_params,
                   "qwen3_moe": _qwen3_moe_params}
_MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")  # their o_proj can be shared over ranks (oproj=TPk)


def model_spec_from_config(config: Mapping[str, Any], name: str | None = None) -> ModelSpec:
    """Derive Ψ_attn, Ψ_moe, h, l, experts and top-k from an HF config.json dict."""
    if not isinstance(config, Mapping):
        raise AnalyzerError("model config must be a JSON object")
    model_type = config.get("model_type")
    if model_type not in _PARAM_COUNTERS:
        raise AnalyzerError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_PARAM_COUNTERS))}")
    psi_attn, psi_moe, experts, top_k = _PARAM_COUNTERS[model_type](config)
    if experts < 1 or not 1 <= top_k <= experts:
        raise AnalyzerError(f"bad expert routing: {experts} experts, top-{top_k}")
    oproj = 0
    if model_type in _MLA_MODEL_TYPES:
        oproj = int(config["num_attention_heads"]) * int(config["v_head_dim"]) * int(config["hidden_size"])
        kv_width = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
    else:
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
        kv_width = 2 * int(config["num_key_value_heads"]) * head_dim
    return ModelSpec(name=name or str(model_type), hidden_size=int(config["hidden_size"]),
                     num_layers=int(config["num_hidden_layers"]), num_experts=experts, top_k=top_k,
                     psi_attn=psi_attn, psi_moe=psi_moe, weight_bytes=_weight_bytes(config), oproj_params=oproj,
                     psi_shared=_shared_expert_params(config) if model_type != "qwen3_moe" else 0,
                     kv_width=kv_width)


def _shared_expert_params(c: Mapping[str, Any]) -> int:
    moe_layers = int(c["num_hidden_layers"]) - int(c.get("first_k_dense_replace", 0))
    return moe_layers * int(c.get("n_shared_experts") or 0) * 3 * int(c["hidden_size"]) * int(
        c["moe_intermediate_size"])


# ---------------------------------------------------------------- Eq. 1-3: collectives

def reduce_scatter_time_eq1(size: float, degree: int, link: Link) -> float:
    """Eq. 1: RS(size, d) ∝ size/d, priced as recursive halving does it (Thakur, Rabenseifner and Gropp, "Optimization
    of collective communication operations in MPICH", 2005): log2(d) latencies, and (d-1)/d of the tensor sent per rank.

    Read as one round of size/d, a collective over 32 ranks cost 1/31 of the bytes a rank must send, and wide MoE TP
    ranked first at every world size the simulator checked (docs/simulate.md)."""
    if degree <= 1:
        return 0.0
    return math.ceil(math.log2(degree)) * link.latency + size * (degree - 1) / degree / link.bandwidth


def all_gather_time_eq1(size: float, degree: int, link: Link) -> float:
    """Eq. 1: AG(size, d) = RS(size, d)."""
    return reduce_scatter_time_eq1(size, degree, link)


def allreduce_time(size: float, degree: int, link: Link) -> float:
    """Eq. 2: AR = RS + AG, each moving size/d per rank.

    The paper nests size/degree inside Eq. 1 a second time, which would make an AR
    (size/d²) cheaper than the RS it contains; we keep the RS + AG decomposition
    with each half priced by Eq. 1 on the full tensor.
    """
    return reduce_scatter_time_eq1(size, degree, link) + all_gather_time_eq1(size, degree, link)


def all_to_all_time(size: float, degree: int, link: Link) -> float:
    """Eq. 3: A2A(size, d) ∝ size/d * (d-1): pairwise exchange in d-1 rounds, each paying latency; over a link
    whose all-to-alls reach every peer at once, one latency and the same bytes."""
    if degree <= 1:
        return 0.0
    rounds = degree - 1 if link.latency_per_peer else 1
    return rounds * link.latency + (degree - 1) * size / degree / link.bandwidth


# ---------------------------------------------------------------- Eq. 4-6: per-token service latency

def compute_latency_eq4(params: float, tokens: float, shard_degree: int, flops: float) -> float:
    """Eq. 4: τ ∝ Ψ/(d_TP·d_EP) · (b/d_DP)·s — 2 FLOPs per weight per token on one rank's shard."""
    return 2.0 * params * tokens / (shard_degree * flops)


def communication_latency_eq5(strategy: ParallelStrategy, tokens: int, hidden: int, top_k: int,
                              cluster: Cluster) -> float:
    """Eq. 5 for one decoder layer; `tokens` = b·s for the whole batch.

    2×AR: one after attention (attention TP group) and one after the MoE (MoE TP group).
    2×A2A (dispatch + combine) among d_EP ranks when d_DP >= d_EP, otherwise among
    d_DP ranks carrying b/d_EP tokens (the redundant hidden states are dropped), plus
    an AR over the d_EP/d_DP replicas of each token to sum their experts' outputs.
    """
    dp, ep = strategy.attn_dp, strategy.moe_ep
    hidden_bytes = math.ceil(tokens / dp) * hidden * ACTIVATION_BYTES
    # A MoE TP group serves the tokens of its whole EP shard, not b·s/d_DP: each token once for every shard that
    # holds one of its top-k experts, b·s·min(k, d_EP)/d_EP (b·s/d_EP priced top-8 routing at EP32 8x too cheap)
    moe_group_bytes = math.ceil(tokens * min(top_k, ep) / ep) * hidden * ACTIVATION_BYTES
    ar = (allreduce_time(hidden_bytes, strategy.attn_tp, cluster.link_for_span(strategy.attn_tp))
          + allreduce_time(moe_group_bytes, strategy.moe_tp, cluster.link_for_span(strategy.moe_tp)))
    if dp >= ep:
        a2a = all_to_all_time(hidden_bytes * top_k, ep, cluster.a2a_link(strategy.world_size))
    else:
        routed_bytes = math.ceil(tokens / ep) * hidden * ACTIVATION_BYTES * top_k
        a2a = all_to_all_time(routed_bytes, dp, cluster.a2a_link(strategy.world_size))
        # Not in Eq. 5: the ep/dp ranks that hold the same tokens each computed only their own
        # experts, so their partial MoE outputs must still be summed (with d_DP = 1 Eq. 5 alone
        # would price a 16-way EP layer at zero communication).
        ar += allreduce_time(hidden_bytes, ep // dp, cluster.link_for_span(strategy.world_size))
    return ar + 2 * a2a


def service_latency_eq6(layers: int, tau: float, lam: float, pp: int = 1, p2p: float = 0.0) -> float:
    """Eq. 6: Δt_svc = l(τ + λ) + (d_PP - 1)·P2P."""
    return layers * (tau + lam) + (pp - 1) * p2p


# ---------------------------------------------------------------- Eq. 7: queueing

def mm1_queueing_delay_eq7(arrival_rate: float, service_rate: float) -> float:
    """Eq. 7: W_q = λ_a / (μ(μ - λ_a)); infinite when the queue is unstable (ρ >= 1)."""
    if service_rate <= 0 or arrival_rate >= service_rate:
        return math.inf
    return arrival_rate / (service_rate * (service_rate - arrival_rate))


# ---------------------------------------------------------------- Eq. 8: memory

def kv_cache_bytes_eq8(batch: int, seq_len: int, hidden: int, layers: int, pp: int = 1, width: int = 0) -> float:
    """The 2·b·s·h·l/d_PP term of Eq. 8 (K and V at hidden width, bf16); `width`: the model's KV elements per token
    and layer instead of 2·h (MLA keeps a 576-wide latent where 2·h is 14,336 for DeepSeek-V3)."""
    return batch * seq_len * (width or 2 * hidden) * layers / pp * ACTIVATION_BYTES


def kv_cache_bytes(model: ModelSpec, batch: int, seq_len: int) -> float:
    """Eq. 8's KV term for `model`'s own cache layout."""
    return kv_cache_bytes_eq8(batch, seq_len, model.hidden_size, model.num_layers, width=model.kv_width)


def weight_read_latency(params: float, weight_bytes: float, shard_degree: int, cluster: Cluster) -> float:
    """Reading a rank's shard of `params` weights once (0 where the cluster gives no memory bandwidth)."""
    if cluster.memory_bandwidth is None:
        return 0.0
    return params * weight_bytes / shard_degree / cluster.memory_bandwidth


def memory_per_rank_eq8(psi_attn_bytes: float, psi_moe_bytes: float, kv_bytes: float,
                        strategy: ParallelStrategy, psi_shared_bytes: float = 0.0) -> float:
    """Left side of Eq. 8: Ψ_attn/d_TP + Ψ_moe/(d_EP·d_TP) + KV. With shared-expert ranks (`shared=EPs`, pure EP,
    attention TP1) the shared experts (part of Ψ_attn) live only on those s ranks: the fuller of a routed rank
    (Ψ_moe over EP - s) and a shared one counts."""
    if strategy.shared_ep:
        return (psi_attn_bytes - psi_shared_bytes + max(psi_moe_bytes / strategy.routed_ep, psi_shared_bytes)
                + kv_bytes)
    return psi_attn_bytes / strategy.attn_tp + psi_moe_bytes / (strategy.moe_ep * strategy.moe_tp) + kv_bytes


def fits_memory_eq8(psi_attn_bytes: float, psi_moe_bytes: float, kv_bytes: float,
                    strategy: ParallelStrategy, device_memory: float, psi_shared_bytes: float = 0.0) -> bool:
    """Eq. 8: the per-rank footprint must stay strictly below M."""
    return memory_per_rank_eq8(psi_attn_bytes, psi_moe_bytes, kv_bytes, strategy, psi_shared_bytes) < device_memory


# ---------------------------------------------------------------- Eq. 9-11: indicators

def ttft_eq9(queueing_delay: float, prefill_latency: float) -> float:
    """Eq. 9: TTFT = W_q + Δt_svc|s=L_in."""
    return queueing_delay + prefill_latency


def itl_eq10(decode_latency: float) -> float:
    """Eq. 10: ITL = Δt_svc|s=1."""
    return decode_latency


def throughput_eq11(input_len: int, output_len: int, queueing_delay: float, prefill_latency: float,
                    decode_latency: float) -> float:
    """Eq. 11: Θ = (L_in + L_out) / (W_q + Δt_prf + L_out·Δt_dec), tokens/s of one request."""
    total = queueing_delay + prefill_latency + output_len * decode_latency
    return 0.0 if math.isinf(total) else (input_len + output_len) / total


# ---------------------------------------------------------------- shared o_proj (xDeepServe Fig. 10)

def attention_params_per_rank(model: ModelSpec, strategy: ParallelStrategy) -> float:
    """Ψ_attn a rank stores before the attention TP split: with `oproj=TPk` only 1/k of each layer's o_proj."""
    k = strategy.oproj_tp
    return model.psi_attn - model.num_layers * model.oproj_params * (k - 1) / k


def oproj_comm_time(model: ModelSpec, strategy: ParallelStrategy, tokens_per_dp: int, cluster: Cluster) -> float:
    """The two all-to-alls of a shared o_proj in one layer, among its k consecutive ranks: the heads' outputs
    (b/d_DP tokens x heads·v_head_dim) out, the partial sums (k·b/d_DP tokens x h) back.

    Its compute is not cheaper: a rank projects k DP groups' tokens with 1/k of the columns, the FLOPs of
    its own tokens with all of them, so τ keeps Ψ_attn whole. The gain is weight memory (Eq. 8)."""
    k = strategy.oproj_tp
    if k == 1:
        return 0.0
    link = cluster.link_for_span(k)
    heads_out = tokens_per_dp * model.oproj_params // model.hidden_size * ACTIVATION_BYTES
    partials = k * tokens_per_dp * model.hidden_size * ACTIVATION_BYTES
    return all_to_all_time(heads_out, k, link) + all_to_all_time(partials, k, link)


# ---------------------------------------------------------------- Eq. 12-13: hybrid TP-EP

def ep_comm_eq12(bsh_bytes: float, top_k: int, n_proc: int, n_node: int, cluster: Cluster) -> float:
    """Eq. 12: λ_EP = AR(bsh, n_proc) + 2·A2A(bshk, n_node) (TP in node, EP across nodes)."""
    return (allreduce_time(bsh_bytes, n_proc, cluster.link_for_span(n_proc))
            + 2 * all_to_all_time(bsh_bytes * top_k, n_node, cluster.ep_link(n_proc * n_node)))


def hybrid_comm_eq13(bsh_bytes: float, top_k: int, n_proc: int, n_node: int, cluster: Cluster) -> float:
    """Eq. 13: λ_mix = AR(bsh, n_proc) + AG(bshk/n_proc, n_proc) + 2·A2A(bshk/n_proc, n_node). The all-gather
    collects the n_proc shards of bshk/n_proc into bshk on every rank: Eq. 1 takes the gathered size."""
    shard = bsh_bytes * top_k / n_proc
    intra = cluster.link_for_span(n_proc)
    return (allreduce_time(bsh_bytes, n_proc, intra) + all_gather_time_eq1(shard * n_proc, n_proc, intra)
            + 2 * all_to_all_time(shard, n_node, cluster.ep_link(n_proc * n_node)))


# ---------------------------------------------------------------- search

@dataclasses.dataclass(frozen=True)
class StrategyEstimate:
    strategy: ParallelStrategy
    fits_memory: bool
    memory_per_rank_bytes: float
    comm_model: str  # which equation priced the layer's communication: eq5, eq12 or eq13
    ttft_s: float = math.nan
    itl_s: float = math.nan
    throughput_tok_s: float = 0.0  # whole batch: b concurrent requests, each at Eq. 11's rate
    meets_slo: bool = False
    # Eq. 11 without the queue (W_q = 0): what the layout serves flat out, which still orders layouts the arrival
    # rate overloads (their throughput is 0)
    capacity_tok_s: float = 0.0


def comm_model_for(strategy: ParallelStrategy, cluster: Cluster) -> str:
    """Eq. 13 prices the MixServe layout (same TP in both blocks, DP = EP across the rest),
    Eq. 12 the DP+EP baseline (TP attention, pure EP MoE); everything else uses Eq. 5."""
    s = strategy
    if s.attn_tp == s.moe_tp > 1 and s.attn_dp == s.moe_ep > 1:
        return "eq13"
    if s.moe_tp == 1 and s.attn_tp > 1 and s.attn_dp > 1 and s.attn_tp <= cluster.devices_per_node:
        return "eq12"
    return "eq5"


def layer_latency(model: ModelSpec, strategy: ParallelStrategy, cluster: Cluster, tokens: int,
                  comm_model: str) -> tuple[float, float]:
    """(τ, λ) of one decoder layer processing `tokens` = b·s tokens of the whole batch."""
    s = strategy
    attn_params = model.psi_attn / model.num_layers
    active_expert_params = model.psi_moe / model.num_layers * model.top_k / model.num_experts
    tokens_per_dp = math.ceil(tokens / s.attn_dp)
    routed_params = model.psi_moe / model.num_layers  # a batch of many tokens touches every expert a rank holds

    def read(params: float, shard: int) -> float:
        return weight_read_latency(params, model.weight_bytes, shard, cluster)

    if s.shared_ep:  # pure EP, attention TP1: routed and shared-expert ranks compute side by side
        shared_params = model.psi_shared / model.num_layers
        tau = (max(compute_latency_eq4(attn_params - shared_params, tokens_per_dp, 1, cluster.flops),
                   read(attention_params_per_rank(model, s) / model.num_layers - shared_params, 1))
               + max(compute_latency_eq4(active_expert_params, tokens, s.routed_ep, cluster.flops),
                     compute_latency_eq4(shared_params, tokens, s.shared_ep, cluster.flops),
                     read(routed_params, s.routed_ep), read(shared_params, 1)))
        # one more row per token goes to a shared-expert rank and back
        return tau, (communication_latency_eq5(s, tokens, model.hidden_size, model.top_k + 1, cluster)
                     + oproj_comm_time(model, s, tokens_per_dp, cluster))
    tau = (max(compute_latency_eq4(attn_params, tokens_per_dp, s.attn_tp, cluster.flops),
               read(attention_params_per_rank(model, s) / model.num_layers, s.attn_tp))
           + max(compute_latency_eq4(active_expert_params, tokens, s.moe_tp * s.moe_ep, cluster.flops),
                 read(routed_params, s.moe_tp * s.moe_ep)))
    bsh = tokens_per_dp * model.hidden_size * ACTIVATION_BYTES
    if comm_model == "eq13":
        lam = hybrid_comm_eq13(bsh, model.top_k, s.moe_tp, s.moe_ep, cluster)
    elif comm_model == "eq12":
        lam = ep_comm_eq12(bsh, model.top_k, s.attn_tp, s.attn_dp, cluster)
    else:
        lam = communication_latency_eq5(s, tokens, model.hidden_size, model.top_k, cluster)
    return tau, lam + oproj_comm_time(model, s, tokens_per_dp, cluster)


def estimate(model: ModelSpec, strategy: ParallelStrategy, cluster: Cluster, workload: Workload) -> StrategyEstimate:
    if strategy.disagg:
        raise AnalyzerError(f"{strategy} is disaggregated: meshserve/parallel/disagg.py prices it (`meshserve plan "
                            "--disagg`)")
    w = workload
    kv = kv_cache_bytes(model, math.ceil(w.batch / strategy.attn_dp), w.input_len + w.output_len)
    attn_bytes = attention_params_per_rank(model, strategy) * model.weight_bytes
    moe_bytes = model.psi_moe * model.weight_bytes
    shared_bytes = model.psi_shared * model.weight_bytes
    if strategy.shared_ep and not model.psi_shared:
        raise AnalyzerError(f"{strategy} puts shared experts on ranks of their own, but {model.name} has none")
    memory = memory_per_rank_eq8(attn_bytes, moe_bytes, kv, strategy, shared_bytes)
    comm = comm_model_for(strategy, cluster)
    if not fits_memory_eq8(attn_bytes, moe_bytes, kv, strategy, cluster.device_memory_bytes, shared_bytes):
        return StrategyEstimate(strategy, False, memory, comm)
    prefill = service_latency_eq6(model.num_layers, *layer_latency(model, strategy, cluster,
                                                                   w.batch * w.input_len, comm))
    decode = service_latency_eq6(model.num_layers, *layer_latency(model, strategy, cluster, w.batch, comm))
    # One service = the batch's b requests from prefill through their last token.
    service_rate = w.batch / (prefill + w.output_len * decode)
    wq = mm1_queueing_delay_eq7(w.arrival_rate, service_rate)
    ttft, itl = ttft_eq9(wq, prefill), itl_eq10(decode)
    throughput = w.batch * throughput_eq11(w.input_len, w.output_len, wq, prefill, decode)
    meets = (math.isfinite(wq) and (w.slo_ttft_s is None or ttft <= w.slo_ttft_s)
             and (w.slo_itl_s is None or itl <= w.slo_itl_s))
    capacity = w.batch * throughput_eq11(w.input_len, w.output_len, 0.0, prefill, decode)
    return StrategyEstimate(strategy, True, memory, comm, ttft, itl, throughput, meets, capacity)


def rank_key(est: StrategyEstimate) -> tuple:
    """Fitting before not fitting, SLO-meeting first, then higher throughput, then lower TTFT, then (among layouts
    the arrival rate overloads) higher capacity."""
    ttft = est.ttft_s if math.isfinite(est.ttft_s) else math.inf
    return (not est.fits_memory, not est.meets_slo, -est.throughput_tok_s, ttft, -est.capacity_tok_s,
            str(est.strategy))


def candidate_strategies(model: ModelSpec, world_size: int) -> list[ParallelStrategy]:
    """The strategies `analyze` prices: every one of the grammar, `oproj=TPk` ones only where o_proj can be shared."""
    return enumerate_strategies(world_size, oproj=model.oproj_params > 0)


def analyze(config: Mapping[str, Any] | ModelSpec, cluster: Cluster, workload: Workload,
            include_unfit: bool = False) -> list[StrategyEstimate]:
    """Estimate every strategy of the cluster's world size (with the o_proj-sharing variants for MLA models), best
    first; unfit ones dropped unless asked."""
    model = config if isinstance(config, ModelSpec) else model_spec_from_config(config)
    candidates = candidate_strategies(model, cluster.world_size)
    if model.psi_shared:
        candidates += [shared for s in candidates for shared in shared_expert_variants(s)]
    estimates = [estimate(model, s, cluster, workload) for s in candidates]
    if not include_unfit:
        estimates = [e for e in estimates if e.fits_memory]
    return sorted(estimates, key=rank_key)


def shared_expert_variants(strategy: ParallelStrategy) -> list[ParallelStrategy]:
    """A pure-EP attention-TP1 layout with 1, 2, 4, ... of its EP ranks (fewer than all) given to the shared
    experts (`shared=EPs`); none for other layouts."""
    if strategy.attn_tp != 1 or strategy.moe_tp != 1 or strategy.shared_ep:
        return []
    counts = [1 << i for i in range(strategy.moe_ep.bit_length()) if (1 << i) < strategy.moe_ep]
    return [dataclasses.replace(strategy, shared_ep=count) for count in counts]


MOE_COMM_MODES = ("fused", "sync")


def to_deployment(strategy: ParallelStrategy, model_dir: str | None = None, est: StrategyEstimate | None = None,
                  cluster: Cluster | None = None, moe_comm: str = "fused", int8_dispatch: bool = False,
                  engine: Mapping[str, Any] | None = None) -> dict:
    """The deployment-file dict `meshserve serve --deployment` reads (plain types only, YAML-serialisable).

    `model` is left out without a model directory (serve then uses its default model);
    `topology` is the cluster's shape, or one node holding the whole world without a cluster.
    """
    if moe_comm not in MOE_COMM_MODES:
        raise AnalyzerError(f"moe_comm must be one of {', '.join(MOE_COMM_MODES)}, got {moe_comm!r}")
    if cluster is not None and cluster.world_size != strategy.world_size:
        raise AnalyzerError(f"strategy {strategy} needs {strategy.world_size} ranks but cluster {cluster.name} "
                            f"has {cluster.world_size}")
    nodes, ranks_per_node = (cluster.nodes, cluster.devices_per_node) if cluster else (1, strategy.world_size)
    deployment: dict[str, Any] = {"model": str(model_dir)} if model_dir else {}
    deployment.update({
        "parallel": str(strategy),
        "topology": {"nodes": nodes, "ranks_per_node": ranks_per_node},
        "moe_comm": moe_comm,
        "int8_dispatch": bool(int8_dispatch),
        "engine": dict(engine or {}),
        "world_size": strategy.world_size,
        "attention": {"tp": strategy.attn_tp, "dp": strategy.attn_dp,
                      **({"oproj_tp": strategy.oproj_tp} if strategy.oproj_tp > 1 else {})},
        "moe": {"tp": strategy.moe_tp, "ep": strategy.moe_ep},
    })
    if strategy.shared_ep:
        deployment["moe"]["shared_ep"] = strategy.shared_ep
    if est is not None:
        deployment["estimate"] = {
            "ttft_ms": round(est.ttft_s * 1e3, 3) if math.isfinite(est.ttft_s) else None,
            "itl_ms": round(est.itl_s * 1e3, 3) if math.isfinite(est.itl_s) else None,
            "throughput_tok_s": round(est.throughput_tok_s, 1),
            "memory_per_rank_gb": round(est.memory_per_rank_bytes / 1e9, 2),
            "meets_slo": est.meets_slo,
            "comm_model": est.comm_model,
        }
    return deployment
