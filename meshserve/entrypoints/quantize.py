"""`meshserve quantize`: post-training W8A8 INT8 quantization into a compressed-tensors checkpoint.

  meshserve quantize --model DIR --out DIR [--method {rtn,smoothquant,smoothquant-gptq}]
                     [--calibration FILE] [--samples N] [--seq-len L] [--seed S] [--threads T]
                     [--min-expert-tokens N] [--no-progress]

Calibration: N windows of L tokens from the training split of the standard-library corpus (what the trained
models learned from; default), or from any text file (`--calibration FILE`, tokenized with the model's
tokenizer). Writes the checkpoint and `quantize_report.json` to DIR and prints the report's summary. Bad
arguments print one line and exit with 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METHODS = ("rtn", "smoothquant", "smoothquant-gptq")  # meshserve.quant.pipeline.METHODS, without importing torch


def add_quantize_parser(subparsers) -> None:
    """Add `quantize` to the top-level `meshserve` subparsers."""
    q = subparsers.add_parser("quantize", help="post-training INT8 W8A8 quantization (SmoothQuant + GPTQ) into a "
                                               "compressed-tensors checkpoint")
    q.add_argument("--model", required=True, help="float HF-format model directory")
    q.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    q.add_argument("--method", default="smoothquant-gptq", choices=METHODS,
                   help="rtn: plain rounding; smoothquant: SmoothQuant then rounding; smoothquant-gptq: "
                        "SmoothQuant, clip search and GPTQ (default)")
    q.add_argument("--calibration", default=None, metavar="FILE",
                   help="calibration text file (default: the training split of the standard-library corpus)")
    q.add_argument("--samples", type=int, default=64, help="calibration sequences (default: 64)")
    q.add_argument("--seq-len", dest="seq_len", type=int, default=256,
                   help="tokens per calibration sequence (default: 256)")
    q.add_argument("--seed", type=int, default=0, help="which corpus windows calibrate (default: 0)")
    q.add_argument("--min-expert-tokens", dest="min_expert_tokens", type=int, default=128,
                   help="routed experts that see fewer calibration tokens are rounded instead of GPTQ'd "
                        "(default: 128)")
    q.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    q.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    q.set_defaults(func=quantize_main)


def _error(message: str) -> int:
    print(f"meshserve quantize: error: {message}", file=sys.stderr)
    return 2


def _calibration(path: str | None):
    """The corpus' training token stream, or the text of the file."""
    if path is None:
        from meshserve.train.corpus import load_corpus

        return load_corpus().train
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"calibration file {str(file)!r} does not exist")
    return [file.read_text(encoding="utf-8", errors="replace")]


def quantize_main(args: argparse.Namespace) -> int:
    if args.samples < 1 or args.seq_len < 2:
        return _error("--samples must be >= 1 and --seq-len >= 2")
    if args.threads is not None and args.threads < 1:
        return _error("--threads must be >= 1")
    if not Path(args.model).is_dir():
        return _error(f"model directory {args.model!r} does not exist")
    # keeps torch and transformers out of the CLI's start-up
    import torch

    from meshserve.quant.api import quantize

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        calibration = _calibration(args.calibration) if args.method != "rtn" else None
        report = quantize(args.model, args.out, args.method, calibration, calibration_samples=args.samples,
                          seq_len=args.seq_len, seed=args.seed, progress=args.progress,
                          min_expert_tokens=args.min_expert_tokens)
    except (ValueError, OSError) as exc:
        return _error(str(exc))
    summary = {k: report[k] for k in ("method", "calibration", "quantized_linears", "kept_float",
                                      "rtn_fallback_experts", "seconds")}
    print(json.dumps(summary, indent=2))
    print(Path(args.out).absolute())
    return 0
