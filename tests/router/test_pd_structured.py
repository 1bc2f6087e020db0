"""Structured outputs across a P/D hand-off: the prefill TE samples the first token under the grammar, the
decode TE's matcher takes that token and continues; the greedy outputs are the colocated engine's and each
satisfies its constraint."""
from __future__ import annotations

import asyncio

from meshserve import LLM
from tests.engine.test_structured_engine import MAX_TOKENS, SPECS, _params, _prompts, assert_valid
from tests.router.deployment_processes import running_deployment
from tests.router.test_pd_deployment import (
    HEARTBEAT_TIMEOUT_S,
    assert_pulled_without_recompute,
    deployment,
    names,
    pd_groups,
)


async def _generate_all(je, prompts) -> list:
    async def one(i: int, prompt: list[int]):
        final = None
        async for out in je.generate(None, prompt, _params(i), f"structured-{i}"):
            final = out
        return final

    return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 120)


def test_a_constrained_request_continues_its_grammar_on_the_decode_te(tiny_model):
    model = str(tiny_model("deepseek_v3", seed=0, name="deepseek_v3"))
    prompts = _prompts()
    with LLM(model=model, num_kv_blocks=256) as llm:
        expected = [out.outputs[0].token_ids for out in llm.generate(prompts, [_params(i) for i in
                                                                                 range(len(prompts))])]
    with running_deployment(model, deployment(pd_groups("1p1d", "shm")), engine={"num_kv_blocks": 256},
                            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, procs):
        outs = asyncio.run(_generate_all(jes[0], prompts))
        assert [list(out.outputs[0].token_ids) for out in outs] == expected
        for i, out in enumerate(outs):
            assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) < MAX_TOKENS
            assert_valid(out.outputs[0].text, SPECS[i % len(SPECS)])
        assert_pulled_without_recompute(jes[0], names(procs, "decode"), expected_total=len(prompts))
