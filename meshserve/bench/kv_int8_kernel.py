"""MLA decode attention over an INT8 KV cache against the float32 cache, kernel against kernel.

`python -m meshserve.bench.kv_int8_kernel`: the small DeepSeek-V3 preset's attention shape (12 heads, a 256-wide
latent and 32 rope dims per cache entry), paged cache blocks of 16 tokens in a shuffled order, at batch 1 and 16
and contexts of 1k and 4k tokens. The same random entries go into a float32 cache and, quantized, into an INT8
one (`kv_quant.quantize`); `cpu_kernels.mla_decode` and `kv_quant.mla_decode_int8` then alternate, each time the
median of `repeats` calls. The ratio is float32 time over INT8 time (above 1: the INT8 kernel is faster); the
largest difference between their outputs is printed beside it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshserve.layers import cpu_kernels, kv_quant

HEADS, LATENT, ROPE, BLOCK = 12, 256, 32, 16
SHAPES = ((1, 1024), (1, 4096), (16, 1024), (16, 4096))


def measure(batch: int, context: int, repeats: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    blocks = batch * per_seq
    cache = torch.randn(blocks, BLOCK, LATENT + ROPE, generator=gen)
    table = torch.randperm(blocks, generator=gen).view(batch, per_seq).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, LATENT + ROPE, generator=gen)
    cache_int8 = kv_quant.quantize(cache.view(-1, LATENT + ROPE), (LATENT, ROPE)).view(blocks, BLOCK, -1)
    calls = {"fp32": lambda: cpu_kernels.mla_decode(q, cache, table, lens, 0.1, LATENT),
             "int8": lambda: kv_quant.mla_decode_int8(q, cache_int8, table, lens, 0.1, LATENT)}
    outputs = {name: call() for name, call in calls.items()}  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    fp32, int8 = (statistics.median(times[name]) * 1e3 for name in ("fp32", "int8"))
    return {"batch": batch, "context": context, "fp32_ms": fp32, "int8_ms": int8, "ratio": fp32 / int8,
            "max_abs_diff": float((outputs["fp32"] - outputs["int8"]).abs().max())}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'batch':>5}{'context':>9}{'fp32 ms':>10}{'int8 ms':>10}{'fp32/int8':>11}{'max diff':>10}"]
    for row in rows:
        lines.append(f"{row['batch']:>5}{row['context']:>9}{row['fp32_ms']:>10.3f}{row['int8_ms']:>10.3f}"
                     f"{row['ratio']:>10.2f}x{row['max_abs_diff']:>10.1e}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per kernel and shape (default: 30)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args()
    if not kv_quant.native_decode_available():
        raise SystemExit("the native CPU kernels are not available here")
    torch.set_num_threads(args.threads)
    print(format_table([measure(batch, context, args.repeats) for batch, context in SHAPES]))


if __name__ == "__main__":
    main()
