"""What this machine's CPU can do, read from /proc/cpuinfo (torch-free, so the CLI and benches may ask)."""
from __future__ import annotations

import functools


@functools.cache
def has_native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). Without it, torch's bf16 matmuls
    are emulated: about ten times slower than float32 on an AVX2 machine."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any("avx512_bf16" in line or "amx_bf16" in line for line in cpuinfo if line.startswith("flags"))
    except OSError:
        return False
