"""How the scheduler batches: sequence and token budgets, chunked prefill, the waiting queue."""
from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from meshserve.config.base import ConfigStruct


class SchedulerConfig(ConfigStruct, frozen=True):
    max_num_seqs: Annotated[int, Meta(ge=1, description="sequences decoded together in one step")] = 64
    max_num_batched_tokens: Annotated[int, Meta(
        ge=1, description="token budget of one engine step (chunked prefill splits longer prompts)")] = 2048
    enable_chunked_prefill: Annotated[bool, Meta(
        description="split a long prompt's prefill over several steps")] = True
    max_model_len: Annotated[int, Meta(
        ge=1, description="longest sequence, prompt and output (default: the model's max_position_embeddings)")
    ] | None = None
    max_waiting: Annotated[int, Meta(
        ge=1, description="queued requests beyond this are refused (HTTP 503)")] = 1024
    async_scheduling: Annotated[bool, Meta(description="prepare step n+1 while step n runs")] = True
