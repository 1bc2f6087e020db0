"""HF transformers modules <-> the factory's checkpoint layout (per-expert tensors, MTP layers after the decoder).

Routed experts are split per expert first (`meshserve.models.hf_experts`). `write_checkpoint` writes a
trained model with the same files, names and shard plan as `models.factory.make_model`.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from meshserve.models import tokenizer_assets as tok
from meshserve.models.factory import (
    DEFAULT_MAX_SHARD_BYTES,
    _write_json,
    checkpoint_tensor_shapes,
    generation_config,
    write_safetensors_shards,
)


def check_layout(tensors: Mapping[str, torch.Tensor], config: dict) -> list[str]:
    """The checkpoint order of `tensors`' names; raises unless they are exactly the factory's layout for
    `config` (an MTP layer's own `embed_tokens` may be left out: the main embedding is then meant)."""
    expected = checkpoint_tensor_shapes(config)
    optional = {name for name in expected if re.fullmatch(r"model\.layers\.\d+\.embed_tokens\.weight", name)}
    missing = sorted(set(expected) - set(tensors) - optional)
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint layout differs from the factory's: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the layout says {expected[name]}")
    return [name for name in expected if name in tensors]


def write_checkpoint(out_dir: Path, config: dict, tensors: Mapping[str, torch.Tensor],
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write config, generation config, tokenizer files and the weights into the existing `out_dir`."""
    order = check_layout(tensors, config)
    dtype = getattr(torch, config["torch_dtype"])
    # e_score_correction_bias stays fp32 on disk, as HF keeps it
    on_disk: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        tensor = (tensor if name.endswith("e_score_correction_bias") else tensor.to(dtype)).detach().contiguous()
        if tensor.data_ptr() in seen:  # a tied head: safetensors stores each tensor on its own
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        on_disk[name] = tensor
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config())
    tok.write_tokenizer_files(out_dir, model_max_length=config["max_position_embeddings"])
    write_safetensors_shards(out_dir, {name: on_disk[name] for name in order}, max_shard_bytes)
