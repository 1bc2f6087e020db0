"""Shared experts on EP ranks of their own (`shared=EPs`): the grammar, the slots, the master's view and the
cost model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from meshserve.config import EngineConfig
from meshserve.core.shrink_layout import shrink_layout
from meshserve.entrypoints.plan import CLUSTER_PRESETS, MODEL_PRESETS
from meshserve.moe.placement import ExpertPlacement, engine_shape
from meshserve.moe.shared_ranks import SharedExpertSlots
from meshserve.parallel import analyzer as az
from meshserve.parallel.strategy import ParallelStrategy, StrategyError, parse_strategy

SHARED = "attn=TP1+DP4 moe=TP1+EP4 shared=EP1"


def test_shared_block_round_trips_and_counts_the_routed_ranks():
    s = parse_strategy(SHARED)
    assert s == ParallelStrategy(1, 4, 1, 4, shared_ep=1)
    assert (s.routed_ep, s.world_size) == (3, 4)
    assert str(s) == SHARED and parse_strategy(str(s)) == s
    assert parse_strategy("shared=EP32 moe=EP288 attn=DP288") == ParallelStrategy(1, 288, 1, 288, shared_ep=32)
    # without the block nothing changes, and it is not printed
    plain = parse_strategy("attn=TP1+DP4 moe=TP1+EP4")
    assert plain.shared_ep == 0 and plain.routed_ep == 4 and str(plain) == "attn=TP1+DP4 moe=TP1+EP4"


@pytest.mark.parametrize("text, message", [
    ("attn=TP1+DP4 moe=TP1+EP4 shared=EP4", "shared=EP4 leaves no routed-expert rank"),
    ("attn=TP1+DP4 moe=TP1+EP4 shared=EP9", "shared=EP9 leaves no routed-expert rank"),
    ("attn=TP2+DP2 moe=TP1+EP4 shared=EP1", "shared=EP1 needs attention TP1 and MoE TP1"),
    ("attn=TP1+DP4 moe=TP2+EP2 shared=EP1", "shared=EP1 needs attention TP1 and MoE TP1"),
    ("attn=TP1+DP4 moe=TP1+EP4 shared=TP1", "TP is not allowed in the shared block"),
    ("attn=TP1+DP4 moe=TP1+EP4 shared=EP1 shared=EP1", "given twice"),
    ("attn=TP1+DP4 shared=EP1", "lacks the moe block"),
])
def test_bad_shared_blocks_are_refused_with_one_line(text, message):
    with pytest.raises(StrategyError, match=message) as err:
        parse_strategy(text)
    assert "\n" not in str(err.value) and "shared" in str(err.value)


def test_slots_follow_the_routed_ones_and_tokens_rotate_over_the_shared_ranks():
    # 16 routed experts over 3 routed ranks: the uneven shape has 6 slots per rank, 18 in all
    routed = engine_shape(16, 3, 0)
    slots = SharedExpertSlots(routed.num_slots, routed_ranks=3, shared_ranks=2, blocks=2)
    assert slots.num_slots == 18 + 4 and slots.first_slot(1) == 20
    assert slots.rank_of_slot() == [r for r in range(3) for _ in range(6)] + [3, 3, 4, 4]
    ids = torch.tensor([[0, 7], [3, 17], [5, 6]])
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.1, 0.2]])
    got_ids, got_weights = slots.append_columns(ids, weights, offset=1)
    # token i goes to shared rank (i + 1) mod 2: slots 20-21, 18-19, 20-21
    assert got_ids.tolist() == [[0, 7, 20, 21], [3, 17, 18, 19], [5, 6, 20, 21]]
    assert got_weights[:, 2:].tolist() == [[1.0, 1.0]] * 3 and torch.equal(got_weights[:, :2], weights)
    with pytest.raises(ValueError, match="shared"):
        SharedExpertSlots(16, routed_ranks=1, shared_ranks=1, blocks=0)  # a model without shared experts


def test_shrink_refuses_a_layout_with_shared_expert_ranks_in_one_line():
    config = EngineConfig.from_kwargs("model-dir", parallel=SHARED)
    shape = engine_shape(16, 3, 0)
    with pytest.raises(ValueError, match="shared") as err:
        shrink_layout(config, ExpertPlacement.default(shape, [1]), None, [2])
    assert "\n" not in str(err.value)


SHARED_MODEL = az.ModelSpec(name="toy", hidden_size=4, num_layers=2, num_experts=4, top_k=2, psi_attn=300,
                            psi_moe=800, weight_bytes=1.0, psi_shared=200)


def test_memory_puts_the_shared_experts_on_their_ranks_only():
    s = parse_strategy(SHARED)
    # every rank: 300 - 200 of attention and the rest; routed ranks 800/3, shared ranks 200: the fuller counts
    assert az.memory_per_rank_eq8(300, 800, 10, s, 200) == pytest.approx(100 + 800 / 3 + 10)
    heavy = ParallelStrategy(1, 4, 1, 4, shared_ep=3)  # one routed rank holds all 800
    assert az.memory_per_rank_eq8(300, 800, 10, heavy, 200) == pytest.approx(100 + 800 + 10)
    assert az.memory_per_rank_eq8(300, 800, 10, parse_strategy("attn=TP1+DP4 moe=TP1+EP4"), 200) == \
        pytest.approx(300 + 200 + 10)


def test_latency_prices_the_shared_ranks_flops_and_one_more_row_per_token():
    cluster = az.Cluster(name="c", nodes=1, devices_per_node=4, device_memory_bytes=1e9, flops=1.0,
                         intra_bandwidth=1.0, inter_bandwidth=1.0, intra_latency=0.0, inter_latency=0.0)
    s = parse_strategy(SHARED)
    tau, lam = az.layer_latency(SHARED_MODEL, s, cluster, tokens=8, comm_model="eq5")
    # attention without the shared experts: 2 * (300 - 200) / 2 per token on its DP group's 2 tokens;
    # routed: 2 * 400 * 2/4 * 8 tokens / 3 ranks; shared: 2 * 100 * 8 / 1 rank: the slower side counts
    assert tau == pytest.approx(2 * 50 * 2 + max(2 * 200 * 8 / 3, 2 * 100 * 8))
    assert lam == pytest.approx(az.communication_latency_eq5(s, 8, 4, 3, cluster))
    assert lam > az.communication_latency_eq5(s, 8, 4, 2, cluster)
    # a shared o_proj's two all-to-alls are paid with shared-expert ranks too
    model = dataclasses.replace(SHARED_MODEL, oproj_params=40)
    shared_oproj = dataclasses.replace(s, oproj_tp=2)
    _, lam_oproj = az.layer_latency(model, shared_oproj, cluster, tokens=8, comm_model="eq5")
    assert lam_oproj == pytest.approx(az.communication_latency_eq5(shared_oproj, 8, 4, 3, cluster)
                                      + az.oproj_comm_time(model, shared_oproj, 2, cluster)) and lam_oproj > lam


def test_plan_prices_shared_variants_of_models_with_shared_experts():
    r1 = az.model_spec_from_config(MODEL_PRESETS["deepseek-r1"])
    assert r1.psi_shared == 58 * 3 * 7168 * 2048
    qwen = az.model_spec_from_config(MODEL_PRESETS["qwen3-235b-a22b"])
    assert qwen.psi_shared == 0
    cluster = CLUSTER_PRESETS["ascend910b-4x8"]
    workload = az.Workload(batch=16, input_len=1024, output_len=256, arrival_rate=4.0)
    priced = {str(e.strategy) for e in az.analyze(r1, cluster, workload, include_unfit=True)}
    assert "attn=TP1+DP32 moe=TP1+EP32 shared=EP4" in priced
    assert not any("shared" in str(e.strategy) for e in az.analyze(qwen, cluster, workload, include_unfit=True))
    assert az.shared_expert_variants(parse_strategy("attn=TP2+DP2 moe=TP1+EP4")) == []
    deployment = az.to_deployment(parse_strategy(SHARED))
    assert deployment["parallel"] == SHARED and deployment["moe"]["shared_ep"] == 1
    with pytest.raises(az.AnalyzerError, match="shared"):
        az.estimate(qwen, parse_strategy("attn=TP1+DP32 moe=TP1+EP32 shared=EP4"), cluster, workload)
