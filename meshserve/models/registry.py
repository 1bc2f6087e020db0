"""Model classes by HF `model_type` (imported lazily so one architecture's import cost is paid once)."""
from __future__ import annotations

import importlib

_REGISTRY: dict[str, str] = {
    "deepseek_v3": "meshserve.models.deepseek_v3:DeepseekV3ForCausalLM",
    "kimi_k2": "meshserve.models.deepseek_v3:DeepseekV3ForCausalLM",
    "qwen3_moe": "meshserve.models.qwen3_moe:Qwen3MoeForCausalLM",
    "qwen3": "meshserve.models.qwen3:Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    pass


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def model_class(model_type: str):
    try:
        target = _REGISTRY[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}") from None
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
