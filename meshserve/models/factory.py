"""Deterministic random checkpoints in HF format, with the house tokenizer and chat template.

`make_model("deepseek_v3", "tiny", out_dir)` writes a directory that HF transformers and
meshserve both load: config.json, safetensors weights (sharded with an index when large),
generation_config.json and the tokenizer files. Each tensor is drawn from a generator
seeded by (seed, tensor name), so the same arguments always give byte-identical weights.

Init scales keep the random model numerically pleasant: O(1) hidden states through the
layers, routers that clearly prefer some experts per token, and final logits with a std
of about 3, so greedy decoding has margins far above float noise.

Torch and safetensors are imported inside the functions that need them: the CLI imports
this module to build its parser.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from meshserve.models import tokenizer_assets as tok
from meshserve.utils import envs

logger = logging.getLogger(__name__)

ARCHITECTURES = ("deepseek_v3", "qwen3_moe", "qwen3")
PRESET_NAMES = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_BYTES = 256 * 2**20

_YARN_ROPE_SCALING = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _common_config(architecture: str, model_type: str) -> dict:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": tok.VOCAB_SIZE,
        "bos_token_id": tok.special_token_ids()[tok.BOS_TOKEN],
        "eos_token_id": tok.special_token_ids()[tok.EOS_TOKEN],
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _deepseek_v3(*, hidden: int, layers: int, experts: int, moe_intermediate: int, intermediate: int,
                 heads: int, mla: tuple[int, int, int, int, int]) -> dict:
    """`mla`: q_lora_rank, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim."""
    q_lora, kv_lora, rope_dim, nope_dim, v_dim = mla
    return _common_config("DeepseekV3ForCausalLM", "deepseek_v3") | {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "seq_aux": True,
        "aux_loss_alpha": 0.001,
        "ep_size": 1,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": nope_dim,
        "v_head_dim": v_dim,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": dict(_YARN_ROPE_SCALING),
        "rope_interleave": True,
    }


def _qwen3_attention(*, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                     intermediate: int) -> dict:
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "max_window_layers": layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
    }


def _qwen3_moe(*, experts: int, moe_intermediate: int, **attention) -> dict:
    return _common_config("Qwen3MoeForCausalLM", "qwen3_moe") | _qwen3_attention(**attention) | {
        "num_experts": experts,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": moe_intermediate,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def _qwen3(**attention) -> dict:
    return _common_config("Qwen3ForCausalLM", "qwen3") | _qwen3_attention(**attention)


# Architecture -> preset -> HF config.json contents (the keys real checkpoints of that model_type carry).
PRESETS: dict[str, dict[str, dict]] = {
    "deepseek_v3": {
        "tiny": _deepseek_v3(hidden=256, layers=4, experts=16, moe_intermediate=128, intermediate=512,
                             heads=8, mla=(128, 64, 16, 32, 32)),
        "small": _deepseek_v3(hidden=768, layers=8, experts=32, moe_intermediate=256, intermediate=2048,
                              heads=12, mla=(384, 256, 32, 64, 64)),
    },
    "qwen3_moe": {
        "tiny": _qwen3_moe(hidden=256, layers=4, experts=16, moe_intermediate=128, heads=8, kv_heads=2,
                           head_dim=32, intermediate=512),
        "small": _qwen3_moe(hidden=768, layers=8, experts=32, moe_intermediate=256, heads=12, kv_heads=4,
                            head_dim=64, intermediate=2048),
    },
    "qwen3": {
        "tiny": _qwen3(hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=768),
        "small": _qwen3(hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2048),
    },
}


# ---------------------------------------------------------------------------------------------
# Config


def preset_config(arch: str, preset: str, overrides: dict | None = None) -> dict:
    """A fresh copy of the preset's HF config with `overrides` applied and checked."""
    if arch not in PRESETS:
        raise ValueError(f"unknown arch {arch!r}; choose one of: {', '.join(ARCHITECTURES)}")
    if preset not in PRESETS[arch]:
        raise ValueError(f"unknown preset {preset!r} for {arch}; choose one of: {', '.join(PRESET_NAMES)}")
    config = copy.deepcopy(PRESETS[arch][preset])
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise ValueError(f"unknown {arch} config key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(config))}")
    # Real checkpoints spell the dtype `torch_dtype`; transformers 5 writes `dtype`. Keep both equal.
    dtypes = {overrides.pop(key) for key in ("dtype", "torch_dtype") if key in overrides}
    if len(dtypes) > 1:
        raise ValueError(f"dtype and torch_dtype overrides disagree: {sorted(map(str, dtypes))}")
    config.update(copy.deepcopy(overrides))
    if dtypes:
        config["torch_dtype"] = config["dtype"] = dtypes.pop()
    if arch == "qwen3_moe" and "mlp_only_layers" not in overrides:
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < config["num_hidden_layers"]]
    if arch in ("qwen3", "qwen3_moe") and "max_window_layers" not in overrides:
        config["max_window_layers"] = config["num_hidden_layers"]
    validate_config(config)
    return config


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def validate_config(config: dict) -> None:
    """Reject configs the weight layout (or HF) cannot represent, with the reason."""
    model_type = config["model_type"]
    positive = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    if model_type == "deepseek_v3":
        positive += ["kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size",
                     "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"]
    else:
        positive += ["head_dim"]
    if model_type == "qwen3_moe":
        positive += ["moe_intermediate_size", "num_experts", "num_experts_per_tok", "decoder_sparse_step"]
    for key in positive:
        value = config[key]
        _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"{key} must be a positive integer, got {value!r}")
    _require(config["vocab_size"] >= tok.VOCAB_SIZE,
             f"vocab_size must be at least the tokenizer's {tok.VOCAB_SIZE}, got {config['vocab_size']}")
    _require(config["num_attention_heads"] % config["num_key_value_heads"] == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
    dtype = config["torch_dtype"]
    _require(dtype in DTYPES, f"torch_dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if model_type == "deepseek_v3":
        q_lora = config["q_lora_rank"]
        _require(q_lora is None or (isinstance(q_lora, int) and q_lora > 0),
                 f"q_lora_rank must be a positive integer or None, got {q_lora!r}")
        experts, groups = config["n_routed_experts"], config["n_group"]
        _require(experts % groups == 0, f"n_routed_experts ({experts}) must be a multiple of n_group ({groups})")
        _require(experts // groups >= 2,
                 "each expert group needs at least 2 experts (groups are scored by their top 2)")
        _require(config["topk_group"] <= groups, "topk_group must not exceed n_group")
        _require(config["num_experts_per_tok"] <= experts // groups * config["topk_group"],
                 "num_experts_per_tok must fit in the experts of the topk_group selected groups")
        _require(config["moe_layer_freq"] == 1, "only moe_layer_freq 1 is supported (as in HF transformers)")
        _require(config["n_shared_experts"] >= 0 and config["num_nextn_predict_layers"] >= 0,
                 "n_shared_experts and num_nextn_predict_layers must not be negative")
    if model_type == "qwen3_moe":
        _require(config["num_experts_per_tok"] <= config["num_experts"],
                 "num_experts_per_tok must not exceed num_experts")


# ---------------------------------------------------------------------------------------------
# Checkpoint layout (HF on-disk tensor names, per-expert weights)


def _mlp_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (intermediate, hidden),
        f"{prefix}.up_proj.weight": (intermediate, hidden),
        f"{prefix}.down_proj.weight": (hidden, intermediate),
    }


def _mla_shapes(prefix: str, config: dict) -> dict[str, tuple[int, ...]]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    rope, nope, v_dim = config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["v_head_dim"]
    bias = config["attention_bias"]
    shapes: dict[str, tuple[int, ...]] = {}
    if q_lora is None:
        shapes[f"{prefix}.q_proj.weight"] = (heads * (nope + rope), hidden)
    else:
        shapes[f"{prefix}.q_a_proj.weight"] = (q_lora, hidden)
        if bias:
            shapes[f"{prefix}.q_a_proj.bias"] = (q_lora,)
        shapes[f"{prefix}.q_a_layernorm.weight"] = (q_lora,)
        shapes[f"{prefix}.q_b_proj.weight"] = (heads * (nope + rope), q_lora)
    shapes[f"{prefix}.kv_a_proj_with_mqa.weight"] = (kv_lora + rope, hidden)
    if bias:
        shapes[f"{prefix}.kv_a_proj_with_mqa.bias"] = (kv_lora + rope,)
    shapes[f"{prefix}.kv_a_layernorm.weight"] = (kv_lora,)
    shapes[f"{prefix}.kv_b_proj.weight"] = (heads * (nope + v_dim), kv_lora)
    shapes[f"{prefix}.o_proj.weight"] = (hidden, heads * v_dim)
    if bias:
        shapes[f"{prefix}.o_proj.bias"] = (hidden,)
    return shapes


def _gqa_shapes(prefix: str, config: dict) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
        shapes[f"{prefix}.{proj}.weight"] = (out, hidden)
        if config["attention_bias"]:
            shapes[f"{prefix}.{proj}.bias"] = (out,)
    shapes[f"{prefix}.o_proj.weight"] = (hidden, q_out)
    if config["attention_bias"]:
        shapes[f"{prefix}.o_proj.bias"] = (hidden,)
    shapes[f"{prefix}.q_norm.weight"] = (head_dim,)
    shapes[f"{prefix}.k_norm.weight"] = (head_dim,)
    return shapes


def is_moe_layer(config: dict, layer: int) -> bool:
    """Whether decoder layer `layer` has routed experts (HF's rule for the model_type)."""
    if config["model_type"] == "deepseek_v3":
        return layer >= config["first_k_dense_replace"]
    if config["model_type"] == "qwen3_moe":
        return (layer not in config["mlp_only_layers"] and config["num_experts"] > 0
                and (layer + 1) % config["decoder_sparse_step"] == 0)
    return False


def _moe_shapes(prefix: str, config: dict) -> dict[str, tuple[int, ...]]:
    hidden, moe_intermediate = config["hidden_size"], config["moe_intermediate_size"]
    deepseek = config["model_type"] == "deepseek_v3"
    experts = config["n_routed_experts"] if deepseek else config["num_experts"]
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.gate.weight": (experts, hidden)}
    if deepseek:
        shapes[f"{prefix}.gate.e_score_correction_bias"] = (experts,)
    for expert in range(experts):
        shapes.update(_mlp_shapes(f"{prefix}.experts.{expert}", hidden, moe_intermediate))
    if deepseek and config["n_shared_experts"] > 0:
        shapes.update(_mlp_shapes(f"{prefix}.shared_experts", hidden, moe_intermediate * config["n_shared_experts"]))
    return shapes


def _decoder_layer_shapes(prefix: str, config: dict, layer: int) -> dict[str, tuple[int, ...]]:
    hidden = config["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.input_layernorm.weight": (hidden,)}
    if config["model_type"] == "deepseek_v3":
        shapes.update(_mla_shapes(f"{prefix}.self_attn", config))
    else:
        shapes.update(_gqa_shapes(f"{prefix}.self_attn", config))
    shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    if is_moe_layer(config, layer):
        shapes.update(_moe_shapes(f"{prefix}.mlp", config))
    else:
        shapes.update(_mlp_shapes(f"{prefix}.mlp", hidden, config["intermediate_size"]))
    return shapes


def _mtp_layer_shapes(config: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek's multi-token-prediction module, stored as decoder layer `num_hidden_layers + i`."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    prefix = f"model.layers.{layer}"
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.embed_tokens.weight": (vocab, hidden),
        f"{prefix}.enorm.weight": (hidden,),
        f"{prefix}.hnorm.weight": (hidden,),
        f"{prefix}.eh_proj.weight": (hidden, 2 * hidden),
    }
    shapes.update(_decoder_layer_shapes(prefix, config, layer))
    shapes[f"{prefix}.shared_head.norm.weight"] = (hidden,)
    shapes[f"{prefix}.shared_head.head.weight"] = (vocab, hidden)
    return shapes


def num_mtp_layers(config: dict) -> int:
    return config.get("num_nextn_predict_layers", 0) if config["model_type"] == "deepseek_v3" else 0


def checkpoint_tensor_shapes(config: dict, include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint for `config`, name -> shape, in a fixed order."""
    hidden, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(layers):
        shapes.update(_decoder_layer_shapes(f"model.layers.{layer}", config, layer))
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    if include_mtp:
        for i in range(num_mtp_layers(config)):
            shapes.update(_mtp_layer_shapes(config, layers + i))
    return shapes


def count_parameters(config: dict, include_mtp: bool = False) -> int:
    """Parameters of the model described by `config` (MTP modules excluded by default, as model cards count)."""
    return sum(math.prod(shape) for shape in checkpoint_tensor_shapes(config, include_mtp=include_mtp).values())


# ---------------------------------------------------------------------------------------------
# Initialisation

_NORM_SPREAD = 0.1  # norm weights ~ 1 + N(0, 0.1)
_LOGIT_STD = 3.0  # std of final logits for unit-RMS normed hidden states
# Output-embedding rows get log-normal scales exp(0.5 * N(0, 1)): heavier-tailed logits put the
# top-1 token well clear of the top-2 (median margin ~3 instead of ~0.5 for Gaussian logits).
_OUTPUT_ROW_LOG_SCALE_STD = 0.5
# o_proj / down_proj are scaled by RESIDUAL_GAIN / sqrt(2L). Block outputs before that scale have
# RMS ~0.55 (attention averages values, SwiGLU shrinks), so the residual stream grows from the
# unit-RMS embeddings to about RMS 2 after L layers: the layers matter and nothing blows up.
_RESIDUAL_GAIN = 3.0
_ROUTER_LOGIT_STD = 2.0  # router logits spread: some experts clearly preferred per token
_SCORE_BIAS_STD = 0.02  # DeepSeek e_score_correction_bias: small next to sigmoid scores in (0, 1)
_BIAS_STD = 0.02
_RESIDUAL_OUTPUT_NAMES = ("o_proj.weight", "down_proj.weight")


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, tensor name), stable across processes and platforms."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _is_output_embedding(name: str) -> bool:
    return name == "lm_head.weight" or name.endswith("shared_head.head.weight")


def _init_std_and_mean(name: str, shape: tuple[int, ...], config: dict) -> tuple[float, float]:
    """(std, mean) of the normal distribution tensor `name` is drawn from."""
    if name.endswith("norm.weight"):  # every RMSNorm: layernorms, q/k norms, enorm/hnorm, final norms
        return _NORM_SPREAD, 1.0
    if name.endswith("e_score_correction_bias"):
        return _SCORE_BIAS_STD, 0.0
    if name.endswith(".bias"):
        return _BIAS_STD, 0.0
    if name.endswith("embed_tokens.weight"):
        return 1.0, 0.0
    fan_in = shape[-1]
    if _is_output_embedding(name):
        return _LOGIT_STD / math.sqrt(fan_in), 0.0
    if name.endswith("mlp.gate.weight"):
        return _ROUTER_LOGIT_STD / math.sqrt(fan_in), 0.0
    if name.endswith(_RESIDUAL_OUTPUT_NAMES):
        # MoE blocks sum top-k experts scaled by routed_scaling_factor: shrink each expert so the
        # mixture adds about what one dense MLP would.
        scale = _RESIDUAL_GAIN / math.sqrt(2 * config["num_hidden_layers"])
        if ".experts." in name:
            scale /= _routed_output_gain(config)
        return scale / math.sqrt(fan_in), 0.0
    return 1.0 / math.sqrt(fan_in), 0.0


def _routed_output_gain(config: dict) -> float:
    """Rough RMS gain of the weighted sum of top-k routed experts over one expert."""
    top_k = config["num_experts_per_tok"]
    # Top-k weights sum to routed_scaling_factor (DeepSeek, normalised) or 1 (Qwen3 normalised).
    total_weight = config.get("routed_scaling_factor", 1.0) if config.get("norm_topk_prob", True) else 1.0
    return max(total_weight / math.sqrt(top_k), 1e-3)


def init_tensor(name: str, shape: tuple[int, ...], config: dict, seed: int):
    """Tensor `name` of the random checkpoint, drawn in fp32 then cast to the on-disk dtype."""
    # keeps torch out of `meshserve` start-up (the parser imports this module)
    import torch

    std, mean = _init_std_and_mean(name, shape, config)
    generator = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
    tensor = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std).add_(mean)
    if _is_output_embedding(name):
        sigma = _OUTPUT_ROW_LOG_SCALE_STD
        # exp(sigma * n) has mean square exp(2 sigma^2); dividing by exp(sigma^2) keeps the logit std.
        row_scales = torch.randn(shape[0], generator=generator, dtype=torch.float32).mul_(sigma).exp_()
        tensor.mul_(row_scales.div_(math.exp(sigma**2)).unsqueeze(1))
    if name.endswith("e_score_correction_bias"):
        return tensor  # HF keeps this buffer in fp32 (`_keep_in_fp32_modules_strict`)
    return tensor.to(getattr(torch, config["torch_dtype"]))


# ---------------------------------------------------------------------------------------------
# Writing


_BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}


def _tensor_bytes(name: str, shape: tuple[int, ...], config: dict) -> int:
    dtype = "float32" if name.endswith("e_score_correction_bias") else config["torch_dtype"]
    return math.prod(shape) * _BYTES_PER_ELEMENT[dtype]


def plan_shards(config: dict, max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard of the factory's checkpoint of `config` (see `shard_by_size`)."""
    sizes = [(name, _tensor_bytes(name, shape, config)) for name, shape in checkpoint_tensor_shapes(config).items()]
    return shard_by_size(sizes, max_shard_bytes)


def shard_by_size(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard: fill shards in the given order, starting a new one before exceeding the limit."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _shard_file_names(num_shards: int) -> list[str]:
    if num_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def write_safetensors_shards(out_dir: Path, tensors: dict, max_shard_bytes: int) -> None:
    """Write `tensors` (name -> tensor, in checkpoint order) into `out_dir` as safetensors shards of at most
    `max_shard_bytes` (see `shard_by_size`), with the index file when there are several."""
    from safetensors.torch import save

    sizes = [(name, t.numel() * t.element_size()) for name, t in tensors.items()]
    shards = shard_by_size(sizes, max_shard_bytes)
    files = _shard_file_names(len(shards))
    for file_name, names in zip(files, shards):
        (out_dir / file_name).write_bytes(save({n: tensors[n] for n in names}, metadata={"format": "pt"}))
    if len(files) > 1:
        weight_map = {name: file_name for file_name, names in zip(files, shards) for name in names}
        _write_json(out_dir / "model.safetensors.index.json",
                    {"metadata": {"total_size": sum(size for _, size in sizes)},
                     "weight_map": dict(sorted(weight_map.items()))})


def _progress_bar(total_bytes: int, description: str):
    # start-up: tqdm only for a large checkpoint
    from tqdm import tqdm

    # Only large checkpoints get a bar; tqdm itself stays quiet when stderr is not a terminal.
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=description,
                disable=True if total_bytes < 64 * 2**20 else None)


def _write_weights(out_dir: Path, config: dict, seed: int, max_shard_bytes: int) -> None:
    # keeps torch out of `meshserve` start-up (the parser imports this module)
    from safetensors.torch import save

    shapes = checkpoint_tensor_shapes(config)
    shards = plan_shards(config, max_shard_bytes)
    files = _shard_file_names(len(shards))
    total_bytes = sum(_tensor_bytes(name, shape, config) for name, shape in shapes.items())
    with _progress_bar(total_bytes, f"writing {out_dir.name}") as progress:
        for number, (file_name, names) in enumerate(zip(files, shards), start=1):
            tensors = {}
            for name in names:
                tensors[name] = init_tensor(name, shapes[name], config, seed)
                progress.update(_tensor_bytes(name, shapes[name], config))
            # `save` + write_bytes (not save_file) so the file gets the usual umask permissions.
            (out_dir / file_name).write_bytes(save(tensors, metadata={"format": "pt"}))
            del tensors
            if len(files) > 1:
                logger.info("wrote shard %d/%d (%d tensors)", number, len(files), len(names))
    if len(files) > 1:
        weight_map = {name: file_name for file_name, names in zip(files, shards) for name in names}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out_dir / "model.safetensors.index.json", index)


def generation_config() -> dict:
    """Generation defaults: stop at end-of-text, and at end-of-turn for chat."""
    ids = tok.special_token_ids()
    return {
        "bos_token_id": ids[tok.BOS_TOKEN],
        "eos_token_id": [ids[tok.EOS_TOKEN], ids[tok.END_OF_TURN_TOKEN]],
        "pad_token_id": ids[tok.PAD_TOKEN],
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


_STAGING_PREFIX = ".{name}.partial-"


def make_staging_dir(out_dir: str | Path) -> tuple[Path, Path]:
    """(absolute `out_dir`, a new empty staging sibling to fill and `rename_into_place`): a directory written
    this way appears complete or not at all. FileExistsError when `out_dir` is a file or not empty."""
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if _is_nonempty_dir(out_dir):
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / (_STAGING_PREFIX.format(name=out_dir.name) + uuid.uuid4().hex[:12])
    staging.mkdir()
    return out_dir, staging


def rename_into_place(staging: Path, out_dir: Path) -> None:
    try:
        os.rename(staging, out_dir)  # atomic; replaces only an empty directory
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(f"{out_dir} was written by someone else meanwhile") from exc
        raise


def _is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def make_model(arch: str, preset: str, out_dir: str | Path, seed: int = 0, overrides: dict | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, fp8: bool = False) -> Path:
    """Write a random HF checkpoint of `arch`/`preset` (config patched by `overrides`) to `out_dir`; with
    `fp8`, its linear projections in the FP8 block format of the published DeepSeek-V3 checkpoints.

    The directory appears complete or not at all: files go to a temporary sibling that is renamed
    into place. An existing non-empty `out_dir` is never overwritten (FileExistsError).
    """
    config = preset_config(arch, preset, overrides)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir, staging = make_staging_dir(out_dir)
    params = count_parameters(config, include_mtp=True)
    logger.info("writing %s/%s (%.1fM parameters, seed %d) to %s", arch, preset, params / 1e6, seed, out_dir)
    try:
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", generation_config())
        tok.write_tokenizer_files(staging, model_max_length=config["max_position_embeddings"])
        _write_weights(staging, config, seed, max_shard_bytes)
        if fp8:
            _convert_to_fp8(staging)
        rename_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote %s", out_dir)
    return out_dir


def _convert_to_fp8(staging: Path) -> None:
    from meshserve.layers.fp8 import write_fp8_checkpoint  # torch stays out of `meshserve` start-up

    converted = staging.with_name(staging.name + "-fp8")
    try:
        write_fp8_checkpoint(staging, converted)
        for path in staging.iterdir():
            path.unlink()
        for path in converted.iterdir():
            path.rename(staging / path.name)
    finally:
        shutil.rmtree(converted, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Default model cache


def default_cache_dir() -> Path:
    """`$MESHSERVE_CACHE`, else `~/.cache/meshserve`."""
    return envs.cache_dir()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_default_model(arch: str = "deepseek_v3", preset: str = "tiny") -> Path:
    """`<cache>/models/<arch>-<preset>`, written once (seed 0) and reused by later calls and processes."""
    preset_config(arch, preset)  # fail fast on bad names
    models_dir = default_cache_dir() / "models"
    target = models_dir / f"{arch}-{preset}"
    if (target / "config.json").is_file():
        logger.info("reusing cached model %s", target)
        tok.follow_chat_template(target)
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    # The lock makes a second process wait for the first one's write instead of repeating it.
    with _file_lock(models_dir / f".{arch}-{preset}.lock"):
        if (target / "config.json").is_file():
            logger.info("reusing cached model %s (written by another process)", target)
            return target
        # Under the lock, staging directories for this name can only be left by crashed writers.
        for stale in models_dir.glob(f"{_STAGING_PREFIX.format(name=target.name)}*"):
            shutil.rmtree(stale, ignore_errors=True)
        logger.info("creating default model %s/%s in %s", arch, preset, target)
        return make_model(arch, preset, target)


# ---------------------------------------------------------------------------------------------
# CLI


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `meshserve make-model`."""
    parser.add_argument("--arch", default="deepseek_v3",
                        help=f"one of: {', '.join(ARCHITECTURES)} (default: deepseek_v3)")
    parser.add_argument("--preset", default="tiny", help=f"one of: {', '.join(PRESET_NAMES)} (default: tiny)")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    parser.add_argument("--dtype", default=None,
                        help=f"weights dtype on disk, one of: {', '.join(DTYPES)} (default: float32)")
    parser.add_argument("--fp8", action="store_true",
                        help="store the linear projections in FP8 (e4m3) with 128x128 block scales, as the "
                             "published DeepSeek-V3/R1 and Kimi-K2 checkpoints")


def make_model_main(args: argparse.Namespace) -> int:
    """Run `meshserve make-model`: print the directory written, or one error line on stderr."""
    overrides = {"torch_dtype": args.dtype} if args.dtype else None
    try:
        path = make_model(args.arch, args.preset, args.out, seed=args.seed, overrides=overrides, fp8=args.fp8)
    except (ValueError, OSError) as exc:
        print(f"meshserve make-model: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
