"""Draft verification: greedy equals plain sampling token for token, rejection sampling keeps the target distribution
(chi-square), seeds are honoured, requests without drafts take the plain path, a failing request fails alone."""
from __future__ import annotations

import random

import pytest
import torch

from meshserve.wire.sampling_params import SamplingParams
from meshserve.worker.sampler import FAILED_TOKEN, Sampler, SamplingRow, make_generator
from meshserve.worker.spec_decode import DraftRow, verify_drafts

VOCAB = 16
EOS = 0
sampler = Sampler()

# chi-square 0.999 quantiles by degrees of freedom: a correct sampler fails a check with probability 0.001
# (and the draws are seeded, so a passing test passes every time)
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    torch.manual_seed(1234)


def _row(output=None, generator=None, **params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), prompt_token_ids=[3, 4, 5],
                       output_token_ids=list(output or []), generator=generator, eos_token_ids=[EOS])


def _model(context: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """A stand-in target model: fixed random logits for each context; it likes to repeat the last token (so
    penalties on the drafts change its choice) and eos is often a favourite (so min_tokens masking does)."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(hash(tuple(context)) % 2**31)) * 2
    logits[context[-1]] += 2.5
    logits[EOS] += 1.5
    return logits


def _verify_logits(row: SamplingRow, drafts: list[int]) -> torch.Tensor:
    context = row.prompt_token_ids + row.output_token_ids
    return torch.stack([_model(context + drafts[:j]) for j in range(len(drafts) + 1)])


def _plain_run(params: dict, steps: int) -> tuple[list[int], list]:
    """The reference: the plain sampler, one token per step."""
    row = _row(**params)
    logprobs = []
    for _ in range(steps):
        out = sampler(_model(row.prompt_token_ids + row.output_token_ids).unsqueeze(0), [row])
        row.output_token_ids.append(out.token_ids[0])
        logprobs.append(out.logprobs[0])
    return row.output_token_ids, logprobs


GREEDY_SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.4),
    dict(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.5),
    dict(temperature=0.0, min_tokens=9, stop_token_ids=[1]),
    dict(temperature=0.0, logprobs=3),
    dict(temperature=0.0, repetition_penalty=1.2, presence_penalty=1.0, min_tokens=5, logprobs=0),
]


@pytest.mark.parametrize("settings", [GREEDY_SETTINGS, [dict(temperature=0.0)] * 3], ids=["processed", "plain"])
def test_greedy_verification_equals_plain_greedy_sampling(settings):
    steps = 24
    references = [_plain_run(params, steps) for params in settings]
    rng = random.Random(0)
    rows = [_row(**params) for params in settings]
    logprobs = [[] for _ in settings]
    accepted = rejected = 0
    while any(len(row.output_token_ids) < steps for row in rows):
        batch = []
        for row, (reference, _) in zip(rows, references):
            done = len(row.output_token_ids)
            # a draft model that is right most of the time; k varies per request and step, 0 included
            drafts = [t if rng.random() < 0.7 else rng.randrange(VOCAB)
                      for t in (reference + [EOS] * 4)[done:done + rng.randint(0, 3)]]
            batch.append(DraftRow(row=row, draft_token_ids=drafts))
        logits = torch.cat([_verify_logits(d.row, d.draft_token_ids) for d in batch])
        out = verify_drafts(sampler, logits, batch)
        assert not out.failed
        for i, (d, tokens) in enumerate(zip(batch, out.token_ids)):
            assert 1 <= len(tokens) <= len(d.draft_token_ids) + 1
            assert tokens[:-1] == d.draft_token_ids[:len(tokens) - 1]  # accepted drafts come first
            accepted += len(tokens) - 1
            rejected += len(tokens) <= len(d.draft_token_ids)
            d.row.output_token_ids.extend(tokens)
            if out.logprobs[i] is not None:
                assert len(out.logprobs[i]) == len(tokens)
                logprobs[i].extend(out.logprobs[i])
    assert accepted > 20 and rejected > 10  # both branches really ran
    for i, (row, (reference, reference_logprobs)) in enumerate(zip(rows, references)):
        assert row.output_token_ids[:steps] == reference, settings[i]
        if settings[i].get("logprobs") is None:
            continue
        for got, want in zip(logprobs[i][:steps], reference_logprobs):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-6)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert any(EOS in ref[:9] for ref, _ in references[:3])  # eos competes, so min_tokens masking matters


def test_greedy_accepts_the_matching_prefix():
    targets = [[2, 5, 1, 7], [4], [6, 6]]  # each row's argmax, per request
    logits = torch.zeros(7, 8)
    for j, t in enumerate(t for request in targets for t in request):
        logits[j, t] = 5.0
    rows = [
        DraftRow(_row(temperature=0.0), [2, 5, 3]),  # third draft wrong
        DraftRow(_row(temperature=0.0), []),  # no drafts: the argmax
        DraftRow(_row(temperature=0.0), [6]),  # all accepted: plus the bonus token
    ]
    assert verify_drafts(sampler, logits, rows).token_ids == [[2, 5, 1], [4], [6, 6]]
    rows[0].draft_token_ids = [2, 5, 1]
    rows[2].draft_token_ids = [3]
    assert verify_drafts(sampler, logits, rows).token_ids == [[2, 5, 1, 7], [4], [6]]


def test_random_drafts_with_certain_and_impossible_target_probability():
    row0 = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    logits = torch.stack([row0, row0.flip(0), row0]).repeat(200, 1)
    # top_k=1 makes p_0(0) exactly 1: always accepted. Row 1 keeps tokens 7 and 6 only: draft 5 is impossible
    rows = [DraftRow(_row(top_k=2 if i % 2 else 1, temperature=1.0), [0, 5]) for i in range(200)]
    out = verify_drafts(sampler, logits, rows)
    for i, tokens in enumerate(out.token_ids):
        if i % 2:  # top_k=2: token 0 kept with probability e^4 / (e^4 + e^3)
            assert tokens[0] in (0, 1)
            if tokens[0] == 0:
                assert tokens[1] in (7, 6)
        else:
            assert tokens[0] == 0 and tokens[1] == 7  # top-1 of row 1
    first = [tokens[0] for tokens in out.token_ids[1::2]]
    expected = torch.softmax(torch.tensor([4.0, 3.0]), 0)[0].item()
    assert abs(first.count(0) / len(first) - expected) < 4 * (expected * (1 - expected) / len(first)) ** 0.5


def _target(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Reference distribution: sort, cut top-k, keep the smallest prefix holding top_p, renormalise."""
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    kept, mass = [], 0.0
    total = probs[order].sum().item()
    for t in order:
        if kept and mass >= top_p:
            break
        kept.append(t)
        mass += probs[t].item() / total
    target = torch.zeros_like(probs)
    target[kept] = probs[kept] / probs[kept].sum()
    return target


def _chi_square(draws: list[int], target: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the target's support and its degrees of freedom; draws off the support fail."""
    counts = torch.bincount(torch.tensor(draws), minlength=target.numel()).double()
    support = target > 0
    assert counts[~support].sum() == 0, f"drew tokens the target excludes: {counts.tolist()}"
    expected = target[support].double() * len(draws)
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def _seeded_draws(logits_rows: torch.Tensor, drafts: list[int], n: int, **params) -> list[list[int]]:
    """n seeded requests with the same logits rows and drafts, all in one call."""
    rows = [DraftRow(_row(generator=make_generator(seed), seed=seed, **params), list(drafts)) for seed in range(n)]
    out = verify_drafts(sampler, logits_rows.repeat(n, 1), rows)
    assert not out.failed
    return out.token_ids


ROW0 = torch.tensor([1.2, 0.9, 0.6, 0.3, 0.0, -0.3, -0.8, -1.5])
ROW1 = torch.tensor([-0.5, 0.8, 0.2, 1.1, -1.0, 0.4, 0.0, 0.6])
ROW2 = torch.randn(8, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=4),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.3, top_k=6, top_p=0.9),
])
def test_first_position_keeps_the_target_distribution(params):
    n = 20000
    target = _target(ROW0, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
    for draft in (1, 2):  # the runner-up and a less likely token: both accept and reject branches carry weight
        assert 0.1 < target[draft] < 0.5
        first = [tokens[0] for tokens in _seeded_draws(torch.stack([ROW0, ROW1]), [draft], n, **params)]
        statistic, dof = _chi_square(first, target)
        assert statistic < CHI2_CRITICAL_P001[dof], (params, draft, statistic)


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.9, top_k=5, top_p=0.95),
    dict(temperature=1.0, presence_penalty=1.0),  # row 1 must see the accepted first draft as generated
])
def test_second_position_keeps_the_target_distribution_after_an_acceptance(params):
    n = 20000
    drafts = [0, 3]  # token 0 is row 0's favourite, so about half the requests accept it
    emitted = _seeded_draws(torch.stack([ROW0, ROW1, ROW2]), drafts, n, **params)
    row1 = ROW1.clone()
    row1[0] -= params.get("presence_penalty", 0.0)  # d_1 = 0 counts as an output token for row 1
    targets = [_target(row, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
               for row in (ROW0, row1)]
    statistic, dof = _chi_square([tokens[0] for tokens in emitted], targets[0])
    assert statistic < CHI2_CRITICAL_P001[dof], (params, "first", statistic)
    second = [tokens[1] for tokens in emitted if tokens[0] == drafts[0]]
    assert len(second) > 5000
    statistic, dof = _chi_square(second, targets[1])
    assert statistic < CHI2_CRITICAL_P001[dof], (params, "second", statistic)
    # a third token only after both drafts were accepted, drawn from row 2
    third = [tokens[2] for tokens in emitted if len(tokens) == 3]
    assert all(tokens[:2] == drafts for tokens in emitted if len(tokens) == 3) and len(third) > 500


def _seeded_run(seed: int, mates: list[dict], position: int, steps: int = 10) -> list[int]:
    """One seeded request decoded with drafts for `steps` steps among changing batch mates."""
    own = _row(generator=make_generator(seed), seed=seed, temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    rng = random.Random(seed)
    for step in range(steps):
        context = own.prompt_token_ids + own.output_token_ids
        own_drafts = [rng.randrange(VOCAB) for _ in range(1 + step % 3)]
        batch = [DraftRow(_row(output=[1, 2], **kw), [1, 2][:step % 3]) for kw in mates]
        batch.insert(position, DraftRow(own, own_drafts))
        logits = torch.cat([_verify_logits(d.row, d.draft_token_ids) if d.row is own else
                            torch.randn(len(d.draft_token_ids) + 1, VOCAB) for d in batch])
        own.output_token_ids.extend(verify_drafts(sampler, logits, batch).token_ids[position])
        assert own.prompt_token_ids + own.output_token_ids[:len(context) - 3] == context
    return own.output_token_ids


def test_seeded_request_is_reproducible_and_independent_of_batch_mates():
    alone = _seeded_run(7, [], 0)
    assert len(set(alone)) > 4
    assert _seeded_run(7, [], 0) == alone
    assert _seeded_run(7, [dict(temperature=1.0), dict(temperature=0.0)], 1) == alone
    assert _seeded_run(7, [dict(seed=3, generator=make_generator(3)), dict(top_k=3), dict(min_tokens=4)], 3) == alone
    assert _seeded_run(8, [], 0) != alone


def test_requests_without_drafts_take_the_plain_path():
    mixed = [dict(temperature=0.7, seed=11, logprobs=2), dict(temperature=0.0, repetition_penalty=1.5),
             dict(temperature=1.0, top_k=5, seed=12, frequency_penalty=0.5)]
    plain_rows = [_row(output=[5, 5, 6], generator=make_generator(kw["seed"]) if "seed" in kw else None, **kw)
                  for kw in mixed]
    logits = torch.randn(len(mixed), VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    expected = sampler(logits, plain_rows)

    # the same requests without drafts, between requests with drafts: same tokens, logprobs and generator use
    rows = [_row(output=[5, 5, 6], generator=make_generator(kw["seed"]) if "seed" in kw else None, **kw)
            for kw in mixed]
    drafted = [DraftRow(_row(temperature=0.8, logprobs=1), [1, 2]), DraftRow(_row(temperature=0.0), [3])]
    batch = [drafted[0], DraftRow(rows[0], []), DraftRow(rows[1], []), drafted[1], DraftRow(rows[2], [])]
    parts = [torch.randn(3, VOCAB), logits[0:2], torch.randn(2, VOCAB), logits[2:3]]
    out = verify_drafts(sampler, torch.cat(parts), batch)
    assert [out.token_ids[i] for i in (1, 2, 4)] == [[t] for t in expected.token_ids]
    assert out.logprobs[1] == [expected.logprobs[0]] and out.logprobs[2] is None
    for plain, row in zip(plain_rows, rows):
        if plain.generator is not None:
            assert torch.equal(plain.generator.get_state(), row.generator.get_state())
    assert len(out.logprobs[0]) == len(out.token_ids[0])  # a drafted request's logprobs: one per emitted token
    raw = torch.log_softmax(parts[0], -1)
    for j, (token, lp) in enumerate(zip(out.token_ids[0], out.logprobs[0])):
        assert lp.logprob == pytest.approx(raw[j, token].item(), abs=1e-6)
        assert [t for t, _ in lp.top] == [raw[j].argmax().item()]

    # a step without any drafts is exactly Sampler.sample_isolating, unseeded rows included
    unseeded = [_row(temperature=1.0), _row(temperature=0.0, logprobs=1), _row(top_p=0.5)]
    torch.manual_seed(5)
    expected = sampler.sample_isolating(logits, unseeded)
    torch.manual_seed(5)
    out = verify_drafts(sampler, logits, [DraftRow(row, []) for row in unseeded])
    assert out.token_ids == [[t] for t in expected.token_ids]
    assert out.logprobs == [[lp] if lp is not None else None for lp in expected.logprobs]


def test_a_failing_request_fails_alone():
    def batch(with_bad: bool) -> list[DraftRow]:
        good = [DraftRow(_row(generator=make_generator(1), seed=1, temperature=1.0), [2, 3]),
                DraftRow(_row(temperature=0.0, presence_penalty=0.5), []),
                DraftRow(_row(generator=make_generator(2), seed=2, temperature=0.5, logprobs=1), [4])]
        if not with_bad:
            return good
        # a stop token outside the vocabulary (min_tokens masks it), and a draft outside it
        return [good[0], DraftRow(_row(min_tokens=3, stop_token_ids=[VOCAB + 5]), [1]), good[1],
                DraftRow(_row(temperature=0.0), [VOCAB]), good[2]]

    def logits_for(rows: list[DraftRow]) -> torch.Tensor:
        return torch.cat([_verify_logits(d.row, [min(t, VOCAB - 1) for t in d.draft_token_ids]) for d in rows])

    clean = verify_drafts(sampler, logits_for(batch(False)), batch(False))
    rows = batch(True)
    out = verify_drafts(sampler, logits_for(rows), rows)
    assert set(out.failed) == {1, 3}
    assert "outside the vocabulary" in out.failed[1] and "draft token id" in out.failed[3]
    assert out.token_ids[1] == out.token_ids[3] == [FAILED_TOKEN] and out.logprobs[1] is None
    assert [out.token_ids[i] for i in (0, 2, 4)] == clean.token_ids
    assert [out.logprobs[i] for i in (0, 2, 4)] == clean.logprobs


def test_bad_shape_is_rejected():
    with pytest.raises(ValueError, match="need 3"):
        verify_drafts(sampler, torch.zeros(2, VOCAB), [DraftRow(_row(), [1, 2])])
