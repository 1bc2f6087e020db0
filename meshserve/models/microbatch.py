"""Two micro-batches per step, so that one computes while the other's tokens travel (CloudMatrix-Infer §4.2.3,
Fig. 14; DeepSeek's dual-microbatch pipeline).

A step's batch is cut at the sequence boundary nearest half its tokens. Each half runs the decoder stack as a
generator that stops (`yield`) right after it has launched a transfer: the MoE dispatch after attention and
gating, the combine after the experts. `interleave` runs the halves in turn, one stage each, so while half A's
rows are in flight half B computes its attention or experts, and the other way round. Every rank runs the same
schedule, so the collectives of each half meet across ranks in the same order; a rank with no tokens runs two
empty halves. The halves' results are those of the whole batch: every token's computation is the same, only
its order differs (a decode token of half B attends to cache entries half A wrote earlier in the same layer,
which it would also see in one batch).
"""
from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field

from meshserve.layers.metadata import AttentionMetadata

Stages = Generator[str, None, object]  # yields the name of each stage it ends, returns the micro-batch's result


def split_point(attn: AttentionMetadata) -> int:
    """Sequences in the first micro-batch: the boundary whose token count is nearest half the batch."""
    total = attn.query_start_loc[-1]
    return min(range(attn.num_seqs + 1), key=lambda i: (abs(2 * attn.query_start_loc[i] - total), i))


def split_batch(attn: AttentionMetadata) -> list[tuple[slice, AttentionMetadata]]:
    """The two micro-batches: each one's token rows and attention metadata."""
    first = split_point(attn)
    cut = attn.query_start_loc[first]
    meta_a, meta_b = attn.split(first)
    return [(slice(0, cut), meta_a), (slice(cut, attn.query_start_loc[-1]), meta_b)]


@dataclass
class StageTimeline:
    """When each stage of each micro-batch ran (perf_counter seconds), for the benchmark's timeline plot."""

    stages: list[tuple[int, str, float, float]] = field(default_factory=list)  # (micro-batch, stage, start, end)

    def clear(self) -> None:
        self.stages.clear()


def interleave(halves: list[Stages], timeline: StageTimeline | None = None) -> list:
    """Run the micro-batches' stage generators in turn, one stage each, until all are done; their results."""
    results: list = [None] * len(halves)
    running = dict(enumerate(halves))
    while running:
        for index in list(running):
            start = time.perf_counter()
            try:
                stage = next(running[index])
            except StopIteration as done:
                results[index] = done.value
                stage = "finish"
                del running[index]
            if timeline is not None:
                timeline.stages.append((index, stage, start, time.perf_counter()))
    return results
