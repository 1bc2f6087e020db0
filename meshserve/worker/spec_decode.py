"""Verifying speculative drafts: which of a request's k draft tokens the target model accepts, and the token after.

The target model scores all drafts of a step in one forward, so each request
brings k + 1 logits rows: row j is the distribution of the token that follows
the committed tokens and drafts d_1..d_j. Row j is processed (min_tokens,
penalties) as if d_1..d_j had already been generated one by one.

Greedy requests accept a draft while it equals its row's argmax and then emit
the argmax of the first row that disagreed (or of the last row): exactly the
tokens plain greedy sampling produces. Random requests follow the speculative
sampling rule (Leviathan et al. 2023, Chen et al. 2023) for a one-hot draft
distribution: accept d_{j+1} with probability p_j(d_{j+1}); on rejection draw
from p_j with d_{j+1} removed (renormalised) and stop; after k acceptances draw
a bonus token from p_k. Every emitted token is then distributed exactly as
under plain sampling. A seeded request draws its k acceptance uniforms and then
one final draw from its own generator, so batch mates cannot shift it.

A request without drafts goes through the plain Sampler unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from meshserve.wire.worker import SampleLogprobs
from meshserve.worker.sampler import (
    FAILED_TOKEN,
    Sampler,
    SamplerOutput,
    SamplingRow,
    _candidates,
    _check_token_range,
    _exponential_noise,
    _gather_logprobs,
    _index,
    _needs_processing,
    batch_or_rewind,
    describe_error,
    is_process_fault,
    process_logits,
)

_NO_DRAFT = -1  # the "next draft" of a request's last row: nothing to accept there


@dataclass
class DraftRow:
    """One request's share of a verification step."""

    row: SamplingRow  # output_token_ids: the tokens generated before this step
    draft_token_ids: list[int]  # the k >= 0 draft tokens proposed for this request this step


@dataclass
class VerifyOutput:
    # per request: the accepted drafts, then one token sampled from the target (1 .. k + 1 tokens);
    # [FAILED_TOKEN] for a failed request
    token_ids: list[list[int]]
    # per request, one entry per emitted token; None for a request that did not ask for logprobs
    logprobs: list[list[SampleLogprobs] | None]
    # request index -> why verifying it failed (as Sampler.sample_isolating)
    failed: dict[int, str] = field(default_factory=dict)


def verify_drafts(sampler: Sampler, logits: torch.Tensor, rows: list[DraftRow]) -> VerifyOutput:
    """Accept or reject each request's drafts against logits [sum(k_i + 1), V]; see the module docstring.

    If the batch raises for a reason other than a process fault, each request is
    verified on its own (seeded generators rewound first) and only those that raise fail.
    """
    _check_shape(logits, rows)
    if all(not r.draft_token_ids for r in rows):  # speculation off for this step: exactly the plain path
        return _from_sampler(sampler.sample_isolating(logits, [r.row for r in rows]))
    batch = batch_or_rewind([r.row.generator for r in rows], lambda: _verify_batch(sampler, logits, rows),
                            "verifying drafts of")
    return batch if batch is not None else _verify_one_by_one(sampler, logits, rows)


def _check_shape(logits: torch.Tensor, rows: list[DraftRow]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_rows, vocab], got shape {tuple(logits.shape)}")
    expected = sum(len(r.draft_token_ids) + 1 for r in rows)
    if logits.shape[0] != expected:
        raise ValueError(f"got {logits.shape[0]} logits rows but the requests' drafts need {expected}")


def _from_sampler(sampled: SamplerOutput) -> VerifyOutput:
    return VerifyOutput(
        token_ids=[[int(t)] for t in sampled.token_ids],
        logprobs=[[lp] if lp is not None else None for lp in sampled.logprobs],
        failed=dict(sampled.failed),
    )


def _verify_one_by_one(sampler: Sampler, logits: torch.Tensor, rows: list[DraftRow]) -> VerifyOutput:
    out = VerifyOutput(token_ids=[], logprobs=[])
    start = 0
    for i, r in enumerate(rows):
        end = start + len(r.draft_token_ids) + 1
        try:
            one = _verify_batch(sampler, logits[start:end], [r])
        except Exception as exc:  # noqa: BLE001 - see verify_drafts
            if is_process_fault(exc):
                raise
            out.token_ids.append([FAILED_TOKEN])
            out.logprobs.append(None)
            out.failed[i] = describe_error(exc)
        else:
            out.token_ids.append(one.token_ids[0])
            out.logprobs.append(one.logprobs[0])
        start = end
    return out


# ---------------------------------------------------------------- one batch


def _verify_batch(sampler: Sampler, logits: torch.Tensor, rows: list[DraftRow]) -> VerifyOutput:
    """Raises on the first request whose settings or drafts are bad; verify_drafts isolates it."""
    starts = _row_starts(rows)
    token_ids: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[SampleLogprobs] | None] = [None] * len(rows)

    plain = [i for i, r in enumerate(rows) if not r.draft_token_ids]
    if plain:  # no drafts: the plain sampler, on those rows alone
        sampled = sampler(logits[_index([starts[i] for i in plain], logits.device)], [rows[i].row for i in plain])
        for i, token, lp in zip(plain, sampled.token_ids, sampled.logprobs):
            token_ids[i] = [int(token)]
            logprobs[i] = [lp] if lp is not None else None

    drafted = [i for i, r in enumerate(rows) if r.draft_token_ids]
    spans = [range(starts[i], starts[i] + len(rows[i].draft_token_ids) + 1) for i in drafted]
    own_logits = logits if not plain else logits[_index([j for span in spans for j in span], logits.device)]
    emitted = _verify_drafted(own_logits, [rows[i] for i in drafted])
    for i, tokens in zip(drafted, emitted):
        token_ids[i] = tokens

    wanted = [i for i in drafted if rows[i].row.params.logprobs is not None]
    if wanted:
        for i, lps in zip(wanted, _emitted_logprobs(logits, [rows[i] for i in wanted],
                                                     [starts[i] for i in wanted], [token_ids[i] for i in wanted])):
            logprobs[i] = lps
    return VerifyOutput(token_ids=token_ids, logprobs=logprobs)


def _row_starts(rows: list[DraftRow]) -> list[int]:
    starts, start = [], 0
    for r in rows:
        starts.append(start)
        start += len(r.draft_token_ids) + 1
    return starts


def _verify_drafted(logits: torch.Tensor, requests: list[DraftRow]) -> list[list[int]]:
    """The emitted tokens of requests that all have drafts; logits holds their k + 1 rows each, in order."""
    vocab, device = logits.shape[1], logits.device
    for r in requests:
        _check_token_range(r.draft_token_ids, vocab, "draft token id")
        g = r.row.generator
        if g is not None and g.device.type != device.type:
            raise ValueError(f"a row's generator is on {g.device} but the logits are on {device}")
    work = logits
    if any(_needs_processing(r.row) for r in requests):  # row j sees d_1..d_j as generated tokens
        work = process_logits(logits, _rows_per_position(requests))

    emitted: list[list[int]] = [[] for _ in requests]
    greedy = [i for i, r in enumerate(requests) if r.row.params.greedy]
    random = [i for i, r in enumerate(requests) if not r.row.params.greedy]
    for group, verify in ((greedy, _verify_greedy), (random, _verify_random)):
        if not group:
            continue
        group_work = work if len(group) == len(requests) else work[_index(_rows_of(requests, group), device)]
        for i, tokens in zip(group, verify(group_work, [requests[i] for i in group])):
            emitted[i] = tokens
    return emitted


def _rows_per_position(requests: list[DraftRow]) -> list[SamplingRow]:
    """One SamplingRow per logits row: row j's outputs are the committed tokens plus d_1..d_j."""
    return [
        dataclasses.replace(r.row, output_token_ids=r.row.output_token_ids + r.draft_token_ids[:j], generator=None)
        for r in requests
        for j in range(len(r.draft_token_ids) + 1)
    ]


def _rows_of(requests: list[DraftRow], chosen: list[int]) -> list[int]:
    """The logits rows (k + 1 each, requests back to back) of the chosen requests."""
    starts = _row_starts(requests)
    return [j for i in chosen for j in range(starts[i], starts[i] + len(requests[i].draft_token_ids) + 1)]


def _verify_greedy(work: torch.Tensor, requests: list[DraftRow]) -> list[list[int]]:
    targets = work.argmax(dim=-1).tolist()
    emitted, start = [], 0
    for r in requests:
        drafts = r.draft_token_ids
        accepted = _leading_true([d == t for d, t in zip(drafts, targets[start:start + len(drafts)])])
        emitted.append(drafts[:accepted] + [targets[start + accepted]])
        start += len(drafts) + 1
    return emitted


def _leading_true(flags: list[bool]) -> int:
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


def _verify_random(work: torch.Tensor, requests: list[DraftRow]) -> list[list[int]]:
    """Speculative sampling for one-hot drafts: accept d with probability p(d), else draw from p without d."""
    device, vocab = work.device, work.shape[1]
    # every row of a request filters with that request's settings
    candidates, candidate_ids = _candidates(work, [r.row for r in requests for _ in range(len(r.draft_token_ids) + 1)])
    probs = torch.softmax(candidates, dim=-1)
    next_draft = _index([d for r in requests for d in [*r.draft_token_ids, _NO_DRAFT]], device).unsqueeze(1)
    token_of = torch.arange(vocab, device=device).unsqueeze(0) if candidate_ids is None else candidate_ids
    is_draft = token_of == next_draft  # [rows, candidates]; all False on a request's last row
    draft_prob = probs.masked_fill(~is_draft, 0.0).sum(dim=-1)
    accepted = (_acceptance_uniforms(requests, device) < draft_prob).tolist()

    stop_rows, start = [], 0
    for r in requests:
        k = len(r.draft_token_ids)
        stop_rows.append(start + _leading_true(accepted[start:start + k]))
        start += k + 1
    stop = _index(stop_rows, device)
    stop_probs = probs[stop]
    residual = stop_probs.masked_fill(is_draft[stop], 0.0)  # the rejected draft removed (the race renormalises)
    # a rejection needs p(d) < 1, so the residual has mass; guard against rounding all the same
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, stop_probs)
    stop_ids = None if candidate_ids is None else candidate_ids[stop]
    # exponential race, as Sampler: drawn after the acceptance uniforms, from each seeded row's own generator
    choice = (residual / _exponential_noise([r.row for r in requests], vocab, stop_ids, device)).argmax(dim=-1)
    final = (choice if stop_ids is None else stop_ids.gather(1, choice.unsqueeze(1)).squeeze(1)).tolist()

    emitted = []
    for r, stop_row, start, token in zip(requests, stop_rows, _row_starts(requests), final):
        emitted.append(r.draft_token_ids[:stop_row - start] + [int(token)])
    return emitted


def _acceptance_uniforms(requests: list[DraftRow], device: torch.device) -> torch.Tensor:
    """U(0, 1) per draft (k per request) and 1.0 on each request's last row (never accepted there).

    A seeded request draws its k uniforms from its own generator; the others share one global draw.
    """
    unseeded = sum(len(r.draft_token_ids) for r in requests if r.row.generator is None)
    shared = torch.rand(unseeded, device=device) if unseeded else None
    pieces, taken = [], 0
    one = torch.ones(1, device=device)
    for r in requests:
        k = len(r.draft_token_ids)
        if r.row.generator is not None:
            pieces.append(torch.rand(k, generator=r.row.generator, device=device))
        else:
            pieces.append(shared[taken:taken + k])
            taken += k
        pieces.append(one)
    return torch.cat(pieces)


# ---------------------------------------------------------------- logprobs


def _emitted_logprobs(
    logits: torch.Tensor, requests: list[DraftRow], starts: list[int], emitted: list[list[int]]
) -> list[list[SampleLogprobs]]:
    """As Sampler: the raw log_softmax of the row that emitted each token (the emitted rows are a prefix)."""
    positions = [start + j for start, tokens in zip(starts, emitted) for j in range(len(tokens))]
    raw = torch.log_softmax(logits[_index(positions, logits.device)].float(), dim=-1)
    flat_tokens = _index([t for tokens in emitted for t in tokens], logits.device)
    rows = [r.row for r, tokens in zip(requests, emitted) for _ in tokens]
    flat = _gather_logprobs(raw, list(range(len(positions))), flat_tokens, rows)
    result, taken = [], 0
    for tokens in emitted:
        result.append(flat[taken:taken + len(tokens)])
        taken += len(tokens)
    return result
