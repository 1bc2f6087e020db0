"""Sampler: greedy/top-k/top-p/min-p semantics, seeded reproducibility, distribution, penalties, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from meshserve.wire.sampling_params import SamplingParams
from meshserve.wire.worker import SampleLogprobs
from meshserve.worker.sampler import Sampler, SamplingRow, make_generator, process_logits, sampling_logits

VOCAB = 32


def _logits(n: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _row(output: list[int] | None = None, prompt: list[int] | None = None, generator=None, eos=None, **params):
    return SamplingRow(
        params=SamplingParams(**params),
        prompt_token_ids=prompt if prompt is not None else [1, 2, 3],
        output_token_ids=output if output is not None else [],
        generator=generator,
        eos_token_ids=eos or [],
    )


sample = Sampler()


@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    # unseeded rows draw from the global RNG; fix it so statistical checks cannot flake
    torch.manual_seed(1234)


def test_greedy_is_argmax():
    logits = _logits(6)
    out = sample(logits, [_row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_with_logprobs_still_argmax():
    logits = _logits(4, seed=1)
    out = sample(logits, [_row(temperature=0.0, logprobs=2) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy():
    logits = _logits(8, seed=2)
    rows = [_row(temperature=1.5, top_k=1) for _ in range(8)]
    for _ in range(5):
        assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = _logits(8, seed=3)
    rows = [_row(temperature=1.0, top_p=1e-6) for _ in range(8)]
    for _ in range(5):
        assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_min_p_only_draws_tokens_above_threshold():
    logits = _logits(1, seed=4)[0]
    min_p = 0.2
    probs = torch.softmax(logits, -1)
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < VOCAB  # the threshold actually removes something and keeps a choice
    draws = sample(logits.expand(3000, VOCAB), [_row(min_p=min_p) for _ in range(3000)]).token_ids
    assert set(draws) == allowed


def test_mixed_greedy_and_random_rows_in_one_batch():
    base = _logits(1, seed=5)[0] / 6  # flat enough that sampling varies
    logits = base.expand(8, VOCAB).clone()
    rows = [_row(temperature=0.0) if i % 2 == 0 else _row(temperature=1.0) for i in range(8)]
    random_draws = []
    for _ in range(20):
        out = sample(logits, rows).token_ids
        assert all(out[i] == int(base.argmax()) for i in range(0, 8, 2))
        random_draws += [out[i] for i in range(1, 8, 2)]
    assert len(set(random_draws)) > 3


def _seeded_run(position: int, batch_size: int, steps: int, neighbour_seed: int | None) -> list[int]:
    """Draw `steps` tokens for a seed-42 row placed at `position` among other rows."""
    generator = make_generator(42)
    neighbour_generators = [make_generator(neighbour_seed + i) if neighbour_seed is not None else None
                            for i in range(batch_size)]
    tokens = []
    for step in range(steps):
        logits = _logits(batch_size, seed=100 + step + batch_size)  # neighbours see other logits
        logits[position] = _logits(1, seed=step)[0] / 3
        rows = [_row(temperature=0.9, top_p=0.95, generator=neighbour_generators[i], top_k=5 + i)
                for i in range(batch_size)]
        rows[position] = _row(temperature=0.8, seed=42, generator=generator)
        tokens.append(sample(logits, rows).token_ids[position])
    return tokens


def test_seeded_row_is_independent_of_batch_composition():
    alone = _seeded_run(position=0, batch_size=1, steps=12, neighbour_seed=None)
    assert len(set(alone)) > 2  # it really samples
    assert _seeded_run(position=2, batch_size=5, steps=12, neighbour_seed=None) == alone
    assert _seeded_run(position=3, batch_size=4, steps=12, neighbour_seed=7) == alone
    assert _seeded_run(position=0, batch_size=3, steps=12, neighbour_seed=99) == alone


def test_seeded_top_p_row_is_independent_of_how_the_batch_filters():
    vocab = 3000  # above the top-p candidate window, so batch mates change how filtering runs
    neighbours = {
        "alone": [],
        "wider window": [dict(top_k=2000)],
        "full-sort neighbour": [dict(top_p=0.95)],  # flat logits: its cutoff is beyond the window
        "unfiltered neighbour": [dict(temperature=1.0)],
    }
    runs = {}
    for name, others in neighbours.items():
        generator = make_generator(5)
        tokens = []
        for step in range(8):
            own = torch.randn(1, vocab, generator=torch.Generator().manual_seed(step)) * 2
            flat = torch.randn(len(others), vocab, generator=torch.Generator().manual_seed(50 + step)) * 0.1
            rows = [_row(**kw) for kw in others] + [_row(top_p=0.9, seed=5, generator=generator)]
            tokens.append(sample(torch.cat([flat, own]), rows).token_ids[-1])
        runs[name] = tokens
    assert len(set(runs["alone"])) > 2
    assert all(tokens == runs["alone"] for tokens in runs.values()), runs


def _empirical(draws: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=vocab).float() / len(draws)


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.7
    draws = sample(logits.expand(20000, 6), [_row(temperature=temperature) for _ in range(20000)]).token_ids
    expected = torch.softmax(logits / temperature, -1)
    assert torch.allclose(_empirical(draws, 6), expected, atol=0.015)


def test_seeded_sampling_matches_softmax():
    logits = torch.tensor([1.0, 0.0, 0.5, -0.5])
    rows = [_row(seed=i, generator=make_generator(i)) for i in range(3000)]
    draws = sample(logits.expand(3000, 4), rows).token_ids
    assert torch.allclose(_empirical(draws, 4), torch.softmax(logits, -1), atol=0.03)


def test_top_k_and_top_p_renormalise_the_kept_tokens():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    probs = torch.softmax(logits, -1)
    draws = sample(logits.expand(20000, 6), [_row(top_k=3) for _ in range(20000)]).token_ids
    expected = torch.zeros(6)
    expected[:3] = probs[:3] / probs[:3].sum()
    assert torch.allclose(_empirical(draws, 6), expected, atol=0.015)

    # the smallest prefix reaching top_p: tokens 0 and 1 hold < 0.8 of the mass, 0..2 hold >= 0.8
    assert probs[:2].sum() < 0.8 <= probs[:3].sum()
    draws = sample(logits.expand(20000, 6), [_row(top_p=0.8) for _ in range(20000)]).token_ids
    assert torch.allclose(_empirical(draws, 6), expected, atol=0.015)


def _oracle_kept(row_logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Plain-Python reference: sort everything, cut top-k, keep the smallest prefix reaching top_p, then min-p."""
    scaled = [x / temperature for x in row_logits]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    if top_k > 0:
        order = order[:top_k]
    peak = scaled[order[0]]
    weights = {t: math.exp(scaled[t] - peak) for t in order}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for t in order:
        if kept and mass >= top_p:
            break
        kept.append(t)
        mass += weights[t] / total
    return {t for t in kept if weights[t] >= min_p * weights[kept[0]]}


def test_filters_match_a_full_sort_reference_on_a_large_vocabulary():
    vocab = 3000  # larger than the top-p candidate window, so both of its paths run
    base = torch.randn(8, vocab, generator=torch.Generator().manual_seed(9))
    scale = torch.tensor([4.0, 0.1, 1.0, 1.0, 2.0, 1.0, 1.0, 0.1]).unsqueeze(1)  # peaked .. flat rows
    logits = base * scale
    settings = [
        dict(top_p=0.9),  # peaked: the cutoff lies among the most likely tokens
        dict(top_p=0.9),  # flat: the cutoff lies far down the vocabulary
        dict(top_k=50),
        dict(top_k=2000, top_p=0.5),
        dict(top_k=10, top_p=0.7, min_p=0.1, temperature=0.7),
        dict(temperature=0.5),
        dict(min_p=0.05),
        dict(top_k=1500, temperature=1.3),
    ]
    rows = [_row(**kw) for kw in settings]
    got = sampling_logits(logits, rows)
    for i, kw in enumerate(settings):
        p = rows[i].params
        expected = _oracle_kept(logits[i].tolist(), p.temperature, p.top_k, p.top_p, p.min_p)
        kept = torch.isfinite(got[i])
        assert set(torch.nonzero(kept).flatten().tolist()) == expected, kw
        torch.testing.assert_close(got[i][kept], logits[i][kept] / p.temperature)


def test_repetition_penalty_follows_hf_formula():
    logits = _logits(2, seed=6)
    prompt, output = [0, 1, 2, 5], [5, 7, 8]
    rows = [_row(prompt=prompt, output=output, repetition_penalty=1.3), _row(prompt=prompt, output=output)]
    got = process_logits(logits, rows)
    expected = logits.clone()
    for t in set(prompt + output):
        value = expected[0, t]
        expected[0, t] = value / 1.3 if value > 0 else value * 1.3
    torch.testing.assert_close(got, expected)


def test_frequency_and_presence_penalties_follow_openai_formula():
    logits = _logits(1, seed=7)
    output = [4, 4, 4, 9, 11, 11]
    rows = [_row(prompt=[4, 20, 21], output=output, frequency_penalty=0.5, presence_penalty=0.75)]
    got = process_logits(logits, rows)
    expected = logits.clone()
    for t in set(output):  # prompt tokens are not penalised
        expected[0, t] -= 0.5 * output.count(t) + 0.75
    torch.testing.assert_close(got, expected)


def test_penalty_changes_the_greedy_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.9
    assert sample(logits, [_row(temperature=0.0, output=[3])]).token_ids == [3]
    assert sample(logits, [_row(temperature=0.0, output=[3], presence_penalty=0.5)]).token_ids == [4]


def test_min_tokens_masks_eos_and_stop_tokens():
    eos, stop = 5, 9
    logits = torch.zeros(1, VOCAB)
    logits[0, eos], logits[0, stop], logits[0, 2] = 3.0, 2.0, 1.0

    def pick(output, **params):
        return sample(logits, [_row(temperature=0.0, output=output, eos=[eos], stop_token_ids=[stop], **params)])

    assert pick([1], min_tokens=3).token_ids == [2]
    assert pick([1, 1, 1], min_tokens=3).token_ids == [eos]  # min_tokens reached
    assert pick([1], min_tokens=3, ignore_eos=True).token_ids == [eos]  # eos is not a stop token then


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives():
    logits = _logits(3, seed=8)
    rows = [
        _row(temperature=0.7, logprobs=4, repetition_penalty=1.5, output=[1, 2]),
        _row(temperature=0.0, logprobs=0),
        _row(temperature=1.0),
    ]
    out = sample(logits, rows)
    reference = torch.log_softmax(logits, -1)
    chosen, top = out.logprobs[0].logprob, out.logprobs[0].top
    assert chosen == pytest.approx(reference[0, out.token_ids[0]].item(), abs=1e-6)
    values, ids = reference[0].topk(4)
    assert [t for t, _ in top] == ids.tolist()
    assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert out.logprobs[1] == SampleLogprobs(pytest.approx(reference[1].max().item(), abs=1e-6), [])
    assert out.logprobs[2] is None


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="logits rows"):
        sample(_logits(2), [_row()])
    with pytest.raises(ValueError, match="2-D"):
        sample(torch.zeros(VOCAB), [_row()])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(_logits(1), [_row(output=[VOCAB + 3], repetition_penalty=1.2)])


def test_empty_batch():
    out = sample(torch.zeros(0, VOCAB), [])
    assert out.token_ids == [] and out.logprobs == []
