"""Multi-head latent attention (DeepSeek MLA) over a paged latent cache.

Each cache entry is one token's latent: `kv_a_layernorm(c_kv)` followed by the roped
`k_pe`, `kv_lora_rank + qk_rope_head_dim` numbers shared by all heads. In an INT8 cache
(`kv_quant`) the two parts are stored as int8 with one scale each inside the row, and every
read dequantizes (the native decode kernel tile by tile, the torch paths the gathered rows).

Prefill sequences attend un-absorbed: their latent (earlier context included) is
gathered and up-projected through `kv_b_proj` into per-head K_nope and V, then a
causal SDPA runs with the query offset by the cached context. Decode sequences use
weight absorption and only read the latent: q_nope goes through W_UK into latent
space, so the scores are one batched product of [q_latent, q_pe] with the cache
entries, the output is P·c in latent space, and W_UV maps it to per-head values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels, kv_quant
from meshserve.layers.linear import Linear
from meshserve.layers.metadata import AttentionMetadata
from meshserve.layers.norm import RMSNorm
from meshserve.layers.paged import gather_sequence, length_mask
from meshserve.layers.rope import apply_rotary_, yarn_factor, yarn_get_mscale
from meshserve.layers.tensor_parallel import attention_tp_part, head_sharded_output_projection, row_parallel_linear
from meshserve.parallel.context import ParallelContext
from meshserve.utils import envs


def mla_softmax_scale(qk_head_dim: int, rope_parameters: dict, max_position_embeddings: int) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (as HF DeepSeek-V3 does)."""
    scale = qk_head_dim ** -0.5
    if rope_parameters.get("rope_type", "default") != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = yarn_get_mscale(yarn_factor(rope_parameters, max_position_embeddings), mscale_all_dim)
            scale = scale * mscale * mscale
    return scale


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill sequence of the batch: its new tokens and the context it attends to."""

    token_start: int
    token_end: int
    seq_len: int  # context after this step, new tokens included
    block_table: torch.Tensor  # int64 [max_blocks]
    attn_mask: torch.Tensor | None  # bool [query_len, seq_len]; None: plain causal (no earlier context)


@dataclass(frozen=True)
class MLABatchPlan:
    """Attention bookkeeping of one forward, built once and shared by every MLA layer."""

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_index: torch.Tensor  # int64 [num_decodes * blocks]: each decode sequence's blocks, flattened
    decode_seq_lens: torch.Tensor | None  # int64 [num_decodes]
    decode_padded_len: int  # blocks * block_size: the decode latent is gathered whole blocks at a time
    decode_bias: torch.Tensor | None  # [num_decodes, 1, decode_padded_len]: 0 inside a sequence, -inf past it
    prefills: tuple[PrefillSpan, ...]
    # one gather buffer per cache shape, reused by every layer of this forward
    _workspaces: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, attn: AttentionMetadata, dtype: torch.dtype, device: torch.device) -> MLABatchPlan:
        num_decodes = attn.num_decodes
        qsl = attn.query_start_loc
        if qsl[num_decodes] != num_decodes:
            raise ValueError("the first num_decodes sequences must have exactly one new token each")
        block_tables = attn.block_tables.to(device)
        decode_bias = lens = None
        num_blocks = 0
        if num_decodes:
            num_blocks = -(-max(attn.seq_lens[:num_decodes]) // attn.block_size)
            if attn.seq_lens_tensor is not None:
                lens = attn.seq_lens_tensor[:num_decodes].to(device)
            else:
                lens = torch.tensor(attn.seq_lens[:num_decodes], dtype=torch.int64, device=device)
            inside = length_mask(lens, num_blocks * attn.block_size)
            decode_bias = torch.zeros(inside.shape, dtype=dtype, device=device)
            decode_bias.masked_fill_(~inside, float("-inf"))
            decode_bias = decode_bias.unsqueeze(1)
        prefills = []
        for i in range(num_decodes, attn.num_seqs):
            query_len = attn.query_len(i)
            if query_len == 0:
                continue
            seq_len = attn.seq_lens[i]
            context_len = seq_len - query_len
            mask = None
            if context_len:
                # query j sits at position context_len + j and sees keys up to there
                query_pos = torch.arange(context_len, seq_len, device=device).unsqueeze(1)
                mask = torch.arange(seq_len, device=device).unsqueeze(0) <= query_pos
            prefills.append(PrefillSpan(qsl[i], qsl[i + 1], seq_len, block_tables[i], mask))
        return cls(
            slot_mapping=attn.slot_mapping.to(device),
            num_decodes=num_decodes,
            decode_block_index=block_tables[:num_decodes, :num_blocks].reshape(-1),
            decode_seq_lens=lens,
            decode_padded_len=num_blocks * attn.block_size,
            decode_bias=decode_bias,
            prefills=tuple(prefills),
        )

    def gather_decode_latent(self, kv_cache: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Cache entries of decode sequences [first, last), whole blocks: [last - first, decode_padded_len, *entry].

        The result is a view of a buffer reused by the next call (and by every layer of this forward).
        """
        blocks_per_seq = self.decode_padded_len // kv_cache.shape[1]
        index = self.decode_block_index[first * blocks_per_seq:last * blocks_per_seq]
        key = (kv_cache.dtype, kv_cache.device, tuple(kv_cache.shape[1:]))
        workspace = self._workspaces.get(key)
        if workspace is None or workspace.shape[0] < index.numel():
            # one reused buffer spares every layer and chunk a fresh multi-MB allocation
            workspace = kv_cache.new_empty((index.numel(), *kv_cache.shape[1:]))
            self._workspaces[key] = workspace
        out = workspace[: index.numel()]
        torch.index_select(kv_cache, 0, index, out=out)
        return out.view(last - first, self.decode_padded_len, *kv_cache.shape[2:])


# On CPU, decode attention walks the batch in chunks whose gathered latent stays in cache
# between the gather, the scores and P·c (several times faster than one pass over a large batch).
_CPU_DECODE_CHUNK_BYTES = 4 << 20


def decode_chunk_size(padded_len: int, kv_cache: torch.Tensor) -> int:
    """How many decode sequences one attention chunk covers."""
    if kv_cache.device.type != "cpu":
        return 1 << 30
    bytes_per_seq = padded_len * kv_cache[0, 0].numel() * kv_cache.element_size()
    return max(1, _CPU_DECODE_CHUNK_BYTES // max(1, bytes_per_seq))


def uninitialized_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> Linear:
    """A Linear without the random initialisation (its weights come from a checkpoint); biases start at 0."""
    layer = torch.nn.utils.skip_init(Linear, in_features, out_features, bias=bias, dtype=dtype)
    if bias:
        layer.bias.data.zero_()
    return layer


@dataclass(frozen=True)
class MLAShape:
    """The sizes of one MLA layer, named as a DeepSeek-V3 config names them (`num_heads`: all of them; a rank
    under attention TP keeps its share)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: q projected directly, without the low-rank step
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


class MultiHeadLatentAttention(torch.nn.Module):
    """MLA with optional q-LoRA; the input projections of q and the latent run as one matmul.

    Under attention TP a rank computes its own heads (`num_heads` counts them): the rows of
    q_b_proj (q_proj) and kv_b_proj of those heads, the matching input columns of o_proj, and
    the group sums the o_proj outputs. The latent projection, its norms and so the latent cache
    are the same on every rank.

    With `oproj=TPk` (attention TP1) a rank computes every head for its own tokens but holds only
    the input columns of heads-shard `oproj_rank` of o_proj; the o_proj group projects its
    members' tokens together (`head_sharded_output_projection`).
    """

    def __init__(self, shape: MLAShape, softmax_scale: float, rope_interleave: bool = True,
                 attention_bias: bool = False, dtype: torch.dtype = torch.float32,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        hidden_size, num_heads, q_lora_rank, kv_lora_rank = (shape.hidden_size, shape.num_heads, shape.q_lora_rank,
                                                             shape.kv_lora_rank)
        qk_nope_head_dim, qk_rope_head_dim = shape.qk_nope_head_dim, shape.qk_rope_head_dim
        v_head_dim = shape.v_head_dim
        self.parallel = parallel or ParallelContext.single()
        num_heads = attention_tp_part(self.parallel, num_heads, "num_attention_heads")
        self.num_heads = num_heads
        oproj_size = self.parallel.oproj_size
        if num_heads % oproj_size:
            raise ValueError(f"oproj=TP{oproj_size}: num_attention_heads of {num_heads} does not split evenly over "
                             f"the {oproj_size} ranks sharing o_proj")
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.softmax_scale = softmax_scale
        self.rope_interleave = rope_interleave
        # rows: [q_a_proj | kv_a_proj_with_mqa] with q-LoRA, [q_proj | kv_a_proj_with_mqa] without
        self.q_in_dim = q_lora_rank if q_lora_rank is not None else num_heads * self.qk_head_dim
        self.fused_qkv_a_proj = uninitialized_linear(
            hidden_size, self.q_in_dim + kv_lora_rank + qk_rope_head_dim, attention_bias, dtype)
        if q_lora_rank is not None:
            # HF builds both latent norms with the default eps, not rms_norm_eps
            self.q_a_layernorm = RMSNorm(q_lora_rank, dtype=dtype)
            self.q_b_proj = uninitialized_linear(q_lora_rank, num_heads * self.qk_head_dim, False, dtype)
        else:
            self.q_a_layernorm = None
            self.q_b_proj = None
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, dtype=dtype)
        self.kv_b_proj = uninitialized_linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False, dtype)
        # with oproj TPk: this rank's heads-shard of the input columns (the bias, added once, stays whole)
        self.o_proj = uninitialized_linear(num_heads // oproj_size * v_head_dim, hidden_size, attention_bias, dtype)
        # derived from kv_b_proj by split_absorbed_weights(): W_UK [H, nope, c], W_UV^T [H, c, v]
        self.register_buffer("w_uk", torch.zeros(num_heads, qk_nope_head_dim, kv_lora_rank, dtype=dtype),
                             persistent=False)
        self.register_buffer("w_uv", torch.zeros(num_heads, kv_lora_rank, v_head_dim, dtype=dtype),
                             persistent=False)
        self._absorbed_packed: tuple[torch.Tensor, torch.Tensor] | None = None  # W_UK, W_UV for the native kernel
        self.kv_parts = (kv_lora_rank, qk_rope_head_dim)  # the two parts of a cache entry (scaled apart in INT8)

    # ---- weights -------------------------------------------------------------------------------

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> str:
        """Copy one HF tensor (name relative to `self_attn.`); returns the parameter it went into."""
        fused = self.fused_qkv_a_proj
        kv_rows = slice(self.q_in_dim, None)
        if self.q_lora_rank is not None:
            targets = {
                "q_a_proj.weight": (fused.weight, slice(0, self.q_in_dim), "fused_qkv_a_proj.weight"),
                "q_a_proj.bias": (fused.bias, slice(0, self.q_in_dim), "fused_qkv_a_proj.bias"),
                "q_a_layernorm.weight": (self.q_a_layernorm.weight, None, name),
                "q_b_proj.weight": (self.q_b_proj.weight, None, name),
            }
        else:
            targets = {"q_proj.weight": (fused.weight, slice(0, self.q_in_dim), "fused_qkv_a_proj.weight")}
        targets.update({
            "kv_a_proj_with_mqa.weight": (fused.weight, kv_rows, "fused_qkv_a_proj.weight"),
            "kv_a_proj_with_mqa.bias": (fused.bias, kv_rows, "fused_qkv_a_proj.bias"),
            "kv_a_layernorm.weight": (self.kv_a_layernorm.weight, None, name),
            "kv_b_proj.weight": (self.kv_b_proj.weight, None, name),
            "o_proj.weight": (self.o_proj.weight, None, name),
            "o_proj.bias": (self.o_proj.bias, None, name),
        })
        param, rows, loaded = targets.get(name, (None, None, None))
        if param is None:
            raise KeyError(f"unexpected MLA weight {name!r}")
        copy_checked(param.data if rows is None else param.data[rows], tensor, name)
        return loaded

    @torch.no_grad()
    def split_absorbed_weights(self) -> None:
        """Derive W_UK and W_UV from kv_b_proj; call after kv_b_proj changes."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        self.w_uk.copy_(w[:, : self.qk_nope_head_dim])
        self.w_uv.copy_(w[:, self.qk_nope_head_dim:].transpose(1, 2))
        if self._absorbed_packed is not None:
            self.pack_weights()

    def pack_weights(self) -> int:
        """Pack W_UK and W_UV for the native CPU decode kernels (on CPU; a bfloat16 model's as float32 copies:
        its decode attention runs in float32); 0 where they do not apply. The projections themselves are Linear
        modules, packed on their own."""
        self._absorbed_packed = None
        if (self.w_uk.device.type == "cpu" and self.w_uk.dtype in (torch.float32, torch.bfloat16)
                and cpu_kernels.enabled() and self.kv_lora_rank % cpu_kernels.BLOCK_COLUMNS == 0
                and self.v_head_dim % cpu_kernels.BLOCK_COLUMNS == 0):
            self._absorbed_packed = (cpu_kernels.pack_weight(self.w_uk.float().transpose(1, 2)),
                                     cpu_kernels.pack_weight(self.w_uv.float().transpose(1, 2)))
            return 2
        return 0

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: MLABatchPlan,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden]; cos/sin [T, rope/2] of the tokens' positions -> [T, hidden]."""
        num_tokens = hidden_states.shape[0]
        if num_tokens == 0:  # an idle DP group: no attention, only its part in a shared o_proj
            return self.output_projection(hidden_states.new_zeros(0, self.num_heads * self.v_head_dim))
        q_in, c_kv, k_pe = self.fused_qkv_a_proj(hidden_states).split(
            [self.q_in_dim, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q = q_in if self.q_b_proj is None else self.q_b_proj(self.q_a_layernorm(q_in))
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        nope = self.qk_nope_head_dim
        apply_rotary_(q[..., nope:], cos, sin, self.rope_interleave)
        apply_rotary_(k_pe, cos, sin, self.rope_interleave)
        kv_quant.write(kv_cache, plan.slot_mapping, torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1),
                       self.kv_parts)

        outputs = []
        if plan.num_decodes:
            outputs.append(self._decode_absorbed(q[: plan.num_decodes], plan, kv_cache))
        for span in plan.prefills:
            outputs.append(self._prefill_unabsorbed(q[span.token_start:span.token_end], span, kv_cache))
        if len(outputs) == 1:
            attn_out = outputs[0]
        elif outputs:
            attn_out = torch.cat(outputs, dim=0)
        else:  # an empty batch
            attn_out = hidden_states.new_zeros(0, self.num_heads * self.v_head_dim)
        return self.output_projection(attn_out)

    def output_projection(self, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs [T, heads * v] -> [T, hidden], over the attention TP group or, with
        `oproj=TPk`, together with the o_proj group (whose every member must call it, with or without tokens)."""
        if self.parallel.oproj_size > 1:
            return head_sharded_output_projection(self.parallel, attn_out, self.o_proj.weight, self.o_proj.bias)
        return row_parallel_linear(self.parallel, attn_out, self.o_proj.weight, self.o_proj.bias)

    def _decode_absorbed(self, q: torch.Tensor, plan: MLABatchPlan, kv_cache: torch.Tensor) -> torch.Tensor:
        """q [B, heads, qk_head_dim] (one token per sequence) -> [B, heads * v_head_dim]."""
        batch, nope, c = q.shape[0], self.qk_nope_head_dim, self.kv_lora_rank
        native = self._native_decode(q, kv_cache)
        if native and q.dtype == torch.bfloat16:  # a bfloat16 cache: the native kernels' float32 math
            return self._decode_absorbed(q.float(), plan, kv_cache).to(torch.bfloat16)
        packed = self._absorbed_packed if native else None
        if packed is not None:  # absorption products through the native kernel, written in place
            q_full = q.new_empty(batch, self.num_heads, c + self.qk_rope_head_dim)
            cpu_kernels.grouped_linear(q[..., :nope], packed[0], q_full[..., :c])
            q_full[..., c:] = q[..., nope:]
        else:
            q_latent = torch.bmm(q[..., :nope].transpose(0, 1), self.w_uk)  # [heads, B, c]
            q_full = torch.cat((q_latent.transpose(0, 1), q[..., nope:]), dim=-1)  # [B, heads, c + rope]
        if native:  # attention read straight from the paged cache
            blocks = plan.decode_padded_len // kv_cache.shape[1]
            table = plan.decode_block_index.view(batch, blocks)
            if kv_quant.is_quantized(kv_cache.dtype):
                o_latent = kv_quant.mla_decode_int8(q_full, kv_cache, table, plan.decode_seq_lens, self.softmax_scale,
                                                    c, int8_scores=envs.int8_kv_scores_enabled())
            elif kv_cache.dtype == torch.bfloat16:
                o_latent = cpu_kernels.mla_decode_bf16(q_full, kv_cache, table, plan.decode_seq_lens,
                                                       self.softmax_scale, c)
            else:
                o_latent = cpu_kernels.mla_decode(q_full, kv_cache, table, plan.decode_seq_lens, self.softmax_scale, c)
        else:
            o_latent = self._decode_latent_gathered(q_full, plan, kv_cache)
        if packed is not None:
            out = q.new_empty(batch, self.num_heads, self.v_head_dim)
            cpu_kernels.grouped_linear(o_latent, packed[1], out)
            return out.view(batch, self.num_heads * self.v_head_dim)
        out = torch.bmm(o_latent.transpose(0, 1), self.w_uv)  # [heads, B, v]
        return out.transpose(0, 1).reshape(batch, self.num_heads * self.v_head_dim)

    def _native_decode(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the native CPU kernel takes this decode's attention: an fp32 query with an fp32 or INT8 cache,
        or a bfloat16 cache (a bfloat16 model's; the query then runs in float32), INT8 and bfloat16 rows with a
        rope part of whole vectors; on CPU, a latent of whole vectors, and the kernels on."""
        if not (q.device.type == "cpu" and kv_cache.is_contiguous() and self.kv_lora_rank % 16 == 0):
            return False
        if kv_cache.dtype == torch.bfloat16:
            return (q.dtype in (torch.float32, torch.bfloat16) and self.qk_rope_head_dim % 16 == 0
                    and self._absorbed_packed is not None and cpu_kernels.enabled())
        if q.dtype != torch.float32:
            return False
        if kv_quant.is_quantized(kv_cache.dtype):
            return self.qk_rope_head_dim % 16 == 0 and kv_quant.native_decode_available()
        return kv_cache.dtype == torch.float32 and cpu_kernels.enabled()

    def _decode_latent_gathered(self, q_full: torch.Tensor, plan: MLABatchPlan, kv_cache: torch.Tensor) -> torch.Tensor:
        """The torch path: P·c [B, heads, c] with the latent gathered chunk by chunk into contiguous copies."""
        batch = q_full.shape[0]
        o_latent = q_full.new_empty(batch, self.num_heads, self.kv_lora_rank)
        step = decode_chunk_size(plan.decode_padded_len, kv_cache)
        for first in range(0, batch, step):
            last = min(first + step, batch)
            latent = kv_quant.read(plan.gather_decode_latent(kv_cache, first, last), self.kv_parts,
                                   q_full.dtype)  # [b, L, c + rope]
            # q_latent·c + q_pe·k_pe is one product because the entry stores [c, k_pe] side by side
            scores = torch.baddbmm(plan.decode_bias[first:last], q_full[first:last], latent.transpose(1, 2),
                                   alpha=self.softmax_scale)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_full.dtype)
            torch.bmm(probs, latent[..., : self.kv_lora_rank], out=o_latent[first:last])
        return o_latent

    def _prefill_unabsorbed(self, q: torch.Tensor, span: PrefillSpan, kv_cache: torch.Tensor) -> torch.Tensor:
        """q [Q, heads, qk_head_dim] of one sequence -> [Q, heads * v_head_dim]."""
        latent = kv_quant.read(gather_sequence(kv_cache, span.block_table, span.seq_len), self.kv_parts, q.dtype)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(span.seq_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(1).expand(span.seq_len, self.num_heads, self.qk_rope_head_dim)
        k = torch.cat((k_nope, k_pe), dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=span.attn_mask, is_causal=span.attn_mask is None, scale=self.softmax_scale)
        return out.transpose(0, 1).reshape(q.shape[0], self.num_heads * self.v_head_dim)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), refusing a shape mismatch."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
