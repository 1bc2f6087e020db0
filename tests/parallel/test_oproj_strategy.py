"""The `oproj=TPk` block of the strategy grammar: MLA at attention TP1 with o_proj shared over k ranks."""
import pytest

from meshserve.config.base import ConfigError
from meshserve.config.parallel import ParallelConfig
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.strategy import ParallelStrategy, StrategyError, enumerate_strategies, parse_strategy


def test_the_oproj_block_parses_and_round_trips():
    s = parse_strategy("attn=TP1+DP4 oproj=TP2 moe=TP1+EP4")
    assert s == ParallelStrategy(attn_tp=1, attn_dp=4, moe_tp=1, moe_ep=4, oproj_tp=2)
    assert s.world_size == 4
    assert str(s) == "attn=TP1+DP4 oproj=TP2 moe=TP1+EP4"
    assert parse_strategy("moe=EP8 oproj=TP8 attn=DP8") == ParallelStrategy(1, 8, 1, 8, oproj_tp=8)


def test_without_the_block_oproj_is_one_and_the_string_is_unchanged():
    s = parse_strategy("attn=TP1+DP4 moe=TP1+EP4")
    assert s.oproj_tp == 1 and str(s) == "attn=TP1+DP4 moe=TP1+EP4"
    assert parse_strategy("attn=TP1+DP4 oproj=TP1 moe=TP1+EP4") == s
    assert str(parse_strategy("attn=TP1+DP4 oproj=TP1 moe=TP1+EP4")) == "attn=TP1+DP4 moe=TP1+EP4"


@pytest.mark.parametrize("text, message", [
    ("attn=TP1+DP4 oproj=TP3 moe=TP1+EP4", "oproj_tp must be a positive power of two, got 3"),
    ("attn=TP1+DP4 oproj=TP0 moe=TP1+EP4", "oproj_tp must be a positive power of two"),
    ("attn=TP2+DP2 oproj=TP2 moe=TP1+EP4", "oproj=TP2 needs attention TP1 .* got attn=TP2"),
    ("attn=TP1+DP2 oproj=TP4 moe=TP1+EP2", "oproj=TP4 must divide the attention DP degree 2"),
    ("attn=TP1+DP6 oproj=TP4 moe=TP1+EP6", "oproj=TP4 must divide the attention DP degree 6"),
    ("attn=TP1+DP4 oproj=DP2 moe=TP1+EP4", "DP is not allowed in the oproj block"),
    ("attn=TP1+DP4 oproj=TP2 oproj=TP2 moe=TP1+EP4", "block 'oproj' given twice"),
    ("oproj=TP2 moe=TP1+EP2", "lacks the attn block"),
    ("attn=TP1+DP4 o_proj=TP2 moe=TP1+EP4", "expected 'attn=...', 'oproj=...', 'moe=...' or 'shared=EPs'"),
])
def test_refusals_name_oproj_in_one_line(text, message):
    with pytest.raises(StrategyError, match=message) as refused:
        parse_strategy(text)
    assert "\n" not in str(refused.value)


def test_enumeration_adds_the_oproj_variants_of_attention_tp1_layouts_only_when_asked():
    plain = enumerate_strategies(4)
    assert all(s.oproj_tp == 1 for s in plain)
    with_oproj = enumerate_strategies(4, oproj=True)
    extra = [s for s in with_oproj if s.oproj_tp > 1]
    assert with_oproj[:len(plain)] == plain
    # attention TP1 (DP4) with each of 3 MoE splits, times oproj TP2 and TP4
    assert sorted(map(str, extra)) == sorted(f"attn=TP1+DP4 oproj=TP{k} moe=TP{m}+EP{4 // m}"
                                             for k in (2, 4) for m in (1, 2, 4))


def test_context_coordinates_of_the_oproj_group():
    strategy = parse_strategy("attn=TP1+DP8 oproj=TP4 moe=TP1+EP8")
    assert [(ParallelContext(strategy, rank=r).oproj_rank, ParallelContext(strategy, rank=r).oproj_size)
            for r in (0, 3, 5)] == [(0, 4), (3, 4), (1, 4)]
    single = ParallelContext.single()
    assert (single.oproj_rank, single.oproj_size, single.oproj_group, single.oproj_ranks) == (0, 1, None, [0])


def test_the_engine_config_reports_a_bad_oproj_in_one_line_and_runs_two_microbatches_with_one():
    with pytest.raises(ConfigError, match="bad parallel strategy .* oproj=TP2 needs attention TP1"):
        ParallelConfig(parallel="attn=TP2+DP2 oproj=TP2 moe=TP1+EP4")
    config = ParallelConfig(parallel="attn=TP1+DP2 oproj=TP2 moe=TP1+EP2", microbatches=2)
    assert config.strategy.oproj_tp == 2 and config.world_size == 2
