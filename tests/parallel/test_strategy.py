import pytest

from meshserve.parallel.strategy import ParallelStrategy, StrategyError, enumerate_strategies, parse_strategy


def test_parse_full_strategy():
    s = parse_strategy("attn=TP2+DP2 moe=TP2+EP2")
    assert s == ParallelStrategy(attn_tp=2, attn_dp=2, moe_tp=2, moe_ep=2)
    assert s.world_size == 4


def test_parse_omitted_terms_default_to_one_and_order_is_free():
    assert parse_strategy("moe=EP8 attn=DP2+TP4") == ParallelStrategy(4, 2, 1, 8)
    assert parse_strategy("attn=TP8 moe=TP8") == ParallelStrategy(8, 1, 8, 1)


@pytest.mark.parametrize("strategy", enumerate_strategies(16))
def test_str_round_trips(strategy):
    text = str(strategy)
    assert text == f"attn=TP{strategy.attn_tp}+DP{strategy.attn_dp} moe=TP{strategy.moe_tp}+EP{strategy.moe_ep}"
    assert parse_strategy(text) == strategy
    assert ParallelStrategy.parse(text) == strategy


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("attn=TP2+DP2", "lacks the moe block"),
    ("attn=TP2 moe=EP4", "same world size"),
    ("attn=TP3+DP1 moe=TP3", "power of two"),
    ("attn=TP0 moe=TP0", "power of two"),
    ("attn=EP2 moe=EP2", "EP is not allowed in the attn block"),
    ("attn=TP2 moe=DP2", "DP is not allowed in the moe block"),
    ("attn=TP2+TP2 moe=TP4", "TP given twice"),
    ("attn=TP2 attn=TP2 moe=TP2", "given twice"),
    ("attn=TPx moe=TP1", "bad term"),
    ("mlp=TP2 moe=TP2", "bad block"),
    ("attn:TP2 moe=TP2", "bad block"),
])
def test_parse_errors(text, message):
    with pytest.raises(StrategyError, match=message):
        parse_strategy(text)


def test_constructor_validates():
    with pytest.raises(StrategyError, match="moe_tp must be a positive power of two"):
        ParallelStrategy(attn_tp=2, attn_dp=3, moe_tp=6, moe_ep=1)
    with pytest.raises(StrategyError, match="attn_dp must be a positive integer"):
        ParallelStrategy(attn_tp=1, attn_dp=0, moe_tp=1, moe_ep=0)
    # DP and EP need not be powers of two: a TE shrunk after a rank failure runs DP3 + EP3
    assert parse_strategy("attn=TP1+DP3 moe=TP1+EP3").world_size == 3
    assert ParallelStrategy.from_degrees(dp=3, ep=3) == ParallelStrategy(1, 3, 1, 3)
    with pytest.raises(StrategyError, match="attention covers 4 ranks"):
        ParallelStrategy(attn_tp=2, attn_dp=2, moe_tp=1, moe_ep=2)
    with pytest.raises(StrategyError):
        ParallelStrategy(attn_tp=True)


def test_from_degrees_fills_moe_tp():
    assert ParallelStrategy.from_degrees(tp=4, dp=2, ep=8) == ParallelStrategy(4, 2, 1, 8)
    assert ParallelStrategy.from_degrees(tp=4, dp=2, ep=2) == ParallelStrategy(4, 2, 4, 2)
    assert ParallelStrategy.from_degrees(tp=8) == ParallelStrategy(8, 1, 8, 1)
    with pytest.raises(StrategyError, match="--ep 16 exceeds"):
        ParallelStrategy.from_degrees(tp=4, dp=2, ep=16)
    with pytest.raises(StrategyError, match="--ep 1 leaves MoE TP 12"):
        ParallelStrategy.from_degrees(tp=4, dp=3)
    with pytest.raises(StrategyError, match="--tp must be a power of two"):
        ParallelStrategy.from_degrees(tp=3)


@pytest.mark.parametrize("world, count", [(1, 1), (2, 4), (8, 16), (16, 25), (32, 36)])
def test_enumeration_counts(world, count):
    # (log2(world) + 1) choices of attention TP times as many of MoE TP.
    strategies = enumerate_strategies(world)
    assert len(strategies) == count
    assert len(set(strategies)) == count
    assert all(s.world_size == world for s in strategies)


def test_a_world_of_any_size_splits_into_power_of_two_tp_degrees():
    # CloudMatrix-Infer's EP320 decode: 320 = 2^6 * 5, so TP 1-64 and DP/EP 320 down to 5
    strategies = enumerate_strategies(320)
    assert len(strategies) == 7 * 7 and all(s.world_size == 320 for s in strategies)
    assert {s.attn_tp for s in strategies} == {1, 2, 4, 8, 16, 32, 64}
    assert parse_strategy("attn=DP320 moe=EP320") in strategies
    assert [str(s) for s in enumerate_strategies(3)] == ["attn=TP1+DP3 moe=TP1+EP3"]


def test_enumeration_rejects_bad_world_size():
    for bad in (0, -4, 2.0, True):
        with pytest.raises(StrategyError, match="world size"):
            enumerate_strategies(bad)
