"""Link states (xdeepserve §6.1): saturation (probes pass, pulls are slow or wait for blocks) is told apart from
a link fault (probes fail), on a fake clock; then the P/D connector's scheduler half feeding its monitor from
what it orders and the ranks' reports."""
from __future__ import annotations

from meshserve.core.link_monitor import LinkMonitor
from meshserve.wire.kv import (
    KVConnectorReport,
    KVPullDone,
    LinkProbe,
    LinkState,
    LinkStatus,
    down_prefills,
    merge_links,
)
from tests.core.test_scheduler import FakeWorker, prompt_of
from tests.core.test_scheduler_pd import consumer, pd, pd_scheduler, prefill, producer, take_pulls


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def monitor(**kwargs) -> tuple[LinkMonitor, Clock]:
    clock = Clock()
    return LinkMonitor("d", clock=clock, **kwargs), clock


def states(mon: LinkMonitor, stalled: dict[str, float] | None = None) -> dict[str, LinkState]:
    return {s.prefill: s.state for s in mon.statuses(stalled)}


# ---------------------------------------------------------------- down
def test_a_link_is_down_after_consecutive_failed_probes_and_ok_after_one_that_passes():
    mon, _ = monitor(down_after=2)
    mon.on_probe("p", "0<p/rank0", True, 0.001)
    assert states(mon) == {"p": LinkState.OK}
    mon.on_probe("p", "0<p/rank0", False, 2.0, "TransferError: timed out")
    assert states(mon) == {"p": LinkState.OK}  # one failure is not a fault yet
    mon.on_probe("p", "0<p/rank0", False, 2.0, "TransferError: connection refused")
    (status,) = mon.statuses()
    assert status.state is LinkState.DOWN and status.consecutive_failures == 2
    assert status.last_error == "TransferError: connection refused" and (status.probes, status.probe_failures) == (3, 2)
    mon.on_probe("p", "0<p/rank0", True, 0.001)
    assert states(mon) == {"p": LinkState.OK}


def test_failures_of_different_rank_pairs_do_not_add_up_but_any_pair_down_downs_the_link():
    mon, _ = monitor(down_after=2)
    mon.on_probe("p", "0<p/rank0", False, 2.0, "x")
    mon.on_probe("p", "1<p/rank1", False, 2.0, "x")
    assert states(mon) == {"p": LinkState.OK}
    mon.on_probe("p", "1<p/rank1", False, 2.0, "x")
    mon.on_probe("p", "0<p/rank0", True, 0.001)
    assert states(mon) == {"p": LinkState.DOWN}


def test_pull_failures_alone_never_make_a_link_down():
    mon, _ = monitor(down_after=2)
    for _ in range(5):
        mon.on_pull("p", 0.01, "TransferError: checksum mismatch")
    (status,) = mon.statuses()
    assert status.state is LinkState.OK and status.pull_failures == 5


# ---------------------------------------------------------------- saturated
def test_a_pull_in_flight_or_waiting_too_long_with_probes_passing_is_saturation_not_down():
    mon, _ = monitor(stall_s=2.0)
    mon.note("p")
    mon.on_probe("p", "0<p/rank0", True, 0.001)
    assert states(mon, {"p": 1.0}) == {"p": LinkState.OK}
    assert states(mon, {"p": 30.0}) == {"p": LinkState.SATURATED}  # however long it waits
    assert states(mon) == {"p": LinkState.OK}  # it went through


def test_a_slow_pull_keeps_its_link_saturated_for_the_window():
    mon, clock = monitor(stall_s=2.0, slow_window_s=10.0)
    mon.on_pull("p", 5.0)
    (status,) = mon.statuses()
    assert status.state is LinkState.SATURATED and status.slow_pulls == 1
    clock.now += 11.0
    mon.on_probe("p", "0<p/rank0", True, 0.001)
    assert states(mon) == {"p": LinkState.OK}


def test_a_probe_that_passes_slowly_is_saturation():
    mon, _ = monitor(slow_probe_s=0.5)
    mon.on_probe("p", "0<p/rank0", True, 1.2)
    assert states(mon) == {"p": LinkState.SATURATED}


def test_failing_probes_make_a_saturated_link_down():
    mon, _ = monitor(down_after=2)
    mon.on_pull("p", 5.0)
    for _ in range(2):
        mon.on_probe("p", "0<p/rank0", False, 2.0, "x")
    assert states(mon, {"p": 30.0}) == {"p": LinkState.DOWN}


def test_state_changes_carry_their_time_and_forgotten_links_go():
    mon, clock = monitor(forget_s=30.0)
    mon.on_probe("p", "0<p/rank0", True, 0.001)
    (first,) = mon.statuses()
    for _ in range(2):
        mon.on_probe("p", "0<p/rank0", False, 2.0, "x")
    (down,) = mon.statuses()
    assert down.state is LinkState.DOWN and down.since >= first.since
    clock.now += 31.0
    assert mon.statuses({"p": 40.0}) and mon.state("p", 40.0) is LinkState.DOWN  # still stalled on it: kept
    assert mon.statuses() == [] and mon.state("p") is LinkState.OK


# ---------------------------------------------------------------- several DP groups, one TE
def test_merged_links_take_the_worst_group_and_add_up_counts():
    groups = [LinkStatus("d", "p", LinkState.OK, since=1.0, rtt_s=0.002, probes=3, pulls=2),
              LinkStatus("d", "p", LinkState.DOWN, since=5.0, rtt_s=0.5, consecutive_failures=2, probes=4,
                         probe_failures=2, last_error="refused"),
              LinkStatus("d", "q", LinkState.SATURATED, slow_pulls=1)]
    p, q = merge_links(groups)
    assert (p.prefill, p.state, p.since, p.rtt_s, p.consecutive_failures) == ("p", LinkState.DOWN, 5.0, 0.5, 2)
    assert (p.probes, p.probe_failures, p.pulls, p.last_error) == (7, 2, 2, "refused")
    assert q.state is LinkState.SATURATED
    assert down_prefills([p, q]) == frozenset({"p"})
    assert groups[0].state is LinkState.OK and groups[0].probes == 3  # the inputs are left as they were


# ---------------------------------------------------------------- the P/D connector's scheduler half
def hand_offs(n: int) -> dict:
    p_sched, p_ex = pd_scheduler("producer", num_blocks=32), FakeWorker()
    return prefill(p_sched, p_ex, [producer(f"r{i}", prompt_of(i, 10)) for i in range(n)])


def link_states(d_sched) -> dict[str, LinkState]:
    return {s.prefill: s.state for s in d_sched.stats().links}


def test_the_decode_connector_reports_waiting_pulls_as_saturation_and_failed_probes_as_down():
    offs = hand_offs(2)
    d_sched = pd_scheduler("consumer", num_blocks=4)  # one request at a time: the second waits for blocks
    conn = pd(d_sched)
    clock = Clock()
    conn.links.clock = clock
    for i in range(2):
        d_sched.add_request(consumer(f"r{i}", prompt_of(i, 10), offs[f"r{i}"].new_token_ids[0],
                                     offs[f"r{i}"].kv_transfer_params))
    d_sched.schedule()
    (order,) = take_pulls(d_sched)
    assert link_states(d_sched) == {"prefill": LinkState.OK}
    clock.now += 5.0  # the pull has been in flight, and r1 waiting for blocks, past the stall threshold
    assert link_states(d_sched) == {"prefill": LinkState.SATURATED}
    # the ranks' probes name the prefill rank the pull was ordered from; one passing keeps it saturated
    peer = order.sources[0].engine
    d_sched.update_connector_output(KVConnectorReport(rank=0, dp_rank=0, link_probes=[
        LinkProbe(peer=peer, ok=True, rtt_s=0.001), LinkProbe(peer="stranger/rank0", ok=False, rtt_s=2.0)]))
    (status,) = d_sched.stats().links
    assert status.state is LinkState.SATURATED and status.probes == 1
    for _ in range(2):
        d_sched.update_connector_output(KVConnectorReport(rank=0, dp_rank=0, link_probes=[
            LinkProbe(peer=peer, ok=False, rtt_s=2.0, error="TransferError: refused")]))
    assert link_states(d_sched) == {"prefill": LinkState.DOWN}
    # the pull fails too; the request is computed here, and the link stays down until a probe passes
    d_sched.update_connector_output(KVConnectorReport(rank=0, dp_rank=0, kv_pulls=[KVPullDone("r0", "refused")]))
    assert d_sched.stats().kv_pull_recomputed == 1
    (status,) = d_sched.stats().links
    assert status.state is LinkState.DOWN and (status.pulls, status.pull_failures) == (1, 1)
    d_sched.update_connector_output(KVConnectorReport(rank=0, dp_rank=0, link_probes=[
        LinkProbe(peer=peer, ok=True, rtt_s=0.001)]))
    assert link_states(d_sched) == {"prefill": LinkState.SATURATED}  # r1 still waits for blocks


def test_an_aborted_waiting_request_no_longer_counts_as_a_stall():
    offs = hand_offs(2)
    d_sched = pd_scheduler("consumer", num_blocks=4)
    conn = pd(d_sched)
    clock = Clock()
    conn.links.clock = clock
    for i in range(2):
        d_sched.add_request(consumer(f"r{i}", prompt_of(i, 10), offs[f"r{i}"].new_token_ids[0],
                                     offs[f"r{i}"].kv_transfer_params))
    d_sched.schedule()
    take_pulls(d_sched)
    d_sched.update_connector_output(KVConnectorReport(rank=0, dp_rank=0, kv_pulls=[KVPullDone("r0")]))
    clock.now += 5.0
    assert link_states(d_sched) == {"prefill": LinkState.SATURATED}  # r1 waits for r0's blocks
    d_sched.abort_requests(["r1"])
    clock.now += 11.0
    assert link_states(d_sched) == {"prefill": LinkState.OK}
