"""DeepSeek-V3 decode steps through the fused native layer ops (layers/csrc/decode_layer.cpp).

A step whose rows are all one-token decodes runs each decoder layer as two native calls, the attention half and
the MLP half, instead of about forty Python-level ops: at batch 1 those ops' interpreter and dispatcher time
was a third of the step. The calls run the same kernels in the same order as the per-op path, so the logits
agree to float rounding (tests/models/test_fused_decode.py).

Where it applies: the native kernels on (not under `cpu_kernels.disabled()`), a float32 model and KV cache on CPU
(or a bfloat16 model and cache: its rows then run in float32 between its bfloat16 linears, each input rounded to
bfloat16 as its own layers round it, so its logits agree with the per-op path's to bfloat16 rounding), one rank
(no attention TP, no expert parallelism, no redundant expert slots), every projection packed for a native kernel
(float32, bfloat16 or INT8 W8A8; a shape the kernels do not pack runs torch's linear inside the op), the experts
packed, no attention biases, one micro-batch, and `MESHSERVE_FUSED_DECODE` not 0. Anything else (prefills, mixed
batches) runs the per-op path.
"""
from __future__ import annotations

import dataclasses

import torch

from meshserve.layers import cpu_kernels
from meshserve.layers.linear import NO_TENSOR, native_tensors
from meshserve.layers.metadata import AttentionMetadata
from meshserve.utils import envs


@dataclasses.dataclass(frozen=True)
class _LayerOps:
    """One decoder layer's arguments to the two fused ops, built once."""

    attn_weights: list[torch.Tensor]
    attn_dims: list[int]
    attn_floats: list[float]
    mlp_weights: list[torch.Tensor]
    mlp_dims: list[int]
    mlp_floats: list[float]
    runtime: object | None  # the MoE runtime (its expert-load counts are attached after start-up)
    attention: torch.nn.Module
    experts: object | None
    packed: tuple  # the packed objects the lists were built from: a repack builds them again

    def current(self) -> bool:
        return self.packed == _packed_objects(self.attention, self.experts)


class FusedDecode:
    """The fused decode path of one DeepseekV3ForCausalLM."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self.layers = layers
        self._ops: list[_LayerOps] | None = None
        self._unsupported = False
        self.steps = 0  # forwards run fused (tests check the path was taken)

    def takes(self, hidden: torch.Tensor, attn: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        """Whether this forward runs fused."""
        num_rows = hidden.shape[0]
        if (self._unsupported or not num_rows or attn.num_decodes != num_rows or attn.num_seqs != num_rows
                or hidden.dtype not in (torch.float32, torch.bfloat16) or hidden.device.type != "cpu"
                or not cpu_kernels.enabled() or not envs.fused_decode_enabled()):
            return False
        cache = kv_caches[0]
        if cache.dtype != hidden.dtype or not cache.is_contiguous():
            return False
        if cache.dtype == torch.bfloat16 and self.layers[0].self_attn.qk_rope_head_dim % 16:
            return False  # the bfloat16 cache's kernel reads rows of whole vectors
        if self._ops is None or not all(ops.current() for ops in self._ops):
            self._ops = _build(self.layers)
            self._unsupported = self._ops is None
        return self._ops is not None

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                 kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The decoder layers over one-token decode rows (`takes` said yes); the final norm is the caller's. A
        bfloat16 model's rows run in float32 between its bfloat16 linears (each input rounded to bfloat16 as its
        own layers round it) and return in bfloat16."""
        if hidden.dtype == torch.bfloat16:
            return self(hidden.float(), cos.float(), sin.float(), attn, kv_caches).to(torch.bfloat16)
        ops = torch.ops.meshserve_cpu
        batch = hidden.shape[0]
        num_blocks = -(-max(attn.seq_lens) // attn.block_size)
        block_table = attn.block_tables[:batch, :num_blocks].contiguous()
        seq_lens = (attn.seq_lens_tensor[:batch] if attn.seq_lens_tensor is not None
                    else torch.tensor(attn.seq_lens, dtype=torch.int64))
        slots = attn.slot_mapping
        for layer_ops, cache in zip(self._ops, kv_caches):
            hidden = _attention_half(ops, hidden, cos, sin, cache, block_table, seq_lens, slots, layer_ops)
            hidden = _mlp_half(ops, hidden, layer_ops)
        self.steps += 1
        return hidden


# the two halves as functions of their own: a profile's stacks tell them apart (bench/step_profile.py)
def _attention_half(ops, hidden, cos, sin, cache, block_table, seq_lens, slots, layer_ops: _LayerOps) -> torch.Tensor:
    return ops.mla_decode_attention(hidden, cos, sin, cache, block_table, seq_lens, slots, layer_ops.attn_weights,
                                    layer_ops.attn_dims, layer_ops.attn_floats)


def _mlp_half(ops, hidden: torch.Tensor, layer_ops: _LayerOps) -> torch.Tensor:
    counts = layer_ops.runtime.load_counts if layer_ops.runtime is not None else None
    return ops.decoder_mlp(hidden, layer_ops.mlp_weights, layer_ops.mlp_dims, layer_ops.mlp_floats, counts)


def _packed_objects(attention, experts) -> tuple:
    if experts is None:
        return (id(attention._absorbed_packed),)
    return id(attention._absorbed_packed), id(experts._native), id(experts._int8_native), id(experts._bf16_native)


def _build(layers: torch.nn.ModuleList) -> list[_LayerOps] | None:
    built = []
    for layer in layers:
        attention = _attention_args(layer)
        mlp = _mlp_args(layer)
        if attention is None or mlp is None:
            return None
        runtime, experts = getattr(layer.mlp, "runtime", None), getattr(layer.mlp, "experts", None)
        built.append(_LayerOps(*attention, *mlp, runtime=runtime, attention=layer.self_attn, experts=experts,
                               packed=_packed_objects(layer.self_attn, experts)))
    return built


def _linears(*modules) -> list[torch.Tensor] | None:
    tensors = []
    for module in modules:
        if module is None:
            tensors += [NO_TENSOR] * 3
            continue
        if module.bias is not None:
            return None
        packed = native_tensors(module.weight)
        if packed is None:
            return None
        tensors += packed
    return tensors


def _attention_args(layer) -> tuple[list, list, list] | None:
    a = layer.self_attn
    if a.parallel.attn_tp_size != 1 or a.parallel.oproj_size != 1 or a._absorbed_packed is None \
            or a.kv_lora_rank % 16:
        return None
    qkv, q_b, o = _linears(a.fused_qkv_a_proj), _linears(a.q_b_proj), _linears(a.o_proj)
    if qkv is None or q_b is None or o is None:
        return None
    q_norm = a.q_a_layernorm
    weights = [layer.input_layernorm.weight.float(), *qkv, q_norm.weight.float() if q_norm is not None else NO_TENSOR,
               *q_b, a.kv_a_layernorm.weight.float(), *a._absorbed_packed, *o]
    dims = [a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim, a.q_in_dim,
            int(a.rope_interleave), int(a.q_b_proj is not None)]
    floats = [layer.input_layernorm.eps, q_norm.eps if q_norm is not None else 0.0, a.kv_a_layernorm.eps,
              a.softmax_scale]
    return weights, dims, floats


def _mlp_args(layer) -> tuple[list, list, list] | None:
    norm, mlp = layer.post_attention_layernorm, layer.mlp
    if not hasattr(mlp, "runtime"):  # a dense MLP
        if mlp.parallel.attn_tp_size != 1:
            return None
        tensors = _linears(mlp.gate_up_proj, mlp.down_proj)
        return None if tensors is None else ([norm.weight.float(), *tensors], [0], [norm.eps])
    runtime, experts = mlp.runtime, mlp.experts
    if not runtime.single or runtime.slot_map is not None or runtime.shared_slots is not None:
        return None
    router = native_tensors(mlp.gate_weight)
    expert_tensors = experts.native_tensors()
    if router is None or expert_tensors is None:
        return None
    num_experts = mlp.gate_weight.shape[0]
    if not (mlp.n_group == 1 or mlp.topk_group == mlp.n_group or num_experts // mlp.n_group >= 2):
        return None  # the native routing's case (deepseek_v3.grouped_topk)
    shared = []
    if mlp.shared_experts is not None:
        shared = _linears(mlp.shared_experts.gate_up_proj, mlp.shared_experts.down_proj)
        if shared is None:
            return None
    weights = [norm.weight.float(), *router, mlp.e_score_correction_bias.float(), *expert_tensors, *shared]
    dims = [1, mlp.top_k, mlp.n_group, mlp.topk_group, int(mlp.norm_topk_prob), experts.first_slot,
            int(bool(shared))]
    return weights, dims, [norm.eps, mlp.routed_scaling_factor]
