"""The engine's MTP layer (DeepseekV3ForCausalLM.forward_mtp) against the training-side reference.

The reference (meshserve/train/mtp.py) runs HF transformers' DeepSeek-V3 main model and an MTP module
built from HF's decoder layer, on the same checkpoint; it is the math `meshserve train` optimises. The
engine runs the main model and then the MTP layer over the paged cache, once as one prefill span and once
position by position as one-token decode rows (the catch-up and draft layouts of speculative decoding).
"""
from __future__ import annotations

import pytest
import torch

from meshserve.layers.metadata import AttentionMetadata
from meshserve.models.loader import load_model
from meshserve.train.mtp import load_main_and_mtp, mtp_reference_logits

BLOCK = 4
TOKENS = [5, 812, 77, 3000, 41, 41, 9, 15000, 250, 6, 6, 31000, 2]
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
    return tiny_model("deepseek_v3", seed=5)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return mtp_reference_logits(load_main_and_mtp(checkpoint), TOKENS)


def _engine_mtp_logits(model, one_token_rows: bool) -> torch.Tensor:
    layout = model.kv_cache_layout(torch.float32, num_mtp_layers=1)
    caches = layout.allocate(16, BLOCK)
    table = [11, 3, 7, 0]  # scrambled, so a wrong block lookup cannot pass
    n = len(TOKENS)
    with torch.inference_mode():
        attn = AttentionMetadata.build([n], [0], [table], BLOCK)
        hidden = model(torch.tensor(TOKENS), torch.arange(n), attn, caches[:-1])
        previous, next_ids, positions = hidden[:-1], torch.tensor(TOKENS[1:]), torch.arange(n - 1)
        if not one_token_rows:
            attn = AttentionMetadata.build([n - 1], [0], [table], BLOCK)
            return model.compute_mtp_logits(model.forward_mtp(previous, next_ids, positions, attn, caches[-1]))
        rows = []
        for p in range(n - 1):  # the catch-up of decode steps: one position at a time
            attn = AttentionMetadata.build([1], [p], [table], BLOCK)
            out = model.forward_mtp(previous[p:p + 1], next_ids[p:p + 1], positions[p:p + 1], attn, caches[-1])
            rows.append(model.compute_mtp_logits(out))
        return torch.cat(rows)


@pytest.mark.parametrize("one_token_rows", [False, True], ids=["prefill-span", "decode-rows"])
def test_engine_mtp_matches_the_reference(checkpoint, reference, one_token_rows):
    model = load_model(str(checkpoint), dtype=torch.float32)
    assert model.num_mtp_layers == 1
    ours = _engine_mtp_logits(model, one_token_rows)
    assert ours.shape == reference.shape == (len(TOKENS) - 1, model.params.vocab_size)
    assert torch.allclose(ours, reference, atol=TOLERANCE, rtol=0), (ours - reference).abs().max()
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_the_mtp_cache_is_one_more_layer_of_the_layout(checkpoint):
    model = load_model(str(checkpoint), dtype=torch.float32)
    plain, with_mtp = model.kv_cache_layout(), model.kv_cache_layout(num_mtp_layers=1)
    assert with_mtp.num_layers == plain.num_layers + 1
    assert with_mtp.bytes_per_token * plain.num_layers == plain.bytes_per_token * with_mtp.num_layers
    with pytest.raises(ValueError, match="MTP layer"):
        model.kv_cache_layout(num_mtp_layers=2)
