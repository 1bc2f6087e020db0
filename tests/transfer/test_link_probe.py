"""Link probing over a real transfer engine pair on loopback (xdeepserve §6.1): the probe op on the wire, a
decode engine probing the prefill engine it pulls from, injected link faults on both paths (hooked around the
pulling engine, as a worker does once such a fault is armed), the prober thread, and the P/D worker half
reporting probes of the links its pulls use."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from meshserve.transfer import BlockRef, LinkProber, TransferEngine, TransferError, TransferStatus, fault_hooks, wire
from meshserve.utils import faults
from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport, KVPull
from meshserve.worker.kv_connector.pd import PDConnectorWorker

pytestmark = pytest.mark.timeout(60)

BS = 4
WAIT_S = 15.0


def wait_until(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def no_faults_left():
    yield
    faults.switch().disarm()


@pytest.fixture
def pair():
    """A prefill engine with a KV region and a decode engine linked to it over `backend`."""
    engines = []

    def make(backend: str | None = "tcp") -> tuple[TransferEngine, TransferEngine]:
        prefill, decode = TransferEngine("pd-prefill-0/rank0"), TransferEngine("pd-decode-0/rank0")
        engines.extend([prefill, decode])
        fault_hooks.install(decode)  # the pulling side, where link faults fire
        prefill.allocate_region("kv", 2, 6, BS, (3,), torch.float32)
        decode.allocate_region("kv", 2, 6, BS, (3,), torch.float32)
        assert decode.link(prefill.name, prefill.descriptor("kv"), backend=backend) == (backend or "shm")
        return prefill, decode

    yield make
    for engine in engines:
        engine.close()


def pull(decode: TransferEngine, prefill: TransferEngine):
    return decode.transfer(BlockRef("kv", (1,), engine=prefill.name), BlockRef("kv", (2,)))


# ---------------------------------------------------------------- the wire
def test_the_probe_op_round_trips_and_refuses_oversized_payloads():
    probe = wire.Probe(nbytes=wire.MAX_PROBE_BYTES)
    assert wire.decode_request(wire.encode(probe)) == probe
    with pytest.raises(wire.HeaderError):
        wire.decode_request(msgspec.msgpack.encode({"op": "probe", "nbytes": wire.MAX_PROBE_BYTES + 1}))


# ---------------------------------------------------------------- TransferEngine.probe
@pytest.mark.parametrize("backend", ["tcp", None])  # None: shared memory on this host
def test_a_probe_reaches_the_prefill_engine_over_the_pull_path(pair, backend):
    prefill, decode = pair(backend)
    rtt = decode.probe(prefill.name)
    assert 0 < rtt < 2.0  # within the probe's own timeout
    with pytest.raises(ValueError, match="not linked"):
        decode.probe("pd-prefill-9/rank0")


def test_a_probe_of_a_peer_that_is_gone_fails(pair):
    prefill, decode = pair("tcp")
    prefill.close()
    with pytest.raises(TransferError, match="cannot connect"):
        decode.probe(prefill.name, timeout=1.0)


def test_a_probe_is_not_held_up_by_a_slow_pull(pair):
    """A pull stalled in the peer's server (saturation) delays the data, not the probe beside it."""
    prefill, decode = pair("tcp")
    gate = threading.Event()
    prefill.server.fault_hook = lambda i, payload: (gate.wait(WAIT_S), payload)[1]
    handle = pull(decode, prefill)
    try:
        decode.probe(prefill.name, timeout=1.0)
        assert decode.status(handle) is TransferStatus.PENDING
    finally:
        gate.set()
    assert decode.wait(handle, WAIT_S).status is TransferStatus.DONE


# ---------------------------------------------------------------- injected link faults
def test_a_link_break_fails_pulls_and_probes_of_its_peer_only(pair):
    prefill, decode = pair("tcp")
    other = TransferEngine("pd-prefill-1/rank0")
    try:
        other.allocate_region("kv", 2, 6, BS, (3,), torch.float32)
        decode.link(other.name, other.descriptor("kv"), backend="tcp")
        faults.arm(faults.Fault(kind=faults.FaultKind.LINK_BREAK, peer="pd-prefill-0"))
        with pytest.raises(TransferError, match="Connection reset"):
            decode.probe(prefill.name)
        done = decode.wait(pull(decode, prefill), WAIT_S)
        assert done.status is TransferStatus.FAILED and "Connection reset" in done.error
        decode.probe(other.name)  # the other prefill engine's link is whole
        assert decode.wait(pull(decode, other), WAIT_S).status is TransferStatus.DONE
    finally:
        other.close()


def test_a_link_break_ends_after_its_duration(pair):
    prefill, decode = pair("tcp")
    faults.arm(faults.Fault(kind=faults.FaultKind.LINK_BREAK, peer=f"@{prefill.tcp_address[0]}:"
                            f"{prefill.tcp_address[1]}", duration_s=0.3))  # matched by address
    with pytest.raises(TransferError):
        decode.probe(prefill.name)

    def passes() -> bool:
        try:
            decode.probe(prefill.name)
        except TransferError:
            return False
        return True

    wait_until(passes, "the link to come back")


def test_a_link_delay_holds_pulls_but_not_probes(pair):
    prefill, decode = pair("tcp")
    faults.arm(faults.Fault(kind=faults.FaultKind.LINK_DELAY, peer="pd-prefill-0", delay_s=1.5, duration_s=0.5))
    fired = len(faults.switch().fired)
    handle = pull(decode, prefill)
    wait_until(lambda: len(faults.switch().fired) > fired, "the delay to start")
    decode.probe(prefill.name, timeout=1.0)
    assert decode.status(handle) is TransferStatus.PENDING  # the pull still sleeps
    assert decode.wait(handle, WAIT_S).status is TransferStatus.DONE


# ---------------------------------------------------------------- the prober thread
class FakeLink:
    def __init__(self) -> None:
        self.up = True
        self.calls: list[str] = []

    def __call__(self, peer: str, timeout: float) -> float:
        self.calls.append(peer)
        if not self.up:
            raise TransferError(f"cannot connect to {peer}")
        return 0.001


def test_the_prober_probes_watched_peers_periodically():
    link = FakeLink()
    prober = LinkProber(link, interval_s=0.05, timeout_s=0.5)
    try:
        prober.watch("a")
        seen = []
        wait_until(lambda: (seen.extend(prober.take()), len(seen) >= 3)[1], "three periodic probes")
        assert all(r.peer == "a" and r.ok and r.rtt_s == 0.001 for r in seen)
    finally:
        prober.close()


def test_the_prober_probes_a_peer_at_once_when_asked_and_forgets_on_request():
    link = FakeLink()
    link.up = False
    prober = LinkProber(link, interval_s=3600.0, timeout_s=0.5)  # nothing periodic comes within the test
    try:
        prober.watch("b")
        prober.probe_now("b")
        (failed,) = wait_until(prober.take, "the asked-for probe")
        assert failed.peer == "b" and not failed.ok and "cannot connect" in failed.error
        wait_until(lambda: prober.failing_for("b") > 0, "the failing time to grow")
        prober.forget("b")
        prober.probe_now("b")  # forgotten: never probed again
        link.up = True
        prober.watch("a")
        prober.probe_now("a")
        (passed,) = wait_until(prober.take, "a probe of the watched peer")
        assert passed.peer == "a" and passed.ok and prober.failing_for("a") == 0
        assert link.calls == ["b", "a"]
    finally:
        prober.close()


def test_the_prober_reports_a_real_link_going_down(pair):
    prefill, decode = pair("tcp")
    prober = LinkProber(decode.probe, interval_s=0.05, timeout_s=1.0)
    try:
        prober.watch(prefill.name)
        assert wait_until(prober.take, "a probe")[0].ok
        prefill.close()
        failed = wait_until(lambda: [r for r in prober.take() if not r.ok], "a failed probe")
        assert failed[0].peer == prefill.name and failed[0].error.startswith("TransferError")
        assert wait_until(lambda: prober.failing_for(prefill.name) > 0, "failing time to grow")
    finally:
        prober.close()


# ---------------------------------------------------------------- the P/D worker half
def make_worker(name: str) -> PDConnectorWorker:
    return PDConnectorWorker(name, "127.0.0.1", "tcp", num_layers=2, num_blocks=6, block_size=BS,
                             entry_shape=(3,), dtype=torch.float32, device=torch.device("cpu"), tp_rank=0)


def test_a_failed_pull_has_its_link_probed_at_once_and_reported():
    prefill, decode = make_worker("pd-prefill-0/rank0"), make_worker("pd-decode-0/rank0")
    fault_hooks.install(decode.engine)
    decode.prober.interval_s = 3600.0  # no periodic probe: what comes is the one the failure asked for
    try:
        report = KVConnectorReport(rank=0, dp_rank=0)

        def order(req_id: str) -> None:
            decode.start_load_kv(KVConnectorMetadata(kv_pulls=[
                KVPull(req_id=req_id, src_block_ids=[1], dst_block_ids=[0], sources=[prefill.region])]))

        order("r1")
        wait_until(lambda: (decode.get_finished(report), report.kv_pulls)[1], "the first pull")
        assert report.kv_pulls[0].error is None and not report.link_probes
        faults.arm(faults.Fault(kind=faults.FaultKind.LINK_BREAK, peer="pd-prefill-0"))
        order("r2")
        report = KVConnectorReport(rank=0, dp_rank=0)
        wait_until(lambda: (decode.get_finished(report), report.link_probes)[1], "the probe of the broken link")
        assert [p.req_id for p in report.kv_pulls] == ["r2"] and report.kv_pulls[0].error
        (probe,) = report.link_probes
        assert probe.peer == "pd-prefill-0/rank0" and not probe.ok and "Connection reset" in probe.error
    finally:
        decode.close()
        prefill.close()
