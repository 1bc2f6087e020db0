"""The native token-mask op (structured outputs) against the torch path: the same tokens refused, on every
row the mask covers and no other, for float32 and bfloat16 logits and a vocabulary that ends inside a word."""
from __future__ import annotations

import pytest
import torch

from meshserve.layers import cpu_kernels
from meshserve.worker.grammar_masks import GrammarMasks

VOCAB = 1000  # 31.25 words: the last word is cut


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3]], ids=["every row", "some rows"])
def test_the_native_op_refuses_what_the_torch_path_refuses(dtype, rows):
    assert cpu_kernels.enabled()
    g = torch.Generator().manual_seed(0)
    words = (VOCAB + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0, :5] = 0  # whole words refused
    bitmask[1, 5:9] = -1  # whole words allowed
    masks = GrammarMasks("unused", VOCAB, [1])
    logits = torch.randn(4, VOCAB, generator=g).to(dtype)
    native = logits.clone()
    masks.apply(native, bitmask, rows)
    with cpu_kernels.disabled():
        reference = logits.clone()
        masks.apply(reference, bitmask, rows)
    assert torch.equal(native, reference)
    untouched = [r for r in range(4) if r not in rows]
    assert torch.equal(native[untouched], logits[untouched])
    refused = torch.isinf(native[rows[0]])
    expected = [not (int(bitmask[rows[0], t // 32]) >> (t % 32)) & 1 for t in range(VOCAB)]
    assert refused.tolist() == expected
    masks.close()
