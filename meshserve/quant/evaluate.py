"""Quality of a W8A8 checkpoint against the float one it was made from.

`quality(reference_dir, quantized_dir, data)` runs both in HF transformers on the same token windows: the
reference in float, the quantized checkpoint with its own W8A8 math (weights dequantized from int8, inputs
of every quantized linear and routed expert quantized per token; see `hf.load_model`). It reports the
held-out perplexity of each, the top-1 agreement of the next-token predictions and the mean KL divergence
KL(p_reference || p_quantized) of the next-token distributions, over every position.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from meshserve.quant import hf


def tokenize_texts(model_dir: str | Path, texts: Sequence[str], seq_len: int) -> list[torch.Tensor]:
    """The texts tokenized with the model's tokenizer and cut into windows of `seq_len` tokens (one batch
    per text; a text shorter than two tokens is skipped)."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    batches = []
    for text in texts:
        ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
        if ids.numel() < 2:
            continue
        if ids.numel() <= seq_len:
            batches.append(ids[None])
        else:
            usable = ids.numel() // seq_len * seq_len
            batches.append(ids[:usable].view(-1, seq_len))
    return batches


def _as_batches(data, model_dir: str | Path, seq_len: int) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        data = [data]
    data = list(data)
    if not data:
        raise ValueError("no evaluation data")
    if all(isinstance(d, str) for d in data):
        batches = tokenize_texts(model_dir, data, seq_len)
    else:
        batches = [torch.as_tensor(d, dtype=torch.long) for d in data]
        batches = [b[None] if b.dim() == 1 else b for b in batches]
    if not batches or any(b.dim() != 2 or b.shape[1] < 2 for b in batches):
        raise ValueError("evaluation data must be texts or token batches [batch, seq_len >= 2]")
    return batches


@torch.no_grad()
def compare_logits(reference, quantized, batches: list[torch.Tensor]) -> dict:
    """The metrics of `quality` for two loaded models."""
    nll_ref = nll_q = 0.0
    targets = 0
    agree = positions = 0
    kl_sum = 0.0
    for ids in batches:
        ref = reference(input_ids=ids, use_cache=False).logits.float()
        out = quantized(input_ids=ids, use_cache=False).logits.float()
        logp_ref, logp_q = F.log_softmax(ref, dim=-1), F.log_softmax(out, dim=-1)
        nxt = ids[:, 1:]
        nll_ref -= float(logp_ref[:, :-1].gather(-1, nxt[..., None]).sum())
        nll_q -= float(logp_q[:, :-1].gather(-1, nxt[..., None]).sum())
        targets += nxt.numel()
        agree += int((ref.argmax(-1) == out.argmax(-1)).sum())
        positions += ids.numel()
        kl_sum += float((logp_ref.exp() * (logp_ref - logp_q)).sum())
    return {"perplexity": math.exp(nll_q / targets), "reference_perplexity": math.exp(nll_ref / targets),
            "top1_agreement": agree / positions, "kl": kl_sum / positions, "tokens": positions}


def quality(reference_dir: str | Path, quantized_dir: str | Path, data, seq_len: int = 256) -> dict:
    """{"perplexity", "reference_perplexity", "top1_agreement", "kl", "tokens"} of the checkpoint in
    `quantized_dir` (run with its W8A8 math) against the float one in `reference_dir`, on `data`: texts (cut
    into `seq_len` windows with the reference's tokenizer) or token batches [batch, seq_len]."""
    batches = _as_batches(data, reference_dir, seq_len)
    reference, _, _ = hf.load_model(reference_dir)
    quantized, _, spec = hf.load_model(quantized_dir)
    if spec is None:
        raise ValueError(f"{quantized_dir} is not a W8A8 compressed-tensors checkpoint")
    return compare_logits(reference, quantized, batches)
