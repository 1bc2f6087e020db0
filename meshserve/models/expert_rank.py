"""The model of an expert rank in a disaggregated layout (`attn=DPa moe=EPe disagg`, xdeepserve §5.2): the routed
experts of this rank's slots in every MoE layer of the decoder (on a shared-expert rank, `shared=EPs`, the shared
experts' column blocks instead) and nothing else (no embedding, no attention, no KV cache). Each forward of the
attention ranks, `serve_forward` serves their A2E rows layer by layer, every DP domain in turn
(meshserve/moe/runtime.py `MoERuntime.serve`); each MTP forward of theirs (speculative decoding), `serve_mtp`
serves the MTP layer's (the first, which drafts every token).

It loads like any model (meshserve/models/loader.py builds it in place of the registered model on an expert rank):
it wants the checkpoint's per-expert tensors of its experts only, and its `expert_balancer` moves experts between
its slots when the placement changes, as on a colocated rank.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from meshserve.layers.moe import FusedMoEWeights
from meshserve.models.base import CausalLM, RoutedExperts
from meshserve.moe.balancer import ExpertBalancer
from meshserve.moe.runtime import MoERuntime, rank_expert_range
from meshserve.moe.shared_ranks import load_shared_expert
from meshserve.parallel.context import ParallelContext

_EXPERT_WEIGHT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_SHARED_WEIGHT = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight")


class ExpertRankBlock(torch.nn.Module):
    """One MoE layer's slots on this expert rank (what the `ExpertBalancer` needs: a runtime and its weights)."""

    def __init__(self, experts: RoutedExperts, layer: int, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.runtime = MoERuntime(parallel, experts.num_experts, experts.top_k, experts.hidden_size, dtype,
                                  num_shared_experts=experts.num_shared_experts, layer=layer)
        self.experts: FusedMoEWeights = self.runtime.make_weights(experts.intermediate_size)


class ExpertRankModel(CausalLM):
    _ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")

    def __init__(self, hf_config: dict, dtype: torch.dtype, parallel: ParallelContext,
                 routed: RoutedExperts) -> None:
        super().__init__()
        if not parallel.is_expert_rank:
            raise ValueError(f"rank {parallel.rank} is not an expert rank of {parallel.strategy}")
        self.model_type = hf_config.get("model_type", "")
        self.parallel, self.dtype, self.routed = parallel, dtype, routed
        self.blocks = torch.nn.ModuleDict({str(layer): ExpertRankBlock(routed, layer, dtype, parallel)
                                           for layer in (*routed.layers, *routed.mtp_layers)})
        self._expert_range = rank_expert_range(parallel, routed.num_experts)
        # the decoder's layers, as the attention ranks' balancer (MTP layers keep the default placement)
        self.expert_balancer = ExpertBalancer({layer: self.blocks[str(layer)] for layer in routed.layers})
        self.requires_grad_(False)

    def wants_weight(self, name: str) -> bool:
        """Only this rank's experts of the decoder's MoE layers (MTP layers run no forward here): its routed ones,
        or on a shared-expert rank the shared ones."""
        if self.parallel.is_shared_expert_rank:
            match = _SHARED_WEIGHT.fullmatch(name)
            return match is not None and match.group(1) in self.blocks
        match = _EXPERT_WEIGHT.fullmatch(name)
        return match is not None and match.group(1) in self.blocks and super().wants_weight(name)

    def weight_shard(self, name: str) -> None:
        return None  # whole experts: the weights keep their column block (MoE TP) themselves

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        for name, tensor in weights:
            routed, shared = _EXPERT_WEIGHT.fullmatch(name), _SHARED_WEIGHT.fullmatch(name)
            match = shared if self.parallel.is_shared_expert_rank else routed
            if match is None or match.group(1) not in self.blocks:
                raise ValueError(f"unexpected weight {name!r} for an expert rank (it holds only "
                                 f"{'shared' if self.parallel.is_shared_expert_rank else 'routed'} experts)")
            experts, proj = self.blocks[match.group(1)].experts, match.group(match.lastindex)
            if shared is not None:
                load_shared_expert(experts, proj, tensor)
            else:
                expected = experts.hf_shape(proj)
                if tuple(tensor.shape) != expected:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
                experts.load_expert(int(match.group(2)), proj, tensor)
            loaded.add(f"blocks.{match.group(1)}.experts." + ("w2" if proj == "down_proj" else "w13"))
        for layer in self.routed.mtp_layers:  # a checkpoint without MTP layers (HF's save_pretrained writes none)
            if not any(name.startswith(f"blocks.{layer}.") for name in loaded):
                del self.blocks[str(layer)]
        return loaded

    @torch.inference_mode()
    def serve_forward(self, microbatches: int = 1) -> int:
        """One forward of the attention ranks (run as `microbatches` micro-batches), seen from here: each MoE
        layer's rows of every DP domain, served in layer order. The rows computed."""
        return sum(self.blocks[str(layer)].runtime.serve(self.blocks[str(layer)].experts, microbatches)
                   for layer in self.routed.layers)

    @torch.inference_mode()
    def serve_mtp(self, forwards: int, microbatches: int = 1) -> int:
        """`forwards` MTP forwards of the attention ranks (split as their step's forward was), seen from here. The
        rows computed."""
        if not forwards:
            return 0
        layers = [layer for layer in self.routed.mtp_layers if str(layer) in self.blocks]
        if not layers:
            raise RuntimeError("the attention ranks run MTP forwards, but the checkpoint holds no MTP layer")
        block = self.blocks[str(layers[0])]
        return sum(block.runtime.serve(block.experts, microbatches) for _ in range(forwards))
