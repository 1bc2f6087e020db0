"""Grouped-query attention over the paged KV cache.

One layer's cache is `[num_blocks, block_size, 2, num_kv_heads, head_dim]` (entry index 0 = K,
1 = V). New K/V are written first, so every sequence then reads its whole context, new tokens
included, from the cache (a prefill with no earlier context uses its fresh K/V directly).

Decode sequences (one query each) run as one padded batch. Query heads are grouped under
their KV head (`[B, Hk, group, D]`), so the group plays the role of SDPA's query length and the
KV heads are never repeated. Prefill sequences run one at a time with causal SDPA; when earlier
context exists the query block starts at offset `context_len`, which needs an explicit mask.

In an INT8 cache (`kv_quant`) each K and V row of a head is int8 followed by its bfloat16 scale
(`[..., 2, num_kv_heads, head_dim + 2]`); reads dequantize, and a prefill without earlier context
attends to its fresh K/V as the cache will return them, so every path sees the same numbers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from meshserve.layers import kv_quant
from meshserve.layers.metadata import AttentionMetadata
from meshserve.layers.paged import gather_batch, gather_sequence, length_mask


class PagedGQAAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self._parts = (head_dim,)  # one scale per token, K/V and head in an INT8 cache

    def entry_shape(self, dtype: torch.dtype | None = None) -> tuple[int, int, int]:
        """One token's cache entry in a cache of `dtype` (default: a float one)."""
        return kv_quant.gqa_entry_shape(self.num_kv_heads, self.head_dim, dtype or torch.float32)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] for the batch's new tokens -> attention output [T, Hq, D]."""
        if tuple(kv_cache.shape[2:]) != self.entry_shape(kv_cache.dtype):
            raise ValueError(f"kv cache entries are {tuple(kv_cache.shape[2:])}, "
                             f"expected {self.entry_shape(kv_cache.dtype)}")
        entries = torch.stack((k, v), dim=1)
        written = kv_quant.write(kv_cache, attn.slot_mapping, entries, self._parts)
        if written is not entries:  # INT8: attend to what the cache holds
            k, v = written.unbind(1)
        outputs = []
        if attn.num_decodes:
            outputs.append(self._decode(q[: attn.num_decodes], attn, kv_cache))
        for i in range(attn.num_decodes, attn.num_seqs):
            start, end = attn.query_start_loc[i], attn.query_start_loc[i + 1]
            outputs.append(self._prefill(q[start:end], k[start:end], v[start:end], attn, i, kv_cache))
        if not outputs:
            return q.new_empty(q.shape)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _decode(self, q: torch.Tensor, attn: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        num_decodes = q.shape[0]
        max_len = max(attn.seq_lens[:num_decodes])  # host list: no device sync
        kv = kv_quant.read(gather_batch(kv_cache, attn.block_tables[:num_decodes], max_len), self._parts,
                           q.dtype)  # [B, L, 2, Hk, D]
        keys = kv[:, :, 0].transpose(1, 2)  # [B, Hk, L, D]
        values = kv[:, :, 1].transpose(1, 2)
        if attn.seq_lens_tensor is not None:
            seq_lens = attn.seq_lens_tensor[:num_decodes]
        else:
            seq_lens = torch.tensor(attn.seq_lens[:num_decodes], device=q.device)
        mask = length_mask(seq_lens, max_len)[:, None, None, :]  # [B, 1, 1, L]
        grouped = q.view(num_decodes, self.num_kv_heads, self.group, self.head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(num_decodes, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata, seq: int,
                 kv_cache: torch.Tensor) -> torch.Tensor:
        query_len = q.shape[0]
        seq_len = attn.seq_lens[seq]
        context_len = seq_len - query_len
        gqa = self.group > 1
        if context_len == 0:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=gqa)
            return out.transpose(0, 1)
        kv = kv_quant.read(gather_sequence(kv_cache, attn.block_tables[seq], seq_len), self._parts,
                           q.dtype)  # [S, 2, Hk, D]
        # query j sits at position context_len + j and sees keys 0..context_len + j
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = torch.arange(context_len, seq_len, device=q.device)
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [Lq, S]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1),
            attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return out.transpose(0, 1)
