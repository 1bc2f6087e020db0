"""What a rank keeps of each request between steps (`RequestState`), the part of a step each sequence runs
(`StepSeq`), and the snapshot a failed step's rollback restores (`StepSnapshot`): the model runner's
bookkeeping, apart from its tensors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from meshserve.wire.sampling_params import SamplingParams
from meshserve.wire.worker import SchedulerOutput

if TYPE_CHECKING:
    import llguidance


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    prompt_token_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)  # MTP drafts to verify next step
    # structured outputs (the sampling rank's constrained requests): the grammar's state, and the outputs it has
    # taken up to (the step after a token was sampled hands it to the matcher, on the mask thread); None while
    # the constraint waits for its start (`StructuredOutputs.starts_after`: the end of a reasoning part)
    matcher: llguidance.LLMatcher | None = None
    num_matched: int | None = 0
    num_searched: int = 0  # while it waits: the outputs already searched for its start

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class StepSnapshot:
    """The request state a step may change, taken before it; `restore` puts it back after a failed attempt.
    Lists a step only extends are kept as lengths; the ones it replaces (drafts) by reference."""

    requests: dict[str, RequestState]
    failed_ids: set[str]
    # per request of the step: (state, len(token_ids), len(block_ids), num_computed_tokens, drafts, generator state)
    progress: list[tuple[RequestState, int, int, int, list[int], torch.Tensor | None]]

    @classmethod
    def take(cls, requests: dict[str, RequestState], failed_ids: set[str], sched: SchedulerOutput) -> StepSnapshot:
        touched = set(sched.num_scheduled_tokens).union(c.req_id for c in sched.cached_reqs)
        progress = []
        for req_id in touched:
            state = requests.get(req_id)
            if state is not None:
                generator = state.generator.get_state() if state.generator is not None else None
                progress.append((state, len(state.token_ids), len(state.block_ids), state.num_computed_tokens,
                                 state.draft_token_ids, generator))
        return cls(dict(requests), set(failed_ids), progress)

    def restore(self, requests: dict[str, RequestState], failed_ids: set[str]) -> None:
        requests.clear()
        requests.update(self.requests)
        failed_ids.clear()
        failed_ids.update(self.failed_ids)
        for state, num_tokens, num_blocks, num_computed, drafts, generator in self.progress:
            del state.token_ids[num_tokens:]
            del state.block_ids[num_blocks:]
            state.num_computed_tokens = num_computed
            state.draft_token_ids = drafts
            if generator is not None:
                state.generator.set_state(generator)


@dataclass
class StepSeq:
    """One sequence's part of a step."""

    state: RequestState
    start: int  # position of its first token this step
    row: int  # its first row in the step's flattened batch
    num_rows: int
    drafts: list[int]  # drafts it verifies: its rows are [last token, *drafts], one-token decode rows each
    is_decode: bool  # its rows are one-token decode rows (a decode, or a verification)
    samples: bool  # the step reaches the end of its known tokens: it produces tokens
