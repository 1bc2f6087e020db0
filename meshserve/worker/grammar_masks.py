"""Structured outputs on the rank that samples: each constrained request's grammar matcher, and per step the
masks of the tokens each sampled row may take.

The masks of a step depend only on tokens known before it (the outputs so far, and the drafts it verifies),
so they are computed while the model runs the forward pass, on a thread, where a core is left over for it
(otherwise just before it), and applied to the logits after it (`StepMasks`). First each matcher takes the
tokens sampled since its last step, then llguidance fills the masks in native code with the GIL released;
the native op (layers/csrc/token_bitmask.cpp) applies them. A verification step needs one mask per draft
position: the matcher walks the drafts the grammar allows, filling each position's mask, and steps back; a
draft the grammar forbids is then refused by its own row's mask, so verification rejects it (and every draft
after it) as it rejects any other mismatch.

Only the rank that samples (a DP group's driver) keeps matchers; the others receive its tokens.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from meshserve.layers import cpu_kernels
from meshserve.structured_output.compiler import GrammarCompiler, load_ll_tokenizer
from meshserve.structured_output.grammar import first_lines
from meshserve.wire.sampling_params import SamplingParams
from meshserve.worker.request_state import RequestState, StepSeq

logger = logging.getLogger(__name__)
_BITS = 32


class GrammarMasks:
    """The driver's grammar state: the compiler (built on the first constrained request) and the mask thread."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: list[int],
                 compiler: GrammarCompiler | None = None) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = (vocab_size + _BITS - 1) // _BITS  # int32 words per mask row
        self._compiler = compiler
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        # beside the forward pass only where a core is left over: on cores torch's threads all use, the mask thread
        # preempts one of them and every parallel op waits for that straggler, which costs more than the masks
        self.overlap = (os.cpu_count() or 1) > torch.get_num_threads()
        self._executor = llguidance.LLExecutor()
        # byte value -> its 8 bits as "refused" flags: unpacks a mask in one gather (the torch path)
        self._refused_bits = ~((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(load_ll_tokenizer(self.model_dir, self.vocab_size, self.eos_token_ids))
        return self._compiler

    def matcher_for(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A request's matcher at the start of its grammar (None for an unconstrained request); the outputs it
        may already have (resumed after preemption, or a decode TE's request whose first token its prefill TE
        sampled) reach it with its first step's masks."""
        if params.structured_outputs is None:
            return None
        return self.compiler.matcher(params.structured_outputs)

    def advance(self, matcher: llguidance.LLMatcher, token_ids: list[int]) -> str | None:
        """Move a matcher past a request's new tokens; why they break its grammar, or None. Once the grammar is
        complete its mask allows only end-of-sequence tokens, which end the request and need no consuming."""
        for token_id in token_ids:
            if matcher.is_stopped() and token_id in self.eos_token_ids:
                continue
            if not matcher.consume_token(token_id):
                return f"token {token_id} breaks the request's grammar: {_first_line(matcher.get_error())}"
        return None

    def start(self, sampling: list[StepSeq]) -> StepMasks | None:
        """Begin the masks of a step's sampling sequences (in the order their logits rows come); None: none of
        them is constrained."""
        jobs, row = [], 0
        for seq in sampling:
            num_rows = seq.num_rows if seq.is_decode else 1
            state = seq.state
            if state.matcher is not None and _constraint_started(state):
                outputs = state.output_token_ids
                jobs.append(_MaskJob(state.req_id, state.matcher, row, seq.drafts, outputs[state.num_matched:]))
                state.num_matched = len(outputs)
            row += num_rows
        if not jobs:
            return None
        bitmask = torch.full((row, self.words), -1, dtype=torch.int32)
        rows = [job.row + j for job in jobs for j in range(len(job.drafts) + 1)]
        if self.overlap:
            return StepMasks(self._thread.submit(self._fill, jobs, bitmask), bitmask, rows, self)
        done: Future = Future()
        done.set_result(self._fill(jobs, bitmask))
        return StepMasks(done, bitmask, rows, self)

    def _fill(self, jobs: list[_MaskJob], bitmask: torch.Tensor) -> dict[str, str]:
        """Fill the jobs' rows; the requests whose masks failed, and why (their rows stay unmasked: the step
        fails those requests alone)."""
        row_bytes = self.words * 4
        failed = {}
        with torch.inference_mode():  # the bitmask was made in the step's inference mode
            plain = []
            for job in jobs:
                try:
                    error = self.advance(job.matcher, job.new_tokens)
                    if error is not None:
                        raise ValueError(error)
                    if job.drafts:
                        _fill_draft_rows(job.matcher, bitmask, job.row, job.drafts, row_bytes)
                    else:
                        plain.append(job)
                except Exception as exc:  # noqa: BLE001 - one request's grammar fails that request alone
                    failed[job.req_id] = f"computing the grammar mask failed: {exc}"
            if plain:  # the rows at the matchers' own state: in parallel, in native code
                self._executor.unsafe_compute_mask_ptr([(job.matcher, job.row) for job in plain], bitmask.data_ptr(),
                                                       row_bytes, bitmask.shape[0])
            for job in plain:  # a grammar beyond the limits ends its matcher in an error while its mask is computed
                if job.matcher.is_error():
                    failed[job.req_id] = f"computing the grammar mask failed: {_first_line(job.matcher.get_error())}"
        return failed

    def refused(self, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
        """Bool [rows, vocab]: which tokens each mask row refuses (bit order: little-endian words, as llguidance)."""
        return self._refused_bits[bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)[:, :vocab]

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """logits[rows[i]] = -inf wherever mask row i refuses a token: the native op on CPU (a store per refused
        token), else torch ops."""
        index = torch.tensor(rows, dtype=torch.long)
        if logits.device.type == "cpu" and cpu_kernels.enabled():
            cpu_kernels.apply_token_bitmask_(logits, bitmask[index] if len(rows) < len(bitmask) else bitmask, index)
            return
        refused = self.refused(bitmask[index], logits.shape[1]).to(logits.device)
        index = index.to(logits.device)
        logits[index] = logits[index].masked_fill(refused, float("-inf"))

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def _constraint_started(state: RequestState) -> bool:
    """Whether a request's constraint applies yet: at once, or once its output holds the tokens it starts after
    (the end of a reasoning part; its matcher then takes the outputs after them). Until then its rows, drafts
    included, are free."""
    if state.num_matched is not None:
        return True
    marker = state.params.structured_outputs.starts_after
    outputs = state.output_token_ids
    for end in range(max(len(marker), state.num_searched + 1), len(outputs) + 1):
        if outputs[end - len(marker):end] == marker:
            state.num_matched = end
            return True
    state.num_searched = len(outputs)
    return False


def _first_line(text: str) -> str:
    return first_lines(text, limit=1) or "no reason given"


def _fill_draft_rows(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int, drafts: list[int],
                     row_bytes: int) -> None:
    """Rows row .. row + len(drafts): the mask after each prefix of the drafts the grammar allows; the rows
    past the first forbidden draft (never reached: its own row refuses it) repeat the last allowed one."""
    allowed = matcher.try_consume_tokens(drafts)
    for j in range(allowed, -1, -1):
        target = bitmask[row + j]
        matcher.unsafe_compute_mask_ptr(target.data_ptr(), row_bytes)
        if j:
            matcher.rollback(1)
    if allowed < len(drafts):
        bitmask[row + allowed + 1:row + len(drafts) + 1] = bitmask[row + allowed]


@dataclass
class _MaskJob:
    req_id: str
    matcher: llguidance.LLMatcher
    row: int  # its first logits row
    drafts: list[int]
    new_tokens: list[int]  # its outputs the matcher has not taken yet


class StepMasks:
    """One step's masks, being filled on the mask thread."""

    def __init__(self, future: Future, bitmask: torch.Tensor, rows: list[int], owner: GrammarMasks) -> None:
        self._future = future
        self.bitmask = bitmask
        self.rows = rows  # the logits rows the masks cover
        self._owner = owner

    def wait(self) -> dict[str, str]:
        """Until the fill is done (it moves matchers through drafts and back: nothing may touch them before);
        the requests whose masks failed, and why."""
        return self._future.result()

    def apply(self, logits: torch.Tensor) -> dict[str, str]:
        """Refuse, in place, every token the grammar does not allow on the constrained rows of `logits`; the
        requests whose masks failed, and why (the caller fails them)."""
        failed = self.wait()
        self._owner.apply(logits, self.bitmask, self.rows)
        return failed
