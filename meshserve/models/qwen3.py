"""Dense Qwen3 (HF `model_type` "qwen3") in plain torch over the paged KV cache.

Matches HF `Qwen3ForCausalLM`: per-head RMSNorm on q and k before rotate-half RoPE, grouped-query
attention, SwiGLU MLP, pre-norm residual blocks. q/k/v and gate/up are stored fused so a layer runs
one matmul for each; `load_weights` accepts the HF per-projection names and fills the slices.
`Qwen3MoeForCausalLM` (qwen3_moe.py) reuses everything here and only swaps some MLPs for MoE blocks.

Under a parallel strategy (`parallel`) the query and KV heads, the MLP columns, the embedding
and the LM head are split over the attention TP group (see layers/tensor_parallel.py).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshserve.layers import w8a8
from meshserve.layers.attention import PagedGQAAttention
from meshserve.layers.linear import attach_packed, linear
from meshserve.layers.metadata import AttentionMetadata, KVCacheLayout
from meshserve.layers.norm import RMSNorm
from meshserve.layers.rope import RotaryEmbedding, standardize_rope_parameters
from meshserve.layers.tensor_parallel import (
    VocabParallelEmbedding,
    attention_tp_part,
    row_parallel_linear,
    vocab_parallel_logits,
)
from meshserve.models.base import CausalLM
from meshserve.parallel.context import ParallelContext


def require(hf_config: dict, key: str):
    if key not in hf_config:
        raise ValueError(f"model config lacks required field {key!r}")
    return hf_config[key]


def empty_param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    # inference only: no init (load_weights overwrites everything) and no autograd
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class Qwen3Dims:
    """The architecture fields of a Qwen3 / Qwen3-MoE HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    rope_parameters: dict
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, hf_config: dict) -> Qwen3Dims:
        if hf_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config['hidden_act']!r}; Qwen3 uses 'silu'")
        if hf_config.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        hidden = require(hf_config, "hidden_size")
        num_heads = require(hf_config, "num_attention_heads")
        num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        return cls(
            vocab_size=require(hf_config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=require(hf_config, "intermediate_size"),
            num_layers=require(hf_config, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=hf_config.get("head_dim") or hidden // num_heads,
            rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            attention_bias=bool(hf_config.get("attention_bias", False)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            rope_parameters=standardize_rope_parameters(hf_config),
            max_position_embeddings=hf_config.get("max_position_embeddings", 32768),
        )


class FusedLinear(torch.nn.Module):
    """A linear layer whose output rows may stack several HF projections (`shard(p, i)` = the rows of part i)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.weight = empty_param(sum(out_sizes), in_features, dtype=dtype)
        self.bias = empty_param(sum(out_sizes), dtype=dtype) if bias else None

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        return param.data.narrow(0, self.offsets[index], self.out_sizes[index])

    def pack_weights(self) -> int:
        return int(attach_packed(self.weight))

    def quantize_int8(self) -> int:
        """W8A8 (`w8a8.convert_model`); a weight tied to the embedding stays float."""
        if self.weight.dtype == torch.int8:
            return 0
        w8a8.quantize_parameter(self.weight)
        return 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Qwen3Attention(torch.nn.Module):
    """GQA attention; under attention TP a rank holds its query heads and their KV heads."""

    def __init__(self, dims: Qwen3Dims, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_heads = attention_tp_part(parallel, dims.num_heads, "num_attention_heads")
        self.num_kv_heads = attention_tp_part(parallel, dims.num_kv_heads, "num_key_value_heads")
        self.head_dim = dims.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = FusedLinear(dims.hidden_size, self.split_sizes, dims.attention_bias, dtype)
        self.o_proj = FusedLinear(q_size, [dims.hidden_size], dims.attention_bias, dtype)
        self.q_norm = RMSNorm(self.head_dim, dims.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, dims.rms_norm_eps, dtype)
        self.paged_attn = PagedGQAAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        # cos/sin are computed once per forward by the model, so rotate with them directly
        q = rotary._rotate(q, cos, sin)
        k = rotary._rotate(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.paged_attn(q, k, v, attn, kv_cache)
        return row_parallel_linear(self.parallel, out.reshape(num_tokens, -1), self.o_proj.weight, self.o_proj.bias)


class Qwen3MLP(torch.nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one matmul; columns split over attention TP."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        intermediate_size = attention_tp_part(self.parallel, intermediate_size, "MLP intermediate size")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = FusedLinear(hidden_size, [intermediate_size, intermediate_size], False, dtype)
        self.down_proj = FusedLinear(intermediate_size, [hidden_size], False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return row_parallel_linear(self.parallel, F.silu(gate) * up, self.down_proj.weight)


class Qwen3DecoderLayer(torch.nn.Module):
    def __init__(self, dims: Qwen3Dims, mlp: torch.nn.Module, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(dims, dtype, parallel)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:  # an idle DP group: no attention, but an MoE block must still run its collectives
            return hidden + self.mlp(hidden)
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, rotary, attn, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3Model(torch.nn.Module):
    def __init__(self, dims: Qwen3Dims, mlps: list[torch.nn.Module], dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(dims.vocab_size, dims.hidden_size, dtype, parallel)
        self.layers = torch.nn.ModuleList(Qwen3DecoderLayer(dims, mlp, dtype, parallel) for mlp in mlps)
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(dims.head_dim, dims.rope_parameters, dims.max_position_embeddings,
                                          interleaved=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, cos, sin, self.rotary_emb, attn, kv_cache)
        return self.norm(hidden)


# HF projection names that live as row slices of one fused parameter: hf part -> (fused module, shard index)
_FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# checkpoint entries that carry no parameter of ours
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Qwen3ForCausalLM(CausalLM):
    model_type = "qwen3"

    # checkpoint tensors split over the attention TP group: output rows / input columns
    _TP_ROWS = re.compile(r"(?:^|\.)(?:self_attn\.(?:q_proj|k_proj|v_proj)\.(?:weight|bias)"
                          r"|mlp\.(?:gate_proj|up_proj)\.weight|embed_tokens\.weight|lm_head\.weight)$")
    _TP_COLUMNS = re.compile(r"(?:^|\.)(?:self_attn\.o_proj|mlp\.down_proj)\.weight$")

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.dims = Qwen3Dims.from_hf(hf_config)
        self.dtype = dtype
        self.parallel = parallel or ParallelContext.single()
        if self.parallel.oproj_size > 1:
            raise ValueError(f"oproj=TP{self.parallel.oproj_size} shares the output projection of MLA attention "
                             f"(DeepSeek-V3 models); {self.model_type} has no MLA: use oproj=TP1")
        mlps = [self.make_mlp(hf_config, i) for i in range(self.dims.num_layers)]
        self.model = Qwen3Model(self.dims, mlps, dtype, self.parallel)
        if not self.dims.tie_word_embeddings:
            self.lm_head = FusedLinear(self.dims.hidden_size, [self.model.embed_tokens.num_local], False, dtype)
        # parameter name -> pieces received so far (whole tensors count as piece None)
        self._loaded_pieces: dict[str, set] = {}

    def make_mlp(self, hf_config: dict, layer_idx: int) -> torch.nn.Module:
        return Qwen3MLP(self.dims.hidden_size, self.dims.intermediate_size, self.dtype, self.parallel)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.dims.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids, positions, attn, kv_caches)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(self.parallel, hidden_states, self.lm_head_weight)

    def kv_cache_layout(self, dtype: torch.dtype | None = None, num_mtp_layers: int = 0) -> KVCacheLayout:
        """Per rank: the KV heads of this rank's attention TP slice."""
        if num_mtp_layers:
            raise ValueError(f"{type(self).__name__} has no MTP layers")
        num_kv_heads = attention_tp_part(self.parallel, self.dims.num_kv_heads, "num_key_value_heads")
        return KVCacheLayout.gqa(self.dims.num_layers, num_kv_heads, self.dims.head_dim, dtype or self.dtype)

    # ---- weight loading -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in; returns the parameters whose every piece has been loaded so far."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.dims.tie_word_embeddings:
                continue  # tied checkpoints may still store a copy of the embedding
            if not self.load_special_weight(name, tensor):
                self._load_plain_or_fused(name, tensor, params)
        expected = self.expected_pieces()
        return {name for name, pieces in self._loaded_pieces.items() if len(pieces) >= expected.get(name, 1)}

    def load_special_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Hook for subclasses: handle a checkpoint entry that is not a plain or fused projection."""
        return False

    def expected_pieces(self) -> dict[str, int]:
        """How many pieces make a complete parameter, for parameters assembled from several tensors."""
        counts = {}
        for module_name, module in self.named_modules():
            if isinstance(module, FusedLinear) and len(module.out_sizes) > 1:
                counts[f"{module_name}.weight"] = len(module.out_sizes)
                if module.bias is not None:
                    counts[f"{module_name}.bias"] = len(module.out_sizes)
        return counts

    def mark_loaded(self, param_name: str, piece: object = None) -> None:
        self._loaded_pieces.setdefault(param_name, set()).add(piece)

    def _load_plain_or_fused(self, name: str, tensor: torch.Tensor, params: dict) -> None:
        if name in params:
            copy_checked(params[name].data, tensor, name)
            self.mark_loaded(name)
            return
        module_path, _, leaf = name.rpartition(".")  # leaf is "weight" or "bias"
        parent, _, part = module_path.rpartition(".")
        if part in _FUSED_PARTS:
            fused_name, index = _FUSED_PARTS[part]
            param_name = f"{parent}.{fused_name}.{leaf}"
            if param_name in params:
                fused = self.get_submodule(f"{parent}.{fused_name}")
                copy_checked(fused.shard(params[param_name], index), tensor, name)
                self.mark_loaded(param_name, index)
                return
        raise ValueError(f"unknown weight {name!r} for {type(self).__name__} "
                         f"({self.dims.num_layers} layers); is the checkpoint for a different architecture?")


def copy_checked(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)
