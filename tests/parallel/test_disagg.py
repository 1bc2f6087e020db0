"""Attention-expert disaggregated layouts (meshserve/parallel/disagg.py): the grammar, the layouts the ranks
cannot form refused naming the setting, the price's shape (a layer is max(A + 2C + E, D * E)), and
`meshserve plan --disagg` beside colocated DP=EP on as many devices."""
from __future__ import annotations

import json
import math

import pytest

from meshserve.config import ConfigError, EngineConfig
from meshserve.entrypoints.cli import main
from meshserve.parallel.analyzer import AnalyzerError, Workload, estimate, model_spec_from_config
from meshserve.parallel.cluster_file import CLUSTER_PRESETS, MODEL_PRESETS
from meshserve.parallel.disagg import DisaggLayout, check_model_dir, compare, estimate_disagg, parse_disagg
from meshserve.parallel.strategy import ParallelStrategy, StrategyError, parse_strategy

R1 = model_spec_from_config(MODEL_PRESETS["deepseek-r1"], name="deepseek-r1")
CLUSTER = CLUSTER_PRESETS["ascend910b-4x8"]


@pytest.mark.parametrize(("text", "layout"), [
    ("attn=DP4 moe=EP2 disagg", DisaggLayout(attention_ranks=4, expert_ranks=2)),
    ("attn=DP480 moe=EP256 shared=EP32 disagg domains=3",
     DisaggLayout(attention_ranks=480, expert_ranks=256, shared_ranks=32, domains=3)),
    ("disagg relay=2 moe=TP2+EP4 attn=DP8", DisaggLayout(attention_ranks=8, expert_ranks=8, expert_tp=2, relay=2)),
])
def test_the_grammar_names_the_roles(text, layout):
    assert parse_disagg(text) == layout
    assert parse_disagg(str(layout)) == layout  # printed canonically, parsed back
    assert layout.devices == layout.attention_ranks + layout.expert_ranks + layout.shared_ranks


@pytest.mark.parametrize(("text", "named"), [
    ("attn=DP4 moe=EP2", "disagg"),
    ("attn=DP6 moe=EP2 disagg domains=4", "domains=4"),
    ("attn=DP4 moe=EP6 disagg relay=4", "relay=4"),
    ("attn=TP2+DP2 moe=EP2 disagg", "attention runs at TP1"),
    ("moe=EP2 disagg", "attn=DPa"),
    ("attn=DP4 moe=TP3+EP2 disagg", "power of two"),
    ("attn=DP4 moe=EP2 disagg speed=fast", "bad part"),
])
def test_a_layout_the_ranks_cannot_form_is_refused_naming_the_setting(text, named):
    with pytest.raises(StrategyError, match=named):
        parse_disagg(text)


def test_a_layout_that_cannot_host_the_model_is_refused_naming_the_setting():
    with pytest.raises(StrategyError, match="moe=EP300"):
        DisaggLayout(attention_ranks=4, expert_ranks=300).check_model(num_experts=256, intermediate_size=2048)
    with pytest.raises(StrategyError, match="moe=TP4"):
        DisaggLayout(attention_ranks=4, expert_ranks=8, expert_tp=4).check_model(256, intermediate_size=1026)
    DisaggLayout(attention_ranks=4, expert_ranks=14).check_model(256, 2048)  # uneven: 19 slots on each of 14


def test_a_layer_is_one_domains_path_or_the_experts_serving_every_domain():
    workload = Workload(batch=256, input_len=1024, output_len=256, arrival_rate=1.0)
    light = estimate_disagg(R1, DisaggLayout(attention_ranks=16, expert_ranks=16, domains=2), CLUSTER, workload)
    assert light.layer_ms == pytest.approx(light.attention_ms + 2 * light.transfer_ms + light.expert_ms)
    assert not light.experts_bound
    # many tokens on few expert ranks: the experts serving the domains in turn set the pace
    heavy = estimate_disagg(R1, DisaggLayout(attention_ranks=16, expert_ranks=2, domains=4), CLUSTER,
                            Workload(batch=4096, input_len=128, output_len=16, arrival_rate=1.0))
    assert heavy.experts_bound and heavy.layer_ms == pytest.approx(4 * heavy.expert_ms)
    assert light.itl_ms == pytest.approx(R1.num_layers * light.layer_ms)
    assert light.tokens_per_s_per_device == pytest.approx(256 / (light.itl_ms / 1e3) / 32)


def test_shared_expert_ranks_take_the_shared_experts_off_the_attention_ranks():
    workload = Workload(batch=256, input_len=1024, output_len=256, arrival_rate=1.0)
    without = estimate_disagg(R1, DisaggLayout(attention_ranks=16, expert_ranks=16), CLUSTER, workload)
    shared = estimate_disagg(R1, DisaggLayout(attention_ranks=16, expert_ranks=14, shared_ranks=2), CLUSTER, workload)
    assert shared.attention_ms < without.attention_ms
    assert shared.attention_memory_bytes < without.attention_memory_bytes


def test_compare_prices_colocated_dp_ep_on_as_many_devices():
    workload = Workload(batch=256, input_len=1024, output_len=256, arrival_rate=1.0)
    result = compare(R1, DisaggLayout(attention_ranks=16, expert_ranks=16), CLUSTER, workload)
    assert str(result["colocated"].strategy) == "attn=TP1+DP32 moe=TP1+EP32"
    assert result["ratio"] == pytest.approx(result["disaggregated"].tokens_per_s_per_device
                                            / result["colocated_tokens_per_s_per_device"])
    assert math.isfinite(result["ratio"]) and result["ratio"] > 0


def test_plan_prices_a_disaggregated_layout(capsys):
    assert main(["plan", "--model-preset", "deepseek-r1", "--preset-cluster", "ascend910b-4x8", "--batch", "256",
                 "--disagg", "attn=DP16 moe=EP14 shared=EP2 disagg domains=2"]) == 0
    out = capsys.readouterr().out
    assert "attn=DP16 moe=EP14 shared=EP2 disagg domains=2: 32 devices" in out
    assert "colocated attn=TP1+DP32 moe=TP1+EP32" in out and "disaggregated/colocated" in out


def test_plan_refuses_a_bad_layout_in_one_line(capsys):
    assert main(["plan", "--model-preset", "deepseek-r1", "--preset-cluster", "ascend910b-4x8",
                 "--disagg", "attn=DP16 moe=EP16 disagg domains=3"]) == 2
    err = capsys.readouterr().err
    assert "domains=3" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("text", "world", "attention"), [
    ("attn=DP2 moe=EP2 disagg", 4, 2),
    ("attn=DP4 moe=EP2 disagg domains=2", 6, 4),
    ("attn=DP2 moe=TP2+EP2 disagg relay=2", 6, 2),
])
def test_the_engine_strategy_of_a_disaggregated_layout_counts_both_roles(text, world, attention):
    strategy = parse_strategy(text)
    assert strategy.disagg and (strategy.world_size, strategy.attention_ranks) == (world, attention)
    assert parse_strategy(str(strategy)) == strategy
    assert strategy.disagg_layout() == parse_disagg(text)


def test_only_a_disaggregated_layout_takes_domains():
    with pytest.raises(StrategyError, match="disagg"):
        ParallelStrategy(attn_dp=2, moe_ep=2, domains=2)


@pytest.mark.parametrize(("settings", "named"), [
    (dict(parallel="attn=DP2 moe=TP2+EP2 shared=EP2 disagg"), "shared=EP2 needs moe=TP1"),
    (dict(parallel="attn=DP2 moe=EP2 disagg", dp_groups="self-contained"), "dp_groups self-contained"),
    (dict(parallel="attn=DP2 moe=EP2 disagg", on_rank_failure="shrink"), "on_rank_failure shrink"),
    (dict(parallel="attn=DP3 moe=EP2 disagg domains=2"), "domains=2"),
])
def test_what_a_served_disaggregated_layout_does_not_do_is_refused_in_one_line(settings, named):
    with pytest.raises(ConfigError, match=named) as err:
        EngineConfig.from_kwargs("model-dir", **settings)
    assert "\n" not in str(err.value)


def test_a_model_without_routed_experts_or_too_few_is_refused_naming_the_setting(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    with pytest.raises(StrategyError, match="no routed experts"):
        check_model_dir(parse_disagg("attn=DP2 moe=EP2 disagg"), str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 4, "moe_intermediate_size": 6}))
    with pytest.raises(StrategyError, match="moe=EP8"):
        check_model_dir(parse_disagg("attn=DP2 moe=EP8 disagg"), str(tmp_path))
    with pytest.raises(StrategyError, match="moe=TP4"):
        check_model_dir(parse_disagg("attn=DP2 moe=TP4+EP1 disagg"), str(tmp_path))
    with pytest.raises(StrategyError, match="no shared experts"):
        check_model_dir(parse_disagg("attn=DP2 moe=EP2 shared=EP1 disagg"), str(tmp_path))
    check_model_dir(parse_disagg("attn=DP2 moe=TP2+EP2 disagg"), str(tmp_path))


def test_the_colocated_analyzer_refuses_a_disaggregated_layout():
    workload = Workload(batch=8, input_len=8, output_len=8, arrival_rate=1.0)
    with pytest.raises(AnalyzerError, match="plan --disagg"):
        estimate(R1, parse_strategy("attn=DP4 moe=EP2 disagg"), CLUSTER, workload)
