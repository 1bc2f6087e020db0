"""A TE with self-contained DP groups in a deployment (`meshserve te`): the job executor sees one TE (the shell's
heartbeat), each group's master sends its requests' tokens straight to the job executor that sent them, and the
greedy tokens are the single-rank engine's."""
from __future__ import annotations

import asyncio
import time

import pytest

from meshserve import LLM, SamplingParams
from meshserve.utils.processes import process_tree
from tests.router.deployment_processes import generate_all, running_deployment, token_ids
from tests.router.test_pd_deployment import (
    HEARTBEAT_TIMEOUT_S,
    assert_pulled_without_recompute,
    deployment,
    names,
    pd_groups,
    wait_until_released,
)

PROMPTS = [[5, 6, 7], [9, 3, 1, 4], [11, 12], [2, 8, 8, 8, 3], [40, 41, 42, 43, 44, 45], [7]]
MAX_TOKENS = 12
ENGINE = {"num_kv_blocks": 128, "parallel": "attn=TP1+DP2 moe=TP1+EP2", "dp_groups": "self-contained"}


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model("deepseek_v3", seed=0, name="deepseek_v3"))


def test_a_self_contained_te_serves_a_job_executor_with_one_ranks_tokens(model):
    with LLM(model=model, num_kv_blocks=128) as llm:
        expected = [out.outputs[0].token_ids for out in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    with running_deployment(model, "colocated", engine=ENGINE) as (jes, procs):
        je = jes[0]
        outs = asyncio.run(generate_all(je, PROMPTS, MAX_TOKENS))
        assert token_ids(outs) == expected
        te = next(iter(je.registry.tes.values()))
        # one TE registered, whatever its number of groups; its stats are the groups' together
        assert len(je.registry.tes) == 1 and te.heartbeat.attn_dp == 2
        assert te.heartbeat.stats.world_size == 2 and te.heartbeat.stats.healthy


def test_the_job_executor_sees_the_groups_prefix_caches_through_the_shell(model):
    """Each group's prefix-cache events reach the job executor's prompt tree as the TE's (the shell publishes
    them again under its own numbers and answers the snapshot a new subscriber asks for)."""
    prompts = [list(range(100 + 50 * i, 140 + 50 * i)) for i in range(4)]  # 40 tokens: 2 full blocks each
    with running_deployment(model, "colocated", engine=ENGINE) as (jes, procs):
        je = jes[0]
        asyncio.run(generate_all(je, prompts, 2))
        te = next(iter(je.registry.tes))
        deadline = time.monotonic() + 30
        while any(je.registry.tree.match(prompt) != {te: 32} for prompt in prompts):
            assert time.monotonic() < deadline, [je.registry.tree.match(prompt) for prompt in prompts]
            time.sleep(0.1)
        assert je.registry.tree.match([*prompts[0][:16], 7] * 2) == {te: 16}  # its first block only


def test_prefill_and_decode_tes_with_self_contained_groups_hand_kv_over(model):
    """1P1D, both TEs DP2+EP2 with self-contained groups: each decode group pulls the prompt KV its request's
    prefill group computed (its own rank's region), releases it through the prefill TE's shell, and the greedy
    tokens are the single rank's."""
    with LLM(model=model, num_kv_blocks=128) as llm:
        expected = [out.outputs[0].token_ids for out in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    layout = deployment(pd_groups("1p1d", "shm", prefill={"parallel": ENGINE["parallel"]},
                                  decode={"parallel": ENGINE["parallel"]}))
    with running_deployment(model, layout, engine={"dp_groups": "self-contained"},
                            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, procs):
        je = jes[0]
        outs = asyncio.run(generate_all(je, PROMPTS, MAX_TOKENS))
        assert token_ids(outs) == expected
        for proc in procs.values():  # each TE is a shell over two group masters
            assert len([p for p in process_tree(proc.pid) if "run_group_master" in " ".join(p.cmdline())]) == 2
        assert_pulled_without_recompute(je, names(procs, "decode"), expected_total=len(PROMPTS))
        wait_until_released(je, names(procs, "prefill"))
