"""INT8 W8A8 serving: which weights run in INT8 and how a loaded model is converted.

Every linear layer of attention, the dense MLP and the shared and routed experts runs with
per-output-channel symmetric INT8 weights and per-token dynamic INT8 activations (the kernels:
`meshserve.layers.int8`), and so does the LM head. Kept in float:
- the router (`mlp.gate`): a few thousand weights whose small logit differences pick the experts;
- `kv_b_proj`: absorbed into the attention (W_UK, W_UV applied per head to the query and to the
  latent output), not applied as a linear layer to a token's activations;
- embeddings and norms (lookups and elementwise scales, no matmul);
- an LM head that the checkpoint's own `ignore` list keeps in float.

The loader (`meshserve.models.loader`) hands the model the exact values the INT8 grid holds: a
compressed-tensors checkpoint's INT8 weights times their scales, and every other weight named by
`is_quantizable_name` rounded to the grid of its whole output row (`round_to_grid`) before a tensor
or expert-parallel rank cuts its piece. `convert_model` then recovers each weight's INT8 values and
scales (`recover_grid`), so a rank holding part of a row serves the same values as one rank holding
all of it.
"""
from __future__ import annotations

import logging

import torch

from meshserve.layers import int8

logger = logging.getLogger(__name__)

QMAX = 127
KEPT_FLOAT_MODULES = ("kv_b_proj", "gate")  # by a module's own name; "gate": the Qwen3-MoE router
_QUANTIZABLE_SUFFIXES = ("_proj.weight", "lm_head.weight", "shared_head.head.weight")
_FUSED_EXPERT_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj")  # transformers-5 style stacked experts
SCALE_ATTR = "int8_scale"  # on an INT8 weight: its float32 per-output-channel scales [out]


def is_quantizable_name(name: str) -> bool:
    """Whether checkpoint tensor `name` is a weight that runs in INT8."""
    if any(name.endswith(f".{module}.weight") for module in KEPT_FLOAT_MODULES):
        return False
    return name.endswith(_QUANTIZABLE_SUFFIXES) or name.endswith(_FUSED_EXPERT_SUFFIXES)


def round_to_grid(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [..., out, in] with each output row rounded to its INT8 grid (values q * scale)."""
    q, scale = int8.quantize_weight(weight.float())
    return (q.float() * scale.unsqueeze(-1)).to(weight.dtype)


def recover_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [..., out, in], float32 scale [..., out]) holding `weight`'s values.

    A row whose values lie on an INT8 grid (a dequantized INT8 row, or a rank's piece of one) keeps
    exactly that grid: its scale is max|row| / k for the largest k <= 127 that makes every value an
    integer multiple. Other rows are rounded to max|row| / 127.
    """
    w = weight.detach().float()
    flat = w.reshape(-1, w.shape[-1])
    absmax = flat.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    pending = torch.nonzero(~_on_grid(flat, scale)).flatten()
    for k in range(QMAX - 1, 0, -1):
        if pending.numel() == 0:
            break
        candidate = absmax[pending] / k
        fits = _on_grid(flat.index_select(0, pending), candidate)
        scale[pending[fits]] = candidate[fits]
        pending = pending[~fits]
    if pending.numel():  # not INT8 values: plain rounding
        scale[pending] = torch.where(absmax[pending] > 0, absmax[pending] / QMAX, torch.ones_like(absmax[pending]))
    q = torch.round(flat / scale.unsqueeze(1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(w.shape), scale.view(w.shape[:-1])


def _on_grid(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    ratio = rows / scale.unsqueeze(1)
    return ((ratio - torch.round(ratio)).abs() <= 1e-3).all(dim=1)


def quantize_parameter(weight: torch.nn.Parameter) -> None:
    """Replace a float [out, in] weight by its INT8 values in place, with its scales as `SCALE_ATTR`."""
    q, scale = recover_grid(weight.data)
    weight.data = q
    setattr(weight, SCALE_ATTR, scale.to(q.device))


def is_int8(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.int8


def convert_model(model: torch.nn.Module, keep_lm_head_float: bool = False) -> int:
    """Turn every linear weight that runs in INT8 into INT8 values plus scales (after loading, before
    packing). Modules with their own layout convert themselves (`quantize_int8()`). Returns the count."""
    from meshserve.layers.linear import Linear  # linear.py dispatches on INT8 weights: imports this module

    embeddings = {id(m.weight) for m in model.modules()
                  if type(m).__name__.endswith("Embedding") and isinstance(getattr(m, "weight", None), torch.Tensor)}
    count = 0
    for name, module in model.named_modules():
        own_name = name.rsplit(".", 1)[-1]
        if own_name in KEPT_FLOAT_MODULES or (keep_lm_head_float and own_name == "lm_head"):
            continue
        hook = getattr(module, "quantize_int8", None)
        if callable(hook):
            count += hook()
            continue
        if not isinstance(module, Linear):
            continue
        if id(module.weight) in embeddings or is_int8(module.weight):  # tied to the embedding; or shared
            continue
        quantize_parameter(module.weight)
        count += 1
    logger.info("%d weights run in INT8 W8A8", count)
    return count
