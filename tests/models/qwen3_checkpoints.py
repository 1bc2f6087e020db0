"""Small random Qwen3 / Qwen3-MoE checkpoints written by transformers, with the HF model kept as the oracle."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits and routing are far from uniform; norms away from 1 so a missed norm shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif p.dim() == 1:  # biases
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def make_checkpoint(path: Path, moe: bool, seed: int = 0, max_shard_size: str | None = None,
                    **overrides) -> transformers.PreTrainedModel:
    """Save a random HF model to `path`; return it (eager attention, fp32, eval) as the reference."""
    fields = {**BASE, **(MOE if moe else {}), **overrides}
    config_cls, model_cls = ((transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM) if moe
                             else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
    config = config_cls(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config)
    randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model.eval()


@torch.inference_mode()
def hf_logits(model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """Reference logits [len(tokens), vocab] for one unpadded sequence."""
    return model(torch.tensor([tokens])).logits[0].float()
