"""What a batch and its KV cache look like to the attention layers.

Tokens of a batch are flattened into one dimension (T tokens in all). Sequences
appear in the order the runner lays them out: first the `num_decodes` decode
sequences (one new token each, their context already in the paged cache), then
the prefill sequences (one or more new tokens each; a prefill may continue a
chunk or start after a prefix-cache hit, so it can also have earlier context
in the cache).

The KV cache is one tensor per attention layer, shaped
`[num_blocks, block_size, *layout.entry_shape]`. A token at flat slot `s` lives
at `cache.view(-1, *entry_shape)[s]`, with `s = block_id * block_size + offset`.
An INT8 cache (`kv_quant`) is an int8 tensor whose rows also hold their scales, so its
last entry dimension counts bytes: values plus two bytes of scale per part.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers import kv_quant


@dataclass(frozen=True)
class KVCacheLayout:
    """What one token occupies in one layer's cache."""

    num_layers: int
    entry_shape: tuple[int, ...]  # MLA: (kv_lora_rank + qk_rope_head_dim,); GQA: (2, num_kv_heads, head_dim)
    dtype: torch.dtype  # torch.int8: quantized entries with their scales inside (`kv_quant`), widths in bytes

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> KVCacheLayout:
        """One latent row per token: [c_kv | k_pe] (INT8: each part with its scale)."""
        return cls(num_layers, kv_quant.mla_entry_shape(kv_lora_rank, qk_rope_head_dim, dtype), dtype)

    @classmethod
    def gqa(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVCacheLayout:
        """K and V rows per KV head (INT8: each row with its scale)."""
        return cls(num_layers, kv_quant.gqa_entry_shape(num_kv_heads, head_dim, dtype), dtype)

    @property
    def bytes_per_token(self) -> int:
        n = 1
        for d in self.entry_shape:
            n *= d
        return n * self.num_layers * torch.tensor([], dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        return [
            torch.zeros((num_blocks, block_size, *self.entry_shape), dtype=self.dtype, device=device)
            for _ in range(self.num_layers)
        ]


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and which cached tokens each sequence attends to."""

    num_decodes: int  # the first `num_decodes` sequences have exactly one new token
    query_start_loc: list[int]  # len num_seqs + 1: new tokens of seq i are [query_start_loc[i], query_start_loc[i+1])
    seq_lens: list[int]  # tokens in context after this step (cached before + new), per sequence
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [T]: flat cache slot that receives each new token's K/V
    block_size: int
    # Optional tensors the runner precomputes for the decode fast path (same content as above).
    seq_lens_tensor: torch.Tensor | None = None  # int64 [num_seqs]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def context_len(self, i: int) -> int:
        """Tokens of sequence i that were cached before this step."""
        return self.seq_lens[i] - self.query_len(i)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        num_decodes: int | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from plain lists (runner and tests share this)."""
        if num_decodes is None:
            num_decodes = 0
            for q in query_lens:
                if q != 1:
                    break
                num_decodes += 1
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        max_blocks = max((len(b) for b in block_tables), default=1) or 1
        # one tensor from padded lists: a row-by-row fill costs more than the step's other inputs together
        bt = (torch.tensor([blocks + [0] * (max_blocks - len(blocks)) for blocks in block_tables], dtype=torch.int64)
              if block_tables else torch.zeros((0, max_blocks), dtype=torch.int64))
        slots = [blocks[pos // block_size] * block_size + pos % block_size
                 for blocks, c, q in zip(block_tables, context_lens, query_lens) for pos in range(c, c + q)]
        return cls(
            num_decodes=num_decodes,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=bt.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=block_size,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        )

    def split(self, num_seqs: int) -> tuple[AttentionMetadata, AttentionMetadata]:
        """The first `num_seqs` sequences and the rest, each as a batch of its own (two micro-batches: their
        tokens are this batch's first `query_start_loc[num_seqs]` tokens and the others)."""
        if not 0 <= num_seqs <= self.num_seqs:
            raise ValueError(f"cannot split {self.num_seqs} sequences after the first {num_seqs}")
        cut = self.query_start_loc[num_seqs]
        lens = self.seq_lens_tensor
        first = AttentionMetadata(
            num_decodes=min(self.num_decodes, num_seqs), query_start_loc=self.query_start_loc[:num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs], block_tables=self.block_tables[:num_seqs],
            slot_mapping=self.slot_mapping[:cut], block_size=self.block_size,
            seq_lens_tensor=None if lens is None else lens[:num_seqs])
        second = AttentionMetadata(
            num_decodes=max(0, self.num_decodes - num_seqs),
            query_start_loc=[q - cut for q in self.query_start_loc[num_seqs:]],
            seq_lens=self.seq_lens[num_seqs:], block_tables=self.block_tables[num_seqs:],
            slot_mapping=self.slot_mapping[cut:], block_size=self.block_size,
            seq_lens_tensor=None if lens is None else lens[num_seqs:])
        return first, second

    @classmethod
    def empty(cls, device: torch.device | str = "cpu", block_size: int = 1) -> AttentionMetadata:
        """A step with no sequences: an idle DP group runs it to join the other groups' MoE collectives."""
        return cls.build([], [], [], block_size, num_decodes=0, device=device)
