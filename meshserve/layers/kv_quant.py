"""INT8 KV cache entries (`--kv-cache-dtype int8`): symmetric per-token quantization, scales inside each row.

A quantized entry is the token's numbers as int8 followed by the scale of each of its parts as raw bfloat16
bytes, so a cache block carries its own scales and everything that moves blocks as bytes (the memory pool,
P/D transfer over shared memory, TCP or torch.distributed) moves them with it. The cache tensor's dtype is
torch.int8 and its last dimension counts bytes:

    MLA (one row per token):       [c_kv int8 x kv_lora_rank | k_pe int8 x rope_dim | scale_c bf16 | scale_pe bf16]
    GQA (one row per K/V and head): [int8 x head_dim | scale bf16]

Each part x is stored as q = round_half_even(x / s) in [-127, 127], with s = max|x| / 127 rounded *up* to
the nearest bfloat16 (so no value clips and the stored scale is exactly the one used); a reader gets
q * s in float32. Every reader of the cache sees the same dequantized numbers: the fresh tokens of a
prefill too (`write` returns them), so outputs do not depend on whether a prefix came from the local
cache, the pool or a prefill TE.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from meshserve.layers import cpu_kernels
from meshserve.layers.paged import write_to_cache

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_BYTES = 2  # one bfloat16 per part
QMAX = 127


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensor dtype for `--kv-cache-dtype` (auto: the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose one of: {', '.join(KV_CACHE_DTYPES)}")


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def row_width(parts: Sequence[int], dtype: torch.dtype) -> int:
    """Elements of one cache row holding `parts` (numbers of each part) in a cache of `dtype`."""
    return sum(parts) + (SCALE_BYTES * len(parts) if is_quantized(dtype) else 0)


def mla_entry_shape(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> tuple[int]:
    return (row_width((kv_lora_rank, rope_dim), dtype),)


def gqa_entry_shape(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    return (2, num_kv_heads, row_width((head_dim,), dtype))


def _ceil_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> the smallest bfloat16 value >= it (as float32)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def _bytes_as_bfloat16(raw: torch.Tensor) -> torch.Tensor:
    """int8 [..., 2k] (raw bytes at any offset) -> bfloat16 [..., k]."""
    return torch.empty(raw.shape, dtype=torch.int8, device=raw.device).copy_(raw).view(torch.bfloat16)


def quantize(x: torch.Tensor, parts: Sequence[int]) -> torch.Tensor:
    """x [..., sum(parts)] -> int8 rows [..., sum(parts) + 2 * len(parts)] (values, then the parts' scales)."""
    values, scales = [], []
    for part in x.float().split(list(parts), dim=-1):
        amax = part.abs().amax(dim=-1, keepdim=True)
        scale = _ceil_to_bfloat16(amax / QMAX)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero part stores zeros
        values.append(torch.round(part / scale).clamp_(-QMAX, QMAX).to(torch.int8))
        scales.append(scale)
    scale_bytes = torch.cat(scales, dim=-1).to(torch.bfloat16).view(torch.int8)
    return torch.cat((*values, scale_bytes), dim=-1)


def dequantize(rows: torch.Tensor, parts: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., width] (`quantize`'s layout) -> [..., sum(parts)] in `dtype`."""
    n = sum(parts)
    scales = _bytes_as_bfloat16(rows[..., n:n + SCALE_BYTES * len(parts)]).float()
    values = rows[..., :n].float()
    start = 0
    for i, part in enumerate(parts):
        values[..., start:start + part].mul_(scales[..., i:i + 1])
        start += part
    return values.to(dtype)


def read(rows: torch.Tensor, parts: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as numbers of `dtype`: dequantized from an int8 cache, converted from a float one."""
    if is_quantized(rows.dtype):
        return dequantize(rows, parts, dtype)
    return rows.to(dtype)


def write(cache: torch.Tensor, slot_mapping: torch.Tensor, entries: torch.Tensor,
          parts: Sequence[int]) -> torch.Tensor:
    """Store new tokens' entries [T, ..., sum(parts)] at their slots; returns them as later reads see them
    (for a float cache the entries themselves)."""
    if not is_quantized(cache.dtype):
        write_to_cache(cache, slot_mapping, entries)
        return entries
    rows = quantize(entries, parts)
    write_to_cache(cache, slot_mapping, rows)
    return dequantize(rows, parts, entries.dtype)


def native_decode_available() -> bool:
    """Whether the native INT8 MLA decode kernel (csrc/kv_int8.cpp) serves this thread's forwards."""
    return cpu_kernels.enabled() and hasattr(torch.ops.meshserve_cpu, "mla_decode_int8")


def int8_scores_available() -> bool:
    """Whether `mla_decode_int8(int8_scores=True)` takes integer scores here (a build with AVX512-VNNI); elsewhere
    it runs the float scores."""
    return native_decode_available() and bool(torch.ops.meshserve_cpu.mla_decode_int8_scores_native())


def quantized_query(q: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """The query as the integer scores see it: per head and part (latent, rope) rounded to 127 steps of its
    largest magnitude, back in float32 (the kernel's own rounding, for references)."""
    out = torch.empty_like(q, dtype=torch.float32)
    for begin, end in ((0, kv_lora_rank), (kv_lora_rank, q.shape[-1])):
        part = q[..., begin:end].float()
        amax = part.abs().amax(dim=-1, keepdim=True)
        steps = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        out[..., begin:end] = torch.round(part * steps) * (amax / 127.0)
    return out


def mla_decode_int8(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, kv_lora_rank: int, int8_scores: bool = True) -> torch.Tensor:
    """`cpu_kernels.mla_decode` over an INT8 cache (MLA rows, above): [B, heads, kv_lora_rank] in float32.
    `int8_scores`: integer scores against an int8 query (`quantized_query`) where the CPU has AVX512-VNNI."""
    if not native_decode_available():
        raise RuntimeError("the native INT8 MLA decode kernel is not available here")
    return torch.ops.meshserve_cpu.mla_decode_int8(q, cache, block_table, seq_lens, scale, kv_lora_rank, int8_scores)
