"""Decode roofline: what one decode step must move and compute, this machine's limits, and what we achieve.

The bound for a decode step of batch B at context length L is
    tokens/s <= B / max(bytes / bandwidth, flops / matmul_rate)
where bytes are the weights the step touches plus the KV cache it reads, and
flops are 2 per active parameter per token plus attention over the context.
Routed experts are counted as the expected number of distinct experts hit by
B tokens under uniform routing, E * (1 - (1 - k/E)^B) per MoE layer.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from meshserve.bench.workload import make_offline_workload
from meshserve.layers import cpu_kernels
from meshserve.layers.linear import linear, pack_weight
from meshserve.wire.sampling_params import SamplingParams

MLA_TYPES = ("deepseek_v3", "kimi_k2")
GQA_MOE_TYPES = ("qwen3_moe",)
DENSE_TYPES = ("qwen3",)


class RooflineConfigError(ValueError):
    """The model config cannot be costed (unknown architecture or missing field)."""


@dataclass(frozen=True)
class ModelFootprint:
    """Parameter counts (elements) of a model, split by how a decode step uses them."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    # Parameters every token touches: attention, norms, dense MLPs, routers,
    # shared experts, final norm and LM head (not the embedding table, of which
    # a step reads only its tokens' rows, nor the routed experts).
    per_token_params: int
    num_moe_layers: int
    num_experts: int
    experts_per_token: int
    params_per_expert: int
    # Cached elements per token per layer: MLA's latent (kv_lora_rank + qk_rope_head_dim), or K and V heads.
    kv_elements_per_token_per_layer: int
    # Attention flops per new token per cached position per layer.
    attention_flops_per_position_per_layer: int
    breakdown: dict[str, int] = field(default_factory=dict)

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token's forward pass multiplies with (embedding lookup excluded)."""
        return self.per_token_params + self.num_moe_layers * self.experts_per_token * self.params_per_expert

    @property
    def total_params(self) -> int:
        embedding = self.breakdown.get("embedding", 0)
        return self.per_token_params + embedding + self.num_moe_layers * self.num_experts * self.params_per_expert


@dataclass(frozen=True)
class DecodeStepCost:
    batch: int
    context_len: int
    weight_bytes: float
    kv_cache_bytes: float
    flops: float
    expected_active_experts_per_layer: float

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_cache_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class RooflineBound:
    tokens_per_s: float
    memory_time_s: float
    compute_time_s: float
    limited_by: str  # "memory" | "compute"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _require(config: dict[str, Any], key: str) -> Any:
    value = config.get(key)
    if value is None:
        raise RooflineConfigError(f"config of model_type {config.get('model_type')!r} has no {key!r}")
    return value


def footprint_from_config(config: dict[str, Any]) -> ModelFootprint:
    """Parameter footprint of a deepseek_v3 / kimi_k2, qwen3_moe or qwen3 HF config dict."""
    model_type = config.get("model_type")
    if model_type in MLA_TYPES:
        return _deepseek_v3_footprint(config)
    if model_type in GQA_MOE_TYPES or model_type in DENSE_TYPES:
        return _qwen3_footprint(config, moe=model_type in GQA_MOE_TYPES)
    raise RooflineConfigError(
        f"no roofline model for model_type {model_type!r}; "
        f"supported: {', '.join(MLA_TYPES + GQA_MOE_TYPES + DENSE_TYPES)}")


def _glu_mlp_params(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate  # gate, up and down projections


def _head_params(config: dict[str, Any], hidden: int, vocab: int) -> dict[str, int]:
    # A tied LM head is the embedding table itself: counted once, as the head every step reads in full.
    tied = bool(config.get("tie_word_embeddings", False))
    return {"embedding": 0 if tied else vocab * hidden, "lm_head": vocab * hidden, "final_norm": hidden}


def _deepseek_v3_footprint(config: dict[str, Any]) -> ModelFootprint:
    hidden = _require(config, "hidden_size")
    vocab = _require(config, "vocab_size")
    layers = _require(config, "num_hidden_layers")
    heads = _require(config, "num_attention_heads")
    nope = _require(config, "qk_nope_head_dim")
    rope = _require(config, "qk_rope_head_dim")
    v_dim = _require(config, "v_head_dim")
    kv_rank = _require(config, "kv_lora_rank")
    q_rank = config.get("q_lora_rank")
    bias = bool(config.get("attention_bias", False))
    qk_dim = nope + rope

    if q_rank is None:
        q_params = hidden * heads * qk_dim
    else:
        q_params = hidden * q_rank + q_rank + q_rank * heads * qk_dim + (q_rank if bias else 0)
    attention = (
        q_params
        + hidden * (kv_rank + rope) + (kv_rank + rope if bias else 0)  # kv_a_proj_with_mqa
        + kv_rank  # kv_a_layernorm
        + kv_rank * heads * (nope + v_dim)  # kv_b_proj (absorbed into q and o at decode: same flops)
        + heads * v_dim * hidden + (hidden if bias else 0)  # o_proj
        + 2 * hidden  # input and post-attention norms
    )

    num_experts = config.get("n_routed_experts") or 0
    first_dense = config.get("first_k_dense_replace", 0) or 0
    freq = config.get("moe_layer_freq", 1) or 1
    moe_layers = [i for i in range(layers) if num_experts and i >= first_dense and i % freq == 0]
    num_moe = len(moe_layers)
    num_dense = layers - num_moe
    dense_mlp = _glu_mlp_params(hidden, _require(config, "intermediate_size")) if num_dense else 0
    expert = _glu_mlp_params(hidden, _require(config, "moe_intermediate_size")) if num_moe else 0
    router = num_experts * hidden + num_experts  # gate weight + e_score_correction_bias
    shared = (config.get("n_shared_experts") or 0) * expert

    breakdown = {
        "attention": layers * attention,
        "dense_mlp": num_dense * dense_mlp,
        "router": num_moe * router,
        "shared_experts": num_moe * shared,
        **_head_params(config, hidden, vocab),
    }
    per_token = sum(v for k, v in breakdown.items() if k != "embedding")
    return ModelFootprint(
        model_type=config["model_type"],
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=layers,
        per_token_params=per_token,
        num_moe_layers=num_moe,
        num_experts=num_experts if num_moe else 0,
        experts_per_token=_require(config, "num_experts_per_tok") if num_moe else 0,
        params_per_expert=expert,
        kv_elements_per_token_per_layer=kv_rank + rope,
        # Absorbed MLA: scores against the latent + rope key, then a weighted sum of latents.
        attention_flops_per_position_per_layer=heads * (2 * (kv_rank + rope) + 2 * kv_rank),
        breakdown=breakdown,
    )


def _qwen3_footprint(config: dict[str, Any], moe: bool) -> ModelFootprint:
    hidden = _require(config, "hidden_size")
    vocab = _require(config, "vocab_size")
    layers = _require(config, "num_hidden_layers")
    heads = _require(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    bias = bool(config.get("attention_bias", False))

    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attention = (
        hidden * q_out + 2 * hidden * kv_out + q_out * hidden  # q, k, v, o projections
        + ((q_out + 2 * kv_out + hidden) if bias else 0)
        + 2 * head_dim  # q_norm, k_norm
        + 2 * hidden  # input and post-attention norms
    )

    num_experts = 0
    moe_layers: list[int] = []
    if moe:
        num_experts = config.get("num_experts", config.get("num_local_experts")) or 0
        sparse_step = config.get("decoder_sparse_step", 1) or 1
        mlp_only = set(config.get("mlp_only_layers") or [])
        moe_layers = [i for i in range(layers)
                      if num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0]
    num_moe = len(moe_layers)
    num_dense = layers - num_moe
    dense_mlp = _glu_mlp_params(hidden, _require(config, "intermediate_size")) if num_dense else 0
    expert = _glu_mlp_params(hidden, _require(config, "moe_intermediate_size")) if num_moe else 0
    router = num_experts * hidden

    breakdown = {
        "attention": layers * attention,
        "dense_mlp": num_dense * dense_mlp,
        "router": num_moe * router,
        "shared_experts": 0,
        **_head_params(config, hidden, vocab),
    }
    per_token = sum(v for k, v in breakdown.items() if k != "embedding")
    return ModelFootprint(
        model_type=config["model_type"],
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=layers,
        per_token_params=per_token,
        num_moe_layers=num_moe,
        num_experts=num_experts if num_moe else 0,
        experts_per_token=_require(config, "num_experts_per_tok") if num_moe else 0,
        params_per_expert=expert,
        kv_elements_per_token_per_layer=2 * kv_out,
        # q.k over every cached position, then the weighted sum of values: 2 flops per multiply-add each.
        attention_flops_per_position_per_layer=4 * heads * head_dim,
        breakdown=breakdown,
    )


def expected_active_experts(num_experts: int, experts_per_token: int, batch: int) -> float:
    """Expected distinct experts hit by `batch` tokens, each picking `experts_per_token` uniformly."""
    if num_experts <= 0 or experts_per_token <= 0:
        return 0.0
    if experts_per_token > num_experts:
        raise RooflineConfigError(f"experts_per_token {experts_per_token} exceeds num_experts {num_experts}")
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** batch)


def decode_step_cost(
    footprint: ModelFootprint,
    batch: int,
    context_len: int,
    weight_bytes_per_param: float = 4,
    kv_bytes_per_element: float = 4,
) -> DecodeStepCost:
    """Bytes moved and flops done by one decode step of `batch` sequences with `context_len` cached tokens each."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    if context_len < 0:
        raise ValueError(f"context_len must be non-negative, got {context_len}")
    active = expected_active_experts(footprint.num_experts, footprint.experts_per_token, batch)
    # Each token reads its own embedding row (already counted with a tied LM head).
    untied = footprint.breakdown.get("embedding", 0) > 0
    embedding_rows = min(batch, footprint.vocab_size) * footprint.hidden_size if untied else 0
    weight_params = (
        footprint.per_token_params
        + embedding_rows
        + footprint.num_moe_layers * active * footprint.params_per_expert
    )
    kv_elements = batch * context_len * footprint.kv_elements_per_token_per_layer * footprint.num_layers
    flops = batch * (
        2 * footprint.active_params_per_token
        + context_len * footprint.num_layers * footprint.attention_flops_per_position_per_layer
    )
    return DecodeStepCost(
        batch=batch,
        context_len=context_len,
        weight_bytes=weight_params * weight_bytes_per_param,
        kv_cache_bytes=kv_elements * kv_bytes_per_element,
        flops=float(flops),
        expected_active_experts_per_layer=active,
    )


def roofline_bound(cost: DecodeStepCost, bandwidth_gbps: float, matmul_gflops: float) -> RooflineBound:
    """Upper bound on decode tokens/s: a step can go no faster than its bytes or its flops allow."""
    if bandwidth_gbps <= 0 or matmul_gflops <= 0:
        raise ValueError("bandwidth and matmul rate must be positive")
    memory_time = cost.total_bytes / (bandwidth_gbps * 1e9)
    compute_time = cost.flops / (matmul_gflops * 1e9)
    step_time = max(memory_time, compute_time)
    return RooflineBound(
        tokens_per_s=cost.batch / step_time,
        memory_time_s=memory_time,
        compute_time_s=compute_time,
        limited_by="memory" if memory_time >= compute_time else "compute",
    )


# ---- measuring this machine -------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memory_bandwidth(
    num_bytes: int = 256 * 2**20, repeats: int = 11, device: str | torch.device = "cpu"
) -> float:
    """GB/s of a large tensor copy (read + write counted), the best of `repeats` timings.

    The default 256 MiB buffer is well beyond the last-level cache of current CPUs. The best, not the
    median: other work on a shared machine only ever slows a timing down, so the fastest is the
    machine's own rate, and a bound built from it is the highest (the fraction reached, the lowest).
    """
    device = torch.device(device)
    n = max(num_bytes // 4, 1)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page before timing
    _sync(device)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        elapsed = time.perf_counter() - start
        rates.append(2 * n * 4 / elapsed / 1e9)
    return max(rates)


def measure_matmul_rate(
    size: int = 2048, repeats: int = 9, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> float:
    """GFLOP/s of a square matmul at the current torch thread count, the best of `repeats` timings (as for
    the bandwidth: the machine's own rate, undisturbed).

    The machine's rate is the best kernel available to the process: `torch.mm`, the prepacked oneDNN
    linear and the native kernel (the two the engine itself uses on CPU) are timed, and the fastest counts.
    """
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    kernels = {"torch.mm": lambda: torch.mm(a, b, out=out)}
    packed = pack_weight(b)
    if packed is not None:
        kernels["onednn"] = lambda: linear(a, b, packed=packed)
    if device.type == "cpu" and cpu_kernels.packable(b) and cpu_kernels.enabled():
        native = cpu_kernels.pack_weight(b.unsqueeze(0))
        native_out = out.view(size, 1, size)
        kernels["native"] = lambda: cpu_kernels.grouped_linear(a.unsqueeze(1), native, native_out)
    best = 0.0
    for run in kernels.values():
        run()  # warm-up: library initialisation and page faults
        _sync(device)
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            _sync(device)
            rates.append(2 * size**3 / (time.perf_counter() - start) / 1e9)
        best = max(best, max(rates))
    return best


# ---- measuring achieved decode throughput -----------------------------------

@dataclass
class DecodeMeasurement:
    batch: int
    context_len: int
    decode_tokens: int
    tokens_per_s: float  # median over repeats
    samples: list[float]
    decode_window_s: list[float]  # last token - first token of the batch, per repeat
    first_token_spread_s: list[float]  # how far apart the batch's first tokens came

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_decode_throughput(
    llm,
    batch: int,
    context_len: int,
    decode_tokens: int,
    vocab_size: int,
    repeats: int = 3,
    seed: int = 0,
    exclude_token_ids: Iterable[int] = (),
) -> DecodeMeasurement:
    """Decode tokens/s at batch `batch`, from the engine's own token timestamps.

    The engine must hold `batch` sequences and prefill them in one step
    (`max_num_batched_tokens >= batch * context_len`): then every request gets its
    first token from the same step and the batch decodes D more steps together,
    so the rate is B*D over the time from the (median) first token to the (median)
    last. Each
    repeat uses fresh prompts, so a prefix cache cannot help.
    """
    if batch < 1 or context_len < 1 or decode_tokens < 1 or repeats < 1:
        raise ValueError("batch, context_len, decode_tokens and repeats must all be at least 1")
    max_tokens = 1 + decode_tokens
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    samples, windows, spreads = [], [], []
    for r in range(repeats):
        workload = make_offline_workload(batch, (context_len, context_len), (max_tokens, max_tokens),
                                         vocab_size, seed=seed + r, exclude_token_ids=exclude_token_ids)
        outputs = llm.generate([w.prompt_token_ids for w in workload], params)
        short = [len(o.token_ids) for o in outputs if len(o.token_ids) != max_tokens]
        if short:
            raise RuntimeError(f"decode measurement expected {max_tokens} tokens per request, got {short[:4]}")
        firsts = [o.metrics.first_token_time for o in outputs]
        # medians: a request that arrives alone is prefilled a step ahead of the batch
        window = statistics.median(o.metrics.last_token_time for o in outputs) - statistics.median(firsts)
        if window <= 0:
            raise RuntimeError("decode took no measurable time: increase decode_tokens")
        samples.append(batch * decode_tokens / window)
        windows.append(window)
        spreads.append(max(firsts) - min(firsts))
    return DecodeMeasurement(batch=batch, context_len=context_len, decode_tokens=decode_tokens,
                             tokens_per_s=statistics.median(samples), samples=samples,
                             decode_window_s=windows, first_token_spread_s=spreads)
