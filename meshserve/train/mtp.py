"""DeepSeek-V3's multi-token-prediction (MTP) module for training, built from HF transformers layers.

DeepSeek-V3 report §2.2, with one MTP depth. For position t of a sequence:

    h = main.model(input_ids).last_hidden_state        # after the final norm
    e = embed(input_ids[t + 1])                         # the main embedding (shared), unless the layer has its own
    x = eh_proj(cat([enorm(e), hnorm(h[t])]))           # embedding first, hidden state second
    x = block(x)                                        # one decoder layer, causal, positions 0 .. T-2
    mtp_logits[t] = shared_head.head(shared_head.norm(x))   # predicts input_ids[t + 2]

The engine runs the same math at inference (`models.deepseek_v3.DeepseekV3MTPLayer`);
`mtp_reference_logits` is the oracle its tests compare with.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from meshserve.models.hf_experts import fuse_experts
from meshserve.utils.checkpoint_files import safetensors_files


class SharedHead(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(nn.Module):
    """One MTP module; its parameter names are the checkpoint's below `model.layers.{layer_idx}.`
    (block weights under `block.` there are the checkpoint's decoder-layer names)."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.enorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx)
        self.shared_head = SharedHead(config)
        self.embed_tokens: nn.Embedding | None = None  # only when the checkpoint carries the layer's own copy

    def tie_head(self, lm_head: nn.Linear) -> None:
        """Share the main model's output head (DeepSeek-V3 shares it between the main model and MTP)."""
        self.shared_head.head.weight = lm_head.weight

    def forward(self, main: DeepseekV3ForCausalLM, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """MTP logits [B, T-1, V] from `input_ids` [B, T] and the main model's final hidden states [B, T, H]."""
        embed = self.embed_tokens if self.embed_tokens is not None else main.model.embed_tokens
        next_embeds = embed(input_ids[:, 1:])
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden[:, :-1])], dim=-1))
        batch, length = x.shape[:2]
        positions = torch.arange(length, device=x.device).unsqueeze(0).expand(batch, -1)
        mask = create_causal_mask(config=main.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=positions)
        x = self.block(x, attention_mask=mask, position_ids=positions,
                       position_embeddings=main.model.rotary_emb(x, positions))
        return self.shared_head.head(self.shared_head.norm(x))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This layer's tensors by checkpoint name (fused experts still fused), the head written even when tied."""
        prefix = f"model.layers.{self.layer_idx}."
        state = self.state_dict()
        return {prefix + name.removeprefix("block."): tensor for name, tensor in state.items()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], with_head: bool = True) -> None:
        """Fill the layer from checkpoint tensors named `model.layers.{layer_idx}.*` (others are ignored)."""
        prefix = f"model.layers.{self.layer_idx}."
        own = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
        if "embed_tokens.weight" in own:
            self.embed_tokens = nn.Embedding(*own["embed_tokens.weight"].shape)
        own = fuse_experts(own)
        if not with_head:
            own.pop("shared_head.head.weight", None)
        block_names = {name for name, _ in self.block.state_dict().items()}
        state = {("block." + name if name in block_names else name): t for name, t in own.items()}
        missing, unexpected = self.load_state_dict(state, strict=False)
        if not with_head:
            missing = [name for name in missing if name != "shared_head.head.weight"]
        if missing or unexpected:
            raise ValueError(f"MTP layer {self.layer_idx}: missing {missing[:5]}, unexpected {unexpected[:5]}")


def read_layer_tensors(model_dir: str | Path, layer_idx: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of decoder (or MTP) layer `layer_idx`, by checkpoint name."""
    prefix = f"model.layers.{layer_idx}."
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if name.startswith(prefix):
                    tensors[name] = handle.get_tensor(name)
    return tensors


def load_mtp_layers(model_dir: str | Path, config: DeepseekV3Config) -> nn.ModuleList:
    """The checkpoint's MTP layers (float32), stored after the `num_hidden_layers` decoder layers."""
    count = json.loads((Path(model_dir) / "config.json").read_text()).get("num_nextn_predict_layers", 0)
    layers = nn.ModuleList()
    for i in range(count):
        layer = MTPLayer(config, config.num_hidden_layers + i)
        layer.load_checkpoint_tensors(read_layer_tensors(model_dir, layer.layer_idx))
        layers.append(layer.float())
    return layers


def from_pretrained_quietly(model_class, model_dir: str | Path, **kwargs):
    """`model_class.from_pretrained` in float32 without HF's table of the MTP tensors it leaves unloaded."""
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        return model_class.from_pretrained(str(model_dir), dtype=torch.float32, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()


def load_main_and_mtp(model_dir: str | Path, attn_implementation: str = "eager"
                      ) -> tuple[DeepseekV3ForCausalLM, MTPLayer]:
    """HF's main model and the first MTP layer of a DeepSeek-V3 checkpoint, float32, in eval mode."""
    main = from_pretrained_quietly(DeepseekV3ForCausalLM, model_dir, attn_implementation=attn_implementation)
    layers = load_mtp_layers(model_dir, main.config)
    if not layers:
        raise ValueError(f"{model_dir} has no MTP layer (num_nextn_predict_layers is 0)")
    return main.eval(), layers[0].eval()


@torch.inference_mode()
def mtp_reference_logits(model: str | Path | tuple[DeepseekV3ForCausalLM, MTPLayer],
                         input_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """The MTP layer's logits [T-1, V] (float32) for one sequence of T tokens: row t predicts token t + 2
    from the main model's hidden state at t and token t + 1. `model` is a checkpoint directory or
    (main, mtp) as `load_main_and_mtp` returns them."""
    main, mtp = load_main_and_mtp(model) if isinstance(model, (str, Path)) else model
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    if ids.shape[1] < 2:
        raise ValueError("MTP needs at least 2 tokens (it reads token t + 1)")
    hidden = main.model(input_ids=ids).last_hidden_state
    return mtp(main, ids, hidden)[0].float()
