"""The baseline: the same workload through HF transformers `generate`, run the way a user would.

Requests go in arrival order in left-padded batches. Each batch generates up to
its longest requested output, so shorter requests in it waste work; only the
tokens each request asked for count as useful output.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshserve.bench.workload import WorkloadRequest


@dataclass
class BaselineResult:
    elapsed_s: float
    load_s: float
    batch_size: int
    prompt_tokens: int
    output_tokens: int  # useful: what the requests asked for
    generated_tokens: int  # everything generate produced, padding rows included
    outputs: list[list[int]] = field(repr=False, default_factory=list)  # per request, its requested length

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> dict:
        return {
            "name": "hf_transformers",
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "elapsed_s": self.elapsed_s,
            "load_s": self.load_s,
            "batch_size": self.batch_size,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "generated_tokens": self.generated_tokens,
        }


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    # start-up: transformers only for the HF baseline
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # HF's load report lists checkpoint tensors it has no module for (DeepSeek's MTP layers), which
    # is expected here; keep it and the per-tensor progress bar out of the benchmark's output.
    verbosity, bars_on = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_on:
            hf_logging.enable_progress_bar()
    model.to(device).eval()
    # No request stops at EOS in this benchmark; clearing it here (not only in the
    # call) keeps generate from filling it back in from the checkpoint's defaults.
    model.generation_config.eos_token_id = None
    return model


def _pad_id(model) -> int:
    for candidate in (model.config.pad_token_id, getattr(model.config, "eos_token_id", None), 0):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask for a batch, padded on the left to the longest prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids, mask


def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt, `max_new_tokens` each, EOS not stopping anything."""
    pad_id = _pad_id(model)
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    return out[:, ids.shape[1]:].tolist()


def run_hf_baseline(
    model_dir: str | Path,
    workload: Sequence[WorkloadRequest],
    batch_size: int = 16,
    dtype: torch.dtype = torch.float32,
    on_batch_done: Callable[[int], None] | None = None,
    model=None,
    device: str = "cpu",
) -> BaselineResult:
    """Run `workload` through HF generate; `on_batch_done(n)` is called with each batch's request count."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    load_start = time.perf_counter()
    if model is None:
        model = load_hf_model(model_dir, dtype, device)
    load_s = time.perf_counter() - load_start
    generate_batch(model, [workload[0].prompt_token_ids], 2)  # warm-up, as for the engine

    outputs: list[list[int]] = []
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        max_new = max(r.output_len for r in batch)
        tokens = generate_batch(model, [r.prompt_token_ids for r in batch], max_new)
        generated += sum(len(t) for t in tokens)
        outputs.extend(t[:r.output_len] for t, r in zip(tokens, batch))
        if on_batch_done is not None:
            on_batch_done(len(batch))
    elapsed = time.perf_counter() - start
    return BaselineResult(
        elapsed_s=elapsed,
        load_s=load_s,
        batch_size=batch_size,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in workload),
        output_tokens=sum(r.output_len for r in workload),
        generated_tokens=generated,
        outputs=outputs,
    )
