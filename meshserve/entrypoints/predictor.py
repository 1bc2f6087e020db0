"""`meshserve predictor train`: fit the decode-length predictor to what a served model actually generates.

  meshserve predictor train --model DIR --out FILE [--num-prompts N] [--held-out 0.2] [--bucket-tokens 128]
                            [--max-tokens-range A:B] [--prompt-len A:B] [--temperature 1.0] [--seed 0]

Steps (deepserve §5.3.3): build prompts, run them through the target model
offline with temperature sampling and a per-request max_tokens, bucket the
output lengths, split train / held-out, train, and report held-out accuracy
against the majority-bucket and max_tokens-bucket baselines. Writes FILE (the
predictor) and FILE.report.json. Bad arguments print one line and exit with 2.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from meshserve.bench import BENCH_ENGINE_SETTINGS
from meshserve.bench.workload import make_offline_workload, parse_range, special_token_ids
from meshserve.config.arguments import add_engine_arguments, given_engine_settings
from meshserve.router.length_examples import DEFAULT_BUCKET_TOKENS, LengthExample, bucket_of
from meshserve.utils import report
from meshserve.wire.errors import EngineDeadError, QueueFullError
from meshserve.wire.sampling_params import SamplingParams

# the prompts' and the samplers' seeds are derived from --seed, apart from each other
SAMPLING_SEED_OFFSET = 1_000_000
# requests handed to the engine at once: well under its waiting-queue limit, and a progress line per chunk
GENERATE_CHUNK = 256


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_predictor_parser(subparsers) -> None:
    """Add the `predictor` command and its subcommands to the top-level `meshserve` subparsers."""
    predictor = subparsers.add_parser("predictor", help="decode-length predictor for PD-aware routing")
    commands = predictor.add_subparsers(dest="predictor_command", required=True, parser_class=_OneLineErrorParser)
    train = commands.add_parser("train", help="generate with a model, then train and evaluate a length predictor")
    train.add_argument("--model", required=True, help="HF-format model directory (the served model)")
    train.add_argument("--out", required=True, help="predictor file to write (safetensors); the report goes to "
                                                    "FILE.report.json")
    train.add_argument("--num-prompts", dest="num_prompts", type=int, default=512,
                       help="requests to generate (default: 512)")
    train.add_argument("--held-out", dest="held_out", type=float, default=0.2,
                       help="fraction of requests kept for evaluation (default: 0.2)")
    train.add_argument("--bucket-tokens", dest="bucket_tokens", type=int, default=DEFAULT_BUCKET_TOKENS,
                       help=f"output tokens per length bucket (default: {DEFAULT_BUCKET_TOKENS})")
    train.add_argument("--max-tokens-range", dest="max_tokens_range", default="16:512",
                       help="per-request max_tokens drawn uniformly from A:B (default: 16:512)")
    train.add_argument("--prompt-len", dest="prompt_len", default="16:256",
                       help="prompt length range A:B in tokens (default: 16:256)")
    train.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    train.add_argument("--seed", type=int, default=0, help="prompts, sampling, split and training seed (default: 0)")
    train.add_argument("--epochs", type=int, default=30, help="training epochs (default: 30)")
    train.add_argument("--hidden", type=int, default=0,
                       help="hidden layer width; 0 is a linear classifier (default: 0)")
    train.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar or log lines")
    add_engine_arguments(train, BENCH_ENGINE_SETTINGS)
    train.set_defaults(func=train_main)


def log(message: str) -> None:
    print(f"[predictor train] {message}", file=sys.stderr, flush=True)


def train_main(args: argparse.Namespace) -> int:
    # start-up: zmq only when training
    from meshserve.engine.core_client import EngineStartupError

    try:
        return _train(args)
    # bad arguments, missing model, unknown engine setting, a request too long for the model, a failed engine
    except (ValueError, OSError, EngineStartupError, EngineDeadError, QueueFullError) as exc:
        print(f"meshserve predictor train: error: {exc}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    # start-up: safetensors only when training
    from meshserve.models.loader import load_hf_config

    if args.num_prompts < 2:
        raise ValueError(f"--num-prompts must be at least 2 (some to train on, some held out), got {args.num_prompts}")
    if not 0.0 < args.held_out < 1.0:
        raise ValueError(f"--held-out must be a fraction in (0, 1), got {args.held_out}")
    if args.bucket_tokens < 1:
        raise ValueError(f"--bucket-tokens must be at least 1, got {args.bucket_tokens}")
    if not args.temperature >= 0.0:
        raise ValueError(f"--temperature must be non-negative, got {args.temperature}")
    if args.epochs < 1 or args.hidden < 0:
        raise ValueError("--epochs must be at least 1 and --hidden non-negative")
    max_tokens_range = parse_range(args.max_tokens_range, "--max-tokens-range")
    prompt_len = parse_range(args.prompt_len, "--prompt-len")
    if not Path(args.model).is_dir():
        raise FileNotFoundError(f"model directory {args.model!r} does not exist")
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory; give a file name")
    engine_args = given_engine_settings(args)
    engine_args.setdefault("dtype", "float32")

    hf_config = load_hf_config(args.model)
    # max_tokens rides on the workload's output length: one draw per request from the range
    workload = make_offline_workload(args.num_prompts, prompt_len, max_tokens_range, int(hf_config["vocab_size"]),
                                     seed=args.seed, exclude_token_ids=special_token_ids(args.model))
    examples, generation = generate_examples(args.model, engine_args, workload, args.temperature, args.seed,
                                             args.progress)
    train_set, held_out = split_examples(examples, args.held_out, args.seed)
    if args.progress:
        log(f"training on {len(train_set)} requests ({args.epochs} epochs), holding out {len(held_out)}")
    from meshserve.router.length_predictor import LengthPredictor  # keeps torch out of the CLI's start-up

    start = time.perf_counter()
    predictor = LengthPredictor.train(train_set, bucket_tokens=args.bucket_tokens, epochs=args.epochs,
                                      seed=args.seed, hidden=args.hidden)
    train_s = time.perf_counter() - start
    predictor.save(out)
    evaluation = predictor.evaluate(held_out)
    result = {
        "predictor": str(out),
        "model": str(args.model),
        "bucket_tokens": args.bucket_tokens,
        "n_train": len(train_set),
        "n_held_out": len(held_out),
        "held_out": evaluation,
        "train_accuracy": predictor.evaluate(train_set)["accuracy"],
        "bucket_histogram": {"train": bucket_histogram(train_set, args.bucket_tokens),
                             "held_out": bucket_histogram(held_out, args.bucket_tokens)},
        "generation": generation,
        "train_s": train_s,
        "settings": {"num_prompts": args.num_prompts, "held_out_fraction": args.held_out,
                     "max_tokens_range": list(max_tokens_range), "prompt_len": list(prompt_len),
                     "temperature": args.temperature, "seed": args.seed, "epochs": args.epochs,
                     "hidden": args.hidden, "engine_args": engine_args},
    }
    report_path = report.write_json(report_path_for(out), result)
    baselines = evaluation["baselines"]
    print(f"held-out accuracy {evaluation['accuracy']:.3f} on {len(held_out)} requests (majority bucket "
          f"{baselines['majority_bucket']:.3f}, max_tokens bucket {baselines['max_tokens_bucket']:.3f}); "
          f"wrote {out} and {report_path}")
    return 0


def report_path_for(predictor_path: str | Path) -> Path:
    path = Path(predictor_path)
    return path.with_name(path.name + ".report.json")


def generate_examples(model: str, engine_args: dict, workload, temperature: float, seed: int,
                      progress: bool) -> tuple[list[LengthExample], dict]:
    """Run every prompt through the model (EOS honoured: the length is what the model chose) and record lengths."""
    # start-up: transformers and the engine only when training
    from meshserve.engine.llm import LLM

    if progress:
        log(f"starting the engine on {model} ({engine_args})")
    # a seed per request, so a batch mate's draw cannot change another request's length
    params = [SamplingParams(temperature=temperature, max_tokens=r.output_len, seed=seed + SAMPLING_SEED_OFFSET + i)
              for i, r in enumerate(workload)]
    outputs = []
    with LLM(model=model, **engine_args) as llm:
        if progress:
            log(f"generating {len(workload)} requests at temperature {temperature:g}")
        start = time.perf_counter()
        for first in range(0, len(workload), GENERATE_CHUNK):
            chunk = slice(first, first + GENERATE_CHUNK)
            outputs += llm.generate([r.prompt_token_ids for r in workload[chunk]], params[chunk], use_tqdm=progress)
            if progress:
                log(f"{len(outputs)}/{len(workload)} requests done, {time.perf_counter() - start:.1f}s")
        elapsed = time.perf_counter() - start
    examples = [LengthExample(list(r.prompt_token_ids), r.output_len, len(o.token_ids))
                for r, o in zip(workload, outputs)]
    finish_reasons: dict[str, int] = {}
    for o in outputs:
        finish_reasons[str(o.finish_reason)] = finish_reasons.get(str(o.finish_reason), 0) + 1
    output_tokens = sum(e.output_tokens for e in examples)
    if progress:
        log(f"generated {output_tokens} tokens in {elapsed:.1f}s; finish reasons {finish_reasons}")
    return examples, {"elapsed_s": elapsed, "output_tokens": output_tokens, "finish_reasons": finish_reasons}


def split_examples(examples: Sequence[LengthExample], held_out_fraction: float,
                   seed: int) -> tuple[list[LengthExample], list[LengthExample]]:
    """A seeded shuffle, then the held-out share (at least one request on each side)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_held = min(max(round(held_out_fraction * len(examples)), 1), len(examples) - 1)
    return [examples[i] for i in order[n_held:]], [examples[i] for i in order[:n_held]]


def bucket_histogram(examples: Sequence[LengthExample], bucket_tokens: int) -> dict[str, int]:
    """Requests per output-length bucket, keyed by the bucket's token range "lo-hi"."""
    counts: dict[int, int] = {}
    for e in examples:
        bucket = bucket_of(e.output_tokens, bucket_tokens)
        counts[bucket] = counts.get(bucket, 0) + 1
    return {f"{b * bucket_tokens + 1}-{(b + 1) * bucket_tokens}": counts[b] for b in sorted(counts)}
