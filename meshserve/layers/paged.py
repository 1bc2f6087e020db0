"""Reading and writing the paged KV cache (shared by every attention kind)."""
from __future__ import annotations

import torch


def write_to_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
    """cache [num_blocks, block_size, *E]; entries [T, *E] go to flat slots slot_mapping [T]."""
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, slot_mapping, entries.to(cache.dtype))


def gather_sequence(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached entries of one sequence: [length, *E]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table_row[:num_blocks])
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def gather_batch(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Entries of many sequences, padded to a common length: [B, max_len, *E].

    Positions past a sequence's own length hold whatever its padding blocks hold;
    callers mask them (see `length_mask`).
    """
    block_size = cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks]
    blocks = cache.index_select(0, table.reshape(-1))  # [B * nb, bs, *E]
    return blocks.view(table.shape[0], num_blocks * block_size, *cache.shape[2:])[:, :max_len]


def length_mask(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Bool [B, max_len]: True where a position is inside its sequence."""
    return torch.arange(max_len, device=seq_lens.device).unsqueeze(0) < seq_lens.unsqueeze(1)
