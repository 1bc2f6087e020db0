"""Structured outputs through the whole engine: every output satisfies its constraint, and the paths that
change how tokens are produced (MTP drafts verified under the grammar masks, DP2+EP2 with the masks on each
group's driver, self-contained DP groups, a preempted request resuming its grammar, INT8 weights) give the
colocated single rank's greedy tokens (INT8: valid outputs of its own)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.wire.sampling_params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "$defs": {"Point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                        "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                       "y": {"type": "integer", "minimum": 0, "maximum": 99}}}},
    "properties": {"label": {"type": "string", "maxLength": 6}, "shape": {"enum": ["dot", "line"]},
                   "points": {"type": "array", "items": {"$ref": "#/$defs/Point"}, "minItems": 1, "maxItems": 2}},
    "required": ["label", "shape", "points"], "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,4}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'start: "[" NUM (";" NUM)* "]"\nNUM: /[1-9][0-9]?/'
SPECS = [StructuredOutputs(json=json.dumps(SCHEMA)), StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES),
         StructuredOutputs(grammar=GRAMMAR)]
MAX_TOKENS = 64
ENGINE_ARGS = dict(max_num_batched_tokens=64, block_size=8, max_num_seqs=8, num_kv_blocks=128)


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 31900, (n,), generator=g).tolist() for n in [5, 70, 17, 33, 9, 48, 2, 27]]


def _params(index: int, **settings) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, **settings},
                          structured_outputs=SPECS[index % len(SPECS)])


def assert_valid(text: str, spec: StructuredOutputs) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        assert re.fullmatch(r"\[[1-9][0-9]?(;[1-9][0-9]?)*\]", text), text


def _run(model_dir, prompts, **engine_args) -> list:
    with LLM(model=str(model_dir), **{**ENGINE_ARGS, **engine_args}) as llm:
        outs = [out.outputs[0] for out in llm.generate(prompts, [_params(i) for i in range(len(prompts))])]
        stats = llm.get_stats()
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", (i, out.text)
        assert_valid(out.text, SPECS[i % len(SPECS)])
    return outs, stats


@pytest.fixture(scope="module")
def reference(tiny_model):
    model_dir = tiny_model("deepseek_v3", seed=3)
    prompts = _prompts()
    outs, _ = _run(model_dir, prompts)
    return model_dir, prompts, [out.token_ids for out in outs]


def test_sampled_outputs_and_several_choices_each_satisfy_their_constraint(reference):
    model_dir, prompts, _ = reference
    with LLM(model=str(model_dir), **ENGINE_ARGS) as llm:
        outs = llm.generate(prompts[:4], [_params(i, temperature=1.0, seed=i, n=3) for i in range(4)])
    for i, out in enumerate(outs):
        assert len(out.outputs) == 3
        for choice in out.outputs:
            if choice.finish_reason == "stop":
                assert_valid(choice.text, SPECS[i])
        assert sum(choice.finish_reason == "stop" for choice in out.outputs) >= 2


@pytest.mark.parametrize("layout", [
    dict(speculative="mtp", num_speculative_tokens=2),
    dict(parallel="attn=TP1+DP2 moe=TP1+EP2"),
    dict(parallel="attn=TP1+DP2 moe=TP1+EP2", speculative="mtp", num_speculative_tokens=2),
    dict(parallel="attn=TP1+DP2 moe=TP1+EP2", dp_groups="self-contained"),
], ids=["MTP", "DP2+EP2", "DP2+EP2+MTP", "DP2+EP2-self-contained-groups"])
def test_a_layout_gives_the_single_rank_tokens(reference, layout):
    model_dir, prompts, expected = reference
    outs, stats = _run(model_dir, prompts, **layout)
    assert [out.token_ids for out in outs] == expected
    if "speculative" in layout:
        assert stats.spec_verify_steps > 0


def test_a_preempted_request_resumes_its_grammar(reference):
    model_dir, prompts, expected = reference
    outs, stats = _run(model_dir, prompts, num_kv_blocks=20)
    assert stats.num_preemptions > 0
    assert [out.token_ids for out in outs] == expected


def test_int8_weights_give_valid_outputs(reference):
    model_dir, prompts, _ = reference
    _run(model_dir, prompts, quantization="int8")
