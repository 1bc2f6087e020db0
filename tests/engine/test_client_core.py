"""ClientCore, the request bookkeeping LLM, the async client and the router share: registration (n > 1
children included), routing of deltas, admission errors, aborts and query replies; no process is started."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from meshserve.engine.client_core import ClientCore, PendingReplies, ReplyCallback, admission_error
from meshserve.wire import codec
from meshserve.wire.client import AdminReply, EngineError, EngineOutputs, EngineStats, ErrorType, RequestDelta
from meshserve.wire.errors import ADMISSION_ERRORS, EngineDeadError
from meshserve.wire.sampling_params import SamplingParams
from tests.engine.byte_level_bpe import byte_level_bpe, encode

PROMPT = encode("Tell me: ")


class Harness:
    """A core whose aborts and deliveries are recorded."""

    def __init__(self) -> None:
        self.aborted: list[list[str]] = []
        self.core = ClientCore(byte_level_bpe(), self.aborted.append)
        self.delivered: dict[str, list] = {}

    def register(self, request_id: str = "r", **params) -> list[str]:
        sink = self.delivered.setdefault(request_id, [])
        children = self.core.register(request_id, None, PROMPT, SamplingParams(**params), 1.0, sink.append)
        return [child_id for child_id, _ in children]

    def feed(self, req_id: str, text: str, **fields) -> None:
        self.core.on_outputs(EngineOutputs(deltas=[RequestDelta(req_id, encode(text), **fields)]))


def test_a_request_is_registered_and_gets_its_deltas():
    h = Harness()
    assert h.register(max_tokens=4) == ["r"]
    h.feed("r", "Hello")
    h.feed("r", " world", finish_reason="length")
    first, last = h.delivered["r"]
    assert first.outputs[0].text == "Hello" and not first.finished
    assert last.finished and last.outputs[0].text == "Hello world" and last.outputs[0].finish_reason == "length"
    assert h.aborted == []


def test_n_children_route_into_one_request_with_distinct_seeds():
    children = Harness().core.register("r", None, PROMPT, SamplingParams(n=2, seed=7), 1.0, lambda out: None)
    assert [(child_id, p.n, p.seed) for child_id, p in children] == [("r-0", 1, 7), ("r-1", 1, 8)]
    h = Harness()
    assert h.register(n=2) == ["r-0", "r-1"]
    h.feed("r-1", "fox", finish_reason="length")
    h.feed("r-0", "dog", finish_reason="length")
    *_, final = h.delivered["r"]
    assert final.finished and [c.text for c in final.outputs] == ["dog", "fox"]


def test_a_duplicate_request_id_is_refused_until_released():
    h = Harness()
    h.register()
    with pytest.raises(ValueError, match="duplicate request id"):
        h.register()
    h.core.release("r", finished=False)
    assert h.aborted == [["r"]]  # left unfinished: the engine is told to stop it
    assert h.register() == ["r"]


def test_a_bad_request_registers_nothing():
    h = Harness()
    with pytest.raises(ValueError, match="empty prompt"):
        h.core.register("r", None, [], SamplingParams(), 1.0, lambda out: None)
    assert h.register() == ["r"]


def test_every_admission_error_type_has_its_exception():
    assert {error_type.value for error_type in ErrorType} == set(ADMISSION_ERRORS)


@pytest.mark.parametrize("error_type", list(ErrorType))
def test_every_admission_error_fails_the_whole_request_with_its_exception(error_type):
    h = Harness()
    h.register(n=3)
    h.feed("r-1", "", error=f"refused: {error_type}", error_type=error_type, finish_reason="error")
    [error] = h.delivered["r"]
    assert type(error) is ADMISSION_ERRORS[error_type] and str(error) == f"refused: {error_type}"
    assert h.aborted == [["r-0", "r-1", "r-2"]]  # the request's other samples stop too
    h.feed("r-0", "late")
    assert h.delivered["r"] == [error]  # nothing after the error


def test_admission_error_maps_only_admission_errors():
    delta = RequestDelta("r", [], error="too long", error_type=ErrorType.REQUEST_TOO_LONG)
    assert isinstance(admission_error(delta), ADMISSION_ERRORS["RequestTooLongError"])
    assert isinstance(admission_error(codec.decode(codec.encode(delta))), ADMISSION_ERRORS["RequestTooLongError"])
    assert admission_error(RequestDelta("r", [], error="boom", finish_reason="error")) is None


def test_an_error_after_admission_ends_the_request_with_error_output():
    h = Harness()
    h.register()
    h.feed("r", "Hi", error="worker 0 lost its device", finish_reason="error")
    [out] = h.delivered["r"]
    assert out.finished and out.outputs[0].finish_reason == "error" and out.error == "worker 0 lost its device"


def test_abort_stops_the_running_children_and_ignores_their_late_deltas():
    h = Harness()
    h.register(n=2)
    h.feed("r-0", "done", finish_reason="length")
    h.core.abort("r")
    assert h.aborted == [["r-1"]]
    h.feed("r-1", "late")
    assert len(h.delivered["r"]) == 1
    h.core.abort("r")  # aborting again asks nothing
    h.core.release("r", finished=False)
    assert h.aborted == [["r-1"]]


def test_a_matched_stop_string_aborts_that_child():
    h = Harness()
    h.register(stop=["STOP"])
    h.feed("r", "go STOP and more")
    [out] = h.delivered["r"]
    assert out.finished and out.outputs[0].text == "go " and h.aborted == [["r"]]


def test_unknown_ids_are_ignored():
    h = Harness()
    h.register()
    h.feed("nobody", "text", finish_reason="length")
    h.feed("nobody-0", "", error="full", error_type=ErrorType.QUEUE_FULL)
    h.core.fail_request("nobody", RuntimeError("x"))
    h.core.abort("nobody")
    h.core.replies.on_reply(AdminReply(query_id=12345))
    assert h.delivered == {"r": []} and h.aborted == []


def test_a_delta_whose_processing_fails_fails_only_its_request(monkeypatch):
    h = Harness()
    h.register("doomed")
    h.register("fine")
    process = h.core.processor.process

    def process_unless_doomed(delta, now):
        if delta.req_id == "doomed":
            raise RuntimeError("cannot process this output")
        return process(delta, now)

    monkeypatch.setattr(h.core.processor, "process", process_unless_doomed)
    h.core.on_outputs(EngineOutputs(deltas=[RequestDelta("doomed", encode("a")),
                                                RequestDelta("fine", encode("b"), finish_reason="length")]))
    [error] = h.delivered["doomed"]
    assert isinstance(error, RuntimeError) and h.aborted == [["doomed"]]
    assert h.delivered["fine"][-1].finished


def test_engine_death_ends_every_request_and_query_and_stops_aborts():
    h = Harness()
    h.register()
    admin, stats = Future(), Future()
    h.core.replies.open(admin)
    h.core.replies.wait_for_stats(stats)
    h.core.on_message(EngineError(message="worker 0 died"))
    assert h.core.dead_error == "worker 0 died"
    [out] = h.delivered["r"]
    assert out.finished and out.outputs[0].finish_reason == "error" and out.error == "worker 0 died"
    for waiter in (admin, stats):
        with pytest.raises(EngineDeadError, match="worker 0 died"):
            waiter.result(0)
    h.register("after")
    h.core.abort("after")
    assert h.aborted == []  # a dead engine is not asked
    h.core.engine_died("later words")
    assert h.core.dead_error == "worker 0 died"  # the first reason stays


def test_query_ids_match_their_replies():
    replies = PendingReplies()
    first, second, forgotten = Future(), Future(), Future()
    ids = [replies.open(first), replies.open(second), replies.open(forgotten)]
    assert len(set(ids)) == 3 and 0 not in ids  # 0 is the id of a reply made without asking
    replies.forget(ids[2])
    for query_id in reversed(ids):
        replies.on_reply(AdminReply(query_id=query_id, data={"id": query_id}))
    assert first.result(0).data == {"id": ids[0]} and second.result(0).data == {"id": ids[1]}
    assert not forgotten.done()
    replies.on_reply(AdminReply(query_id=ids[0], data={"again": True}))  # a repeated reply is ignored
    assert first.result(0).data == {"id": ids[0]}


def test_every_waiting_stats_query_takes_the_next_stats_and_callbacks_get_their_reply():
    h = Harness()
    waiters = [Future(), Future()]
    for waiter in waiters:
        h.core.replies.wait_for_stats(waiter)
    h.core.on_message(EngineStats(num_running=3))
    assert [w.result(0).num_running for w in waiters] == [3, 3]
    got: list = []
    query_id = h.core.replies.open(ReplyCallback(got.append))
    h.core.on_message(AdminReply(query_id=query_id, data={"blocks": []}))
    assert [r.query_id for r in got] == [query_id]
    h.core.engine_died("gone")  # a callback has nobody to tell


def test_stream_submits_the_children_and_yields_until_finished():
    h = Harness()
    submitted: list = []

    async def scenario():
        outs = h.core.stream("r", None, PROMPT, SamplingParams(n=2), lambda children, now: submitted.extend(children))
        first = asyncio.ensure_future(outs.__anext__())
        await asyncio.sleep(0)
        assert [child_id for child_id, _ in submitted] == ["r-0", "r-1"]
        h.feed("r-0", "a", finish_reason="length")
        assert not (await first).finished
        h.feed("r-1", "b", finish_reason="length")
        rest = [out async for out in outs]
        assert [out.finished for out in rest] == [True]

    asyncio.run(scenario())
    assert h.aborted == []
    assert h.register() == ["r"]  # released once finished


def test_stream_raises_an_admission_error_and_a_caller_leaving_early_aborts():
    h = Harness()

    async def refused():
        outs = h.core.stream("r", None, PROMPT, SamplingParams(), lambda children, now: None)
        pending = asyncio.ensure_future(outs.__anext__())
        await asyncio.sleep(0)
        h.feed("r", "", error="the waiting queue is full", error_type=ErrorType.QUEUE_FULL)
        with pytest.raises(ADMISSION_ERRORS["QueueFullError"], match="queue is full"):
            await pending

    async def left_early():
        outs = h.core.stream("s", None, PROMPT, SamplingParams(), lambda children, now: None)
        pending = asyncio.ensure_future(outs.__anext__())
        await asyncio.sleep(0)
        h.feed("s", "partial")
        assert not (await pending).finished
        await outs.aclose()  # a client disconnect

    asyncio.run(refused())
    asyncio.run(left_early())
    assert h.aborted == [["r"], ["s"]]


def test_a_submit_that_fails_aborts_the_request():
    h = Harness()

    def no_route(children, now):
        raise EngineDeadError("no TE can take it")

    async def scenario():
        with pytest.raises(EngineDeadError, match="no TE"):
            async for _ in h.core.stream("r", None, PROMPT, SamplingParams(), no_route):
                pass

    asyncio.run(scenario())
    assert h.aborted == [["r"]] and h.register() == ["r"]
