"""Linear layers with weights prepacked once for a fast CPU kernel.

PyTorch's default CPU matmul for fp32 (MKL sgemm) reaches about half of this
machine's matmul rate, and far less at the small row counts of decode. Weights are
packed once at load: for the native kernel (cpu_kernels.py: 32-column blocks,
register-tiled, its work shared between threads as they come free) where it
applies, else into oneDNN's blocked layout, which runs 2-3x faster than MKL. On
other devices, or where neither applies, `linear` is plain `F.linear`.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels, int8, w8a8

logger = logging.getLogger(__name__)

_PACKED_ATTR = "_onednn_packed"
_NATIVE_ATTR = "_native_packed"
_INT8_ATTR = "_int8_packed"


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's prepacked linear runs in `dtype` here: its bf16 path needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT, which some x86 CPUs lack (they then take F.linear)."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:  # the op exists in every CPU build we know, but prove it runs before relying on it
        w = torch.randn(8, 4, dtype=dtype)
        out = op(torch.randn(3, 4, dtype=dtype), torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none", [],
                 "")
        return out.shape == (3, 8)
    except RuntimeError:
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a [out, in] weight, or None where it does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not onednn_linear_available(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the prepacked weight when there is one: passed (oneDNN's), or attached by
    `pack_linears` (the native kernel's, else oneDNN's). An INT8 weight (`w8a8`) runs W8A8."""
    if weight.dtype == torch.int8:
        return _int8_linear(x, weight, bias)
    if packed is None:
        native = getattr(weight, _NATIVE_ATTR, None)
        if native is not None and x.device.type == "cpu" and x.dtype == native.dtype and x.numel() \
                and cpu_kernels.enabled():
            return _native_linear(x, weight, bias, native)
        packed = _onednn_packed(weight)
    if packed is None or x.device.type != "cpu" or x.numel() == 0:
        return F.linear(x, weight, bias)
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), weight, bias, packed).view(*x.shape[:-1], weight.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   native: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if native.dtype == torch.bfloat16:
        out = cpu_kernels.bf16_linear(rows, native)
    else:
        out = rows.new_empty(rows.shape[0], 1, weight.shape[0])
        cpu_kernels.grouped_linear(rows.unsqueeze(1), native, out)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out.add_(bias)


def _int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = getattr(weight, _INT8_ATTR, None) if x.device.type == "cpu" and cpu_kernels.enabled() else None
    out = int8.linear(x.float(), weight, getattr(weight, w8a8.SCALE_ATTR), None if bias is None else bias.float(),
                      packed=packed)
    return out.to(x.dtype)


def native_tensors(weight: torch.Tensor) -> list[torch.Tensor] | None:
    """A weight as the fused decode ops take a linear (csrc/decode_layer.cpp): INT8 packed (blocks, compensation,
    scales), or a float32 or bfloat16 weight packed for its native kernel (else the plain weight) and two empty
    tensors; None for anything else."""
    if weight.dtype == torch.int8:
        packed = getattr(weight, _INT8_ATTR, None)
        return None if packed is None else [packed.blocks, packed.compensation, getattr(weight, w8a8.SCALE_ATTR)]
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2:
        return None
    native = getattr(weight, _NATIVE_ATTR, None)
    return [weight if native is None else native, NO_TENSOR, NO_TENSOR]


NO_TENSOR = torch.empty(0)  # an unused slot of the fused decode ops' weight lists


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's oneDNN copy; made on first use where the native kernel's was packed instead (the
    torch path asked for under `cpu_kernels.disabled()`)."""
    packed = getattr(weight, _PACKED_ATTR, None)
    if packed is None and getattr(weight, _NATIVE_ATTR, None) is not None:
        packed = pack_weight(weight)
        if packed is not None:
            setattr(weight, _PACKED_ATTR, packed)
    return packed


class Linear(torch.nn.Linear):
    """nn.Linear that uses a prepacked weight once `pack_linears` has run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def attach_packed(weight: torch.Tensor) -> bool:
    """Pack a [out, in] weight for `linear`: for the native CPU kernel where it applies (float32 on CPU, or
    bfloat16 where the CPU has AVX512-BF16; a multiple of 32 outputs), else for oneDNN; an INT8 weight for the
    INT8 kernel. False where none applies."""
    if weight.dtype == torch.int8:
        if not (cpu_kernels.enabled() and int8.packable(weight)):
            return False
        setattr(weight, _INT8_ATTR, int8.pack(weight))
        return True
    if weight.dim() == 2 and cpu_kernels.packable(weight) and cpu_kernels.enabled():
        setattr(weight, _NATIVE_ATTR, cpu_kernels.pack_weight(weight.detach().unsqueeze(0)))
        return True
    if cpu_kernels.bf16_packable(weight):
        setattr(weight, _NATIVE_ATTR, cpu_kernels.pack_weight_bf16(weight.detach()))
        return True
    packed = pack_weight(weight)
    if packed is None:
        return False
    setattr(weight, _PACKED_ATTR, packed)
    return True


def pack_linears(model: torch.nn.Module) -> int:
    """Prepack every weight that `linear` is called with: modules that declare `packable_weights()`.

    Call after the weights are final (packing copies them). Returns the number of weights packed.
    """
    count = 0
    for module in model.modules():
        hook = getattr(module, "pack_weights", None)
        if hook is not None:
            count += hook()
        elif isinstance(module, Linear) and attach_packed(module.weight):
            count += 1
    if count:
        logger.info("prepacked %d weights for oneDNN", count)
    return count
