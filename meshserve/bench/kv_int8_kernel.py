"""MLA decode attention over an INT8 KV cache against the float32 cache, kernel against kernel, and the integer
scores' effect on a trained model.

`python -m meshserve.bench.kv_int8_kernel`: the small DeepSeek-V3 preset's attention shape (12 heads, a 256-wide
latent and 32 rope dims per cache entry), paged cache blocks of 16 tokens in a shuffled order, at batch 1 and 16
and contexts of 1k and 4k tokens. The same random entries go into a float32 cache and, quantized, into an INT8
one (`kv_quant.quantize`); `cpu_kernels.mla_decode` and `kv_quant.mla_decode_int8` (its float scores, and its
integer scores where the CPU has AVX512-VNNI) then take turns, each time the median of `repeats` calls. A ratio is
float32 time over INT8 time (above 1: the INT8 kernel is faster); the largest difference between the outputs
is printed beside it.

`--quality`: the trained DeepSeek-V3 model (`tiny` unless `--preset small`; trained on first use) reads
held-out text teacher-forced, one decode step per token after a prefilled prefix, on a float32 cache and on an
INT8 one with float and with integer scores. Against the float32 cache: top-1 agreement and the mean KL
divergence of each next-token distribution; and each one's perplexity on the text.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from meshserve.layers import cpu_kernels, kv_quant

HEADS, LATENT, ROPE, BLOCK = 12, 256, 32, 16
SHAPES = ((1, 1024), (1, 4096), (16, 1024), (16, 4096))
QUALITY_PREFIX = 32  # prefilled tokens before the decode steps


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
             "int8": lambda: kv_quant.mla_decode_int8(q, cache_int8, table, lens, 0.1, LATENT, int8_scores=False),
             "int8_integer": lambda: kv_quant.mla_decode_int8(q, cache_int8, table, lens, 0.1, LATENT)}
    outputs = {name: call() for name, call in calls.items()}  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    fp32, int8, integer = (statistics.median(times[name]) * 1e3 for name in calls)
    return {"batch": batch, "context": context, "fp32_ms": fp32, "int8_ms": int8, "ratio": fp32 / int8,
            "max_abs_diff": float((outputs["fp32"] - outputs["int8"]).abs().max()),
            "int8_integer_ms": integer, "integer_ratio": fp32 / integer,
            "integer_max_abs_diff": float((outputs["fp32"] - outputs["int8_integer"]).abs().max())}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'batch':>5}{'context':>9}{'fp32 ms':>10}{'int8 ms':>10}{'fp32/int8':>11}{'max diff':>10}"
             f"{'integer ms':>12}{'fp32/int':>10}{'max diff':>10}"]
    for row in rows:
        lines.append(f"{row['batch']:>5}{row['context']:>9}{row['fp32_ms']:>10.3f}{row['int8_ms']:>10.3f}"
                     f"{row['ratio']:>10.2f}x{row['max_abs_diff']:>10.1e}{row['int8_integer_ms']:>12.3f}"
                     f"{row['integer_ratio']:>9.2f}x{row['integer_max_abs_diff']:>10.1e}")
    return "\n".join(lines)


# ---------------------------------------------------------------- quality on a trained model
CACHES = (("fp32", "auto", "1"), ("int8, float scores", "int8", "0"), ("int8, integer scores", "int8", "1"))


def teacher_forced_logprobs(model_dir: str, cache_dtype: str, texts: list[list[int]], prefix: int) -> torch.Tensor:
    """Log-probabilities [steps, sequences, vocab] of each next token after `prefix` tokens: the prefixes
    prefilled together, then every later token fed as a decode step (the steps the decode kernel runs)."""
    from meshserve.config import EngineConfig
    from meshserve.layers.metadata import AttentionMetadata
    from meshserve.worker.model_runner import ModelRunner

    steps = len(texts[0]) - prefix - 1
    per_seq = -(-len(texts[0]) // BLOCK)
    config = EngineConfig.from_kwargs(model_dir, dtype="float32", device="cpu", block_size=BLOCK,
                                      num_kv_blocks=len(texts) * per_seq + 1, enable_prefix_caching=False,
                                      max_num_seqs=len(texts), kv_cache_dtype=cache_dtype)
    runner = ModelRunner(config)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(texts))]
    out = []
    try:
        with torch.inference_mode():
            attn = AttentionMetadata.build([prefix] * len(texts), [0] * len(texts), tables, BLOCK)
            ids = torch.tensor([t for text in texts for t in text[:prefix]])
            runner.model(ids, torch.arange(prefix).repeat(len(texts)), attn, runner.model_kv_caches)
            for step in range(steps):
                position = prefix + step
                attn = AttentionMetadata.build([1] * len(texts), [position] * len(texts), tables, BLOCK)
                ids = torch.tensor([text[position] for text in texts])
                hidden = runner.model(ids, torch.full((len(texts),), position), attn, runner.model_kv_caches)
                out.append(torch.log_softmax(runner.model.compute_logits(hidden).double(), dim=-1))
    finally:
        runner.close()
    return torch.stack(out)


def measure_quality(model_dir: str, sequences: int, prefix: int, steps: int, seed: int = 0) -> list[dict]:
    from meshserve.train.corpus import heldout_prompts
    from meshserve.utils import envs

    texts = heldout_prompts(sequences, prefix + steps + 1, seed=seed)
    targets = torch.tensor([text[prefix + 1:] for text in texts]).T  # [steps, sequences]
    logprobs = {}
    for name, cache_dtype, scores in CACHES:
        with envs.MESHSERVE_INT8_KV_SCORES.set_to(scores):
            logprobs[name] = teacher_forced_logprobs(model_dir, cache_dtype, texts, prefix)
    exact = logprobs["fp32"]
    rows = []
    for name, got in logprobs.items():
        nll = -got.gather(-1, targets.unsqueeze(-1)).mean().item()
        rows.append({"cache": name, "perplexity": math.exp(nll),
                     "top1_agreement": (got.argmax(-1) == exact.argmax(-1)).double().mean().item(),
                     "kl": (exact.exp() * (exact - got)).sum(-1).mean().item()})
    return rows


def format_quality(rows: list[dict]) -> str:
    lines = [f"{'cache':<22}{'perplexity':>11}{'top-1 vs fp32':>15}{'KL vs fp32':>12}"]
    for row in rows:
        lines.append(f"{row['cache']:<22}{row['perplexity']:>11.3f}{row['top1_agreement']:>15.4f}{row['kl']:>12.2e}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per kernel and shape (default: 30)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--quality", action="store_true",
                        help="also the integer scores' effect on the trained model's next-token distributions")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small"),
                        help="the trained DeepSeek-V3 model of --quality (default: tiny)")
    parser.add_argument("--sequences", type=int, default=8, help="--quality: held-out texts (default: 8)")
    parser.add_argument("--steps", type=int, default=192, help="--quality: decode steps per text (default: 192)")
    args = parser.parse_args()
    if not kv_quant.native_decode_available():
        raise SystemExit("the native CPU kernels are not available here")
    if min(args.repeats, args.threads, args.sequences, args.steps) < 1:
        raise SystemExit("--repeats, --threads, --sequences and --steps must be at least 1")
    torch.set_num_threads(args.threads)
    print(f"integer scores (AVX512-VNNI): {'yes' if kv_quant.int8_scores_available() else 'no, float scores'}")
    print(format_table([measure(batch, context, args.repeats) for batch, context in SHAPES]))
    if args.quality:
        from meshserve.train.cache import ensure_trained_model

        model_dir = str(ensure_trained_model("deepseek_v3", args.preset))
        print(f"\n{model_dir}: {args.sequences} held-out texts, {QUALITY_PREFIX}-token prefix, "
              f"{args.steps} decode steps each")
        print(format_quality(measure_quality(model_dir, args.sequences, QUALITY_PREFIX, args.steps)))


if __name__ == "__main__":
    main()
