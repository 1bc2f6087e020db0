"""The sampling rank's grammar masks: a step's constrained rows take only what their grammar allows, the free
rows are untouched, a verification step masks each draft position, so a draft the grammar forbids is rejected
even where the model would accept it, and each sampled token reaches its matcher once, with the next step's
masks (a step run again after a rollback takes nothing twice)."""
from __future__ import annotations

import llguidance
import pytest
import torch

from meshserve.layers import cpu_kernels
from meshserve.models.tokenizer_assets import TOKENIZER_FILE, VOCAB_SIZE
from meshserve.structured_output.compiler import GrammarCompiler
from meshserve.wire.sampling_params import SamplingParams, StructuredOutputs
from meshserve.worker.grammar_masks import GrammarMasks
from meshserve.worker.request_state import RequestState, StepSeq
from meshserve.worker.sampler import Sampler, SamplingRow
from meshserve.worker.spec_decode import DraftRow, verify_drafts

EOS = [1, 6]


@pytest.fixture(scope="module")
def tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(TOKENIZER_FILE.read_text(encoding="utf-8"), n_vocab=VOCAB_SIZE, eos_token=EOS)


@pytest.fixture(params=[True, False], ids=["beside the forward pass", "before it"])
def masks(tokenizer, request):
    grammar = GrammarMasks("unused", VOCAB_SIZE, EOS, compiler=GrammarCompiler(tokenizer))
    grammar.overlap = request.param  # on a thread of its own where a core is free, else inline
    # the torch path: building the native op starts a compiler, which this tier does not (tests/layers compares
    # the two paths)
    with cpu_kernels.disabled():
        yield grammar
    grammar.close()


def _state(masks: GrammarMasks, req_id: str, spec: StructuredOutputs | None, outputs: list[int] = ()) -> RequestState:
    params = SamplingParams(temperature=0.0, structured_outputs=spec)
    return RequestState(req_id=req_id, token_ids=[5, 9, *outputs], num_prompt_tokens=2, params=params,
                        block_ids=[0], num_computed_tokens=1 + len(outputs), generator=None,
                        matcher=masks.matcher_for(params), num_matched=None if spec and spec.starts_after else 0)


def _seq(state: RequestState, drafts: list[int] = ()) -> StepSeq:
    return StepSeq(state, start=len(state.token_ids) - 1, row=0, num_rows=1 + len(drafts), drafts=list(drafts),
                   is_decode=True, samples=True)


def _allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_constrained_rows_take_only_their_grammar_and_free_rows_are_untouched(masks, tokenizer):
    digits = _state(masks, "digits", StructuredOutputs(regex="[0-9]+"))
    free = _state(masks, "free", None)
    choice = _state(masks, "choice", StructuredOutputs(choice=["yes", "no"]))
    logits = torch.randn(3, VOCAB_SIZE)
    original = logits.clone()
    masks.start([_seq(digits), _seq(free), _seq(choice)]).apply(logits)
    assert all(tokenizer.decode_str([t]).isdigit() for t in _allowed(logits[0]))
    assert len(_allowed(logits[0])) >= 10
    assert torch.equal(logits[1], original[1])
    assert {tokenizer.decode_str([t]) for t in _allowed(logits[2])} <= {"y", "ye", "yes", "n", "no"}
    assert {"yes", "no"} <= {tokenizer.decode_str([t]) for t in _allowed(logits[2])}


def test_each_draft_position_is_masked_and_a_forbidden_draft_is_rejected_where_the_model_accepts_it(masks,
                                                                                                     tokenizer):
    state = _state(masks, "r", StructuredOutputs(regex="a[0-9]b"))
    a, b = tokenizer.tokenize_str("a"), tokenizer.tokenize_str("b")
    seven, letter_x = tokenizer.tokenize_str("7"), tokenizer.tokenize_str("x")
    drafts = [a[0], letter_x[0], b[0]]  # "x" breaks the grammar after "a"
    # the model agrees with every draft: without the masks all three would be accepted
    logits = torch.full((4, VOCAB_SIZE), -5.0)
    for row, token in enumerate([*drafts, EOS[0]]):
        logits[row, token] = 5.0
    logits[1, seven[0]] = 4.0  # the best token the grammar allows after "a"
    step = masks.start([_seq(state, drafts)])
    step.apply(logits)
    assert _allowed(logits[0]) >= {a[0]} and letter_x[0] not in _allowed(logits[1])
    assert torch.equal(torch.isfinite(logits[2]), torch.isfinite(logits[1]))  # past the forbidden draft
    row = SamplingRow(params=state.params, prompt_token_ids=[5, 9], output_token_ids=[])
    verified = verify_drafts(Sampler(), logits, [DraftRow(row, drafts)])
    assert verified.token_ids == [[a[0], seven[0]]]
    assert masks.advance(state.matcher, verified.token_ids[0]) is None  # the matcher was left where it was


def test_a_finished_grammar_ends_on_any_end_of_sequence_token_and_a_stray_token_is_an_error(masks, tokenizer):
    state = _state(masks, "r", StructuredOutputs(choice=["no"]))
    assert masks.advance(state.matcher, [*tokenizer.tokenize_str("no"), EOS[1]]) is None
    other = _state(masks, "s", StructuredOutputs(choice=["no"]))
    assert "breaks the request's grammar" in masks.advance(other.matcher, tokenizer.tokenize_str("yes"))


def test_a_request_resumed_with_outputs_continues_its_grammar(masks, tokenizer):
    """After preemption, or on a decode TE whose prefill TE sampled the first token."""
    first = tokenizer.tokenize_str("1")
    state = _state(masks, "r", StructuredOutputs(regex="1[a-z]"), outputs=first)
    logits = torch.zeros(1, VOCAB_SIZE)
    assert masks.start([_seq(state)]).apply(logits) == {}
    assert all(tokenizer.decode_str([t]).isalpha() for t in _allowed(logits[0]))
    bad = _state(masks, "bad", StructuredOutputs(regex="1[a-z]"), outputs=tokenizer.tokenize_str("x"))
    failed = masks.start([_seq(bad)]).apply(torch.zeros(1, VOCAB_SIZE))
    assert "breaks the request's grammar" in failed["bad"]


def test_each_sampled_token_reaches_the_matcher_once_with_the_next_steps_masks(masks, tokenizer):
    state = _state(masks, "r", StructuredOutputs(regex="[0-9]{2}"))
    masks.start([_seq(state)]).apply(torch.zeros(1, VOCAB_SIZE))
    state.token_ids.extend(tokenizer.tokenize_str("4"))  # the step sampled "4"
    for attempt in range(2):  # the next step, and the same step run again after a rollback
        logits = torch.zeros(1, VOCAB_SIZE)
        assert masks.start([_seq(state)]).apply(logits) == {}
        assert all(tokenizer.decode_str([t]).isdigit() for t in _allowed(logits[0])), attempt
    assert state.num_matched == 1
    assert masks.advance(state.matcher, tokenizer.tokenize_str("5")) is None  # one digit to go, not two
    assert state.matcher.is_accepting()


def test_a_constraint_after_a_reasoning_part_starts_once_the_part_ends(masks, tokenizer):
    """The thinking is free; the answer after the end-of-thinking tokens takes the grammar."""
    end = tokenizer.tokenize_str("</think>")
    state = _state(masks, "r", StructuredOutputs(choice=["yes", "no"], starts_after=end),
                   outputs=tokenizer.tokenize_str("Let me think"))
    assert masks.start([_seq(state)]) is None  # still thinking: no mask
    state.token_ids.extend(tokenizer.tokenize_str(" more") + end)
    logits = torch.zeros(1, VOCAB_SIZE)
    assert masks.start([_seq(state)]).apply(logits) == {}
    assert {tokenizer.decode_str([t]) for t in _allowed(logits[0])} <= {"y", "ye", "yes", "n", "no"}
    assert state.num_matched == len(state.output_token_ids)


def test_a_grammar_beyond_the_engines_limits_fails_its_request_alone(masks, tokenizer):
    """`a{1000}{1000}` builds a huge lexer once the output leaves its forced path: the limits turn that into
    this request's failure, and its batch mate's mask is computed as ever."""
    runaway = _state(masks, "runaway", StructuredOutputs(regex="a{1000}{1000}"), outputs=tokenizer.tokenize_str("aa"))
    digits = _state(masks, "digits", StructuredOutputs(regex="[0-9]+"))
    logits = torch.zeros(2, VOCAB_SIZE)
    failed = masks.start([_seq(runaway), _seq(digits)]).apply(logits)
    assert list(failed) == ["runaway"] and "lexer" in failed["runaway"]
    assert all(tokenizer.decode_str([t]).isdigit() for t in _allowed(logits[1]))
