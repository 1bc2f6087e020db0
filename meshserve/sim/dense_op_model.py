"""A dense decoder's step (Llama family: GQA attention, a gated MLP) from the same op-level figures as the MLA op
model (meshserve/sim/op_model.py): the shape simulators of dense models share with meshserve's (Vidur,
meshserve/sim/vidur.py).

Per decoder layer, on each of a replica's `tp` devices (heads, KV heads and the MLP's columns split among them):
the QKV and output projections and the MLP's gate/up and down projections (the slower of their FLOPs at the GEMM
rate of the weight format and their weights read at the HBM rate); attention proper (a decode row reads its
request's K and V and scores them; a prompt token its (token, attended token) pairs); the elementwise ops (RMSNorm
twice, rotary embedding, the KV cache write, SiLU-and-multiply, the two residual adds) at the HBM rate; and under
TP two all-reduces of the layer's rows. A step adds the LM head (BF16, its vocabulary split over the TP devices)
over the rows it samples, and the host's gap between steps.

`DenseOps` prices each op alone, so the tables another simulator reads (`meshserve/sim/vidur.py`) and this
model's steps come from one set of formulas.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshserve.parallel.strategy import ParallelStrategy
from meshserve.sim.hardware import Hardware, HardwareError
from meshserve.sim.op_model import ACTIVATION_BYTES, HEAD_BYTES, WEIGHT_FORMATS, gemm_seconds
from meshserve.sim.profile import GroupWork

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2")
# The architecture fields of the published HF config.json (meta-llama/Meta-Llama-3-8B).
DENSE_PRESETS: dict[str, dict] = {
    "llama-3-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
KV_BYTES = 2.0  # BF16 K and V
STEP_PARTS = ("linear", "attention", "elementwise", "all_reduce", "lm_head", "host")


@dataclass(frozen=True)
class DenseShape:
    """What the dense op model needs of a Llama-family config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping) -> DenseShape:
        if config.get("model_type") not in DENSE_MODEL_TYPES:
            raise HardwareError(f"the dense op model times {', '.join(DENSE_MODEL_TYPES)} models, not "
                                f"{config.get('model_type')!r}")
        keys = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                "inter": "intermediate_size", "vocab": "vocab_size"}
        missing = [key for key in keys.values() if not config.get(key)]
        if missing:
            raise HardwareError(f"model config lacks {', '.join(missing)}")
        values = {field: int(config[key]) for field, key in keys.items()}
        kv_heads = int(config.get("num_key_value_heads") or values["heads"])
        head_dim = int(config.get("head_dim") or values["hidden"] // values["heads"])
        return cls(kv_heads=kv_heads, head_dim=head_dim, **values)

    @property
    def qkv_params(self) -> int:
        return self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def o_params(self) -> int:
        return self.heads * self.head_dim * self.hidden

    @property
    def kv_width(self) -> int:  # K and V per token and layer
        return 2 * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class DenseDeployment:
    """One replica of a dense model over `tp` devices."""

    tp: int = 1
    weight_format: str = "bf16"
    kv_bytes: float = KV_BYTES

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise HardwareError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weight_format!r}")
        if self.tp < 1:
            raise HardwareError(f"tensor-parallel degree is 1 or more, got {self.tp}")


def dense_deployment_of(strategy: ParallelStrategy, weight_format: str = "bf16") -> DenseDeployment:
    """One dense replica from a TE's layout: `attn=TPk moe=TPk` (its MLP split like its heads)."""
    if (strategy.attn_dp, strategy.moe_ep, strategy.disagg, strategy.oproj_tp) != (1, 1, False, 1) \
            or strategy.moe_tp != strategy.attn_tp:
        raise HardwareError(f"a dense model is one replica at attn=TPk moe=TPk, got {strategy}")
    return DenseDeployment(tp=strategy.attn_tp, weight_format=weight_format)


class DenseOps:
    """Seconds of each op of one layer (or the LM head) on one device of a replica."""

    def __init__(self, shape: DenseShape, hardware: Hardware, deployment: DenseDeployment) -> None:
        self.shape, self.hw, self.deployment = shape, hardware, deployment
        if shape.heads % deployment.tp or shape.kv_heads % deployment.tp:
            raise HardwareError(f"TP{deployment.tp} does not divide the model's {shape.heads} heads and "
                                f"{shape.kv_heads} KV heads")
        hardware.check_devices(deployment.tp)
        if deployment.tp > 1:
            hardware.value("devices_per_node")
            hardware.link(deployment.tp)
        self.weight_bytes, rate_op = WEIGHT_FORMATS[deployment.weight_format]
        self.gemm_flops = 1e12 * hardware.value(rate_op)
        self.attn_flops = 1e12 * hardware.value("attention_tflops")
        self.hbm = 1e9 * hardware.value("hbm_read_gbps")

    def _gemm(self, params: float, rows: float) -> float:
        return gemm_seconds(params, rows, self.gemm_flops, self.weight_bytes, self.hbm)

    def _moved(self, elements: float) -> float:
        """An elementwise op moving `elements` BF16 values through HBM (read and written)."""
        return elements * ACTIVATION_BYTES / self.hbm

    # the linear ops, by the rows through them
    def attn_pre_proj(self, rows: float) -> float:
        return self._gemm(self.shape.qkv_params / self.deployment.tp, rows)

    def attn_post_proj(self, rows: float) -> float:
        return self._gemm(self.shape.o_params / self.deployment.tp, rows)

    def mlp_up_proj(self, rows: float) -> float:  # gate and up together
        return self._gemm(2 * self.shape.hidden * self.shape.inter / self.deployment.tp, rows)

    def mlp_down_proj(self, rows: float) -> float:
        return self._gemm(self.shape.hidden * self.shape.inter / self.deployment.tp, rows)

    # the elementwise ops
    def norm(self, rows: float) -> float:
        return self._moved(2 * rows * self.shape.hidden)

    def mlp_act(self, rows: float) -> float:  # SiLU(gate) * up: two read, one written
        return self._moved(3 * rows * self.shape.inter / self.deployment.tp)

    def attn_rope(self, rows: float) -> float:
        s = self.shape
        return self._moved(2 * rows * (s.heads + s.kv_heads) * s.head_dim / self.deployment.tp)

    def kv_cache_save(self, rows: float) -> float:
        return self._moved(2 * rows * self.shape.kv_width / self.deployment.tp)

    def add(self, rows: float) -> float:
        return self._moved(3 * rows * self.shape.hidden)

    # attention proper
    def attention(self, decode_flop_tokens: float, prefill_pairs: float, kv_tokens_read: float) -> float:
        """`decode_flop_tokens`: the (decode row, attended token) pairs; `prefill_pairs`: the prompt tokens'
        (token, attended token) pairs; `kv_tokens_read`: the tokens whose K and V the step reads."""
        s, tp = self.shape, self.deployment.tp
        flops = 4.0 * s.heads * s.head_dim * (decode_flop_tokens + prefill_pairs) / tp
        read = kv_tokens_read * s.kv_width * self.deployment.kv_bytes / tp
        return max(flops / self.attn_flops, read / self.hbm)

    def attn_decode(self, batch: int, kv_tokens: int) -> float:
        """`batch` decode rows, each attending to `kv_tokens` tokens."""
        return self.attention(batch * kv_tokens, 0.0, batch * kv_tokens)

    def attn_prefill(self, kv_tokens: int, chunk: int) -> float:
        """One request's chunk of `chunk` prompt tokens after `kv_tokens` computed ones."""
        return self.attention(0.0, chunk * (kv_tokens + chunk / 2), kv_tokens + chunk)

    # communication and the head
    def all_reduce(self, rows: float) -> float:
        tp = self.deployment.tp
        if tp == 1:
            return 0.0
        return self.hw.link(tp).ring_seconds(rows * self.shape.hidden * ACTIVATION_BYTES, tp, passes=2)

    def lm_head(self, rows: float) -> float:
        """The LM head over `rows` sampled rows (none: the engine skips it)."""
        params = self.shape.vocab * self.shape.hidden / self.deployment.tp
        return gemm_seconds(params, rows, 1e12 * self.hw.value("gemm_bf16_tflops"), HEAD_BYTES, self.hbm)


class DenseStepModel:
    """The time of a dense replica's step from its work (`GroupWork`), op by op (`DenseOps`)."""

    def __init__(self, config: Mapping, hardware: Hardware, deployment: DenseDeployment,
                 delivery_ms: float = 0.0, omit: Sequence[str] = ()) -> None:
        """`omit`: parts of the step not timed (to compare with a simulator that does not time them)."""
        self.shape = DenseShape.from_config(config)
        self.ops = DenseOps(self.shape, hardware, deployment)
        self.hw, self.deployment, self.delivery_ms = hardware, deployment, delivery_ms
        unknown = sorted(set(omit) - set(STEP_PARTS))
        if unknown:
            raise HardwareError(f"no step part {', '.join(unknown)} (parts: {', '.join(STEP_PARTS)})")
        self.omit = frozenset(omit)
        self.name = f"{hardware.name} dense op model" + (f" without {', '.join(sorted(omit))}" if omit else "")

    def step_seconds(self, groups: Sequence[GroupWork]) -> float:
        return sum(self.breakdown(groups).values())

    def breakdown(self, groups: Sequence[GroupWork]) -> dict[str, float]:
        """Seconds of the step by part (one replica: one group's work)."""
        if len(groups) != 1:
            raise HardwareError(f"a dense replica runs one group's work, got {len(groups)}")
        work, ops, layers = groups[0], self.ops, self.shape.layers
        rows = work.rows
        decode_pairs = work.context_tokens * work.rows_per_decode_request
        attention = ops.attention(decode_pairs, work.prefill_pairs, work.context_tokens + work.prefill_tokens)
        parts = {
            "linear": layers * (ops.attn_pre_proj(rows) + ops.attn_post_proj(rows) + ops.mlp_up_proj(rows)
                                + ops.mlp_down_proj(rows)),
            "attention": layers * attention,
            "elementwise": layers * (2 * ops.norm(rows) + ops.attn_rope(rows) + ops.kv_cache_save(rows)
                                     + ops.mlp_act(rows) + 2 * ops.add(rows)),
            "all_reduce": layers * 2 * ops.all_reduce(rows),
            "lm_head": ops.lm_head(work.sampled_rows),
            "host": 1e-3 * self.hw.value("step_overhead_ms"),
        }
        return {part: seconds for part, seconds in parts.items() if part not in self.omit}

    def kv_pull_seconds(self, tokens: int) -> float:
        """A P/D pull of `tokens` tokens' K and V over one device's link."""
        return tokens * self.kv_bytes_per_token() / self.kv_link_bytes_per_s()

    def kv_bytes_per_token(self) -> float:
        """One token's K and V over every layer, on one device of the replica."""
        s = self.shape
        return s.layers * s.kv_width * self.deployment.kv_bytes / self.deployment.tp

    def kv_link_bytes_per_s(self) -> float:
        """One device's KV link (P/D transfers and the memory pool)."""
        return 1e9 * self.hw.value("kv_link_gbps")
