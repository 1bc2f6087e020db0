"""Routing policies on constructed loads and prompt trees, and the JE's load tracker."""
from __future__ import annotations

import pytest

from meshserve.router.prompt_tree import GlobalPromptTree
from meshserve.router.routing import (
    POLICIES,
    LoadTracker,
    NoRouteError,
    RoutingPolicy,
    TELoad,
    TEView,
    load_score,
)
from meshserve.wire.kv import BlockStored, KVCacheEvents, chain_block_hash

BS = 4


def te(name: str, role: str = "colocated", group: str = "g", healthy: bool = True, **load) -> TEView:
    return TEView(name, role, group, TELoad(**load), healthy)


def tree_with(holdings: dict[str, list[int]]) -> GlobalPromptTree:
    """A tree where each TE caches the full blocks of the given tokens (DP group 0)."""
    tree = GlobalPromptTree(BS)
    for name, toks in holdings.items():
        hashes, parent = [], None
        for i in range(len(toks) // BS):
            parent = chain_block_hash(parent, toks[i * BS : (i + 1) * BS])
            hashes.append(parent)
        stored = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks[: len(hashes) * BS],
                                 block_size=BS)
        assert tree.apply(name, KVCacheEvents(seq=1, timestamp=0.0, events=[stored]))
    return tree


PROMPT = list(range(32))


class FixedPredictor:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.calls: list[tuple[int, int | None]] = []

    def predict_tokens(self, prompt_token_ids, max_tokens):
        self.calls.append((len(prompt_token_ids), max_tokens))
        return self.tokens


class LongPromptShortOutput:
    """Disaggregated wins where the prompt is longer than twice the output."""

    def value(self, prefill_tokens: int, decode_tokens: int) -> float:
        return 1.0 if prefill_tokens > 2 * decode_tokens else -1.0


def test_round_robin_cycles_over_colocated_tes_and_pd_slots():
    router = RoutingPolicy()
    tes = [te("c1"), te("p1", "prefill", "pd"), te("p2", "prefill", "pd"), te("d1", "decode", "pd"), te("c2")]
    got = []
    for _ in range(8):
        d = router.route(PROMPT, tes)
        got.append(d.te if d.kind == "colocated" else (d.prefill, d.decode))
        assert d.policy == "round_robin"
    # the 2P1D group is two slots; its prefill TEs alternate, its one decode TE takes both
    assert got == ["c1", "c2", ("p1", "d1"), ("p2", "d1")] * 2


def test_round_robin_skips_unhealthy_tes_and_incomplete_groups():
    router = RoutingPolicy()
    tes = [te("c1", healthy=False), te("c2"), te("p1", "prefill", "lonely"), te("p2", "prefill", "pd"),
           te("d2", "decode", "pd")]
    names = {str(router.route(PROMPT, tes).tes) for _ in range(4)}
    assert names == {"['c2']", "['p2', 'd2']"}


def test_load_picks_the_least_loaded_unit_and_the_least_loaded_decode():
    tes = [te("c1", waiting_tokens=5000), te("c2", num_running=4, running_tokens=40000),
           te("p1", "prefill", waiting_tokens=100),
           te("d1", "decode", kv_usage=0.9), te("d2", "decode", kv_usage=0.2, num_running=30)]
    d = RoutingPolicy("load").route(PROMPT, tes)
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "p1", "d2")
    tes[2] = te("p1", "prefill", waiting_tokens=9000)
    d = RoutingPolicy("load").route(PROMPT, tes)
    assert (d.kind, d.te) == ("colocated", "c2")


def test_load_counts_a_pairs_busy_decode_te():
    """An idle prefill TE does not make its pair attractive when the pair's decode TE is saturated."""
    tes = [te("c1", num_running=4, running_tokens=4000), te("p1", "prefill"),
           te("d1", "decode", kv_usage=0.9, num_running=40, running_tokens=30000)]
    d = RoutingPolicy("load").route(PROMPT, tes)
    assert (d.kind, d.te) == ("colocated", "c1")
    tes[2] = te("d1", "decode", kv_usage=0.1, num_running=1)
    d = RoutingPolicy("load").route(PROMPT, tes)
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "p1", "d1")


def test_prefill_tes_sharing_a_busy_decode_te_take_turns_by_their_own_load():
    """Every pair's score is its decode TE's when that is the busier half: the tie goes to the least loaded prefill
    TE, not always to the first (a second prefill TE would sit idle; found by `meshserve simulate`)."""
    busy_decode = te("d1", "decode", num_running=400, running_tokens=900_000, kv_usage=0.8)
    tes = [te("p1", "prefill", waiting_tokens=3000, num_waiting=1), te("p2", "prefill"), busy_decode]
    d = RoutingPolicy("load").route(PROMPT, tes)
    assert (d.prefill, d.decode) == ("p2", "d1")
    tes[0], tes[1] = te("p1", "prefill"), te("p2", "prefill", waiting_tokens=3000, num_waiting=1)
    assert RoutingPolicy("load").route(PROMPT, tes).prefill == "p1"


def test_heatmap_without_predictor_uses_max_tokens():
    class Heatmap:
        def value(self, prefill_tokens, decode_tokens):
            return 1.0 if decode_tokens < 50 else -1.0

    tes = [te("c1"), te("p1", "prefill"), te("d1", "decode")]
    router = RoutingPolicy("pd_aware", heatmap=Heatmap())
    assert router.route(PROMPT, tes, max_tokens=10).kind == "disaggregated"
    assert router.route(PROMPT, tes, max_tokens=500).kind == "colocated"


def test_load_score_orders_what_a_new_request_waits_for():
    idle = load_score(TELoad())
    assert idle == 0
    assert load_score(TELoad(waiting_tokens=1000)) > load_score(TELoad(running_tokens=1000))
    assert load_score(TELoad(num_waiting=1)) > idle
    assert load_score(TELoad(kv_usage=0.95)) - load_score(TELoad(kv_usage=0.85)) > \
        load_score(TELoad(kv_usage=0.2)) - load_score(TELoad(kv_usage=0.1))  # steeper when nearly full


def test_locality_prefers_the_longest_cached_prefix_then_the_least_load():
    tree = tree_with({"c1": PROMPT[:8], "c2": PROMPT[:24], "c3": PROMPT[:24], "p1": PROMPT[:32]})
    router = RoutingPolicy("locality", tree=tree)
    colocated = [te("c1"), te("c2", waiting_tokens=300), te("c3", waiting_tokens=200)]
    d = router.route(PROMPT, colocated)
    assert d.te == "c3" and "24 tokens" in d.reason
    # a prefill TE computes the prompt, so its cache counts for the pair
    d = router.route(PROMPT, colocated + [te("p1", "prefill"), te("d1", "decode")])
    assert (d.prefill, d.decode) == ("p1", "d1")
    # nothing cached anywhere: the least loaded
    d = router.route(list(range(100, 132)), colocated)
    assert d.te == "c1"


def test_locality_without_a_tree_falls_back_to_load():
    d = RoutingPolicy("locality").route(PROMPT, [te("c1", num_waiting=3), te("c2")])
    assert d.te == "c2" and "no prompt tree" in d.reason


def test_pd_aware_follows_the_heatmap_with_the_predicted_decode_length():
    tes = [te("c1"), te("c2", num_running=2), te("p1", "prefill"), te("p2", "prefill", waiting_tokens=50),
           te("d1", "decode")]
    short = FixedPredictor(4)
    router = RoutingPolicy("pd_aware", heatmap=LongPromptShortOutput(), predictor=short)
    d = router.route(PROMPT, tes, max_tokens=100)
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "p1", "d1")
    assert short.calls == [(32, 100)]
    router.predictor = FixedPredictor(1000)
    d = router.route(PROMPT, tes, max_tokens=100)  # capped at max_tokens: 32 <= 200, colocated
    assert (d.kind, d.te) == ("colocated", "c1")
    assert "decode 100" in d.reason


def test_pd_aware_without_max_tokens_assumes_the_default_output_length():
    predictor = FixedPredictor(1)
    router = RoutingPolicy("pd_aware", heatmap=LongPromptShortOutput(), predictor=predictor)
    tes = [te("c1"), te("p1", "prefill"), te("d1", "decode")]
    assert router.route(list(range(600)), tes).kind == "disaggregated"  # 600 > 2 * 256
    assert router.route(list(range(500)), tes).kind == "colocated"
    assert predictor.calls == []  # a predictor plans within a known output limit only


def test_pd_aware_without_a_model_disaggregates_prompts_longer_than_the_output():
    tes = [te("c1"), te("p1", "prefill"), te("d1", "decode")]
    router = RoutingPolicy("pd_aware")
    assert router.route(PROMPT, tes, max_tokens=16).kind == "disaggregated"
    assert router.route(PROMPT, tes, max_tokens=64).kind == "colocated"
    assert router.route(PROMPT, tes).kind == "colocated"  # no max_tokens: a default output length
    assert router.route(list(range(1000)), tes).kind == "disaggregated"


def test_pd_aware_with_one_type_uses_that_type():
    router = RoutingPolicy("pd_aware", heatmap=LongPromptShortOutput(), predictor=FixedPredictor(1))
    d = router.route(PROMPT, [te("c1", num_waiting=1), te("c2")])
    assert d.te == "c2"
    d = router.route(PROMPT, [te("p1", "prefill"), te("d1", "decode"), te("c1", healthy=False)], max_tokens=10_000)
    assert d.kind == "disaggregated"


def test_combined_uses_locality_when_balanced_and_least_load_when_not():
    tree = tree_with({"c1": PROMPT, "p1": PROMPT})
    router = RoutingPolicy("combined", tree=tree, balance_threshold=0.25, balance_floor=100)
    balanced = [te("c1", waiting_tokens=1100), te("c2", waiting_tokens=1000), te("p1", "prefill"), te("d1", "decode")]
    d = router.route(PROMPT, balanced, max_tokens=1000)  # long output: colocated; loads within 25%
    assert d.te == "c1" and "balanced" in d.reason and "cached prefix" in d.reason
    unbalanced = [te("c1", waiting_tokens=3000)] + balanced[1:]
    d = router.route(PROMPT, unbalanced, max_tokens=1000)
    assert d.te == "c2" and "unbalanced" in d.reason
    # among P/D pairs the same rule applies to the prefill TEs
    pairs = [te("p1", "prefill", waiting_tokens=20), te("p2", "prefill"), te("d1", "decode")]
    assert router.route(PROMPT, pairs + [te("c1")], max_tokens=1).prefill == "p1"
    pairs[0] = te("p1", "prefill", waiting_tokens=5000)
    assert router.route(PROMPT, pairs + [te("c1")], max_tokens=1).prefill == "p2"


def test_combined_counts_a_nearly_idle_cluster_as_balanced():
    tree = tree_with({"c2": PROMPT})
    d = RoutingPolicy("combined", tree=tree).route(PROMPT, [te("c1"), te("c2", num_waiting=1, waiting_tokens=10)])
    assert d.te == "c2"  # one small request apart is below the balance floor: the cache wins


def test_per_request_policy_override_and_unknown_names():
    tes = [te("c1", waiting_tokens=100), te("c2")]
    router = RoutingPolicy("round_robin")
    assert router.route(PROMPT, tes).te == "c1"
    assert router.route(PROMPT, tes, policy="load").te == "c2"
    assert router.route(PROMPT, tes, policy="load").policy == "load"
    assert router.route(PROMPT, tes).te == "c2"  # the override did not advance round robin
    with pytest.raises(ValueError, match="round_robin, load, locality, pd_aware, combined"):
        router.route(PROMPT, tes, policy="random")
    with pytest.raises(ValueError, match="valid"):
        RoutingPolicy("fastest")
    assert set(POLICIES) == {"round_robin", "load", "locality", "pd_aware", "combined"}


@pytest.mark.parametrize("policy", POLICIES)
def test_no_route_when_nothing_healthy_can_serve(policy):
    router = RoutingPolicy(policy)
    with pytest.raises(NoRouteError, match="no TE is registered"):
        router.route(PROMPT, [])
    with pytest.raises(NoRouteError, match="unhealthy: c1"):
        router.route(PROMPT, [te("c1", healthy=False), te("p1", "prefill"), te("d1", "decode", "other")])


def test_an_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        te("x", "mixed")


def test_load_tracker_adds_dispatches_until_a_heartbeat_counts_them():
    now = [0.0]
    tracker = LoadTracker(clock=lambda: now[0])
    tracker.report("a", TELoad(num_running=2, running_tokens=500))
    now[0] = 1.0
    tracker.on_dispatch("a", 100, "r1")
    now[0] = 2.0
    tracker.on_dispatch("a", 40, "r2")
    load = tracker.load_of("a")
    assert (load.num_running, load.num_waiting, load.waiting_tokens) == (2, 2, 140)
    # a heartbeat taken at 1.5 counts r1 but not r2
    tracker.report("a", TELoad(num_running=2, num_waiting=1, waiting_tokens=100, running_tokens=500), at=1.5)
    load = tracker.load_of("a")
    assert (load.num_waiting, load.waiting_tokens) == (2, 140)
    tracker.on_finished("a", "r2")  # never reported: its addition goes
    assert tracker.load_of("a").num_waiting == 1
    tracker.on_finished("a", "r0", num_tokens=300)  # counted by the heartbeat as running
    load = tracker.load_of("a")
    assert (load.num_running, load.running_tokens) == (1, 200)
    assert tracker.load_of("unknown") == TELoad()
    tracker.forget("a")
    assert tracker.load_of("a") == TELoad()


def test_a_burst_between_heartbeats_spreads_over_tes():
    tracker = LoadTracker()
    names = ["a", "b", "c"]
    for name in names:
        tracker.report(name, TELoad())
    router = RoutingPolicy("load")
    chosen = []
    for i in range(6):
        d = router.route(PROMPT, [TEView(n, "colocated", "g", tracker.load_of(n)) for n in names])
        tracker.on_dispatch(d.te, len(PROMPT), f"r{i}")
        chosen.append(d.te)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]
    # prefill and decode of one request are tracked apart
    tracker.on_dispatch("p", 10, "x")
    tracker.on_dispatch("d", 10, "x")
    assert tracker.load_of("p").num_waiting == tracker.load_of("d").num_waiting == 1
