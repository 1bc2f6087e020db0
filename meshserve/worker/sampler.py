"""Batched token sampling over the last-position logits of one engine step.

Order of processing (as vLLM): min_tokens masking, logit bias, repetition
penalty, frequency/presence penalties; then greedy rows take the argmax and the other
rows go through temperature, top-k, top-p and min-p before drawing a token.
Every step is a tensor operation over the whole batch (or over the rows that
need it); Python loops run over rows only, never over the vocabulary.

`Sampler.sample_isolating` keeps one request's failure in that request: when
the batch raises, it samples row by row and fails only the rows that raise.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from meshserve.wire.sampling_params import SamplingParams
from meshserve.wire.worker import SampleLogprobs

logger = logging.getLogger(__name__)
T = TypeVar("T")

_NEG_INF = float("-inf")
FAILED_TOKEN = -1  # the token id of a row whose sampling failed (see SamplerOutput.failed)
# error texts of a broken device or collective: the process itself is at fault, not one request
_DEVICE_FAULT_MARKS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert", "NCCL")


@dataclass
class SamplingRow:
    """One request's share of a sampling step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far
    # per-request RNG seeded from params.seed; the worker keeps it across steps
    generator: torch.Generator | None = None
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: the sampled token's logprobs, None for a row that did not ask for them
    logprobs: list[SampleLogprobs | None]
    # row index -> why sampling that row failed (its token id is FAILED_TOKEN); sample_isolating only
    failed: dict[int, str] = field(default_factory=dict)


def is_process_fault(exc: BaseException) -> bool:
    """Whether an error is the device's or the process's (out of memory, a CUDA or NCCL error) rather
    than one request's: only such errors may end an worker."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)) or (
            accelerator_error is not None and isinstance(exc, accelerator_error)):
        return True
    text = str(exc)
    return any(mark in text for mark in _DEVICE_FAULT_MARKS)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator a seeded request samples with (on the logits' device)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Turns logits [N, V] and one SamplingRow per logits row into N token ids."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        _check_inputs(logits, rows)
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        if all(_is_plain_greedy(row) for row in rows):
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=[None] * len(rows))

        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = None
        if wanted:  # reported on the model's raw distribution, before any processing
            raw_logprobs = torch.log_softmax(logits[_index(wanted, logits.device)].float(), dim=-1)

        work = process_logits(logits, rows) if any(_needs_processing(row) for row in rows) else logits
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):
            token_ids = work.argmax(dim=-1)
        elif not greedy:
            token_ids = _sample_random_rows(work, rows)
        else:
            random = [i for i, row in enumerate(rows) if not row.params.greedy]
            token_ids = torch.empty(len(rows), dtype=torch.long, device=work.device)
            index = _index(greedy, work.device)
            token_ids[index] = work[index].argmax(dim=-1)
            index = _index(random, work.device)
            token_ids[index] = _sample_random_rows(work[index], [rows[i] for i in random])

        logprobs: list[SampleLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, wanted, token_ids, rows)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def sample_isolating(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample the batch; if that raises for a reason other than a process fault, sample each row
        on its own and fail only the rows that raise. Seeded rows are rewound first, so every other
        row gets the very token it would have got in a batch without the failing ones."""
        batch = batch_or_rewind([row.generator for row in rows], lambda: self(logits, rows), "sampling")
        if batch is not None:
            return batch
        out = SamplerOutput(token_ids=[], logprobs=[])
        for i, row in enumerate(rows):
            try:
                one = self(logits[i:i + 1], [row])
            except Exception as exc:  # noqa: BLE001 - see above
                if is_process_fault(exc):
                    raise
                out.token_ids.append(FAILED_TOKEN)
                out.logprobs.append(None)
                out.failed[i] = describe_error(exc)
                continue
            out.token_ids.append(int(one.token_ids[0]))
            out.logprobs.append(one.logprobs[0])
        return out


def batch_or_rewind(generators: list[torch.Generator | None], run_batch: Callable[[], T], what: str) -> T | None:
    """`run_batch()`; if it raises for a reason other than a process fault, None with every seeded generator
    rewound to where it was (the caller then goes one request at a time)."""
    states = [g.get_state() if g is not None else None for g in generators]
    try:
        return run_batch()
    except Exception as exc:  # noqa: BLE001 - one request's settings must not end the worker
        if is_process_fault(exc):
            raise
        logger.warning("%s a batch of %d requests failed (%s); going one by one", what, len(generators),
                       describe_error(exc))
    for generator, state in zip(generators, states):
        if state is not None:
            generator.set_state(state)
    return None


# ---------------------------------------------------------------- checks


def _check_inputs(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_rows, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != len(rows):
        raise ValueError(f"got {logits.shape[0]} logits rows but {len(rows)} sampling rows")
    for row in rows:
        g = row.generator
        if g is not None and g.device.type != logits.device.type:
            raise ValueError(f"a row's generator is on {g.device} but the logits are on {logits.device}")


def _is_plain_greedy(row: SamplingRow) -> bool:
    return row.params.greedy and row.params.logprobs is None and not _needs_processing(row)


def _needs_processing(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or bool(p.logit_bias)
        or _min_tokens_active(row)
    )


def _min_tokens_active(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


# ---------------------------------------------------------------- logits processing


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A float32 copy of logits with min_tokens masking, logit bias and the penalties applied (greedy and random
    rows alike)."""
    _check_inputs(logits, rows)
    work = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    _mask_stop_tokens_below_min_tokens(work, rows)
    _apply_logit_bias(work, rows)
    _apply_repetition_penalty(work, rows)
    _apply_frequency_presence_penalties(work, rows)
    return work


def _mask_stop_tokens_below_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Until a request has min_tokens outputs, neither eos nor its stop tokens may be drawn."""
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if not _min_tokens_active(row):
            continue
        stops = set(row.params.stop_token_ids)
        if not row.params.ignore_eos:
            stops.update(row.eos_token_ids)
        row_index.extend([i] * len(stops))
        token_index.extend(stops)
    if row_index:
        _check_token_range(token_index, logits.shape[1], "stop/eos token id")
        logits[_index(row_index, logits.device), _index(token_index, logits.device)] = _NEG_INF


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI's logit_bias: each listed token's logit plus its bias."""
    row_index: list[int] = []
    token_index: list[int] = []
    bias: list[float] = []
    for i, row in enumerate(rows):
        for token_id, value in (row.params.logit_bias or {}).items():
            row_index.append(i)
            token_index.append(token_id)
            bias.append(value)
    if row_index:
        _check_token_range(token_index, logits.shape[1], "logit_bias token id")
        device = logits.device
        logits[_index(row_index, device), _index(token_index, device)] += torch.tensor(bias, device=device)


def _sparse_token_counts(
    rows: list[int], token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs as flat indices into a [N, V] tensor, and how often each occurs.

    Penalties touch only tokens a request has seen, so they work on these few
    positions instead of on dense [N, V] count tensors.
    """
    flat_tokens = [t for tokens in token_lists for t in tokens]
    if not flat_tokens:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty
    _check_token_range(flat_tokens, vocab_size, "token id")
    row_of_token = [r for r, tokens in zip(rows, token_lists) for _ in range(len(tokens))]
    flat = _index(row_of_token, device) * vocab_size + _index(flat_tokens, device)
    return torch.unique(flat, return_counts=True)


def _check_token_range(token_ids: list[int], vocab_size: int, what: str) -> None:
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"{what} {bad} is outside the vocabulary [0, {vocab_size})")


def _per_position(values: list[float], rows: list[int], flat: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Spread per-row values to the flat positions of those rows."""
    by_row = torch.zeros(max(rows) + 1, device=flat.device)
    by_row[_index(rows, flat.device)] = torch.tensor(values, device=flat.device)
    return by_row[flat // vocab_size]


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """HF semantics over prompt + output tokens: positive logits divided, negative multiplied."""
    selected = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not selected:
        return
    vocab = logits.shape[1]
    tokens = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in selected]
    flat, _ = _sparse_token_counts(selected, tokens, vocab, logits.device)
    if flat.numel() == 0:
        return
    penalty = _per_position([rows[i].params.repetition_penalty for i in selected], selected, flat, vocab)
    flat_logits = logits.view(-1)
    seen = flat_logits[flat]
    flat_logits[flat] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _apply_frequency_presence_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI semantics over output tokens: logit -= freq * count + presence * (count > 0)."""
    selected = [
        i for i, row in enumerate(rows)
        if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0
    ]
    if not selected:
        return
    vocab = logits.shape[1]
    flat, counts = _sparse_token_counts(selected, [rows[i].output_token_ids for i in selected], vocab, logits.device)
    if flat.numel() == 0:
        return
    frequency = _per_position([rows[i].params.frequency_penalty for i in selected], selected, flat, vocab)
    presence = _per_position([rows[i].params.presence_penalty for i in selected], selected, flat, vocab)
    logits.view(-1)[flat] -= frequency * counts.float() + presence


# ---------------------------------------------------------------- random sampling


def sampling_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied: the distribution (as logits) non-greedy rows draw from.

    Only for non-greedy rows (temperature > 0); greedy rows never reach this.
    """
    candidates, candidate_ids = _candidates(logits, rows)
    if candidate_ids is None:
        return candidates
    full = torch.full((logits.shape[0], logits.shape[1]), _NEG_INF, device=logits.device)
    return full.scatter_(1, candidate_ids, candidates)


def _sample_random_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    candidates, candidate_ids = _candidates(logits, rows)
    probs = torch.softmax(candidates, dim=-1)
    # exponential race: argmax(p / q), q ~ Exp(1), draws token t with probability p[t]
    race = _exponential_noise(rows, logits.shape[1], candidate_ids, logits.device)
    choice = (probs / race).argmax(dim=-1)
    if candidate_ids is None:
        return choice
    return candidate_ids.gather(1, choice.unsqueeze(1)).squeeze(1)


# top-k/top-p look for their cutoff among this many most likely tokens (a partial top-k,
# far cheaper than sorting the vocabulary); rows whose top-p cutoff lies further get a full sort
_TOP_P_WINDOW = 1024


def _candidates(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Filtered, temperature-scaled logits over the tokens that can still be drawn.

    When every row filters with top-k/top-p and its survivors lie among the
    window of most likely tokens, returns those [N, window] logits (dropped
    ones at -inf) and their token ids, so the draw touches only the window.
    Otherwise returns [N, V] logits and None.
    """
    vocab = logits.shape[1]
    device = logits.device
    temperature = torch.tensor([row.params.temperature for row in rows], device=device).unsqueeze(1)
    scaled = logits.float() / temperature
    k_list = [row.params.top_k if 0 < row.params.top_k < vocab else 0 for row in rows]  # 0: off
    p_list = [row.params.top_p for row in rows]
    filtering = [bool(k) or p < 1.0 for k, p in zip(k_list, p_list)]
    if not any(filtering):
        return _apply_min_p(scaled, rows), None

    top_k = torch.tensor(k_list, device=device)
    top_p = torch.tensor(p_list, device=device)
    window = min(vocab, max(k if k else (_TOP_P_WINDOW if p < 1.0 else 1) for k, p in zip(k_list, p_list)))
    candidates, candidate_ids = scaled.topk(window, dim=-1)  # sorted, descending
    kept, window_mass = _keep_sorted(candidates, scaled, top_k, top_p)
    candidates = candidates.masked_fill(~kept, _NEG_INF)
    # rows whose window holds less than top_p of the mass: their cutoff lies beyond it
    overflow = (top_k == 0) & (top_p < 1.0) & (window_mass < top_p)
    needs_sort = window < vocab and bool(overflow.any())
    if all(filtering) and not needs_sort:
        return _apply_min_p(candidates, rows), candidate_ids

    full = torch.full_like(scaled, _NEG_INF).scatter_(1, candidate_ids, candidates)
    if needs_sort:
        over = scaled[overflow]
        sorted_logits, order = over.sort(dim=-1, descending=True)
        kept, _ = _keep_sorted(sorted_logits, over, top_k[overflow], top_p[overflow])
        full[overflow] = torch.full_like(over, _NEG_INF).scatter_(1, order, sorted_logits.masked_fill(~kept, _NEG_INF))
    if not all(filtering):
        unfiltered = torch.tensor([not f for f in filtering], device=device).unsqueeze(1)
        full = torch.where(unfiltered, scaled, full)
    return _apply_min_p(full, rows), None


def _keep_sorted(
    candidates: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sorted (descending) candidates survive top-k then top-p; also the mass the candidates hold."""
    rank = torch.arange(candidates.shape[1], device=candidates.device).unsqueeze(0)
    kept = (top_k == 0).unsqueeze(1) | (rank < top_k.unsqueeze(1))
    masked = candidates.masked_fill(~kept, _NEG_INF)
    # with top-k all survivors are candidates; without it the whole row normalises
    log_norm = masked.logsumexp(dim=-1)
    if bool((top_k == 0).any()):
        log_norm = torch.where(top_k > 0, log_norm, logits.logsumexp(dim=-1))
    probs = (masked - log_norm.unsqueeze(1)).exp()
    mass = probs.cumsum(dim=-1)
    # keep the smallest prefix holding top_p; a threshold above 1 switches top-p off for a row
    threshold = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, 2.0)).unsqueeze(1)
    drop = (mass - probs) >= threshold
    drop[:, 0] = False  # always keep the most likely token
    return kept & ~drop, mass[:, -1]


def _apply_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    if not any(row.params.min_p > 0.0 for row in rows):
        return logits
    min_p = torch.tensor([row.params.min_p for row in rows], device=logits.device).unsqueeze(1)
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p)  # log(0) = -inf keeps all
    return logits.masked_fill(logits < threshold, _NEG_INF)


def _exponential_noise(
    rows: list[SamplingRow], vocab: int, candidate_ids: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Exp(1) noise per candidate; a seeded row draws from its own generator so batch mates cannot shift it."""
    width = vocab if candidate_ids is None else candidate_ids.shape[1]
    uniform = torch.empty(len(rows), width, dtype=torch.float32, device=device)
    unseeded = [i for i, row in enumerate(rows) if row.generator is None]
    if len(unseeded) == len(rows):
        uniform.uniform_()
    else:
        for i, row in enumerate(rows):
            if row.generator is None:
                continue
            # always a whole vocabulary's worth, read at the candidates' ids: the row's
            # random stream and each token's noise then do not depend on the window size
            draw = torch.empty(vocab, dtype=torch.float32, device=device).uniform_(generator=row.generator)
            uniform[i] = draw if candidate_ids is None else draw[candidate_ids[i]]
        if unseeded:
            uniform[_index(unseeded, device)] = torch.rand(len(unseeded), width, device=device)
    # -log(U) is Exp(1) (and cheaper than exponential_). Keeping U inside (0, 1) keeps q finite
    # and positive, so a kept token's p / q is positive and a dropped token's is 0, never NaN
    return uniform.clamp_(torch.finfo(torch.float32).tiny, 1.0 - 2.0**-24).log_().neg_()


# ---------------------------------------------------------------- logprobs


def _gather_logprobs(
    raw_logprobs: torch.Tensor, wanted: list[int], token_ids: torch.Tensor, rows: list[SamplingRow]
) -> list[SampleLogprobs | None]:
    """raw_logprobs holds the rows listed in `wanted`, in that order."""
    device = raw_logprobs.device
    chosen_ids = token_ids[_index(wanted, device)]
    chosen = raw_logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    max_top = max(rows[i].params.logprobs for i in wanted)
    if max_top > 0:
        top_values, top_ids = raw_logprobs.topk(max_top, dim=-1)  # sorted, descending
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    result: list[SampleLogprobs | None] = [None] * len(rows)
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs
        top = [(top_ids[j][r], top_values[j][r]) for r in range(k)] if k > 0 else []
        result[i] = SampleLogprobs(chosen[j], top)
    return result
