"""A two-class workload for P/D benchmarks: long prompts with short outputs, short prompts with long outputs.

The first class is where disaggregation helps (prefill-heavy), the second where colocation does
(decode-heavy; deepserve §5.3.1). Optionally every prompt starts with one of a few shared prefixes
(system prompts), so routing can exploit prefix caches. The request shapes (class, lengths, order,
prefix of each request) come from `seed`, the token ids from `token_seed`: runs with the same seed and
different token seeds have identical shapes and share no prefix-cache content.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from meshserve.bench.workload import WorkloadError, WorkloadRequest, make_offline_workload

LONG_PROMPT = "long_prompt"  # long prompt, short output
LONG_OUTPUT = "long_output"  # short prompt, long output
KINDS = (LONG_PROMPT, LONG_OUTPUT)


@dataclass(frozen=True)
class Mix:
    long_prompt: tuple[int, int]  # token ranges, inclusive
    short_output: tuple[int, int]
    short_prompt: tuple[int, int]
    long_output: tuple[int, int]
    long_prompt_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_prompt_fraction <= 1.0:
            raise WorkloadError(f"the long-prompt fraction must be in [0, 1], got {self.long_prompt_fraction}")

    def longest_request(self) -> int:
        """Most prompt + output tokens one request of the mix can take (without a shared prefix)."""
        return max(self.long_prompt[1] + self.short_output[1], self.short_prompt[1] + self.long_output[1])


def make_mixed_workload(num_requests: int, mix: Mix, vocab_size: int, seed: int = 0, token_seed: int | None = None,
                        exclude_token_ids=(), num_prefixes: int = 0,
                        prefix_len: int = 0) -> tuple[list[WorkloadRequest], list[str]]:
    """`num_requests` requests in a seeded random order and each one's class (LONG_PROMPT or LONG_OUTPUT).

    With `num_prefixes` > 0 each prompt is one of that many shared prefixes of `prefix_len` tokens (each
    used by an equal share of the requests) followed by the class's prompt length of its own tokens."""
    if num_requests < 1:
        raise WorkloadError(f"the number of requests must be at least 1, got {num_requests}")
    if num_prefixes < 0 or (num_prefixes > 0 and prefix_len < 1):
        raise WorkloadError(f"shared prefixes need a count >= 0 and a length >= 1, got {num_prefixes} x {prefix_len}")
    rng = random.Random(seed)
    num_long_prompt = round(mix.long_prompt_fraction * num_requests)
    kinds = [LONG_PROMPT] * num_long_prompt + [LONG_OUTPUT] * (num_requests - num_long_prompt)
    rng.shuffle(kinds)
    shapes = [(rng.randint(*mix.long_prompt), rng.randint(*mix.short_output)) if kind == LONG_PROMPT
              else (rng.randint(*mix.short_prompt), rng.randint(*mix.long_output)) for kind in kinds]
    prefix_of = [i % num_prefixes for i in range(num_requests)] if num_prefixes else []
    rng.shuffle(prefix_of)
    # one stream of token ids, cut into the prefixes and every request's own tokens
    total = num_prefixes * prefix_len + sum(prompt_len for prompt_len, _ in shapes)
    stream = make_offline_workload(1, (total, total), (1, 1), vocab_size,
                                   seed=seed if token_seed is None else token_seed,
                                   exclude_token_ids=exclude_token_ids)[0].prompt_token_ids
    prefixes = [stream[i * prefix_len:(i + 1) * prefix_len] for i in range(num_prefixes)]
    at = num_prefixes * prefix_len
    requests = []
    for i, (prompt_len, output_len) in enumerate(shapes):
        own = stream[at:at + prompt_len]
        at += prompt_len
        requests.append(WorkloadRequest((prefixes[prefix_of[i]] if num_prefixes else []) + own, output_len))
    return requests, kinds
