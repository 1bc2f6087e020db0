"""The HF transformers model that calibration and evaluation run: loading, naming, W8A8 fake quantization.

transformers 5 keeps an MoE layer's routed experts fused (`experts.gate_up_proj` [E, 2I, H] with the gate
rows first, `experts.down_proj` [E, H, I]); checkpoints store one tensor per expert and projection. Here
the checkpoint names are the ones that count: `expert_weight(model, "model.layers.1.mlp.experts.3.up_proj")`
is a view into the fused tensor.

`load_model(dir)` builds the model from a float checkpoint or from a W8A8 one (int8 weights dequantized
with their scales) and installs the W8A8 activation math for the quantized linears: each input row
(token) is quantized to int8 per token before the matmul (forward pre-hooks on nn.Linear; the routed
experts run `experts_forward`, which quantizes each expert's gate/up input and down input per token).
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.models.compressed_tensors import SCALE_SUFFIX, W8A8Spec, read_quantization_config
from meshserve.models.hf_experts import fuse_experts
from meshserve.models.loader import iter_safetensors, load_hf_config
from meshserve.quant.int8 import dequantize_weight, fake_quantize_activation

_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "qwen3_moe", "qwen3")


def read_config(model_dir: str | Path) -> dict:
    config = load_hf_config(model_dir)
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {config.get('model_type')!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return config


def is_main_model_tensor(name: str, config: dict) -> bool:
    """Whether HF's model has this checkpoint tensor (the MTP layers after the decoder it has not)."""
    match = _LAYER.match(name)
    return match is None or int(match.group(1)) < int(config["num_hidden_layers"])


# ---------------------------------------------------------------------------------------------
# experts


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's eager routed-experts math; with `self.w8a8` set, each expert's gate/up and down inputs are
    quantized per token (int8, symmetric) as the W8A8 kernels do."""
    quantize = getattr(self, "w8a8", False)
    x = fake_quantize_activation(hidden_states) if quantize else hidden_states
    out = torch.zeros_like(hidden_states)
    for expert in torch.unique(top_k_index).tolist():
        if expert >= self.num_experts:
            continue
        token_idx, slot = torch.where(top_k_index == expert)
        gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
        inner = self.act_fn(gate) * up
        if quantize:
            inner = fake_quantize_activation(inner)
        y = F.linear(inner, self.down_proj[expert]) * top_k_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Fused routed-experts modules by name (`model.layers.L.mlp.experts`)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(module, "down_proj", None), torch.Tensor)}


def expert_weight(model: nn.Module, name: str) -> torch.Tensor:
    """The [out, in] view of a routed expert's projection inside the fused tensors; `name` is the checkpoint
    module name (`...experts.E.gate_proj`)."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        raise KeyError(f"{name} is not a routed expert projection")
    prefix, expert, kind = match.groups()
    module = model.get_submodule(prefix)
    expert = int(expert)
    if kind == "down_proj":
        return module.down_proj.data[expert]
    inter = module.gate_up_proj.shape[1] // 2
    rows = slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter)
    return module.gate_up_proj.data[expert, rows]


def linear_weight(model: nn.Module, name: str) -> torch.Tensor:
    """The weight tensor ([out, in], shared storage) of the checkpoint module `name`."""
    if _EXPERT.fullmatch(name):
        return expert_weight(model, name)
    module = model.get_submodule(name)
    if not isinstance(module, nn.Linear):
        raise KeyError(f"{name} is not a Linear module")
    return module.weight.data


# ---------------------------------------------------------------------------------------------
# loading


def read_checkpoint(model_dir: str | Path, config: dict, main_only: bool = True) -> dict[str, torch.Tensor]:
    """All checkpoint tensors in file order (only those HF's model has when `main_only`)."""
    wanted = (lambda name: is_main_model_tensor(name, config)) if main_only else None
    return dict(iter_safetensors(model_dir, name_filter=wanted))


def dequantized_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
                        ) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with every int8 `weight` + `weight_scale` pair replaced by the float weight."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name.removesuffix(".weight") + SCALE_SUFFIX) if name.endswith(".weight") else None
        if scale is not None:
            out[name] = dequantize_weight(tensor, scale, dtype)
        elif tensor.is_floating_point() and not name.endswith("e_score_correction_bias"):
            out[name] = tensor.to(dtype)
        else:
            out[name] = tensor
    return out


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def build_model(config: dict, tensors: dict[str, torch.Tensor], attn_implementation: str = "sdpa") -> nn.Module:
    """HF's causal LM for `config` (its quantization_config left out) holding the float checkpoint `tensors`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with _quiet_transformers(), no_init_weights():
        hf_config = AutoConfig.for_model(**plain)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    state = fuse_experts(tensors)
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if config.get("tie_word_embeddings", False):
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit HF's {config['model_type']} model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for module in experts_modules(model).values():
        module.forward = experts_forward.__get__(module)
    return model.eval()


def quantize_inputs_hook(_module: nn.Module, args: tuple) -> tuple:
    return (fake_quantize_activation(args[0]), *args[1:])


def install_w8a8(model: nn.Module, is_quantized) -> list[str]:
    """Per-token int8 input quantization for the Linear modules and routed experts that `is_quantized(name)`
    (checkpoint module names); returns the names of the Linear modules hooked."""
    hooked = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and is_quantized(name):
            module.register_forward_pre_hook(quantize_inputs_hook)
            hooked.append(name)
    for name, module in experts_modules(model).items():
        module.w8a8 = is_quantized(f"{name}.0.gate_proj")
    return hooked


def load_model(model_dir: str | Path, attn_implementation: str = "sdpa") -> tuple[nn.Module, dict, W8A8Spec | None]:
    """(HF model in eval mode, config.json, W8A8 spec or None) for a float or a W8A8 checkpoint. A W8A8
    checkpoint runs its own math: weights dequantized from int8, inputs of quantized linears quantized per
    token."""
    config = read_config(model_dir)
    spec = read_quantization_config(config)
    tensors = dequantized_tensors(read_checkpoint(model_dir, config))
    model = build_model(config, tensors, attn_implementation)
    if spec is not None:
        install_w8a8(model, spec.is_quantized)
    return model, config, spec
