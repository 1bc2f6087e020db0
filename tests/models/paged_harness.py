"""Drive a model through the paged KV cache the way the runner does, for math tests."""
from __future__ import annotations

import torch

from meshserve.layers.metadata import AttentionMetadata


class PagedHarness:
    def __init__(self, model, block_size: int = 4, num_blocks: int = 256) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = model.kv_cache_layout().allocate(num_blocks, block_size)
        # hand out blocks in a scrambled order so a wrong block-table lookup cannot pass by accident
        g = torch.Generator().manual_seed(0)
        self.free_blocks = torch.randperm(num_blocks, generator=g).tolist()
        self.block_tables: list[list[int]] = []
        self.lens: list[int] = []

    def _ensure_blocks(self, seq: int, new_len: int) -> None:
        while len(self.block_tables[seq]) * self.block_size < new_len:
            self.block_tables[seq].append(self.free_blocks.pop())

    @torch.inference_mode()
    def step(self, seq_ids: list[int], new_tokens: list[list[int]], microbatches: int = 1) -> list[torch.Tensor]:
        """Run one batch: seq i gets new_tokens[i] appended. Returns per-seq logits [len(new), V]."""
        for s in seq_ids:
            while s >= len(self.block_tables):
                self.block_tables.append([])
                self.lens.append(0)
        # decodes (one token) first, as the runner lays them out
        order = sorted(range(len(seq_ids)), key=lambda i: len(new_tokens[i]) != 1)
        ids, pos, q_lens, ctx_lens, tables = [], [], [], [], []
        for i in order:
            s, toks = seq_ids[i], new_tokens[i]
            self._ensure_blocks(s, self.lens[s] + len(toks))
            ids += toks
            pos += list(range(self.lens[s], self.lens[s] + len(toks)))
            q_lens.append(len(toks))
            ctx_lens.append(self.lens[s])
            tables.append(self.block_tables[s])
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, self.block_size)
        extra = {"microbatches": microbatches} if microbatches != 1 else {}
        hidden = self.model(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta,
                            self.kv_caches, **extra)
        logits = self.model.compute_logits(hidden)
        out: list[torch.Tensor | None] = [None] * len(seq_ids)
        start = 0
        for i, q in zip(order, q_lens):
            out[i] = logits[start:start + q]
            start += q
            self.lens[seq_ids[i]] += q
        return out  # type: ignore[return-value]


@torch.inference_mode()
def prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of one prompt prefilled from an empty cache of 4 blocks of 8 tokens."""
    meta = AttentionMetadata.build([len(tokens)], [0], [list(range(4))], block_size=8)
    caches = model.kv_cache_layout().allocate(num_blocks=4, block_size=8)
    return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)), meta, caches))


def short_random_prompts() -> list[list[int]]:
    """Four prompts of 5 to 30 random ids (seeded), the quantization tests' inputs."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 31900, (n,), generator=g).tolist() for n in (5, 30, 17, 9)]
