"""The flags and settings of `meshserve bench eplb --layer-time` (meshserve/bench/eplb_layer_time.py), apart
from the measurement so that building the command line does not import torch."""
from __future__ import annotations

import argparse

from meshserve.moe.synthetic_load import zipf_exponent

STRATEGY = "attn=TP1+DP4 moe=TP1+EP4"
WORLD_SIZE = 4
DEFAULTS = {"experts": 64, "top_k": 8, "hidden": 512, "intermediate": 256, "tokens": 128, "batches": 8,
            "steps": 40, "warmup": 3, "redundant": "1,2"}


def add_layer_time_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layer-time", action=argparse.BooleanOptionalAction, default=True,
                        help="time one MoE layer on 4 local ranks for the default placement and the planner's plans "
                             "(default: on, about 20 s; with --no-synthetic and no --load: only that)")
    for name, kind, text in (
            ("experts", int, "logical experts"), ("top-k", int, "experts per token"), ("hidden", int, "hidden size"),
            ("intermediate", int, "expert intermediate size"), ("tokens", int, "tokens per rank per step"),
            ("batches", int, "distinct routed batches per window (planned from one window, timed on the other)"),
            ("steps", int, "timed steps per placement"), ("warmup", int, "untimed steps per placement"),
            ("redundant", str, "redundant slots per rank for the redundant and full plans")):
        default = DEFAULTS[name.replace("-", "_")]
        parser.add_argument(f"--layer-{name}", dest=f"layer_{name.replace('-', '_')}", type=kind, default=default,
                            help=f"layer time: {text} (default: {default})")


def layer_config(args: argparse.Namespace, redundant: list[int], hot_ratio: float) -> dict:
    """The measured part's settings from the parsed flags; ValueError names a bad one."""
    config = {name: getattr(args, f"layer_{name}") for name in DEFAULTS if name != "redundant"}
    for name, value in config.items():
        if value < (0 if name == "warmup" else 1):
            raise ValueError(f"--layer-{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}")
    if config["experts"] % WORLD_SIZE:
        raise ValueError(f"--layer-experts must be a multiple of {WORLD_SIZE} (the EP ranks)")
    if config["top_k"] > config["experts"]:
        raise ValueError("--layer-top-k must not exceed --layer-experts")
    if config["experts"] <= hot_ratio:
        raise ValueError(f"--layer-experts must exceed {hot_ratio:g} for the hottest expert to get {hot_ratio:g}x "
                         "the mean popularity")
    config.update(redundant=redundant, seed=args.seed, hot_ratio=hot_ratio, strategy=STRATEGY,
                  zipf_exponent=zipf_exponent(config["experts"], hot_ratio))
    return config
