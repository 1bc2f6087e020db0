"""Disaggregated prefill/decode on an INT8 KV cache: the blocks move with their scales.

The oracle is the same model on one colocated TE with the same INT8 cache: greedy tokens through 1p1d over
each KV transfer backend (shared memory, the TCP block server, torch.distributed) must equal it, with every
prompt's KV pulled (none computed again on the decode side).
"""
from __future__ import annotations

import asyncio

import pytest

from meshserve.router.deployment import MultiDeployment
from tests.router.deployment_processes import generate_all, running_deployment, token_ids
from tests.router.test_pd_deployment import (
    HEARTBEAT_TIMEOUT_S,
    assert_pulled_without_recompute,
    names,
    pd_groups,
    prompt,
    stats,
    wait_until_released,
)

pytestmark = pytest.mark.timeout(300)

BUDGET_GB = 0.01
ENGINE = {"kv_cache_dtype": "int8", "kv_cache_memory_gb": BUDGET_GB}
# the tiny DeepSeek-V3 in INT8: 4 layers x (64 + 16 + 4) bytes a token, 16 tokens a block
INT8_BLOCKS = int(BUDGET_GB * 2**30 // (4 * 84 * 16))
PROMPTS = [prompt(1, 5), prompt(2, 16), prompt(3, 17), prompt(4, 40), prompt(6, 33)]
MAX_TOKENS = 6
BACKENDS = ("shm", "tcp", "dist")


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model("deepseek_v3", seed=0, name="deepseek_v3"))


def test_disaggregated_int8_kv_gives_the_colocated_tokens(model):
    with running_deployment(model, "colocated", engine=ENGINE, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, _):
        reference = token_ids(asyncio.run(generate_all(jes[0], PROMPTS, MAX_TOKENS)))
    layout = MultiDeployment.from_dict({"engine": ENGINE,
                                        "te_groups": [g for b in BACKENDS for g in pd_groups("1p1d", b)]})
    with running_deployment(model, layout, engine={}, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, procs):
        je = jes[0]
        # round-robin alternates between the groups: each prompt once per backend
        per_group = [p for p in PROMPTS for _ in BACKENDS]
        outputs = asyncio.run(generate_all(je, per_group, MAX_TOKENS, policy="round_robin"))
        assert token_ids(outputs) == [t for t in reference for _ in BACKENDS]
        decode_tes = names(procs, "decode")
        assert_pulled_without_recompute(je, decode_tes, expected_total=len(per_group))
        # both sides sized their caches as INT8 (the transfer refuses blocks of another dtype or shape)
        assert {stats(je, te)["num_kv_blocks"] for te in decode_tes + names(procs, "prefill")} == {INT8_BLOCKS}
        wait_until_released(je, names(procs, "prefill"))
