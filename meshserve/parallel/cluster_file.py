"""Cluster descriptions for the strategy analyzer: the papers' presets and cluster YAML files."""
from __future__ import annotations

from typing import Any

import yaml

from meshserve.parallel.analyzer import Cluster

GB = 1e9
GBIT = 1e9 / 8

# The two clusters of MixServe §IV-A. Memory and link bandwidths are the paper's;
# dense bf16 FLOP/s are the vendors' datasheet figures and link latencies are
# typical values, neither of which the paper states.
CLUSTER_PRESETS: dict[str, Cluster] = {
    "h20-2x8": Cluster(name="h20-2x8", nodes=2, devices_per_node=8, device_memory_bytes=96 * GB,
                       flops=148e12, intra_bandwidth=900 * GB, inter_bandwidth=400 * GBIT,
                       intra_latency=5e-6, inter_latency=15e-6),
    "ascend910b-4x8": Cluster(name="ascend910b-4x8", nodes=4, devices_per_node=8, device_memory_bytes=64 * GB,
                              flops=313e12, intra_bandwidth=480 * GBIT, inter_bandwidth=200 * GBIT,
                              intra_latency=10e-6, inter_latency=25e-6),
}

# The architecture fields of the published HF config.json files.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-r1": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "vocab_size": 129280, "max_position_embeddings": 163840,
        "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}

# Cluster file keys -> (Cluster field, multiplier to SI units).
_CLUSTER_FILE_KEYS = {
    "name": ("name", None), "nodes": ("nodes", None), "devices_per_node": ("devices_per_node", None),
    "device_memory_gb": ("device_memory_bytes", GB), "tflops": ("flops", 1e12),
    "intra_bandwidth_gb_s": ("intra_bandwidth", GB), "inter_bandwidth_gb_s": ("inter_bandwidth", GB),
    "intra_latency_us": ("intra_latency", 1e-6), "inter_latency_us": ("inter_latency", 1e-6),
    "a2a_latency_us": ("a2a_latency", 1e-6), "a2a_bandwidth_gb_s": ("a2a_bandwidth", GB),
    "memory_bandwidth_gb_s": ("memory_bandwidth", GB), "a2a_concurrent": ("a2a_concurrent", None),
}
# Keys a cluster file may carry for people, not for the analyzer: `calibrate` records its raw samples here.
_CLUSTER_FILE_NOTES = {"measured"}


class PlanError(ValueError):
    """A bad `meshserve plan` input, reported as one line."""


def load_cluster_file(path: str) -> Cluster:
    """Cluster YAML: nodes, devices_per_node, device_memory_gb, tflops, intra/inter_bandwidth_gb_s,
    optional intra/inter_latency_us, a2a_latency_us with a2a_bandwidth_gb_s (a measured all-to-all),
    memory_bandwidth_gb_s (weights read once per step), a2a_concurrent (all-to-alls reach every peer at once) and
    name; a `measured` section is ignored."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise PlanError(f"cannot read cluster file {path}: {e}") from e
    if not isinstance(data, dict):
        raise PlanError(f"cluster file {path} must be a mapping")
    data = {key: value for key, value in data.items() if key not in _CLUSTER_FILE_NOTES}
    unknown = sorted(set(data) - set(_CLUSTER_FILE_KEYS))
    if unknown:
        raise PlanError(f"cluster file {path}: unknown keys {', '.join(unknown)}")
    required = set(_CLUSTER_FILE_KEYS) - {"name", "intra_latency_us", "inter_latency_us", "a2a_latency_us",
                                          "a2a_bandwidth_gb_s", "memory_bandwidth_gb_s", "a2a_concurrent"}
    missing = sorted(required - set(data))
    if missing:
        raise PlanError(f"cluster file {path}: missing keys {', '.join(missing)}")
    kwargs: dict[str, Any] = {"name": str(data.get("name", path))}
    for key, value in data.items():
        field, scale = _CLUSTER_FILE_KEYS[key]
        if key == "a2a_concurrent":
            if not isinstance(value, bool):
                raise PlanError(f"cluster file {path}: {key} must be true or false, got {value!r}")
            kwargs[field] = value
        elif scale is None:
            kwargs[field] = value if key == "name" else _as_int(key, value)
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PlanError(f"cluster file {path}: {key} must be a number, got {value!r}")
            kwargs[field] = float(value) * scale
    return Cluster(**kwargs)


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"cluster {key} must be an integer, got {value!r}")
    return value
