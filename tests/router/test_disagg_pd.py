"""A disaggregated decode TE (attention ranks + expert ranks, xdeepserve §5.2) as the decode side of a 1P1D
deployment, behind a colocated or a disaggregated prefill TE: its attention ranks pull the prompt KV the prefill
TE computed, its expert ranks hold none, and the greedy tokens are the single rank's."""
from __future__ import annotations

import asyncio

import pytest
import torch

from meshserve import LLM, SamplingParams
from tests.router.deployment_processes import generate_all, running_deployment, token_ids
from tests.router.test_pd_deployment import (
    HEARTBEAT_TIMEOUT_S,
    assert_pulled_without_recompute,
    deployment,
    names,
    pd_groups,
    wait_until_released,
)

MAX_TOKENS = 32


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 70, 17, 33, 9, 120, 48, 2, 64, 3, 27, 91, 12, 40, 7, 55]
    return [torch.randint(100, 31900, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("prefill_layout", ["attn=TP1+DP2 moe=TP1+EP2", "attn=DP2 moe=EP2 disagg"])
def test_a_disaggregated_decode_te_behind_a_prefill_te_gives_the_single_rank_tokens(tiny_model, prefill_layout):
    """Behind a colocated DP2+EP2 prefill TE, and behind a disaggregated one."""
    model = str(tiny_model("deepseek_v3", seed=0, name="deepseek_v3"))
    prompts = _prompts()
    with LLM(model=model, num_kv_blocks=256) as llm:
        expected = [out.outputs[0].token_ids for out in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    layout = deployment(pd_groups("1p1d", "shm", prefill={"parallel": prefill_layout},
                                  decode={"parallel": "attn=DP2 moe=EP2 disagg"}))
    with running_deployment(model, layout, engine={"num_kv_blocks": 256},
                            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, procs):
        je = jes[0]
        outs = asyncio.run(generate_all(je, prompts, MAX_TOKENS))
        assert token_ids(outs) == expected
        assert_pulled_without_recompute(je, names(procs, "decode"), expected_total=len(prompts))
        wait_until_released(je, names(procs, "prefill"))
