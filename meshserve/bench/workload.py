"""Deterministic synthetic workloads: random token-id prompts with fixed output lengths.

Prompts are token ids, not text, so every request has exactly the length asked
for, whatever the tokenizer. Ids that a model treats specially (bos/eos/pad and
tokenizer special tokens) are never drawn, so a prompt cannot end early or look
like a chat template.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple


class WorkloadError(ValueError):
    """A workload parameter is malformed or out of range."""


class WorkloadRequest(NamedTuple):
    prompt_token_ids: list[int]
    output_len: int


def parse_range(text: str, name: str = "range") -> tuple[int, int]:
    """Parse "A:B" (inclusive, 1 <= A <= B) or a single "N" meaning N:N."""
    parts = str(text).strip().split(":")
    if len(parts) not in (1, 2) or any(not p.strip() for p in parts):
        raise WorkloadError(f"{name} must look like A:B or N, got {text!r}")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise WorkloadError(f"{name} must be integers like A:B, got {text!r}") from None
    low, high = values[0], values[-1]
    _check_range((low, high), name)
    return low, high


def _check_range(bounds: tuple[int, int], name: str) -> None:
    low, high = bounds
    if low < 1:
        raise WorkloadError(f"{name} must start at 1 or more, got {low}:{high}")
    if high < low:
        raise WorkloadError(f"{name} must have A <= B, got {low}:{high}")


def special_token_ids(model_dir: str | Path) -> set[int]:
    """Ids a model treats specially: bos/eos/pad from config.json plus tokenizer special tokens."""
    model_dir = Path(model_dir)
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            config = json.loads(path.read_text())
            for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
                ids.update(_as_ids(config.get(key)))
    tokenizer = model_dir / "tokenizer.json"
    if tokenizer.is_file():
        for token in json.loads(tokenizer.read_text()).get("added_tokens", []):
            if token.get("special"):
                ids.add(int(token["id"]))
    return ids


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class _TokenSampler:
    """Draws uniformly from [0, vocab_size) minus the excluded ids."""

    def __init__(self, vocab_size: int, exclude: Iterable[int], rng: random.Random):
        if vocab_size < 1:
            raise WorkloadError(f"vocab_size must be positive, got {vocab_size}")
        self._excluded = sorted({i for i in exclude if 0 <= i < vocab_size})
        self._num_allowed = vocab_size - len(self._excluded)
        if self._num_allowed < 1:
            raise WorkloadError(f"no token ids left to draw from: vocab_size {vocab_size}, all special")
        self._rng = rng

    def draw(self, n: int) -> list[int]:
        return [self._nth_allowed(self._rng.randrange(self._num_allowed)) for _ in range(n)]

    def _nth_allowed(self, rank: int) -> int:
        # Shift the rank past every excluded id at or below it (the list is short and sorted).
        token = rank
        for excluded in self._excluded:
            if excluded <= token:
                token += 1
            else:
                break
        return token


def make_offline_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    exclude_token_ids: Iterable[int] = (),
) -> list[WorkloadRequest]:
    """`num_requests` prompts with uniform lengths in `input_len` and uniform output lengths in `output_len`."""
    if num_requests < 1:
        raise WorkloadError(f"num_requests must be at least 1, got {num_requests}")
    _check_range(input_len, "input_len")
    _check_range(output_len, "output_len")
    rng = random.Random(seed)
    tokens = _TokenSampler(vocab_size, exclude_token_ids, rng)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        requests.append(WorkloadRequest(tokens.draw(n_in), n_out))
    return requests


def make_shared_prefix_workload(
    num_requests: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    shared_fraction: float = 1.0,
    num_prefixes: int = 1,
    seed: int = 0,
    exclude_token_ids: Iterable[int] = (),
) -> list[WorkloadRequest]:
    """Requests where a `shared_fraction` of them start with one of `num_prefixes` common prefixes.

    Sharing requests pick their prefix round-robin, so each prefix gets an equal
    share; the others get a private prefix of the same length, so every prompt
    has the same length distribution and only the reuse differs.
    """
    if num_requests < 1:
        raise WorkloadError(f"num_requests must be at least 1, got {num_requests}")
    if prefix_len < 1:
        raise WorkloadError(f"prefix_len must be at least 1, got {prefix_len}")
    if not 0.0 <= shared_fraction <= 1.0:
        raise WorkloadError(f"shared_fraction must be in [0, 1], got {shared_fraction}")
    if num_prefixes < 1:
        raise WorkloadError(f"num_prefixes must be at least 1, got {num_prefixes}")
    _check_range(suffix_len, "suffix_len")
    _check_range(output_len, "output_len")
    rng = random.Random(seed)
    tokens = _TokenSampler(vocab_size, exclude_token_ids, rng)
    prefixes = [tokens.draw(prefix_len) for _ in range(num_prefixes)]
    num_shared = round(shared_fraction * num_requests)
    shared_slots = set(rng.sample(range(num_requests), num_shared))
    requests = []
    next_prefix = 0
    for i in range(num_requests):
        if i in shared_slots:
            prefix = prefixes[next_prefix % num_prefixes]
            next_prefix += 1
        else:
            prefix = tokens.draw(prefix_len)
        suffix = tokens.draw(rng.randint(*suffix_len))
        requests.append(WorkloadRequest(list(prefix) + suffix, rng.randint(*output_len)))
    return requests
