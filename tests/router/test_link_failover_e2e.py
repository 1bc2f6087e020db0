"""Link probing end to end (xdeepserve §6.1), on a real 2-prefill + 1-decode deployment of `meshserve te`
processes behind an in-process job executor.

(a) A link broken by an injected fault (`link_break` on the decode TE's ranks, for the link from one prefill
    TE) is found by the decode ranks' probes and reported down in the decode TE's heartbeat; the JE stops
    pairing that prefill TE with the decode TE (the other prefill TE takes the requests), every request
    completes with the tokens it gave before the fault, and once the fault is over a probe passes and the
    pair is used again.
(b) A slow data path (`link_delay` on pulls, not on probes: the decode side receives slowly) is reported
    saturated, never down, and the pair stays in use.
The faults reach the decode TE's ranks the way an operator's do: `fault.inject` through the JE to the TE's
master, which forwards them to its ranks.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from meshserve.wire.kv import LinkState, LinkStatus
from tests.router.deployment_processes import generate_all, running_deployment, token_ids

pytestmark = pytest.mark.timeout(240)

DECODE, P0, P1 = "pd-decode-0", "pd-prefill-0", "pd-prefill-1"
ENGINE = {"num_kv_blocks": 64}
HEARTBEAT_TIMEOUT_S = 10.0  # generous: a TE starved of CPU on a busy machine is not dropped
BREAK_S = 10.0  # how long the injected link break lasts once it first fires
DETECT_BOUND_S = 20.0  # probes every 2 s, down after 2 failures, heartbeats every 0.5 s: well within this
PROMPTS = [[(seed * 131 + i * 17) % 900 + 5 for i in range(24 + seed)] for seed in range(4)]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def je(tiny_model):
    model = str(tiny_model("deepseek_v3", seed=0))
    with running_deployment(model, "2p1d", engine=ENGINE, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, _):
        yield jes[0]


def links(je) -> dict[str, LinkStatus]:
    """The decode TE's links as its last heartbeat reported them, by prefill TE."""
    record = je.registry.get(DECODE)
    assert record is not None, "the decode TE was dropped"
    return {link.prefill: link for link in record.heartbeat.stats.links}


@contextlib.contextmanager
def recorded_routes(je):
    """The JE's routing decisions while the block runs, as (prefill or colocated TE, decode TE)."""
    decisions: list[tuple[str | None, str | None]] = []
    route = je.routing.route

    def recording(*args, **kwargs):
        decision = route(*args, **kwargs)
        decisions.append((decision.prefill or decision.te, decision.decode))
        return decision

    je.routing.route = recording
    try:
        yield decisions
    finally:
        del je.routing.route


async def wait_for(predicate, what: str, timeout_s: float, report=None):
    """`predicate`'s first true value within `timeout_s`; `report()` says what was seen instead."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f": {report()}" if report is not None else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{seen}")
        await asyncio.sleep(0.1)


async def inject(je, te: str, **fault) -> None:
    reply = await je.admin("fault.inject", {"te": te, "fault": fault})
    assert reply.ok, reply.error



def test_a_broken_link_is_found_routed_around_and_used_again_once_it_heals(je):
    async def scenario():
        # both prefill TEs hand off to the decode TE (round robin): its ranks link to both and probe them
        reference = token_ids(await generate_all(je, PROMPTS, MAX_TOKENS))
        assert all(len(t) == MAX_TOKENS for t in reference)
        await wait_for(lambda: {P0, P1} <= set(links(je)), "the decode TE to report both links", 10.0)
        assert {link.state for link in links(je).values()} <= {LinkState.OK, LinkState.SATURATED}

        await inject(je, DECODE, kind="link_break", peer=P0, duration_s=BREAK_S)
        injected = time.monotonic()
        # requests in flight meanwhile lose nothing: a pull over the broken link is computed on the decode TE
        assert token_ids(await generate_all(je, PROMPTS[:2], MAX_TOKENS)) == reference[:2]
        down = await wait_for(lambda: links(je)[P0].state is LinkState.DOWN and links(je)[P0],
                              "the link from the first prefill TE to be reported down", DETECT_BOUND_S)
        print(f"link down reported {time.monotonic() - injected:.1f} s after the fault was armed "
              f"(probe failures {down.probe_failures}: {down.last_error})")
        assert down.consecutive_failures >= 2 and "injected link_break" in down.last_error
        assert links(je)[P1].state is not LinkState.DOWN  # the other prefill TE's link is whole

        # while it is down, the JE pairs that prefill TE with nothing: the other one serves every request
        assert je.routing.route_to(P0, je.registry.views(), "test") is None
        with recorded_routes(je) as routes:
            assert token_ids(await generate_all(je, PROMPTS, MAX_TOKENS)) == reference
        assert links(je)[P0].state is LinkState.DOWN, "the fault ended before the check: lengthen BREAK_S"
        assert routes == [(P1, DECODE)] * len(PROMPTS)

        # the fault ends: a probe passes, the link is up again and the pair is used
        await wait_for(lambda: links(je)[P0].state is not LinkState.DOWN, "the link to come back",
                       BREAK_S + DETECT_BOUND_S)
        decision = je.routing.route_to(P0, je.registry.views(), "test")
        assert decision is not None and (decision.prefill, decision.decode) == (P0, DECODE)
        with recorded_routes(je) as routes:
            assert token_ids(await generate_all(je, PROMPTS, MAX_TOKENS)) == reference
        assert (P0, DECODE) in routes

    asyncio.run(scenario())


def test_a_slow_decode_side_is_reported_saturated_not_down(je):
    async def scenario():
        # both links in use (round robin: each prefill TE hands off to the decode TE), reported, neither down
        await generate_all(je, PROMPTS, MAX_TOKENS)
        await wait_for(lambda: {P0, P1} <= set(links(je))
                       and all(link.state is not LinkState.DOWN for link in links(je).values()),
                       "every link up before the test", BREAK_S + DETECT_BOUND_S, report=lambda: links(je))
        pulls_before = links(je)[P1].pulls
        # every pull from the second prefill TE takes 3 s more (past the 2 s stall threshold); probes do not
        await inject(je, DECODE, kind="link_delay", peer=P1, delay_s=3.0, duration_s=6.0)
        seen: set[LinkState] = set()
        done = asyncio.Event()

        async def watch():
            while not done.is_set():
                seen.add(links(je)[P1].state)
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        outputs = await generate_all(je, PROMPTS, MAX_TOKENS)  # round robin: half of them pull from P1
        await wait_for(lambda: links(je)[P1].slow_pulls >= 1 and LinkState.SATURATED in seen,
                       "the slow link to be reported saturated", 15.0)
        done.set()
        await watcher
        assert all(len(t) == MAX_TOKENS for t in token_ids(outputs))
        link = links(je)[P1]
        assert LinkState.DOWN not in seen and link.consecutive_failures == 0
        assert link.pulls > pulls_before and link.pull_failures == 0  # slow, but every pull went through
        decision = je.routing.route_to(P1, je.registry.views(), "test")  # a saturated link is still used
        assert decision is not None and decision.decode == DECODE

    asyncio.run(scenario())
