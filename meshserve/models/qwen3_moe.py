"""Qwen3-MoE (HF `model_type` "qwen3_moe"): Qwen3 attention with routed-expert MLPs.

Routing follows HF `Qwen3MoeTopKRouter`: softmax over all experts in float32, top-k, and (with
`norm_topk_prob`) renormalise the k weights to sum to one. A layer is sparse unless it is listed in
`mlp_only_layers` or `(layer_idx + 1) % decoder_sparse_step != 0`; the others keep a dense SwiGLU MLP
of `intermediate_size`, exactly like HF `Qwen3MoeDecoderLayer`.

Under a parallel strategy the router is replicated and the routed experts run through `MoERuntime`:
a rank reads only its experts (EP; of packed expert tensors only its expert range) and keeps their
intermediate-column block (MoE TP). `expert_balancer` records expert load and reconfigures
redundant expert slots (meshserve/moe/balancer.py).
"""
from __future__ import annotations

import re

import torch

from meshserve.layers.moe import FusedMoEWeights
from meshserve.layers.tensor_parallel import Shard, Span
from meshserve.models.base import RoutedExperts
from meshserve.models.qwen3 import FusedLinear, Qwen3ForCausalLM, Qwen3MLP, require
from meshserve.moe.balancer import ExpertBalancer
from meshserve.moe.runtime import MoERuntime, rank_expert_range
from meshserve.parallel.context import ParallelContext

# per-expert tensors as transformers writes them, and the packed form some checkpoints keep
_EXPERT_WEIGHT = re.compile(
    r"^(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PACKED_EXPERTS = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


class Qwen3MoeSparseBlock(torch.nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 norm_topk_prob: bool, dtype: torch.dtype, parallel: ParallelContext | None = None,
                 layer: int = 0) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.num_experts = num_experts  # across all ranks; `experts` may hold a slice
        self.hidden_size = hidden_size
        self.moe_intermediate_size = moe_intermediate_size  # full HF size; `experts` may hold a column block
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = FusedLinear(hidden_size, [num_experts], False, dtype)
        self.runtime = MoERuntime(parallel or ParallelContext.single(), num_experts, top_k, hidden_size, dtype,
                                  layer=layer)
        self.experts = self.runtime.make_weights(moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Also with 0 tokens: the runtime's collectives must run on every rank."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.runtime(x, ids, weights.to(x.dtype), self.experts)

    def expert_shape(self, proj: str) -> tuple[int, int]:
        """One expert's full HF tensor shape for `proj`."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return (h, i) if proj == "down_proj" else (i, h)


def is_sparse_layer(hf_config: dict, layer_idx: int) -> bool:
    """HF Qwen3MoeDecoderLayer's rule for which layers get the MoE block."""
    num_experts = num_routed_experts(hf_config)
    step = hf_config.get("decoder_sparse_step", 1) or 1
    return (layer_idx not in (hf_config.get("mlp_only_layers") or [])
            and num_experts > 0 and (layer_idx + 1) % step == 0)


def num_routed_experts(hf_config: dict) -> int:
    # transformers writes `num_local_experts` (its attribute_map alias); Qwen's own configs say `num_experts`
    if "num_experts" in hf_config:
        return hf_config["num_experts"]
    return hf_config.get("num_local_experts", 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_type = "qwen3_moe"

    _ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__(hf_config, dtype, parallel)
        num_experts = num_routed_experts(hf_config)
        self._expert_range = rank_expert_range(self.parallel, num_experts) if num_experts else (0, 0)
        moe_blocks = {i: layer.mlp for i, layer in enumerate(self.model.layers)
                      if isinstance(layer.mlp, Qwen3MoeSparseBlock)}
        self.expert_balancer = ExpertBalancer(moe_blocks) if moe_blocks else None

    def make_mlp(self, hf_config: dict, layer_idx: int) -> torch.nn.Module:
        if not is_sparse_layer(hf_config, layer_idx):
            return Qwen3MLP(self.dims.hidden_size, self.dims.intermediate_size, self.dtype, self.parallel)
        return Qwen3MoeSparseBlock(
            hidden_size=self.dims.hidden_size,
            num_experts=num_routed_experts(hf_config),
            top_k=require(hf_config, "num_experts_per_tok"),
            moe_intermediate_size=require(hf_config, "moe_intermediate_size"),
            norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
            dtype=self.dtype,
            parallel=self.parallel,
            layer=layer_idx,
        )

    @staticmethod
    def routed_experts_of(hf_config: dict) -> RoutedExperts:
        """The sparse layers' routed experts (what an expert rank of a disaggregated layout holds)."""
        layers = tuple(i for i in range(require(hf_config, "num_hidden_layers")) if is_sparse_layer(hf_config, i))
        return RoutedExperts(layers, num_routed_experts(hf_config), require(hf_config, "num_experts_per_tok"),
                             require(hf_config, "hidden_size"), require(hf_config, "moe_intermediate_size"))

    def weight_shard(self, name: str) -> Shard | Span | None:
        # packed expert tensors [E, ...]: only this rank's expert range is read
        if self.parallel.ep_size > 1 and _PACKED_EXPERTS.match(name):
            return Span(0, *self._expert_range)
        return super().weight_shard(name)

    def expected_pieces(self) -> dict[str, int]:
        counts = super().expected_pieces()
        for module_name, module in self.named_modules():
            if isinstance(module, FusedMoEWeights):
                counts[f"{module_name}.w13"] = 2 * module.num_experts
                counts[f"{module_name}.w2"] = module.num_experts
        return counts

    def load_special_weight(self, name: str, tensor: torch.Tensor) -> bool:
        match = _EXPERT_WEIGHT.match(name) or _PACKED_EXPERTS.match(name)
        if match is None:
            return False
        block = self._sparse_block(match["block"], name)
        if "expert" in match.groupdict():
            self._load_one_expert(match["block"], block, int(match["expert"]), match["proj"], tensor, name)
        else:
            self._load_packed_experts(match["block"], block, match["proj"], tensor, name)
        return True

    def _sparse_block(self, module_name: str, weight_name: str) -> Qwen3MoeSparseBlock:
        try:
            block = self.get_submodule(module_name)
        except AttributeError:
            block = None
        if not isinstance(block, Qwen3MoeSparseBlock):
            raise ValueError(f"unknown weight {weight_name!r}: {module_name} is not an MoE layer of this model "
                             "(check mlp_only_layers / decoder_sparse_step)")
        return block

    def _load_one_expert(self, block_name: str, block: Qwen3MoeSparseBlock, expert_id: int, proj: str,
                         tensor: torch.Tensor, name: str) -> None:
        if expert_id >= block.num_experts:
            raise ValueError(f"unknown weight {name!r}: expert {expert_id} >= num_experts {block.num_experts}")
        expected = block.expert_shape(proj)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        # the runtime's weights keep this rank's column block of their own experts and skip the others
        if block.experts.load_expert(expert_id, proj, tensor):
            self.mark_loaded(f"{block_name}.experts.{'w2' if proj == 'down_proj' else 'w13'}", (expert_id, proj))

    def _load_packed_experts(self, block_name: str, block: Qwen3MoeSparseBlock, proj: str, tensor: torch.Tensor,
                             name: str) -> None:
        """Packed tensors hold the experts of this rank's EP range (see `weight_shard`; all of them with one
        EP rank): [E, 2I, H] with gate rows then up rows, or [E, H, I]."""
        experts = block.experts
        num_local, first = experts.num_local_experts, experts.first_expert
        i = block.moe_intermediate_size
        gate_up = proj == "gate_up_proj"
        expected = (num_local, 2 * i, block.hidden_size) if gate_up else (num_local, *block.expert_shape("down_proj"))
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        param_name = "w13" if gate_up else "w2"
        for local in range(num_local):
            pieces = {"gate_proj": tensor[local, :i], "up_proj": tensor[local, i:]} if gate_up \
                else {"down_proj": tensor[local]}
            for piece, part in pieces.items():
                experts.load_expert(first + local, piece, part)
                self.mark_loaded(f"{block_name}.experts.{param_name}", (first + local, piece))
