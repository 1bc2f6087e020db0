"""Routing requests to the DP groups of one TE (xdeepserve §4.3, DP load balancing).

Every DP group meets the others at each MoE dispatch, so the slowest group sets
the pace. The master keeps requests that no group has taken yet in one shared
queue and places them with a global view of every group:

- a group at its batch limit (`max_num_seqs` unfinished requests) takes nothing
  (decode: a full group would only queue the request and delay its second token);
- among the rest, the prefill cost decides: the prompt tokens the group still has
  to prefill plus this prompt's tokens that miss the group's prefix cache, so a
  request goes where its prefix is cached and long prompts spread over groups
  instead of meeting short ones in one straggling step;
- ties go to the lowest KV usage counting the blocks every request of the group
  (and this one) will still need up to its expected output length.

Each step the waiting requests that fit are placed as one batch, longest uncached
prompt first (LPT), which is what keeps the groups' prefill work even.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# the output length assumed for a request without max_tokens when reserving its KV space
DEFAULT_EXPECTED_OUTPUT_TOKENS = 256


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DPGroupLoad:
    """What the balancer knows of one DP group."""

    num_requests: int  # unfinished requests its scheduler holds
    max_num_seqs: int
    num_blocks: int  # its KV pool
    num_used_blocks: int  # held by requests (free and evictable cached blocks excluded)
    reserved_blocks: int  # blocks its requests will still need up to their expected length
    pending_prefill_tokens: int  # prompt tokens it has not computed yet

    @property
    def at_batch_limit(self) -> bool:
        return self.num_requests >= self.max_num_seqs

    def kv_usage_with(self, extra_blocks: int) -> float:
        return (self.num_used_blocks + self.reserved_blocks + extra_blocks) / max(1, self.num_blocks)


@dataclass(frozen=True)
class Placement:
    group: int
    prefill_cost: int
    kv_usage: float


def place_request(num_prompt_tokens: int, expected_output_tokens: int, block_size: int,
                  loads: list[DPGroupLoad], prefix_hit_tokens: list[int]) -> Placement | None:
    """The DP group for one request, or None when every group is at its batch limit."""
    if len(prefix_hit_tokens) != len(loads):
        raise ValueError(f"{len(prefix_hit_tokens)} prefix-hit counts for {len(loads)} DP groups")
    best: tuple | None = None
    for group, load in enumerate(loads):
        if load.at_batch_limit:
            continue
        hit = min(prefix_hit_tokens[group], num_prompt_tokens)
        prefill_cost = load.pending_prefill_tokens + num_prompt_tokens - hit
        # blocks of a prefix hit are shared, not new
        new_blocks = max(0, cdiv(num_prompt_tokens + expected_output_tokens, block_size) - hit // block_size)
        kv_usage = load.kv_usage_with(new_blocks)
        key = (prefill_cost, kv_usage, group)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    return Placement(group=best[2], prefill_cost=best[0], kv_usage=best[1])


@dataclass
class PendingRequest:
    """A request waiting in the shared queue, with what placement needs to know of it."""

    key: object  # whatever the caller uses to find the request again
    num_prompt_tokens: int
    expected_output_tokens: int


def place_batch(pending: list[PendingRequest], block_size: int, loads: list[DPGroupLoad],
                prefix_hits: Callable[[PendingRequest], list[int]]) -> list[tuple[PendingRequest, int]]:
    """Place the waiting requests that fit, longest uncached prompt first.

    `pending` is in queue order (priority, then arrival); only its first requests, as many as
    the groups have free slots, form the batch, so placement order never lets a later request
    overtake an earlier one that could not be placed. `prefix_hits(request) -> list[int]` gives
    the request's cached prompt tokens in each group. Loads are updated as requests are placed,
    so one batch spreads over the groups.
    """
    loads = list(loads)
    free_slots = sum(max(0, load.max_num_seqs - load.num_requests) for load in loads)
    pending = pending[:free_slots]
    hits = {id(req): prefix_hits(req) for req in pending}
    order = sorted(pending, key=lambda r: -(r.num_prompt_tokens - max(hits[id(r)], default=0)))
    placed: list[tuple[PendingRequest, int]] = []
    for req in order:
        choice = place_request(req.num_prompt_tokens, req.expected_output_tokens, block_size, loads, hits[id(req)])
        if choice is None:
            break  # every group is full; later ones would not fit either
        load = loads[choice.group]
        hit = min(hits[id(req)][choice.group], req.num_prompt_tokens)
        new_blocks = max(0, cdiv(req.num_prompt_tokens + req.expected_output_tokens, block_size) - hit // block_size)
        loads[choice.group] = DPGroupLoad(
            num_requests=load.num_requests + 1, max_num_seqs=load.max_num_seqs, num_blocks=load.num_blocks,
            num_used_blocks=load.num_used_blocks, reserved_blocks=load.reserved_blocks + new_blocks,
            pending_prefill_tokens=load.pending_prefill_tokens + req.num_prompt_tokens - hit)
        placed.append((req, choice.group))
    return placed
