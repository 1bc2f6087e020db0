"""What the output-length predictor learns from, without torch: observed requests and length buckets.

Kept apart from `length_predictor` so the CLI can describe `meshserve predictor` without loading torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BUCKET_TOKENS = 128


@dataclass(frozen=True)
class LengthExample:
    """One observed request: its prompt, the max_tokens it asked for, and how many tokens it got."""

    prompt_token_ids: Sequence[int]
    max_tokens: int
    output_tokens: int


def bucket_of(tokens: int, bucket_tokens: int) -> int:
    """The bucket of an output length: (k*B, (k+1)*B] -> k; 0 tokens -> 0."""
    return max(int(tokens) - 1, 0) // bucket_tokens
