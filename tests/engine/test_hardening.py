"""A request, a message or an operator command never takes the engine down.

Against a running TE (its master in this process, its worker a real process, its input a real TCP
socket): requests the master must refuse, requests that fail only inside the worker (the master's
checks switched off), garbage frames, and operator commands with bad arguments. Each time the others
go on unharmed and the TE serves the next request. Also: message decoding, the sampler's and the
runner's per-request isolation, and the engine client's health when its reader thread dies.
"""
from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
import uuid

import msgpack
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from meshserve import LLM
from meshserve.config import EngineConfig
from meshserve.core.client_links import RouterLinks
from meshserve.core.master import EngineCore
from meshserve.engine.async_client import AsyncEngineClient
from meshserve.moe.placement import ExpertPlacement
from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.client import AbortRequests, AddRequest, AdminReply, AdminRequest, EngineStats, StatsQuery
from meshserve.wire.codec import MAX_INBOX_BYTES, MessageError
from meshserve.wire.eplb import EplbCommand, EplbPhase
from meshserve.wire.heartbeat import EngineHeartbeat
from meshserve.wire.kv import KVConnectorMetadata, PoolBlock
from meshserve.wire.receive import dropped_frames, recv_message
from meshserve.wire.sampling_params import SamplingParams, SamplingParamsError
from meshserve.wire.worker import CachedRequestData, NewRequestData, SchedulerOutput, StepBatch
from meshserve.worker.model_runner import ModelRunner
from meshserve.worker.sampler import FAILED_TOKEN, Sampler, SamplingRow
from tests.core.test_scheduler import FakeWorker, make_request, make_scheduler, prompt_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11]}
WAIT_S = 60


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2}))


def _params(base: SamplingParams = GREEDY, **changes) -> dict:
    """Sampling params as a peer sends them, past the checks a SamplingParams object makes."""
    return {**base.to_dict(), **changes}


# ---------------------------------------------------------------- a TE on real sockets


class _TE:
    """A TE master running in a thread of this process, and a client on its real sockets."""

    def __init__(self, model: str, **engine_args) -> None:
        self.config = EngineConfig.from_kwargs(model, kv_cache_memory_gb=0.05, **engine_args)
        self.ctx = zmq.Context()
        self.ipc_dir = tempfile.mkdtemp(prefix="meshserve-test-te-")
        link = RouterLinks(self.ctx, "tcp://127.0.0.1:0", [])
        self.core = EngineCore(self.config, self.ctx, link, self.ipc_dir, watch_parent=False)
        self.thread = threading.Thread(target=self.core.run, name="te-master", daemon=True)
        self.thread.start()
        self.client_ctx = zmq.Context()
        self.inbox_addr = link.listen_addr
        self.push = self.sender()
        self.replies = self.client_ctx.socket(zmq.PULL)
        self.reply_to = f"ipc://{self.ipc_dir}/replies"
        self.replies.bind(self.reply_to)

    def sender(self) -> zmq.Socket:
        sock = self.client_ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        cluster_auth.client(sock, self.inbox_addr)
        sock.connect(self.inbox_addr)
        return sock

    def send(self, item) -> None:
        self.push.send(codec.encode(item))

    def add(self, req_id: str, prompt: list[int], params: dict) -> None:
        self.send(AddRequest(req_id=req_id, prompt_token_ids=prompt, sampling_params=params,
                                 arrival_time=time.time(), reply_to=self.reply_to))

    def next_reply(self, deadline: float):
        while time.monotonic() < deadline:
            if self.replies.poll(200):
                return codec.decode(self.replies.recv())
        raise AssertionError("the TE did not answer in time")

    def collect(self, req_ids: list[str]) -> dict[str, dict]:
        """Each request's tokens, finish reason, error and error type once it finished."""
        results = {r: {"tokens": [], "finish": None, "error": None, "error_type": None} for r in req_ids}
        deadline = time.monotonic() + WAIT_S
        while any(r["finish"] is None for r in results.values()):
            item = self.next_reply(deadline)
            for delta in getattr(item, "deltas", []):
                result = results.get(delta.req_id)
                if result is not None:
                    result["tokens"] += delta.new_token_ids
                    if delta.finish_reason is not None:
                        result.update(finish=delta.finish_reason, error=delta.error, error_type=delta.error_type)
        return results

    def ask(self, item, kind: type):
        self.send(item)
        deadline = time.monotonic() + WAIT_S
        while True:
            reply = self.next_reply(deadline)
            if isinstance(reply, kind):
                return reply

    def stats(self) -> EngineStats:
        return self.ask(StatsQuery(reply_to=self.reply_to), EngineStats)

    def admin(self, op: str, args: dict) -> AdminReply:
        """An operator command as a peer may send it: its fields unchecked (the TE checks them)."""
        request = AdminRequest(query_id=1, op=op, placement=args.get("placement"), cache_id=args.get("id"),
                                   reply_to=self.reply_to)
        return self.ask(request, AdminReply)

    def serves(self, prompt: list[int] = (3, 4, 5)) -> list[int]:
        """The tokens of one fresh request: the TE is alive and serving."""
        req_id = f"probe-{uuid.uuid4().hex[:8]}"
        self.add(req_id, list(prompt), _params(max_tokens=3))
        result = self.collect([req_id])[req_id]
        assert result["finish"] == "length", result
        assert self.thread.is_alive()
        return result["tokens"]

    def close(self) -> None:
        self.send(Shutdown())
        self.thread.join(60)
        for sock in (self.push, self.replies):
            sock.close(0)
        self.client_ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def te(model_dir):
    server = _TE(model_dir, eplb_redundant_experts=1)  # redundant slots: a rebalance reads its placement
    yield server
    server.close()
    assert not server.thread.is_alive()


def _reference(te: _TE) -> dict[str, list[int]]:
    ids = {name: f"ref-{name}-{uuid.uuid4().hex[:6]}" for name in PROMPTS}
    for name, req_id in ids.items():
        te.add(req_id, PROMPTS[name], _params())
    results = te.collect(list(ids.values()))
    return {name: results[req_id]["tokens"] for name, req_id in ids.items()}


@pytest.mark.parametrize("change", [
    {"stop_token_ids": [-1], "min_tokens": 1},
    {"stop_token_ids": ["VOCAB"], "min_tokens": 1},
    {"bogus": 1},
    {"temperature": "hot"},
    {"seed": 2**63},
    {"prompt": [1, "VOCAB"]},
    {"prompt": [-3]},
    {"prompt": []},
])
def test_the_master_refuses_a_bad_request_alone(te, change):
    vocab = te.core.vocab_size  # "VOCAB" stands for it: the first id past the vocabulary
    change = {k: [vocab if x == "VOCAB" else x for x in v] if isinstance(v, list) else v for k, v in change.items()}
    prompt = change.pop("prompt", [5, 6, 7])
    good, bad = f"good-{uuid.uuid4().hex[:6]}", f"bad-{uuid.uuid4().hex[:6]}"
    te.add(good, [5, 6, 7], _params())
    te.add(bad, prompt, _params(**change))
    results = te.collect([good, bad])
    assert results[bad]["finish"] == "error"
    assert results[bad]["error_type"] in ("SamplingParamsError", "InvalidRequestError")
    assert results[good]["finish"] == "length" and len(results[good]["tokens"]) == GREEDY.max_tokens
    te.serves()


def test_a_request_that_fails_in_the_worker_fails_alone(te, monkeypatch):
    _poison_the_worker(te, monkeypatch)


@pytest.mark.parametrize("parallel", ["attn=TP2+DP1 moe=TP2+EP1", "attn=TP1+DP2 moe=TP1+EP2"])
def test_ranks_fail_the_same_requests_and_stay_in_lockstep(model_dir, monkeypatch, parallel):
    server = _TE(model_dir, parallel=parallel)
    try:
        _poison_the_worker(server, monkeypatch)
    finally:
        server.close()


def _poison_the_worker(te: _TE, monkeypatch) -> None:
    """The master's checks off: the poisoned requests reach the worker, which fails them alone."""
    reference = _reference(te)
    monkeypatch.setattr(te.core.admission, "check", lambda item: item.sampling_params)
    vocab = te.core.vocab_size
    poisoned = {f"stop-{uuid.uuid4().hex[:6]}": ([5, 6, 7], _params(stop_token_ids=[vocab], min_tokens=1)),
                f"prompt-{uuid.uuid4().hex[:6]}": ([5, vocab + 7], _params())}
    ids = {name: f"{name}-{uuid.uuid4().hex[:6]}" for name in PROMPTS}
    for name, req_id in ids.items():  # one burst: the master drains it before it schedules a step
        te.add(req_id, PROMPTS[name], _params())
    for req_id, (prompt, params) in poisoned.items():
        te.add(req_id, prompt, params)
    results = te.collect([*ids.values(), *poisoned])
    for req_id in poisoned:
        assert results[req_id]["finish"] == "error"
        assert "outside the vocabulary" in results[req_id]["error"]
    for name, req_id in ids.items():
        assert results[req_id]["finish"] == "length"
        assert results[req_id]["tokens"] == reference[name]
    assert te.stats().healthy
    te.serves()


def test_garbage_frames_are_dropped_and_counted(te):
    before = te.stats().dropped_frames.get("te-inbox", 0)
    frames = [b"\x00garbage\xff", msgpack.packb(["Nonsense", {}]), msgpack.packb(["AddRequest", {"req_id": 7}]),
              msgpack.packb(["AbortRequests", {"req_ids": "abc"}]), msgpack.packb(["Shutdown", {"now": True}]),
              msgpack.packb([1, 2, 3]), codec.encode(EngineStats())]
    for frame in frames:
        te.push.send(frame)
    assert te.stats().dropped_frames["te-inbox"] == before + len(frames)
    te.serves()


def test_a_frame_above_the_size_limit_never_reaches_the_master(te):
    sender = te.sender()
    events = sender.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        sender.send(b"\x00" * (MAX_INBOX_BYTES + 1))
        seen = []
        deadline = time.monotonic() + WAIT_S
        while zmq.EVENT_DISCONNECTED not in seen and time.monotonic() < deadline:
            if events.poll(200):
                seen.append(recv_monitor_message(events)["event"])
        assert zmq.EVENT_DISCONNECTED in seen  # the TE closed the connection that sent it
    finally:
        sender.disable_monitor()
        events.close(0)
        sender.close(0)
    assert te.stats().healthy
    te.serves()


@pytest.mark.parametrize("op, args, reason", [
    ("eplb.rebalance", {"placement": {"format": "meshserve-expert-placement/1", "num_logical": float("inf"),
                                      "num_ranks": 1, "redundant_per_rank": 1, "layers": {}}}, "num_logical"),
    ("eplb.rebalance", {"placement": {"format": "meshserve-expert-placement/1", "num_logical": 16,
                                      "num_ranks": 1, "redundant_per_rank": 1, "layers": []}}, "layers"),
    ("eplb.rebalance", {"placement": "everything"}, "not a meshserve expert placement"),
    ("eplb.rebalance", {"placement": {"format": "meshserve-expert-placement/1", "num_logical": 16,
                                      "num_ranks": None, "redundant_per_rank": 1, "layers": {"1": "x"}}}, "num_ranks"),
    ("context_cache.delete", {"id": 5}, "context_cache.delete needs"),
    ("no.such.op", {}, "unknown admin operation"),
])
def test_a_bad_admin_command_is_refused(te, op, args, reason):
    reply = te.admin(op, args)
    assert reply.ok is False and reason in reply.error
    te.serves()


def test_an_admin_handler_that_raises_is_refused(te, monkeypatch):
    def broken() -> dict:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(te.core.eplb, "status", broken)
    reply = te.admin("eplb.status", {})
    assert reply.ok is False and "boom" in reply.error
    te.serves()


# ---------------------------------------------------------------- the offline engine client


def test_offline_llm_refuses_an_out_of_vocabulary_stop_token_and_goes_on(model_dir):
    with LLM(model=model_dir, kv_cache_memory_gb=0.05) as llm:
        vocab = llm.engine.ready.vocab_size
        assert vocab > 0
        poisoned = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=1)
        poisoned.stop_token_ids = [vocab]  # past the API's checks
        with pytest.raises(SamplingParamsError, match="vocabulary"):
            llm.generate([[5, 6, 7]], poisoned)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        assert llm.get_stats().healthy


async def _generate(engine: AsyncEngineClient, request_id: str):
    outs = [out async for out in engine.generate(None, [5, 6, 7], GREEDY, request_id)]
    return outs[-1]


def test_engine_client_isolates_a_failing_output_and_is_unhealthy_once_its_reader_dies(model_dir, monkeypatch):
    engine = AsyncEngineClient(EngineConfig.from_kwargs(model_dir, kv_cache_memory_gb=0.05))
    process = engine.processor.process

    def process_unless_doomed(delta, now):
        if delta.req_id.startswith("doomed"):
            raise RuntimeError("cannot process this output")
        return process(delta, now)

    def broken_recv(timeout_ms: int):
        raise RuntimeError("reader broke")

    async def scenario():
        monkeypatch.setattr(engine.processor, "process", process_unless_doomed)
        doomed, fine = await asyncio.gather(_generate(engine, "doomed"), _generate(engine, "fine"),
                                            return_exceptions=True)
        assert isinstance(doomed, RuntimeError)
        assert fine.finished and len(fine.outputs[0].token_ids) == GREEDY.max_tokens
        assert engine.healthy
        monkeypatch.setattr(engine.engine, "recv", broken_recv)
        engine._reader.join(10)
        await asyncio.sleep(0.1)  # the reader's last word reaches the loop
        assert not engine.healthy
        assert "reader" in engine.dead_error
        assert (await engine.get_stats()).healthy is False

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- message decoding


@pytest.mark.parametrize("frame, reason", [
    (b"\xc1\xc1", "not msgpack"),
    (msgpack.packb("AddRequest"), "pair"),
    (msgpack.packb(["Nonsense", {}]), "unknown message type"),
    (msgpack.packb(["StepBatch", {"per_dp": [{"step_id": 1, "surprise": 2}]}]), "unknown field"),
    (msgpack.packb(["StepBatch", {"per_dp": [{"step_id": "1"}]}]), "Expected `int`"),
    (msgpack.packb(["EngineOutputs", {"deltas": [{"req_id": "r", "new_token_ids": [1.5]}]}]), "Expected `int`"),
    (msgpack.packb(["AddRequest", {"req_id": "r"}]), "missing required field"),
    (b"\x91" * 100_000, "not msgpack|pair"),  # deep nesting: refused, never a crash
])
def test_decode_rejects_bad_frames(frame, reason):
    with pytest.raises(MessageError, match=reason):
        codec.decode(frame)


def test_decode_rejects_oversized_frames():
    data = codec.encode(AbortRequests(req_ids=["x" * 1000]))
    with pytest.raises(MessageError, match="exceeds"):
        codec.decode(data, max_bytes=len(data) - 1)
    assert codec.decode(data, max_bytes=len(data)) == AbortRequests(req_ids=["x" * 1000])


def test_decode_round_trips_nested_messages():
    batch = StepBatch(per_dp=[SchedulerOutput(
        step_id=3, new_reqs=[NewRequestData("r", [1, 2], GREEDY, [0], 0, 2)],
        cached_reqs=[CachedRequestData("q", [4], 9)], num_scheduled_tokens={"r": 2, "q": 1})],
        kv_connector={0: KVConnectorMetadata(pool_stores=[PoolBlock(1, "key")])},
        eplb=EplbCommand(EplbPhase.ABORT), report_load=True)
    assert codec.decode(codec.encode(batch)) == batch
    beat = EngineHeartbeat(name="te", role="colocated", group="g", input_addr="tcp://h:1", kv_events_addr="",
                           model="m", max_model_len=64, block_size=8, attn_tp=1, attn_dp=1,
                           stats=EngineStats(dropped_frames={"te-inbox": 2}))
    assert codec.decode(codec.encode(beat)) == beat


def test_recv_message_drops_and_counts_a_bad_frame():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://hardening-drop")
        push.connect("inproc://hardening-drop")
        before = dropped_frames().get("test-socket", 0)
        push.send(b"junk")
        push.send(codec.encode(Shutdown()))
        assert recv_message(pull, "test-socket") is None
        assert recv_message(pull, "test-socket") == Shutdown()
        assert dropped_frames()["test-socket"] == before + 1
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()


@pytest.mark.parametrize("data", [
    {"format": "meshserve-expert-placement/1", "num_logical": float("inf"), "num_ranks": 1,
     "redundant_per_rank": 0, "layers": {}},
    {"format": "meshserve-expert-placement/1", "num_logical": 4, "num_ranks": 1, "redundant_per_rank": 0,
     "layers": []},
    {"format": "meshserve-expert-placement/1", "num_logical": 4, "num_ranks": 1, "redundant_per_rank": 0,
     "layers": {"1": [0, 1, 2, 3.5]}},
    {"format": "meshserve-expert-placement/1", "num_logical": True, "num_ranks": 1, "redundant_per_rank": 0,
     "layers": {}},
    {"format": "meshserve-expert-placement/1", "num_ranks": 1},
])
def test_expert_placement_from_dict_refuses_bad_values(data):
    with pytest.raises(ValueError):
        ExpertPlacement.from_dict(data)


# ---------------------------------------------------------------- the sampler and the runner


def _row(generator=None, **params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), prompt_token_ids=[1, 2], output_token_ids=[],
                       generator=generator)


def test_sampler_fails_only_the_rows_that_raise():
    vocab = 32
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    poisoned = _row(temperature=0.0, min_tokens=1, stop_token_ids=[vocab])

    def rows() -> list[SamplingRow]:
        return [_row(temperature=0.0), _row(temperature=1.0, seed=7, generator=torch.Generator().manual_seed(7)),
                _row(temperature=0.0, logprobs=2)]

    clean = Sampler()(logits[:3], rows())
    out = Sampler().sample_isolating(torch.cat([logits[:3], logits[3:]]), [*rows(), poisoned])
    assert out.failed.keys() == {3} and "outside the vocabulary" in out.failed[3]
    assert out.token_ids == [*clean.token_ids, FAILED_TOKEN]  # the seeded row too
    assert out.logprobs[:3] == clean.logprobs


def test_sampler_lets_a_device_fault_through(monkeypatch):
    def out_of_memory(self, logits, rows):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(Sampler, "__call__", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        Sampler().sample_isolating(torch.zeros(1, 8), [_row(temperature=0.0)])


def _unchecked(params: dict) -> SamplingParams:
    """Sampling params with the given values, past the checks building or decoding them makes."""
    out = SamplingParams()
    for name, value in params.items():
        setattr(out, name, value)
    return out


def _new(req_id: str, prompt: list[int], params: dict) -> NewRequestData:
    return NewRequestData(req_id=req_id, token_ids=prompt, sampling_params=_unchecked(params),
                          block_ids=[2 * len(req_id)],
                          num_computed_tokens=0, num_prompt_tokens=len(prompt))


def test_runner_fails_poisoned_requests_and_skips_them_until_dropped(model_dir):
    runner = ModelRunner(EngineConfig.from_kwargs(model_dir, num_kv_blocks=32, block_size=16))
    vocab = runner.vocab_size
    good = [_new("a", [5, 6, 7], _params()), _new("bb", [9, 10], _params())]
    bad = [_new("ccc", [5, 6], _params(stop_token_ids=[vocab], min_tokens=1)),
           _new("dddd", [5, vocab], _params()), _new("eeeee", [5, 6], _params(stop_token_ids=[-1]))]
    step = SchedulerOutput(step_id=1, new_reqs=good + bad,
                           num_scheduled_tokens={r.req_id: len(r.token_ids) for r in good + bad})
    out = runner.execute(step)
    assert out.failed.keys() == {"ccc", "dddd", "eeeee"}
    assert out.sampled.keys() == {"a", "bb"}
    alone = ModelRunner(EngineConfig.from_kwargs(model_dir, num_kv_blocks=32, block_size=16)).execute(
        SchedulerOutput(step_id=1, new_reqs=good, num_scheduled_tokens={"a": 3, "bb": 2}))
    assert out.sampled == alone.sampled
    # a step queued before the master heard of the failures still names them: they are skipped
    decode = SchedulerOutput(step_id=2, num_scheduled_tokens={r.req_id: 1 for r in good + bad},
                             cached_reqs=[CachedRequestData(r.req_id, [], len(r.token_ids)) for r in good + bad])
    assert runner.execute(decode).sampled.keys() == {"a", "bb"}
    runner.execute(SchedulerOutput(step_id=3, finished_req_ids=[r.req_id for r in bad]))
    assert not runner.failed_ids


def test_scheduler_finishes_a_failed_request_with_its_error_and_frees_its_blocks():
    sched = make_scheduler(num_blocks=16)
    worker = FakeWorker()
    sched.add_request(make_request("ok", prompt_of(1, 9)))
    sched.add_request(make_request("bad", prompt_of(2, 9)))
    step = sched.schedule()
    out = worker.execute(step)
    del out.sampled["bad"]
    out.failed["bad"] = "ValueError: stop token 40000 is outside the vocabulary"
    deltas = {d.req_id: d for d in sched.update_from_output(step, out)}
    assert deltas["bad"].finish_reason == "error" and "outside the vocabulary" in deltas["bad"].error
    assert deltas["ok"].new_token_ids == out.sampled["ok"] and deltas["ok"].finish_reason is None
    assert sched.num_running == 1
    assert sched.schedule().finished_req_ids == ["bad"]  # the worker is told to forget it
