"""DeepSeek-V3 / Kimi-K2: MLA attention, sigmoid group-limited MoE with shared experts, MTP layers.

Matches HF `transformers.DeepseekV3ForCausalLM` on the same weights. MTP layers
(`num_nextn_predict_layers`, stored after the last decoder layer) are loaded into
`self.mtp` and run by `forward_mtp` (speculative decoding drafts with them).

Under a parallel strategy (`parallel`), attention heads, dense and shared-expert MLP
columns, the embedding and the LM head are split over the attention TP group, the
routers are replicated, and the routed experts run through `MoERuntime`, which holds
this rank's experts (EP) and intermediate columns (MoE TP). With `oproj=TPk` each rank
keeps every head but only its heads-shard of o_proj's columns, shared over k DP groups
(meshserve/layers/mla.py). MTP layers are split the same way. `expert_balancer` records
expert load and reconfigures redundant expert slots (meshserve/moe/balancer.py). With shared-expert ranks
(`shared=EPs`, meshserve/moe/shared_ranks.py) no rank computes the shared experts locally: they are
dispatched like routed experts, and a shared-expert rank's `experts` hold their column blocks instead.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels
from meshserve.layers.fp8 import fp8_block_size
from meshserve.layers.linear import attach_packed, linear
from meshserve.layers.metadata import AttentionMetadata, KVCacheLayout
from meshserve.layers.mla import (
    MLABatchPlan,
    MLAShape,
    MultiHeadLatentAttention,
    copy_checked,
    mla_softmax_scale,
    uninitialized_linear,
)
from meshserve.layers.norm import RMSNorm
from meshserve.layers.rope import RotaryEmbedding, standardize_rope_parameters
from meshserve.layers.tensor_parallel import (
    Shard,
    VocabParallelEmbedding,
    attention_tp_part,
    oproj_shard,
    row_parallel_linear,
    vocab_parallel_logits,
)
from meshserve.models.base import CausalLM, RoutedExperts
from meshserve.models.fused_decode import FusedDecode
from meshserve.models.microbatch import Stages, StageTimeline, interleave, split_batch
from meshserve.moe.balancer import ExpertBalancer
from meshserve.moe.runtime import MoERuntime, rank_expert_range
from meshserve.moe.shared_ranks import load_shared_expert
from meshserve.parallel.context import ParallelContext

_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)


@dataclass(frozen=True)
class DeepseekV3Params:
    """The config.json fields the model uses.

    Missing optional keys take HF DeepseekV3Config defaults, except that MTP layers are
    only built when `num_nextn_predict_layers` (or `num_mtp_layers`) counts them.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool
    num_nextn_predict_layers: int

    @classmethod
    def from_hf_config(cls, cfg: dict) -> DeepseekV3Params:
        missing = [k for k in _REQUIRED_KEYS if cfg.get(k) is None]
        if missing:
            raise ValueError(f"DeepSeek-V3 config lacks {', '.join(missing)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (DeepSeek-V3 uses silu)")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"unsupported scoring_func {cfg['scoring_func']!r} (supported: sigmoid)")
        if cfg.get("topk_method", "noaux_tc") not in ("noaux_tc", None):
            raise ValueError(f"unsupported topk_method {cfg['topk_method']!r} (supported: noaux_tc)")
        fp8_block_size(cfg)  # FP8 block checkpoints are dequantized at load; other formats are refused here

        def opt(key: str, default, *aliases: str):
            for k in (key, *aliases):
                if cfg.get(k) is not None:
                    return cfg[k]
            return default

        params = cls(
            **{k: int(cfg[k]) for k in _REQUIRED_KEYS},
            q_lora_rank=cfg.get("q_lora_rank", 1536),
            moe_intermediate_size=int(opt("moe_intermediate_size", 2048)),
            n_routed_experts=int(opt("n_routed_experts", 256)),
            n_shared_experts=int(opt("n_shared_experts", 1)),
            num_experts_per_tok=int(opt("num_experts_per_tok", 8)),
            n_group=int(opt("n_group", 8)),
            topk_group=int(opt("topk_group", 4)),
            norm_topk_prob=bool(opt("norm_topk_prob", True)),
            routed_scaling_factor=float(opt("routed_scaling_factor", 2.5)),
            first_k_dense_replace=int(opt("first_k_dense_replace", 3)),
            moe_layer_freq=int(opt("moe_layer_freq", 1)),
            max_position_embeddings=int(opt("max_position_embeddings", 4096)),
            rms_norm_eps=float(opt("rms_norm_eps", 1e-6)),
            rope_parameters=standardize_rope_parameters(cfg),
            rope_interleave=bool(opt("rope_interleave", True)),
            attention_bias=bool(opt("attention_bias", False)),
            tie_word_embeddings=bool(opt("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(opt("num_nextn_predict_layers", 0, "num_mtp_layers")),
        )
        if params.n_routed_experts:
            if params.n_routed_experts % params.n_group:
                raise ValueError(
                    f"n_routed_experts {params.n_routed_experts} is not divisible by n_group {params.n_group}")
            if not 1 <= params.topk_group <= params.n_group:
                raise ValueError(f"topk_group {params.topk_group} must be in [1, n_group={params.n_group}]")
            if params.n_group > 1 and params.n_routed_experts // params.n_group < 2:
                raise ValueError("group-limited routing needs at least 2 experts per group")
            reachable = params.topk_group * (params.n_routed_experts // params.n_group)
            if not 1 <= params.num_experts_per_tok <= reachable:
                raise ValueError(f"num_experts_per_tok {params.num_experts_per_tok} must be in [1, {reachable}] "
                                 f"(the experts of topk_group={params.topk_group} groups)")
        if params.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {params.moe_layer_freq}")
        return params

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (bool(self.n_routed_experts) and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)


def grouped_topk(
    router_logits: torch.Tensor,  # float32 [T, E]
    correction_bias: torch.Tensor,  # float32 [E]
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores; experts chosen by biased score within the best groups.

    A group's score is the sum of its two best biased scores; only the `topk_group`
    best groups may contribute experts. The weights are the unbiased scores of the
    chosen experts. Returns (weights float32 [T, K], expert ids int64 [T, K]).
    """
    if (router_logits.device.type == "cpu" and router_logits.dtype == torch.float32
            and correction_bias.dtype == torch.float32 and router_logits.shape[0] and cpu_kernels.enabled()
            and (n_group == 1 or topk_group == n_group or router_logits.shape[1] // n_group >= 2)):
        return cpu_kernels.grouped_topk(router_logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                                        routed_scaling_factor)
    scores = router_logits.sigmoid()
    scores_for_choice = scores + correction_bias
    if 1 < n_group and topk_group < n_group:
        num_tokens, num_experts = scores_for_choice.shape
        grouped = scores_for_choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        scores_for_choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    topk_ids = scores_for_choice.topk(top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


class SwiGLUMLP(torch.nn.Module):
    """silu(gate(x)) * up(x) -> down, with gate and up as one matmul.

    Under attention TP a rank holds its block of the intermediate columns (gate/up rows, down
    input columns); `partial` is its share of the output and the group sums the shares.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        intermediate_size = attention_tp_part(self.parallel, intermediate_size, "MLP intermediate size")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = uninitialized_linear(hidden_size, 2 * intermediate_size, False, dtype)
        self.down_proj = uninitialized_linear(intermediate_size, hidden_size, False, dtype)

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> str:
        i = self.intermediate_size
        if name == "gate_proj.weight":
            copy_checked(self.gate_up_proj.weight.data[:i], tensor, name)
            return "gate_up_proj.weight"
        if name == "up_proj.weight":
            copy_checked(self.gate_up_proj.weight.data[i:], tensor, name)
            return "gate_up_proj.weight"
        if name == "down_proj.weight":
            copy_checked(self.down_proj.weight.data, tensor, name)
            return name
        raise KeyError(f"unexpected MLP weight {name!r}")

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        i = self.intermediate_size
        return F.silu(gate_up[:, :i]) * gate_up[:, i:]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (the whole output with one attention TP rank)."""
        return self.down_proj(self._activation(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(self.parallel, self._activation(x), self.down_proj.weight)


class DeepseekV3MoE(torch.nn.Module):
    """Router (fp32, as HF keeps it) + routed experts (through the MoE runtime) + shared experts.

    Every rank routes its own tokens with the full router; the shared experts are split over
    the attention TP group like a dense MLP.
    """

    _EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    _SHARED = re.compile(r"shared_experts\.(gate_proj|up_proj|down_proj)\.weight")

    def __init__(self, p: DeepseekV3Params, dtype: torch.dtype, parallel: ParallelContext | None = None,
                 layer: int = 0) -> None:
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        self.hidden_size = p.hidden_size
        self.moe_intermediate_size = p.moe_intermediate_size
        self.num_experts = p.n_routed_experts
        self.top_k = p.num_experts_per_tok
        self.n_group = p.n_group
        self.topk_group = p.topk_group
        self.norm_topk_prob = p.norm_topk_prob
        self.routed_scaling_factor = p.routed_scaling_factor
        self.gate_weight = torch.nn.Parameter(torch.empty(p.n_routed_experts, p.hidden_size), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(p.n_routed_experts))
        self.runtime = MoERuntime(self.parallel, p.n_routed_experts, p.num_experts_per_tok, p.hidden_size, dtype,
                                  num_shared_experts=p.n_shared_experts, layer=layer)
        # this rank's expert slots: routed experts, or on a shared-expert rank the shared experts' blocks
        self.experts = self.runtime.make_weights(p.moe_intermediate_size)
        local_shared = p.n_shared_experts and not self.parallel.shared_ep_size
        self.shared_experts = (SwiGLUMLP(p.hidden_size, p.moe_intermediate_size * p.n_shared_experts, dtype,
                                         self.parallel) if local_shared else None)

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> str:
        if name == "gate.weight":
            copy_checked(self.gate_weight.data, tensor, name)
            return "gate_weight"
        if name == "gate.e_score_correction_bias":
            copy_checked(self.e_score_correction_bias, tensor, name)
            return "e_score_correction_bias"
        match = self._EXPERT.fullmatch(name)
        if match:
            expert, proj = int(match.group(1)), match.group(2)
            if not 0 <= expert < self.num_experts:
                raise KeyError(f"expert id {expert} out of range in {name!r} ({self.num_experts} experts)")
            h, i = self.hidden_size, self.moe_intermediate_size
            expected = (h, i) if proj == "down_proj" else (i, h)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            # another rank's expert is skipped; it still counts as handled
            if not self.parallel.is_shared_expert_rank:
                self.experts.load_expert(expert, proj, tensor)
            return "experts.w2" if proj == "down_proj" else "experts.w13"
        if name.startswith("shared_experts.") and self.shared_experts is not None:
            return "shared_experts." + self.shared_experts.load_hf_weight(name[len("shared_experts."):], tensor)
        shared = self._SHARED.fullmatch(name)
        if shared and self.parallel.shared_ep_size:  # shared experts on their own ranks: other ranks skip them
            if self.parallel.is_shared_expert_rank:
                load_shared_expert(self.experts, shared.group(1), tensor)
            return "experts.w2" if shared.group(1) == "down_proj" else "experts.w13"
        raise KeyError(f"unexpected MoE weight {name!r}")

    def pack_weights(self) -> int:
        """Prepack the router for oneDNN (see linear.py); the experts and shared experts pack themselves."""
        return int(attach_packed(self.gate_weight))

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = linear(hidden_states.float(), self.gate_weight)
        return grouped_topk(router_logits, self.e_score_correction_bias, self.top_k, self.n_group,
                            self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Also with 0 tokens: the runtime's collectives must run on every rank."""
        topk_weights, topk_ids = self.route(hidden_states)
        routed = self.runtime(hidden_states, topk_ids, topk_weights, self.experts)
        if self.shared_experts is None:
            return routed
        if self.parallel.attn_tp_size == 1:
            return routed + self.shared_experts(hidden_states)
        if hidden_states.shape[0] == 0:  # the whole attention TP group is idle
            return routed
        # one all-reduce for both: the shared-expert shares, plus the routed output (the same on
        # every rank of the group) added by one rank only
        out = self.shared_experts.partial(hidden_states)
        if self.parallel.attn_tp_rank == 0:
            out += routed
        return self.parallel.attn_all_reduce(out)


    def forward_stages(self, hidden_states: torch.Tensor, buffer_index: int) -> Stages:
        """`forward` for one of two micro-batches (meshserve/models/microbatch.py): stops after launching the
        dispatch and after launching the combine. Attention TP1 only (the shared experts need no all-reduce)."""
        topk_weights, topk_ids = self.route(hidden_states)
        pending = self.runtime.start(hidden_states, topk_ids, topk_weights, self.experts, buffer_index)
        yield "attention, dispatch"
        shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        self.runtime.compute(pending, self.experts)
        yield "experts, combine"
        routed = self.runtime.finish(pending)
        return routed if shared is None else routed + shared


class DeepseekV3DecoderLayer(torch.nn.Module):
    def __init__(self, p: DeepseekV3Params, layer_idx: int, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(
            MLAShape(hidden_size=p.hidden_size, num_heads=p.num_attention_heads, q_lora_rank=p.q_lora_rank,
                     kv_lora_rank=p.kv_lora_rank, qk_nope_head_dim=p.qk_nope_head_dim,
                     qk_rope_head_dim=p.qk_rope_head_dim, v_head_dim=p.v_head_dim),
            softmax_scale=mla_softmax_scale(p.qk_nope_head_dim + p.qk_rope_head_dim, p.rope_parameters,
                                            p.max_position_embeddings),
            rope_interleave=p.rope_interleave,
            attention_bias=p.attention_bias,
            dtype=dtype,
            parallel=parallel,
        )
        self.mlp = DeepseekV3MoE(p, dtype, parallel, layer_idx) if p.is_moe_layer(layer_idx) else SwiGLUMLP(
            p.hidden_size, p.intermediate_size, dtype, parallel)
        self.input_layernorm = RMSNorm(p.hidden_size, p.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(p.hidden_size, p.rms_norm_eps, dtype)

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> str:
        """name relative to `model.layers.N.`; returns the parameter name relative to this layer."""
        if name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            copy_checked(self.get_parameter(name).data, tensor, name)
            return name
        for prefix, module in (("self_attn.", self.self_attn), ("mlp.", self.mlp)):
            if name.startswith(prefix):
                return prefix + module.load_hf_weight(name[len(prefix):], tensor)
        raise KeyError(f"unexpected decoder-layer weight {name!r}")

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: MLABatchPlan,
                kv_cache: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] == 0:  # an idle DP group: no attention, but the MoE runtime must still run
            self._join_shared_oproj(hidden_states)
            return hidden_states + self.mlp(hidden_states)
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, plan, kv_cache)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


    def _join_shared_oproj(self, empty_hidden: torch.Tensor) -> None:
        """With `oproj=TPk`, an idle rank still takes its part in its o_proj group's all-to-alls."""
        if self.self_attn.parallel.oproj_size > 1:
            self.self_attn.output_projection(empty_hidden.new_zeros(0, self.self_attn.num_heads
                                                                    * self.self_attn.v_head_dim))

    def forward_stages(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       plan: MLABatchPlan, kv_cache: torch.Tensor, buffer_index: int) -> Stages:
        """`forward` for one of two micro-batches: a MoE layer stops where its transfers are in flight."""
        if hidden_states.shape[0] == 0:
            self._join_shared_oproj(hidden_states)
            mlp_input = hidden_states
        else:
            hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, plan,
                                                           kv_cache)
            mlp_input = self.post_attention_layernorm(hidden_states)
        if isinstance(self.mlp, DeepseekV3MoE):
            out = yield from self.mlp.forward_stages(mlp_input, buffer_index)
        else:
            out = self.mlp(mlp_input)
        return hidden_states + out


class SharedHead(torch.nn.Module):
    def __init__(self, p: DeepseekV3Params, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.norm = RMSNorm(p.hidden_size, p.rms_norm_eps, dtype)
        # vocab-parallel like the main LM head
        self.head = uninitialized_linear(p.hidden_size, attention_tp_part(parallel, p.vocab_size, "vocab_size"),
                                         False, dtype)


class DeepseekV3MTPLayer(torch.nn.Module):
    """One multi-token-prediction module (DeepSeek-V3 MTP).

    For position i it computes eh_proj(cat(enorm(embed(token[i + 1])), hnorm(h[i]))), runs that through
    one decoder block and predicts token i + 2 with shared_head (norm, then head).

    `embed_tokens` exists only when the checkpoint carries a copy; otherwise the main embedding is meant.
    """

    _OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")

    def __init__(self, p: DeepseekV3Params, layer_idx: int, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        self.embedding_shape = (p.vocab_size, p.hidden_size)
        self.dtype = dtype
        self.enorm = RMSNorm(p.hidden_size, p.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(p.hidden_size, p.rms_norm_eps, dtype)
        self.eh_proj = uninitialized_linear(2 * p.hidden_size, p.hidden_size, False, dtype)
        self.block = DeepseekV3DecoderLayer(p, layer_idx, dtype, self.parallel)
        self.shared_head = SharedHead(p, dtype, self.parallel)
        self.embed_tokens: VocabParallelEmbedding | None = None

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> str:
        if name in self._OWN:
            copy_checked(self.get_parameter(name).data, tensor, name)
            return name
        if name == "embed_tokens.weight":
            if self.embed_tokens is None:
                with torch.device(self.eh_proj.weight.device):
                    self.embed_tokens = VocabParallelEmbedding(*self.embedding_shape, self.dtype, self.parallel)
            copy_checked(self.embed_tokens.weight.data, tensor, name)
            return name
        return "block." + self.block.load_hf_weight(name, tensor)

    def forward(self, previous_hidden: torch.Tensor, next_embeds: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, plan: MLABatchPlan, kv_cache: torch.Tensor) -> torch.Tensor:
        """The hidden state at each position (before shared_head), from the previous depth's hidden state there
        and the embedding of the token after it: eh_proj([enorm(emb), hnorm(h)]) through one decoder block."""
        return self.block(self._block_input(previous_hidden, next_embeds), cos, sin, plan, kv_cache)

    def forward_stages(self, previous_hidden: torch.Tensor, next_embeds: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, plan: MLABatchPlan, kv_cache: torch.Tensor, buffer_index: int) -> Stages:
        """`forward` for one of two micro-batches: the block stops where its MoE transfers are in flight."""
        hidden = self._block_input(previous_hidden, next_embeds)
        return (yield from self.block.forward_stages(hidden, cos, sin, plan, kv_cache, buffer_index))

    def _block_input(self, previous_hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        if previous_hidden.shape[0] == 0:
            return previous_hidden  # an idle DP group still joins the block's MoE collectives
        return self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(previous_hidden)), dim=-1))


class DeepseekV3ForCausalLM(CausalLM):
    model_type = "deepseek_v3"
    supports_microbatches = True

    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
    _ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
    _SHARED_EXPERT = re.compile(r"\.mlp\.shared_experts\.")
    # checkpoint tensors split over the attention TP group: output rows / input columns
    _TP_ROWS = re.compile(r"(?:^|\.)(?:self_attn\.(?:q_b_proj|q_proj|kv_b_proj)"
                          r"|mlp\.(?:shared_experts\.)?(?:gate_proj|up_proj)"
                          r"|embed_tokens|lm_head|shared_head\.head)\.weight$")
    _TP_COLUMNS = re.compile(r"(?:^|\.)(?:self_attn\.o_proj|mlp\.(?:shared_experts\.)?down_proj)\.weight$")
    _OPROJ = re.compile(r"(?:^|\.)self_attn\.o_proj\.weight$")

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        p = DeepseekV3Params.from_hf_config(hf_config)
        self.params = p
        self.dtype = dtype
        self.parallel = parallel or ParallelContext.single()
        self.num_heads = p.num_attention_heads
        self.embed_tokens = VocabParallelEmbedding(p.vocab_size, p.hidden_size, dtype, self.parallel)
        self.layers = torch.nn.ModuleList(
            DeepseekV3DecoderLayer(p, i, dtype, self.parallel) for i in range(p.num_hidden_layers))
        self.norm = RMSNorm(p.hidden_size, p.rms_norm_eps, dtype)
        self.lm_head = uninitialized_linear(p.hidden_size, self.embed_tokens.num_local, False, dtype)
        if p.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary_emb = RotaryEmbedding(p.qk_rope_head_dim, p.rope_parameters, p.max_position_embeddings,
                                          interleaved=p.rope_interleave)
        self.mtp = torch.nn.ModuleList(
            DeepseekV3MTPLayer(p, p.num_hidden_layers + i, dtype, self.parallel)
            for i in range(p.num_nextn_predict_layers))
        self.requires_grad_(False)
        self._expert_range = rank_expert_range(self.parallel, p.n_routed_experts) if p.n_routed_experts else (0, 0)
        # load counts and expert placement of the decoder layers' MoE blocks (MTP layers keep the default)
        moe_blocks = {i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, DeepseekV3MoE)}
        self.expert_balancer = ExpertBalancer(moe_blocks) if moe_blocks else None
        self.stage_timeline: StageTimeline | None = None  # the benchmark's record of the micro-batches' stages
        self.fused_decode = FusedDecode(self.layers)  # all-decode steps as two native calls per layer

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp)

    @staticmethod
    def routed_experts_of(hf_config: dict) -> RoutedExperts:
        """The decoder layers' routed experts (what an expert rank of a disaggregated layout holds)."""
        p = DeepseekV3Params.from_hf_config(hf_config)
        mtp = range(p.num_hidden_layers, p.num_hidden_layers + p.num_nextn_predict_layers)
        return RoutedExperts(tuple(i for i in range(p.num_hidden_layers) if p.is_moe_layer(i)), p.n_routed_experts,
                             p.num_experts_per_tok, p.hidden_size, p.moe_intermediate_size, p.n_shared_experts,
                             tuple(i for i in mtp if p.is_moe_layer(i)))

    def wants_weight(self, name: str) -> bool:
        """Also: with shared-expert ranks, only they read the shared experts."""
        if self.parallel.shared_ep_size and self._SHARED_EXPERT.search(name):
            return self.parallel.is_shared_expert_rank
        return super().wants_weight(name)

    def weight_shard(self, name: str) -> Shard | None:
        """As the base class; with `oproj=TPk` also this rank's heads-shard of o_proj's input columns."""
        if self.parallel.oproj_size > 1 and self._OPROJ.search(name):
            return oproj_shard(self.parallel)
        return super().weight_shard(name)

    def kv_cache_layout(self, dtype: torch.dtype | None = None, num_mtp_layers: int = 0) -> KVCacheLayout:
        """The decoder layers' caches, then `num_mtp_layers` MTP layers' (their blocks move and cache with the rest)."""
        if num_mtp_layers > len(self.mtp):
            raise ValueError(f"{num_mtp_layers} MTP layer caches asked, the checkpoint has {len(self.mtp)} MTP layers")
        return KVCacheLayout.mla(self.params.num_hidden_layers + num_mtp_layers, self.params.kv_lora_rank,
                                 self.params.qk_rope_head_dim, dtype or self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[torch.Tensor], microbatches: int = 1) -> torch.Tensor:
        """Hidden states of the batch; `microbatches=2` runs it as two overlapped halves (every rank of the step
        must pass the same count: the halves' collectives pair up across ranks)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        if microbatches == 2:
            return self.norm(torch.cat(self._two_microbatches(hidden_states, cos, sin, attn, kv_caches)))
        if self.fused_decode.takes(hidden_states, attn, kv_caches):
            return self.norm(self.fused_decode(hidden_states, cos, sin, attn, kv_caches))
        plan = MLABatchPlan.build(attn, hidden_states.dtype, hidden_states.device)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = layer(hidden_states, cos, sin, plan, kv_cache)
        return self.norm(hidden_states)

    def _two_microbatches(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          attn: AttentionMetadata, kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
        halves = []
        for index, (rows, meta) in enumerate(split_batch(attn)):
            plan = MLABatchPlan.build(meta, hidden_states.dtype, hidden_states.device)
            halves.append(self._stack_stages(hidden_states[rows], cos[rows], sin[rows], plan, kv_caches, index))
        return interleave(halves, self.stage_timeline)

    def _stack_stages(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: MLABatchPlan,
                      kv_caches: list[torch.Tensor], buffer_index: int) -> Stages:
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = yield from layer.forward_stages(hidden_states, cos, sin, plan, kv_cache, buffer_index)
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(self.parallel, hidden_states, self.lm_head.weight)

    def forward_mtp(self, previous_hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor,
                    attn: AttentionMetadata, kv_cache: torch.Tensor, layer: int = 0,
                    microbatches: int = 1) -> torch.Tensor:
        """MTP layer `layer` over a batch laid out like `forward`'s: row i is position positions[i], with the
        previous depth's hidden state there (the main model's final-normed output, or this layer's own output
        when applied recursively) and the id of the token that follows it. Returns the layer's hidden states
        [T, H]; `compute_mtp_logits` turns them into the distribution of the token after next. `microbatches=2`:
        two overlapped halves, as `forward` (every rank must pass the same count)."""
        mtp = self.mtp[layer]
        embed = mtp.embed_tokens if mtp.embed_tokens is not None else self.embed_tokens
        next_embeds = embed(next_token_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, next_embeds.dtype)
        if microbatches == 2:
            halves = []
            for index, (rows, meta) in enumerate(split_batch(attn)):
                plan = MLABatchPlan.build(meta, next_embeds.dtype, next_embeds.device)
                halves.append(mtp.forward_stages(previous_hidden[rows], next_embeds[rows], cos[rows], sin[rows], plan,
                                                 kv_cache, index))
            return torch.cat(interleave(halves, self.stage_timeline))
        plan = MLABatchPlan.build(attn, next_embeds.dtype, next_embeds.device)
        return mtp(previous_hidden, next_embeds, cos, sin, plan, kv_cache)

    def compute_mtp_logits(self, mtp_hidden: torch.Tensor, layer: int = 0) -> torch.Tensor:
        head = self.mtp[layer].shared_head
        return vocab_parallel_logits(self.parallel, head.norm(mtp_hidden), head.head.weight)

    def mtp_head(self, layer: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
        """MTP layer `layer`'s output norm and (this rank's rows of) its head weight."""
        head = self.mtp[layer].shared_head
        return head.norm, head.head.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names (as in `named_parameters`) of the parameters written.

        Unknown names raise ValueError. W_UK/W_UV are re-derived from kv_b_proj afterwards.
        When the checkpoint carries no MTP layer at all (HF's `save_pretrained` writes none even
        though its config counts one), `self.mtp` is emptied so no unloaded parameters remain.
        """
        loaded: set[str] = set()
        num_layers = self.params.num_hidden_layers
        with torch.no_grad():
            for name, tensor in weights:
                try:
                    param_name = self._load_one(name, tensor, num_layers)
                except KeyError as err:
                    raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}: {err.args[0]}") from None
                if param_name is not None:
                    loaded.add(param_name)
            if not any(name.startswith("mtp.") for name in loaded):
                self.mtp = torch.nn.ModuleList()
            for layer in self.layers:
                layer.self_attn.split_absorbed_weights()
            for mtp_layer in self.mtp:
                mtp_layer.block.self_attn.split_absorbed_weights()
        return loaded

    def _load_one(self, name: str, tensor: torch.Tensor, num_layers: int) -> str | None:
        if name.endswith("rotary_emb.inv_freq"):  # recomputed from the config
            return None
        if name == "model.embed_tokens.weight":
            copy_checked(self.embed_tokens.weight.data, tensor, name)
            return "embed_tokens.weight"
        if name == "model.norm.weight":
            copy_checked(self.norm.weight.data, tensor, name)
            return "norm.weight"
        if name == "lm_head.weight":
            copy_checked(self.lm_head.weight.data, tensor, name)
            return "lm_head.weight"
        match = self._LAYER.fullmatch(name)
        if match is None:
            raise KeyError("not a DeepSeek-V3 weight name")
        idx, rest = int(match.group(1)), match.group(2)
        if idx < num_layers:
            return f"layers.{idx}." + self.layers[idx].load_hf_weight(rest, tensor)
        if idx < num_layers + len(self.mtp):
            return f"mtp.{idx - num_layers}." + self.mtp[idx - num_layers].load_hf_weight(rest, tensor)
        raise KeyError(f"layer {idx} is beyond {num_layers} layers + {len(self.mtp)} MTP layers")
