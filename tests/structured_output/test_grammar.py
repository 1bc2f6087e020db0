"""The grammar engine's side of structured outputs: every kind of constraint compiles, a malformed one is refused
with the part at fault named, compiled grammars are reused, and a matcher walks exactly the outputs its
constraint allows (on the committed tokenizer: no model)."""
from __future__ import annotations

import json

import llguidance
import pytest

from meshserve.models.tokenizer_assets import TOKENIZER_FILE, VOCAB_SIZE
from meshserve.structured_output.compiler import GrammarCompiler
from meshserve.structured_output.grammar import GrammarSpecError, check_grammar
from meshserve.wire.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs

EOS = [1, 6]
SCHEMA = {
    "type": "object",
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["x"], "additionalProperties": False}},
    "properties": {"kind": {"enum": ["a", "b"]}, "points": {"type": "array", "items": {"$ref": "#/$defs/Point"},
                                                           "maxItems": 2}},
    "required": ["kind", "points"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(TOKENIZER_FILE.read_text(encoding="utf-8"), n_vocab=VOCAB_SIZE, eos_token=EOS)


def _walk(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    """Whether the matcher takes `text` (as the tokenizer splits it) and may end there."""
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("spec, good, bad", [
    (StructuredOutputs(json=json.dumps(SCHEMA)), '{"kind":"a","points":[{"x":3}]}', '{"kind":"c","points":[]}'),
    (StructuredOutputs(json_object=True), '{"any":[1,2]}', '[1,2]'),
    (StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"), "123-ab", "12-ab"),
    (StructuredOutputs(choice=["a.b", "yes"]), "a.b", "axb"),  # a choice is literal text, not a regex
    (StructuredOutputs(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'), "(1,22)", "(1,)"),
])
def test_each_kind_takes_its_outputs_and_refuses_others(tokenizer, spec, good, bad):
    compiler = GrammarCompiler(tokenizer)
    assert _walk(compiler.matcher(spec), tokenizer, good)
    assert not _walk(compiler.matcher(spec), tokenizer, bad)


def test_a_finished_grammar_allows_only_the_end_of_sequence_tokens(tokenizer):
    matcher = GrammarCompiler(tokenizer).matcher(StructuredOutputs(choice=["yes"]))
    assert _walk(matcher, tokenizer, "yes")
    mask = bytearray(matcher.compute_bitmask())
    allowed = [t for t in range(VOCAB_SIZE) if mask[t // 8] >> (t % 8) & 1]
    assert allowed == EOS


def test_a_compiled_grammar_is_reused_and_each_request_gets_its_own_matcher(tokenizer):
    compiler = GrammarCompiler(tokenizer, cache_size=2)
    spec = StructuredOutputs(regex="[ab]+")
    first, second = compiler.matcher(spec), compiler.matcher(StructuredOutputs(regex="[ab]+"))
    assert (compiler.misses, compiler.hits) == (1, 1)
    assert first.consume_tokens(tokenizer.tokenize_str("ab"))
    assert second.consume_tokens(tokenizer.tokenize_str("b"))  # unaffected by the first one's progress
    for regex in ("a", "b"):  # two more grammars push the first out of a cache of two
        compiler.matcher(StructuredOutputs(regex=regex))
    compiler.matcher(spec)
    assert compiler.misses == 4


@pytest.mark.parametrize("spec, where, words", [
    (StructuredOutputs(json=json.dumps({"type": "object", "properties": {"age": {"type": "intger"}}})),
     "$.properties.age.type", "intger"),
    (StructuredOutputs(json=json.dumps({"type": "object", "required": "age"})), "$.required", "not of type"),
    (StructuredOutputs(json="[1, 2]"), "", "must be an object"),
    (StructuredOutputs(json="{not json"), "", "not JSON"),
    (StructuredOutputs(regex="a(b"), "", "unclosed group"),
    (StructuredOutputs(grammar="start: undefined_rule"), "", "unknown name"),
])
def test_a_constraint_the_engine_cannot_enforce_is_refused_with_the_part_at_fault(spec, where, words):
    with pytest.raises(GrammarSpecError) as caught:
        check_grammar(spec)
    assert caught.value.where == where
    assert words in str(caught.value)


def test_a_strict_schema_refuses_what_the_engine_cannot_enforce_and_a_lenient_one_skips_it():
    schema = json.dumps({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    with pytest.raises(GrammarSpecError) as caught:
        check_grammar(StructuredOutputs(json=schema))
    assert caught.value.where == "$.properties.a.not"
    assert check_grammar(StructuredOutputs(json=schema, lenient=True))


@pytest.mark.parametrize("fields, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"grammar": ""}, "structured_outputs.grammar"),
])
def test_a_malformed_constraint_fails_where_it_is_built(fields, param):
    with pytest.raises(SamplingParamsError) as caught:
        StructuredOutputs(**fields)
    assert caught.value.param == param


def test_a_constraint_crosses_processes_inside_the_sampling_params():
    params = SamplingParams.from_dict({"structured_outputs": {"choice": ["x", "y"]}, "logit_bias": {7: -5.0}})
    assert params.structured_outputs == StructuredOutputs(choice=["x", "y"])
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={7: 101.0})
    with pytest.raises(SamplingParamsError, match="at most 1024 tokens"):
        SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0))
    with pytest.raises(SamplingParamsError, match="outside the vocabulary"):
        SamplingParams(logit_bias={VOCAB_SIZE: 1.0}).verify(VOCAB_SIZE)
