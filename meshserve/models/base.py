"""The contract between the engine's runner and every model.

How a batch and its paged KV cache are laid out is `meshserve.layers.metadata`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from meshserve.layers.metadata import KVCacheLayout
from meshserve.layers.tensor_parallel import Shard, attention_tp_shard


@dataclass(frozen=True)
class RoutedExperts:
    """A model's routed experts: the decoder layers that have them and their shape. Models with routed experts
    say theirs through `routed_experts_of(hf_config)` (a staticmethod)."""

    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_shared_experts: int = 0  # column blocks of the shared experts (shared-expert ranks hold them)
    mtp_layers: tuple[int, ...] = ()  # the MTP layers with routed experts (their checkpoint layer indices)


class CausalLM(torch.nn.Module):
    """Base class of every served model.

    Subclasses implement:
      forward(input_ids[T], positions[T], attn: AttentionMetadata, kv_caches: list[Tensor]) -> hidden [T, H]
      compute_logits(hidden[N, H]) -> float32 logits [N, vocab_size]
      kv_cache_layout(dtype) -> KVCacheLayout
      load_weights(iterable of (hf_name, tensor)) -> set of loaded parameter names
    Models with multi-token-prediction layers (speculative decoding) also implement
      num_mtp_layers, kv_cache_layout(dtype, num_mtp_layers), forward_mtp(...), compute_mtp_logits(...)
    and are constructed as Model(hf_config: dict, dtype: torch.dtype, parallel: ParallelContext | None).

    Under a parallel strategy a model keeps only this rank's part of the weights. The loader asks
    `wants_weight(name)` before reading a tensor (False: another rank's routed expert) and reads
    only the piece `weight_shard(name)` names, and `load_weights` receives exactly that piece
    (`meshserve.models.loader.shard_weights` cuts full tensors the same way for other callers).
    """

    # forward(..., microbatches=2) runs a step as two overlapped micro-batches (meshserve/models/microbatch.py)
    supports_microbatches = False

    model_type: str = ""

    # Subclasses name their sharded tensors: per-expert tensors (group 1: the expert id) and the
    # weights split over the attention TP group by output rows or by input columns.
    _ROUTED_EXPERT: re.Pattern | None = None
    _TP_ROWS: re.Pattern | None = None
    _TP_COLUMNS: re.Pattern | None = None
    _expert_range: tuple[int, int] = (0, 0)  # [first, first + count) of the routed experts this rank holds

    def wants_weight(self, name: str) -> bool:
        """Whether this rank keeps (part of) the checkpoint tensor `name`: all but other EP ranks' experts."""
        match = self._ROUTED_EXPERT.search(name) if self._ROUTED_EXPERT is not None else None
        if match is None:
            return True
        first, count = self._expert_range
        return first <= int(match.group(1)) < first + count

    def weight_shard(self, name: str) -> Shard | None:
        """The piece of checkpoint tensor `name` this rank keeps; None for the whole tensor."""
        parallel = getattr(self, "parallel", None)
        if parallel is None or parallel.attn_tp_size == 1:
            return None
        if self._TP_ROWS is not None and self._TP_ROWS.search(name):
            return attention_tp_shard(parallel, 0)
        if self._TP_COLUMNS is not None and self._TP_COLUMNS.search(name):
            return attention_tp_shard(parallel, 1)
        return None

    # MTP layers loaded from the checkpoint (DeepSeek-V3 `num_nextn_predict_layers`); 0: no speculative drafts
    num_mtp_layers: int = 0

    def kv_cache_layout(self, dtype: torch.dtype | None = None,
                        num_mtp_layers: int = 0) -> KVCacheLayout:  # pragma: no cover - abstract
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def load_weights(self, weights) -> set[str]:  # pragma: no cover - abstract
        raise NotImplementedError
