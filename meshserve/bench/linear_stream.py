"""Batch-1 linear layers streamed from DRAM: the native kernel against oneDNN's, weight by weight.

`python -m meshserve.bench.linear_stream`: the `small` DeepSeek-V3 preset's float32 weight shapes at one input
row, as a batch-1 decode step runs them. Each shape is copied until the copies fill `--pool-mb` (default 512 MB,
more than a server's last-level cache), and a round calls every copy once in turn, so every call reads its
weight from DRAM, as a step that streams the whole model does. Both sides take turns on the same copies:
`cpu_kernels.grouped_linear` on the packed weight (the native kernel: decode steps use it) and torch's
`F.linear` on the plain one (oneDNN's sgemv). Medians of `--rounds` rounds; GB/s is weight bytes over the time
per call, and the ratio is oneDNN's time over the native kernel's (above 1: the native kernel is faster).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels

# (what it is, out features, in features) in the small preset
SHAPES = (("q_a + kv_a projection", 672, 768), ("q_b projection", 1152, 384), ("o_proj", 768, 768),
          ("expert gate + up", 512, 768), ("dense MLP down", 768, 2048), ("LM head", 32000, 768))


def measure(name: str, out_features: int, in_features: int, pool_mb: float, rounds: int) -> dict:
    weight_bytes = out_features * in_features * 4
    copies = max(2, int(pool_mb * 1e6 // weight_bytes))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=gen) for _ in range(copies)]
    packed = [cpu_kernels.pack_weight(w).unsqueeze(0) for w in weights]  # one group
    x = torch.randn(1, in_features, generator=gen)
    out = torch.empty(1, 1, out_features)
    sides = {"native": lambda i: cpu_kernels.grouped_linear(x.unsqueeze(1), packed[i], out),
             "onednn": lambda i: F.linear(x, weights[i])}
    agree = torch.allclose(sides["native"](0).view(1, -1), sides["onednn"](0), rtol=1e-4, atol=1e-4)
    per_call: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, call in sides.items():
            start = time.perf_counter()
            for i in range(copies):
                call(i)
            per_call[side].append((time.perf_counter() - start) / copies)
    native, onednn = (statistics.median(per_call[side]) for side in sides)
    return {"weight": name, "shape": [out_features, in_features], "mb": weight_bytes / 1e6, "copies": copies,
            "native_us": native * 1e6, "onednn_us": onednn * 1e6, "native_gb_s": weight_bytes / native / 1e9,
            "onednn_gb_s": weight_bytes / onednn / 1e9, "ratio": onednn / native, "outputs_agree": agree}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'weight':<24}{'MB':>7}{'native us':>11}{'GB/s':>7}{'oneDNN us':>11}{'GB/s':>7}{'ratio':>8}"]
    for row in rows:
        lines.append(f"{row['weight']:<24}{row['mb']:>7.2f}{row['native_us']:>11.1f}{row['native_gb_s']:>7.1f}"
                     f"{row['onednn_us']:>11.1f}{row['onednn_gb_s']:>7.1f}{row['ratio']:>7.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-mb", type=float, default=512, help="weight copies per shape, in MB (default: 512)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over the copies, medians (default: 5)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args()
    if args.pool_mb <= 0 or min(args.rounds, args.threads) < 1:
        raise SystemExit("--pool-mb must be positive; --rounds and --threads at least 1")
    if not cpu_kernels.enabled():
        raise SystemExit("the native CPU kernels are not available here")
    torch.set_num_threads(args.threads)
    print(format_table([]), flush=True)
    for name, out_features, in_features in SHAPES:  # a line per weight as it is measured
        row = measure(name, out_features, in_features, args.pool_mb, args.rounds)
        if not row["outputs_agree"]:
            raise SystemExit(f"{name}: the native kernel and oneDNN disagree")
        print(format_table([row]).splitlines()[1], flush=True)


if __name__ == "__main__":
    main()
