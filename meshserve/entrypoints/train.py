"""`meshserve train`: train a preset on the standard-library corpus (DeepSeek-V3 with its MTP layer).

  meshserve train --arch A --preset P --out DIR [--steps N] [--seq-len L] [--batch-size B] [--seed S]
                  [--lr X] [--mtp-loss-weight W] [--eval-sequences N] [--threads T] [--fp32]
                  [--init-dir DIR] [--override KEY=JSON ...]
  meshserve train --cached [--arch A] [--preset P]     # the cached trained model's path (trained on first use)

Writes an HF-format checkpoint (the factory's layout) and `train_report.json` to DIR and prints the
report. Bad arguments print one line and exit with 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from meshserve.models.factory import ARCHITECTURES, PRESET_NAMES

_TRAINING_FLAGS = ("steps", "seq_len", "batch_size", "lr", "mtp_loss_weight", "mtp_distill_steps", "mtp_distill_lr",
                   "eval_sequences", "threads", "init_dir", "overrides")


def add_train_parser(subparsers) -> None:
    """Add `train` to the top-level `meshserve` subparsers."""
    train = subparsers.add_parser("train", help="train a preset on the Python standard library's sources "
                                                "(DeepSeek-V3: with its MTP layer)")
    train.add_argument("--arch", default="deepseek_v3", help=f"one of: {', '.join(ARCHITECTURES)} "
                                                             "(default: deepseek_v3)")
    train.add_argument("--preset", default=None, help=f"one of: {', '.join(PRESET_NAMES)} "
                                                      "(default: tiny; with --cached: small)")
    train.add_argument("--out", default=None, help="output directory (must not exist or be empty)")
    train.add_argument("--cached", action="store_true",
                       help="print the cached trained model's directory, training it with the preset's defaults "
                            "on first use")
    train.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    train.add_argument("--seq-len", dest="seq_len", type=int, default=None,
                       help="tokens per training sequence (default: the preset's)")
    train.add_argument("--batch-size", dest="batch_size", type=int, default=None,
                       help="sequences per step (default: the preset's)")
    train.add_argument("--seed", type=int, default=None, help="init, batches and everything else (default: 0)")
    train.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    train.add_argument("--mtp-loss-weight", dest="mtp_loss_weight", type=float, default=None,
                       help="weight of the MTP loss next to the next-token loss (default: 0.3)")
    train.add_argument("--mtp-distill-steps", dest="mtp_distill_steps", type=int, default=None,
                       help="then train the MTP layer alone on the main model's own predictions of token t+2 "
                            "(self-distillation, what drafts are checked against) (default: the preset's)")
    train.add_argument("--mtp-distill-lr", dest="mtp_distill_lr", type=float, default=None,
                       help="peak learning rate of that stage (default: 1e-3)")
    train.add_argument("--eval-sequences", dest="eval_sequences", type=int, default=None,
                       help="held-out sequences per evaluation (default: 16)")
    train.add_argument("--fp32", dest="bf16", action="store_false", default=None,
                       help="float32 matmuls (default: bfloat16 autocast where the CPU multiplies bf16 natively, "
                            "float32 elsewhere; weights and optimizer are float32 anyway)")
    train.add_argument("--bf16", dest="bf16", action="store_true", help="bfloat16 autocast even where emulated")
    train.add_argument("--threads", type=int, default=None,
                       help="torch threads (default: 1; more pay only on an idle machine, set OMP_WAIT_POLICY=PASSIVE "
                            "if others share it)")
    train.add_argument("--init-dir", dest="init_dir", default=None,
                       help="start from this checkpoint (e.g. from make-model) instead of the seeded factory init")
    train.add_argument("--override", dest="overrides", action="append", default=None, metavar="KEY=JSON",
                       help="config.json override, e.g. num_hidden_layers=2 (repeatable)")
    train.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    train.set_defaults(func=train_main)


def _parse_overrides(items: list[str] | None) -> dict | None:
    if not items:
        return None
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--override takes KEY=JSON, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value  # a bare string
    return overrides


def _error(message: str) -> int:
    print(f"meshserve train: error: {message}", file=sys.stderr)
    return 2


def train_main(args: argparse.Namespace) -> int:
    # keeps torch and transformers out of the CLI's start-up
    from meshserve.train import cache, trainer

    try:
        given = {name: getattr(args, name) for name in _TRAINING_FLAGS}
        given["overrides"] = _parse_overrides(args.overrides)
        if args.cached:
            chosen = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None]
            if args.out is not None or chosen or args.seed is not None or args.bf16 is not None:
                return _error("--cached trains with the preset's defaults: give only --arch and --preset")
            print(cache.ensure_trained_model(args.arch, args.preset or "small", progress=args.progress))
            return 0
        if args.out is None:
            return _error("give --out DIR (or --cached)")
        settings = trainer.settings_for(args.arch, args.preset or "tiny", seed=args.seed, bf16=args.bf16, **given)
        out_dir = trainer.train(settings, args.out, progress=args.progress)
    except (ValueError, OSError) as exc:
        return _error(str(exc))
    report = json.loads((out_dir / trainer.REPORT_FILE).read_text())
    print(json.dumps(trainer.summary(report), indent=2))
    print(out_dir)
    return 0
