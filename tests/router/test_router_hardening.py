"""The job executor against bad peers and dead TEs: garbage frames do not stop its reader, a process
without the cluster secret cannot register as a TE or message one, a dead reader makes it unhealthy,
and /health says whether each kind of request can be routed (503 with the missing part when none can)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
import zmq
from starlette.testclient import TestClient

from meshserve.config import RouterConfig
from meshserve.entrypoints.openai.api_server import build_app
from meshserve.router.router import Router
from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.client import AdminReply, AdminRequest
from meshserve.wire.heartbeat import EngineHeartbeat
from meshserve.wire.sampling_params import SamplingParams
from tests.router.deployment_processes import kill_te, running_deployment

pytestmark = pytest.mark.timeout(300)

HEARTBEAT_TIMEOUT_S = 1.0
LONG_HEARTBEAT_TIMEOUT_S = 60.0  # far longer than a test waits: what /health sees before it comes from sockets
WRONG = b"an-attackers-guess"


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model("deepseek_v3", seed=0))


class FakeTE:
    """What a JE sees of a TE: heartbeats and outputs from a socket keyed by `secret` (None: the cluster's)."""

    def __init__(self, ctx: zmq.Context, je: Router, name: str, role: str, group: str,
                 secret: bytes | None = None) -> None:
        self.inbox = cluster_auth.server(ctx.socket(zmq.PULL), secret=secret)
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.heartbeat = EngineHeartbeat(name=name, role=role, group=group, input_addr=f"tcp://127.0.0.1:{port}",
                                         kv_events_addr="", model="m", max_model_len=4096, block_size=16,
                                         attn_tp=1, attn_dp=1)
        self.to_je = cluster_auth.client(ctx.socket(zmq.PUSH), secret=secret)
        self.to_je.connect(je.register_addr)
        self.outputs = cluster_auth.client(ctx.socket(zmq.PUSH), secret=secret)
        self.outputs.connect(je.output_addr)
        for sock in (self.inbox, self.to_je, self.outputs):
            sock.setsockopt(zmq.LINGER, 0)

    def beat(self) -> None:
        self.heartbeat.timestamp = time.time()
        self.to_je.send(codec.encode(self.heartbeat), zmq.NOBLOCK)


@contextlib.contextmanager
def fake_tes(model: str, spec: list[tuple[str, str, str, bytes | None]],
             heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S):
    je = Router(RouterConfig(model=model, heartbeat_timeout_s=heartbeat_timeout_s))
    ctx = zmq.Context()
    try:
        yield je, {name: FakeTE(ctx, je, name, role, group, secret) for name, role, group, secret in spec}
    finally:
        ctx.destroy(0)
        je.shutdown()


async def beat_until(je: Router, tes, predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for te in tes:
            te.beat()
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return False


def live(je: Router) -> set[str]:
    return {r.name for r in je.registry.live()}


def test_garbage_frames_do_not_stop_the_reader(model, caplog):
    caplog.set_level(logging.WARNING)

    async def scenario():
        with fake_tes(model, [("main-0", "colocated", "main", None)]) as (je, tes):
            await je.start()
            te = tes["main-0"]
            for frame in (b"", b"\xc1\xc1", b"\x92\xa7Nothing\x80", codec.encode(Shutdown())[:-1]):
                te.to_je.send(frame)
                te.outputs.send(frame)
            assert await beat_until(je, [te], lambda: live(je) == {"main-0"})
            assert je.bad_frames >= 8 and je.healthy
            assert je.reader.is_alive()
            assert any("does not decode" in r.getMessage() for r in caplog.records)

    asyncio.run(scenario())


def test_a_process_without_the_secret_cannot_register_as_a_te(model):
    async def scenario():
        with fake_tes(model, [("intruder", "colocated", "main", WRONG),
                              ("member", "colocated", "main", None)]) as (je, tes):
            await je.start()
            assert await beat_until(je, tes.values(), lambda: "member" in live(je))
            await beat_until(je, tes.values(), lambda: False, timeout_s=1.0)  # twenty of the intruder's beats
            assert live(je) == {"member"}

    asyncio.run(scenario())


def test_a_dead_reader_makes_the_job_executor_unhealthy(model, monkeypatch):
    async def scenario():
        with fake_tes(model, [("main-0", "colocated", "main", None)]) as (je, tes):
            await je.start()
            assert await beat_until(je, tes.values(), lambda: je.healthy)

            def broken() -> None:
                raise RuntimeError("a bug in the reader loop")

            monkeypatch.setattr(je.registry, "apply_subscription_changes", broken)
            for _ in range(100):  # bounded: 5 s
                if not je.reader.is_alive():
                    break
                await asyncio.sleep(0.05)
            assert not je.healthy and "reader thread stopped" in je.dead_error
            with TestClient(build_app(je)) as client:
                health = client.get("/health")
            assert health.status_code == 503 and health.json()["reader"].startswith("stopped")

    asyncio.run(scenario())


def test_health_says_what_cannot_be_routed_when_the_decode_te_stops(model):
    """The finding: /health said ok for 70 s while the only decode TE was dead and every request failed."""
    with fake_tes(model, [("pd-prefill-0", "prefill", "pd", None), ("pd-decode-0", "decode", "pd", None)]) as (je, tes):
        with TestClient(build_app(je)) as client:
            client.portal.call(je.start)  # as the server does: take heartbeats on the app's loop
            assert client.get("/health").status_code == 503  # nothing registered yet
            for _ in range(100):  # bounded: 5 s
                for te in tes.values():
                    te.beat()
                if client.get("/health").status_code == 200:
                    break
                time.sleep(0.05)
            body = client.get("/health").json()
            assert body["status"] == "ok" and body["disaggregated"]["routable"]
            stopped = time.monotonic()
            while time.monotonic() - stopped < 3 * HEARTBEAT_TIMEOUT_S:  # only the prefill TE beats on
                tes["pd-prefill-0"].beat()
                health = client.get("/health")
                if health.status_code == 503:
                    break
                time.sleep(0.05)
            assert health.status_code == 503
            assert time.monotonic() - stopped < HEARTBEAT_TIMEOUT_S + 1.0
            body = health.json()
            assert body["missing"] == ["group pd: no live decode TE"]
            assert body["disaggregated"]["groups"]["pd"] == {"prefill": ["pd-prefill-0"], "decode": []}
            assert "no live decode TE" in body["error"]["message"]


def test_health_follows_a_te_whose_socket_closed_before_its_heartbeats_time_out(model):
    """The finding: /health said ok for ~5 s after a decode TE died, until its heartbeats timed out. A dead
    process's sockets close at once: the JE's link to it drops, and routing and /health follow then."""
    spec = [("pd-prefill-0", "prefill", "pd", None), ("pd-decode-0", "decode", "pd", None)]
    with fake_tes(model, spec, heartbeat_timeout_s=LONG_HEARTBEAT_TIMEOUT_S) as (je, tes):
        with TestClient(build_app(je)) as client:
            client.portal.call(je.start)
            for _ in range(100):  # bounded: 5 s
                for te in tes.values():
                    te.beat()
                if client.get("/health").status_code == 200:
                    break
                time.sleep(0.05)
            assert client.get("/health").json()["status"] == "ok"
            tes["pd-decode-0"].inbox.close(0)  # what a kill -9 does to its sockets; it beats no more
            for _ in range(200):  # bounded: 10 s, a sixth of the heartbeat timeout
                tes["pd-prefill-0"].beat()
                health = client.get("/health")
                if health.status_code == 503:
                    break
                time.sleep(0.05)
            assert health.status_code == 503
            assert health.json()["missing"] == ["group pd: no live decode TE"]
            # seen by the socket, not the heartbeat timeout: the TE is still registered, only not routable
            assert je.registry.get("pd-decode-0") is not None and not je.registry.expired(time.monotonic())
            assert "pd-decode-0" not in {r.name for r in je.registry.routable()}


# ---------------------------------------------------------------- a real TE (`meshserve te`)
def admin_snapshot(input_addr: str, secret: bytes | None, timeout_s: float) -> AdminReply | None:
    """Send a TE a kv.snapshot request from sockets keyed by `secret`; its reply, or None."""
    ctx = zmq.Context()
    try:
        inbox = cluster_auth.server(ctx.socket(zmq.PULL), secret=secret)
        reply_to = f"tcp://127.0.0.1:{inbox.bind_to_random_port('tcp://127.0.0.1')}"
        out = cluster_auth.client(ctx.socket(zmq.PUSH), secret=secret)
        out.connect(input_addr)
        out.send(codec.encode(AdminRequest(query_id=99, op="kv.snapshot", reply_to=reply_to)))
        return codec.decode(inbox.recv()) if inbox.poll(int(timeout_s * 1000)) else None
    finally:
        ctx.destroy(0)


def test_a_process_without_the_secret_cannot_message_a_te(model):
    with running_deployment(model, "colocated", heartbeat_timeout_s=10.0) as (jes, procs):
        je = jes[0]
        input_addr = je.registry.live()[0].heartbeat.input_addr
        assert admin_snapshot(input_addr, WRONG, timeout_s=3.0) is None
        reply = admin_snapshot(input_addr, None, timeout_s=30.0)
        assert reply is not None and reply.ok and reply.query_id == 99

        async def generate() -> list[int]:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            final = None
            async for out in je.generate(None, [5, 6, 7, 8], params, "after-the-intruder"):
                final = out
            return list(final.outputs[0].token_ids)

        assert len(asyncio.run(asyncio.wait_for(generate(), 120))) == 4  # the TE serves on
        assert all(proc.poll() is None for proc in procs.values())


def test_route_health_names_the_missing_part_of_each_kind():
    from meshserve.router.routing import TELoad, TEView, route_health

    def view(name, role, group, healthy=True):
        return TEView(name=name, role=role, group=group, load=TELoad(), healthy=healthy)

    known = {"main": "colocated", "pd": "prefill", "pd2": "decode"}
    health = route_health([view("c0", "colocated", "main"), view("p0", "prefill", "pd"),
                           view("d0", "decode", "pd", healthy=False)], known)
    assert health.routable and health.colocated == ["c0"]
    assert health.missing == ["group pd: no live decode TE", "group pd2: no live prefill and no live decode TE"]
    lost_colocated = route_health([view("p0", "prefill", "pd"), view("d0", "decode", "pd")], known)
    assert lost_colocated.routable and lost_colocated.missing[0] == "no live colocated TE"
    assert route_health([]).missing == ["no TE is registered"] and not route_health([]).routable


def test_health_says_a_killed_decode_te_is_gone_before_its_heartbeat_timeout(model):
    """kill -9 of a real decode TE in a 1p1d deployment: /health's routable set loses it while its heartbeats
    are still within their (long) timeout."""
    with running_deployment(model, "1p1d", heartbeat_timeout_s=LONG_HEARTBEAT_TIMEOUT_S) as (jes, procs):
        je = jes[0]

        async def health_after_kill() -> dict:
            await je.start()
            assert je.health()["status"] == "ok"
            kill_te(procs["pd-decode-0"])
            for _ in range(200):  # bounded: 20 s, a third of the heartbeat timeout
                if not je.healthy:
                    break
                await asyncio.sleep(0.1)
            return je.health()

        health = asyncio.run(health_after_kill())
        assert health["status"] == "unavailable" and health["missing"] == ["group pd: no live decode TE"]
        assert je.registry.get("pd-decode-0") is not None  # not dropped: its heartbeat timeout has not passed
        assert not je.registry.expired(time.monotonic())
