"""The job executor's side of autoscaling, against fake TEs: a request that arrives while no TE exists is held
and answered once one registers (or fails with a 503-type error after hold_s); the JE stays healthy meanwhile
when a cluster manager can scale from zero; its JobExecutorReports reach the manager with held counts and
TTFT / TPOT samples; a draining TE finishes its streams but gets no new job."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq

from meshserve.config import RouterConfig
from meshserve.router.router import Router, RouteUnavailableError
from meshserve.router.routing import ANY_POOL
from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.client import AddRequest, EngineOutputs, RequestDelta
from meshserve.wire.cluster import GroupDemand, JobExecutorReport
from meshserve.wire.heartbeat import EngineHeartbeat
from meshserve.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model("deepseek_v3", seed=0))


class FakeTE:
    """A TE as the JE sees it: heartbeats out, requests in, outputs sent by hand (no engine behind it)."""

    def __init__(self, ctx: zmq.Context, je: Router, name: str, role: str = "colocated", group: str = "main"):
        self.inbox = cluster_auth.server(ctx.socket(zmq.PULL))
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.heartbeat = EngineHeartbeat(name=name, role=role, group=group, input_addr=f"tcp://127.0.0.1:{port}",
                                         kv_events_addr="", model="m", max_model_len=4096, block_size=16,
                                         attn_tp=1, attn_dp=1)
        self.to_je = cluster_auth.client(ctx.socket(zmq.PUSH))
        self.to_je.connect(je.register_addr)
        self.outputs = cluster_auth.client(ctx.socket(zmq.PUSH))
        self.outputs.connect(je.output_addr)
        for sock in (self.inbox, self.to_je, self.outputs):
            sock.setsockopt(zmq.LINGER, 0)
        self.beating = False

    def beat(self) -> None:
        self.heartbeat.timestamp = time.time()
        self.to_je.send(codec.encode(self.heartbeat), zmq.NOBLOCK)

    async def next_request(self, timeout_s: float = 10.0) -> AddRequest:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            while self.inbox.poll(0):
                item = codec.decode(self.inbox.recv())
                if isinstance(item, AddRequest):
                    return item
            await asyncio.sleep(0.01)
        raise AssertionError(f"{self.heartbeat.name} received no request")

    def requests(self) -> list[AddRequest]:
        """The requests that arrived and were not read yet (KV snapshot queries skipped)."""
        items = []
        while self.inbox.poll(0):
            items.append(codec.decode(self.inbox.recv()))
        return [i for i in items if isinstance(i, AddRequest)]

    def answer(self, req_id: str, token_ids: list[int], finish_reason: str | None = None) -> None:
        delta = RequestDelta(req_id=req_id, new_token_ids=token_ids, finish_reason=finish_reason,
                                 num_prompt_tokens=len(PROMPT))
        self.outputs.send(codec.encode(EngineOutputs(deltas=[delta], timestamp=time.time())))


class Manager:
    """Stands in for the cluster manager: a PULL socket that JEs report to."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = cluster_auth.server(ctx.socket(zmq.PULL))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.reports: list[JobExecutorReport] = []

    def take(self) -> list[JobExecutorReport]:
        while self.sock.poll(0):
            item = codec.decode(self.sock.recv())
            assert isinstance(item, JobExecutorReport)
            self.reports.append(item)
        return self.reports

    async def wait_for(self, predicate, timeout_s: float = 10.0) -> JobExecutorReport:
        """The first report (from now on) whose demand satisfies `predicate`."""
        seen = len(self.take())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for report in self.take()[seen:]:
                if predicate(report):
                    return report
            seen = len(self.reports)
            await asyncio.sleep(0.05)
        raise AssertionError("no such report reached the manager")


def demand_of(report: JobExecutorReport, pool: str) -> GroupDemand | None:
    return next((g for g in report.groups if g.group == pool), None)


@contextlib.contextmanager
def cluster(model: str, **router_settings):
    """A JE reporting to a fake manager; yields (je, manager, make_te)."""
    ctx = zmq.Context()
    manager = Manager(ctx)
    je = Router(RouterConfig(model=model, manager_addrs=(manager.addr,), name="je-test",
                             http_addr="http://127.0.0.1:1", **router_settings))
    try:
        yield je, manager, lambda name, **kw: FakeTE(ctx, je, name, **kw)
    finally:
        je.shutdown()
        ctx.destroy(0)


@contextlib.asynccontextmanager
async def beating(tes):
    """Heartbeats every 0.1 s from each TE whose `beating` is set, on the test's loop (sockets stay on one thread)."""
    async def beat_forever():
        while True:
            for te in tes:
                if te.beating:
                    te.beat()
            await asyncio.sleep(0.1)

    task = asyncio.ensure_future(beat_forever())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def generate(je: Router, request_id: str, max_tokens: int = 3):
    final = None
    async for out in je.generate(None, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0), request_id):
        final = out
    return final


def test_a_request_with_no_te_is_held_until_one_registers_and_reports_show_it(model):
    with cluster(model, hold_s=30.0) as (je, manager, make_te):
        async def scenario():
            await je.start()
            # no TE at all: a JE that can have its pools scaled from zero is healthy, and says why
            assert je.healthy and je.dead_error is None
            health = je.health()
            assert health["status"] == "ok" and "from zero" in health["scaling"]
            assert je.max_model_len > 0  # requests are admitted by the model's context length meanwhile
            work = asyncio.ensure_future(generate(je, "r0"))
            await until(lambda: je.health()["held"] == 1)
            # the manager hears of it: this JE has never seen a TE, so the request waits for any pool
            report = await manager.wait_for(lambda r: (demand_of(r, ANY_POOL) or GroupDemand("")).held == 1)
            assert report.name == "je-test" and report.register_addr == je.register_addr and report.te_names == []
            assert report.http_addr == "http://127.0.0.1:1"
            held_at_registration = time.time()
            te = make_te("main-colocated-0")
            async with beating([te]):
                te.beating = True
                task = await te.next_request()
                # dispatched after the wait; the TE sees the request's arrival at the JE, so its wait counts
                assert task.arrival_time < held_at_registration
                assert task.prompt_token_ids == PROMPT and task.reply_to == je.output_addr
                assert je.health()["held"] == 0
                await asyncio.sleep(0.05)  # the first token a little later than the second: TPOT > 0
                te.answer(task.req_id, [11])
                await asyncio.sleep(0.05)
                te.answer(task.req_id, [12, 13], finish_reason="length")
                final = await asyncio.wait_for(work, 10)
                assert final.outputs[0].token_ids == [11, 12, 13]
                # TTFT counted from the arrival at the JE (the hold included), TPOT of the finished job
                samples = await manager.wait_for(lambda r: bool((demand_of(r, "main/colocated")
                                                                 or GroupDemand("")).tpot_s))
                pool = demand_of(samples, "main/colocated")
                assert samples.te_names == ["main-colocated-0"]
            reports = manager.take()
            pools = [demand_of(r, "main/colocated") for r in reports]
            assert sum(p.arrivals for p in pools if p) == 1
            ttft = [s for p in pools if p for s in p.ttft_s]
            assert len(ttft) == 1 and ttft[0] >= held_at_registration - task.arrival_time > 0  # the hold counts
            assert pool.tpot_s[0] > 0

        asyncio.run(scenario())


def test_a_held_request_fails_with_503_after_hold_s(model):
    with cluster(model, hold_s=0.5) as (je, _, _make_te):
        async def scenario():
            await je.start()
            started = time.monotonic()
            with pytest.raises(RouteUnavailableError, match=r"no TE could take the request within 0.5 s"):
                await asyncio.wait_for(generate(je, "r0"), 10)
            assert time.monotonic() - started >= 0.5  # held first, not refused at once
            assert je.health()["held"] == 0

        asyncio.run(scenario())


def test_without_hold_s_an_unroutable_request_is_refused_at_once(model):
    with cluster(model) as (je, _, _make_te):
        async def scenario():
            await je.start()
            assert not je.healthy  # nothing holds requests: no TE means unavailable, as before
            with pytest.raises(RouteUnavailableError, match="no TE is registered"):
                await asyncio.wait_for(generate(je, "r0"), 10)

        asyncio.run(scenario())


def test_a_request_held_for_a_known_pool_is_reported_for_that_pool(model):
    with cluster(model, hold_s=30.0) as (je, manager, make_te):
        async def scenario():
            await je.start()
            prefill, decode = make_te("pd-prefill-0", role="prefill", group="pd"), make_te("pd-decode-0",
                                                                                         role="decode", group="pd")
            async with beating([prefill, decode]):
                prefill.beating = decode.beating = True
                await until(lambda: len(je.registry.routable()) == 2)
                decode.beating = False
                decode.heartbeat.draining = True  # the decode pool is scaled down to zero: it drains, then leaves
                decode.beat()
                await until(lambda: len(je.registry.routable()) == 1)
                work = asyncio.ensure_future(generate(je, "r0"))
                report = await manager.wait_for(lambda r: (demand_of(r, "pd/decode") or GroupDemand("")).held)
                assert demand_of(report, "pd/prefill").held == 0 and report.te_names == ["pd-prefill-0"]
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                await until(lambda: je.health()["held"] == 0)  # an abandoned request is held no longer

        asyncio.run(scenario())


def test_a_draining_te_finishes_its_stream_but_gets_no_new_job(model):
    with cluster(model, hold_s=0.0) as (je, manager, make_te):
        async def scenario():
            await je.start()
            tes = {name: make_te(name) for name in ("main-colocated-0", "main-colocated-1")}
            async with beating(tes.values()):
                for te in tes.values():
                    te.beating = True
                await until(lambda: len(je.registry.routable()) == 2)
                first = asyncio.ensure_future(generate(je, "r0"))
                task, busy = await first_request(tes)
                idle = next(te for te in tes.values() if te is not busy)
                busy.heartbeat.draining = True  # scaled down: it finishes r0, takes nothing new
                busy.beat()
                await until(lambda: len(je.registry.routable()) == 1)
                report = await manager.wait_for(lambda r: True)
                assert report.te_names == [idle.heartbeat.name]
                assert je.registry.get(busy.heartbeat.name) is not None  # kept: its stream goes on
                # new requests all go to the other TE
                others = [asyncio.ensure_future(generate(je, f"r{i}", max_tokens=1)) for i in range(1, 4)]
                for _ in others:
                    job = await idle.next_request()
                    idle.answer(job.req_id, [21], finish_reason="length")
                assert [(await asyncio.wait_for(o, 10)).outputs[0].token_ids for o in others] == [[21]] * 3
                assert busy.requests() == []
                # the draining TE's stream still reaches the client
                busy.answer(task.req_id, [11])
                busy.answer(task.req_id, [12, 13], finish_reason="length")
                assert (await asyncio.wait_for(first, 10)).outputs[0].token_ids == [11, 12, 13]
                # with every TE draining nothing can be routed (and nothing holds: refused at once)
                idle.heartbeat.draining = True
                idle.beat()
                await until(lambda: not je.registry.routable())
                assert not je.healthy
                with pytest.raises(RouteUnavailableError):
                    await asyncio.wait_for(generate(je, "r9"), 10)

        asyncio.run(scenario())


async def first_request(tes: dict[str, FakeTE], timeout_s: float = 10.0) -> tuple[AddRequest, FakeTE]:
    """The first request any of `tes` gets, and which one got it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for te in tes.values():
            got = te.requests()
            if got:
                return got[0], te
        await asyncio.sleep(0.01)
    raise AssertionError("no TE received the request")
