"""INT8 against float32 native CPU kernels, matmul by matmul, on the small model's shapes.

Each linear of the small DeepSeek-V3 preset (hidden 768: fused q_a + kv_a, q_b, o_proj, the dense MLP's
gate_up and down, the LM head) and its MoE layer (32 experts of intermediate 256, top-4 routing of random
tokens) runs at 1, 8 and 64 rows through the float32 native kernels (`linear.linear` on a natively
packed weight, `cpu_kernels.moe_forward`) and through the INT8 ones (`int8.linear`, `int8.moe_forward`).
The two alternate within one run; each time is the median of `repeats` calls. "cold" calls cycle through
copies of the weights, 160 MB of them, so each call finds its weight in memory, not in a cache: a decode
step streams the whole model, far beyond the caches, between two uses of one weight. "hot" calls repeat
on one cached copy. MoE calls route fresh random tokens each. The ratio is float32 time
over INT8 time (above 1: INT8 is faster).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from meshserve.layers import cpu_kernels, int8
from meshserve.layers.linear import attach_packed, linear

HIDDEN = 768
LINEAR_SHAPES = (  # name, out features, in features
    ("q_a+kv_a", 384 + 288, HIDDEN),
    ("q_b", 1152, 384),
    ("o_proj", HIDDEN, HIDDEN),
    ("gate_up", 4096, HIDDEN),
    ("down", HIDDEN, 2048),
    ("lm_head", 32000, HIDDEN),
)
NUM_EXPERTS, MOE_INTERMEDIATE, TOP_K = 32, 256, 4
ROWS = (1, 8, 64)
_COLD_BYTES = 160 << 20  # weight copies cycled per kernel for cold calls: five times this machine's L3


def _copies(nbytes: int) -> int:
    return -(-_COLD_BYTES // nbytes)


def _timed_pair(fp32: Callable[[int], object], quant: Callable[[int], object], repeats: int,
                cold: bool) -> tuple[float, float]:
    """Median ms of each function over calls 0, 1, ... (cold: call i uses weight copy i, so its weight was
    last read a long stretch of other weights ago; hot: copy 0 always). The calls alternate between the two,
    so noise from other work falls on both alike."""
    fp32(0), quant(0)  # warm-up: first-call set-up, scratch sizes
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats):
        for fn, out in ((fp32, times[0]), (quant, times[1])):
            start = time.perf_counter()
            fn(i + 1 if cold else 0)
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def _row(name: str, rows: int, fp32: Callable[[int], object], quant: Callable[[int], object],
         repeats: int) -> dict:
    row: dict = {"kernel": name, "rows": rows}
    for state in ("cold", "hot"):
        fp32_ms, int8_ms = _timed_pair(fp32, quant, repeats, state == "cold")
        row |= {f"fp32_ms_{state}": fp32_ms, f"int8_ms_{state}": int8_ms, f"ratio_{state}": fp32_ms / int8_ms}
    return row


def _linear_rows(name: str, n: int, k: int, repeats: int, g: torch.Generator) -> list[dict]:
    weight = torch.randn(n, k, generator=g) * k ** -0.5
    # views of one weight, each with its own natively packed copy (which is what `linear` reads)
    views = [weight.view_as(weight) for _ in range(_copies(4 * n * k))]
    if not all(attach_packed(view) for view in views):
        raise RuntimeError(f"{name}: the float32 native kernel does not take a {n}x{k} weight")
    q, scale = int8.quantize_weight(weight)
    packed = int8.pack(q)
    packs = [packed] + [int8.PackedWeight(packed.blocks.clone(), packed.compensation)
                        for _ in range(_copies(n * k) - 1)]
    out = []
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        out.append(_row(name, rows, lambda i, x=x: linear(x, views[i % len(views)]),
                        lambda i, x=x: int8.linear(x, q, scale, packed=packs[i % len(packs)]), repeats))
    return out


def _moe_rows(repeats: int, g: torch.Generator) -> list[dict]:
    w13 = torch.randn(NUM_EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN, generator=g) * HIDDEN ** -0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, MOE_INTERMEDIATE, generator=g) * MOE_INTERMEDIATE ** -0.5
    fp32_packed = (cpu_kernels.pack_weight(w13), cpu_kernels.pack_weight(w2))
    (q13, s13), (q2, s2) = int8.quantize_weight(w13), int8.quantize_weight(w2)
    packed = int8.pack_moe(q13, q2)
    fp32_copies = [fp32_packed] + [tuple(w.clone() for w in fp32_packed)
                                   for _ in range(_copies(4 * (w13.numel() + w2.numel())) - 1)]
    int8_copies = [packed] + [int8.PackedExperts(*(int8.PackedWeight(w.blocks.clone(), w.compensation)
                                                   for w in packed))
                              for _ in range(_copies(w13.numel() + w2.numel()) - 1)]
    out = []
    for rows in ROWS:
        # each call routes its own random tokens: decode steps hit different experts
        hidden = [torch.randn(rows, HIDDEN, generator=g) for _ in range(repeats + 1)]
        ids = [torch.rand(rows, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K] for _ in hidden]
        weights = [torch.rand(rows, TOP_K, generator=g) for _ in hidden]
        calls = list(zip(hidden, ids, weights))
        out.append(_row("moe", rows,
                        lambda i, c=calls: cpu_kernels.moe_forward(*c[i], 0, *fp32_copies[i % len(fp32_copies)]),
                        lambda i, c=calls: int8.moe_forward(*c[i], 0, q13, s13, q2, s2,
                                                            packed=int8_copies[i % len(int8_copies)]),
                        repeats))
    return out


def kernel_ratios(repeats: int = 15, seed: int = 0) -> list[dict]:
    """One row per (kernel, rows): float32 and INT8 median ms, cold and hot, and their ratios."""
    if not cpu_kernels.enabled():
        raise RuntimeError("the native CPU kernels are not available here: nothing to compare")
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, n, k in LINEAR_SHAPES:
        out += _linear_rows(name, n, k, repeats, g)
    return out + _moe_rows(repeats, g)


def format_table(rows: list[dict]) -> str:
    """A text table of `kernel_ratios` rows."""
    lines = [f"{'':<15}  {'cold (weights from memory)':^25}  {'hot (weights cached)':^25}",
             f"{'kernel':<10}{'rows':>5}  {'fp32 ms':>9}{'int8 ms':>9}{'ratio':>7}  "
             f"{'fp32 ms':>9}{'int8 ms':>9}{'ratio':>7}"]
    for row in rows:
        lines.append(f"{row['kernel']:<10}{row['rows']:>5}  {row['fp32_ms_cold']:>9.3f}{row['int8_ms_cold']:>9.3f}"
                     f"{row['ratio_cold']:>6.2f}x  {row['fp32_ms_hot']:>9.3f}{row['int8_ms_hot']:>9.3f}"
                     f"{row['ratio_hot']:>6.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per kernel and cache state")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(format_table(kernel_ratios(repeats=args.repeats)))


if __name__ == "__main__":
    main()
