"""Loading a W8A8 INT8 compressed-tensors checkpoint of an MoE model in HF transformers.

transformers (5.23) keeps each MoE layer's routed experts as fused 3-D parameters and, for a quantized
checkpoint, dequantizes the per-expert tensors before merging them (`CompressedTensorsDequantize`). That
step knows two expert layouts only: FP8 (`weight` + `weight_scale` pairs) and packed integers
(`weight_packed`). The `int-quantized` format that vLLM and llm-compressor use for W8A8 INT8 stores int8
`weight` + `weight_scale` pairs, which fall through both branches: the experts come out empty and
`from_pretrained` stops with a conversion error. Dense layers, attention and `lm_head` load fine.

`int8_experts_loading()` adds the missing branch while it is active: an int8 expert weight times its
per-channel scale, exactly the FP8 branch's arithmetic. Nothing else of the load changes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


def _dequantize_int8_pairs(input_dict: dict, dtype: torch.dtype) -> dict:
    out = {}
    for key, value in input_dict.items():
        if key.endswith("weight_scale"):
            continue
        scale_key = key.removesuffix("weight") + "weight_scale"
        if scale_key not in input_dict:
            out[key] = value
            continue
        codes = value if isinstance(value, list) else [value]
        scales = input_dict[scale_key]
        scales = scales if isinstance(scales, list) else [scales]
        out[key] = torch.stack([(q.to(torch.float32) * s.to(torch.float32)).to(dtype)
                                for q, s in zip(codes, scales)])
    return out


def _is_int8_expert_pairs(input_dict: dict) -> bool:
    keys = list(input_dict)
    if "weight" in input_dict or "weight_scale" in input_dict:  # a dense module: transformers handles it
        return False
    if any("weight_packed" in k for k in keys) or not any(k.endswith("weight_scale") for k in keys):
        return False
    for key in keys:
        if key.endswith("weight_scale"):
            continue
        values = input_dict[key] if isinstance(input_dict[key], list) else [input_dict[key]]
        if not all(v.dtype == torch.int8 for v in values):
            return False
    return True


@contextlib.contextmanager
def int8_experts_loading() -> Iterator[None]:
    """While active, transformers loads int8 `weight` + `weight_scale` routed experts (see the module doc)."""
    from transformers.integrations.compressed_tensors import CompressedTensorsDequantize

    original = CompressedTensorsDequantize.convert

    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, **kwargs):
        if _is_int8_expert_pairs(input_dict):
            dtype = kwargs["model"].get_parameter(full_layer_name).dtype
            return _dequantize_int8_pairs(input_dict, dtype)
        return original(self, input_dict, source_patterns, target_patterns, full_layer_name=full_layer_name,
                        **kwargs)

    CompressedTensorsDequantize.convert = convert
    try:
        yield
    finally:
        CompressedTensorsDequantize.convert = original


def load_in_transformers(model_dir: str | Path, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)` for a W8A8 checkpoint (float32 by
    default), with `int8_experts_loading` active."""
    from transformers import AutoModelForCausalLM

    kwargs.setdefault("dtype", torch.float32)
    with int8_experts_loading():
        return AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
