"""Routing around KV links that are down (xdeepserve §6.1 link probing): no policy pairs a prefill TE with a
decode TE whose link to it is down; another pair or a colocated TE takes the request, or NoRouteError says
why; the pair is used again once the link is back. The JE's registry reads the links from the decode TEs'
heartbeats, a hand-off over a link that went down is computed on the decode TE, and /metrics shows the links."""
from __future__ import annotations

import time

import pytest
import zmq

from meshserve.entrypoints.openai.metrics import ServerMetrics
from meshserve.router.engine_registry import EngineRegistry
from meshserve.router.routing import POLICIES, LoadTracker, NoRouteError, RoutingPolicy, TELoad, TEView, route_health
from meshserve.wire.client import EngineStats
from meshserve.wire.heartbeat import EngineHeartbeat
from meshserve.wire.kv import LinkState, LinkStatus

PROMPT = list(range(64))  # long prompt, short output: pd_aware and combined disaggregate


def te(name: str, role: str, group: str = "pd", down: tuple[str, ...] = (), **load) -> TEView:
    return TEView(name, role, group, TELoad(**load), down_links=frozenset(down))


def pairs(policy: str, tes: list[TEView], n: int = 8) -> set[tuple[str | None, str | None]]:
    router = RoutingPolicy(policy)
    return {(d.prefill, d.decode) if d.kind == "disaggregated" else (d.te, None)
            for d in (router.route(PROMPT, tes, max_tokens=4) for _ in range(n))}


@pytest.mark.parametrize("policy", POLICIES)
def test_no_policy_pairs_a_prefill_te_with_a_decode_te_whose_link_to_it_is_down(policy):
    up = [te("p0", "prefill"), te("p1", "prefill"), te("d0", "decode"), te("d1", "decode", kv_usage=0.5)]
    assert ("p0", "d0") in pairs(policy, up, 16)
    # d0, the least loaded decode TE, cannot pull from p0: p0 goes with d1, p1 still with d0
    cut = [te("p0", "prefill"), te("p1", "prefill"), te("d0", "decode", down=("p0",)),
           te("d1", "decode", kv_usage=0.5)]
    chosen = pairs(policy, cut, 16)
    assert ("p0", "d0") not in chosen
    assert chosen <= {("p0", "d1"), ("p1", "d0"), ("p1", "d1")}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefill_te_no_decode_te_can_pull_from_takes_no_request(policy):
    tes = [te("p0", "prefill"), te("p1", "prefill"), te("d0", "decode", down=("p0",))]
    assert pairs(policy, tes) == {("p1", "d0")}
    with_colocated = [te("p0", "prefill"), te("d0", "decode", down=("p0",)), te("c0", "colocated", group="main")]
    assert pairs(policy, with_colocated) == {("c0", None)}


def test_with_every_link_down_and_nothing_else_routing_says_why():
    tes = [te("p0", "prefill"), te("d0", "decode", down=("p0",))]
    with pytest.raises(NoRouteError, match="KV links down: p0 -> d0"):
        RoutingPolicy("round_robin").route(PROMPT, tes)
    assert RoutingPolicy().route_to("p0", tes, "pinned") is None
    health = route_health(tes)
    assert not health.routable and health.pd_groups["pd"] == {"prefill": [], "decode": ["d0"]}
    assert health.missing == ["group pd: the KV links of every live prefill TE are down"]


def test_the_pair_is_used_again_once_the_link_is_back():
    router = RoutingPolicy("round_robin")
    down = [te("p0", "prefill"), te("d0", "decode", down=("p0",)), te("c0", "colocated", group="main")]
    assert {router.route(PROMPT, down).kind for _ in range(4)} == {"colocated"}
    back = [te("p0", "prefill"), te("d0", "decode"), te("c0", "colocated", group="main")]
    decisions = [router.route(PROMPT, back) for _ in range(4)]
    assert ("p0", "d0") in {(d.prefill, d.decode) for d in decisions}
    assert route_health(back).routable and route_health(back).pd_groups["pd"]["prefill"] == ["p0"]


# ---------------------------------------------------------------- the JE's registry
def heartbeat(name: str, role: str, links: list[LinkStatus] = ()) -> EngineHeartbeat:
    return EngineHeartbeat(name=name, role=role, group="pd", input_addr=f"inproc://{name}", kv_events_addr="",
                               model="m", max_model_len=4096, block_size=16, attn_tp=1, attn_dp=1,
                               stats=EngineStats(links=list(links)))


def link(prefill: str, state: LinkState, decode: str = "d0", since: float | None = None) -> LinkStatus:
    return LinkStatus(decode=decode, prefill=prefill, state=state, since=time.time() if since is None else since,
                          rtt_s=0.002,
                          consecutive_failures=2 if state is LinkState.DOWN else 0, probes=10,
                          probe_failures=2)


@pytest.fixture
def registry():
    ctx = zmq.Context()
    reg = EngineRegistry(ctx, None, LoadTracker())
    yield reg
    reg.close()
    ctx.term()


def test_the_registry_follows_the_links_decode_tes_report(registry):
    now = time.monotonic()
    for name, role in (("p0", "prefill"), ("p1", "prefill")):
        registry.on_heartbeat(heartbeat(name, role), now)
    registry.on_heartbeat(heartbeat("d0", "decode", [link("p0", LinkState.DOWN),
                                                     link("p1", LinkState.SATURATED)]), now)
    views = {v.name: v for v in registry.views()}
    assert views["d0"].down_links == frozenset({"p0"}) and views["p0"].down_links == frozenset()
    assert registry.link_down("d0", "p0") and not registry.link_down("d0", "p1")  # saturated links are used
    router = RoutingPolicy("round_robin")
    assert {router.route(PROMPT, list(views.values())).prefill for _ in range(4)} == {"p1"}
    registry.on_heartbeat(heartbeat("d0", "decode", [link("p0", LinkState.OK)]), now + 0.5)
    assert not registry.link_down("d0", "p0") and not registry.link_down("gone", "p0")
    assert {router.route(PROMPT, registry.views()).prefill for _ in range(4)} == {"p0", "p1"}


def test_a_link_down_to_a_prefill_te_that_restarted_since_is_not_held_against_the_new_one(registry):
    now = time.monotonic()
    registry.on_heartbeat(heartbeat("p0", "prefill"), now)
    went_down = time.time() - 60  # before p0's process registered: it was about the one before it
    registry.on_heartbeat(heartbeat("d0", "decode", [link("p0", LinkState.DOWN, since=went_down)]), now)
    assert not registry.link_down("d0", "p0")
    registry.on_heartbeat(heartbeat("d0", "decode", [link("p0", LinkState.DOWN)]), now + 0.5)
    assert registry.link_down("d0", "p0")  # down since the new one registered: it counts


# ---------------------------------------------------------------- /metrics
def test_metrics_show_each_link_s_state_rtt_and_probe_failures():
    metrics = ServerMetrics()
    metrics.update_engine_stats(EngineStats(links=[link("p0", LinkState.DOWN),
                                                       link("p1", LinkState.OK)]))
    text = metrics.render()[0].decode()
    assert 'meshserve_kv_link_state{decode="d0",prefill="p0",state="down"} 1.0' in text
    assert 'meshserve_kv_link_state{decode="d0",prefill="p0",state="ok"} 0.0' in text
    assert 'meshserve_kv_link_state{decode="d0",prefill="p1",state="ok"} 1.0' in text
    assert 'meshserve_kv_link_rtt_seconds{decode="d0",prefill="p1"} 0.002' in text
    assert 'meshserve_kv_link_probe_failures_total{decode="d0",prefill="p0"} 2.0' in text
    assert 'meshserve_kv_link_consecutive_probe_failures{decode="d0",prefill="p0"} 2.0' in text
