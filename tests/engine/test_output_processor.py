"""OutputProcessor: stop strings, streaming hold-back, n > 1 fan-out, aborts, failures, logprobs, metrics."""
from __future__ import annotations

import pytest

from meshserve.engine.output_processor import OutputProcessor
from meshserve.wire.client import RequestDelta, Tenancy
from meshserve.wire.sampling_params import SamplingParams
from meshserve.wire.worker import SampleLogprobs
from tests.engine.byte_level_bpe import byte_level_bpe, encode

PROMPT = "Tell me: "


def _processor() -> OutputProcessor:
    return OutputProcessor(byte_level_bpe())


def _add(processor, request_id="r", **params):
    return processor.add_request(request_id, PROMPT, encode(PROMPT), SamplingParams(**params), arrival_time=1.0)


def _stream(processor, engine_id, ids, start_time=10.0, finish_reason=None, stop_reason=None):
    """Feed ids one token per delta (the last delta may carry a finish); collect (output, aborts)."""
    results = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        delta = RequestDelta(engine_id, [token_id], finish_reason=finish_reason if last else None,
                             stop_reason=stop_reason if last else None)
        results.append(processor.process(delta, now=start_time + i))
    return results


def _streamed_text(results, index=0) -> str:
    return "".join(out.outputs[index].text_delta for out, _ in results if out is not None)


def test_stop_string_split_across_tokens_truncates_and_aborts():
    processor = _processor()
    _add(processor, max_tokens=100, stop=["STOP"])
    ids = encode("go STOP and more")
    assert len(encode("STOP")) > 1  # the stop string spans several tokens
    results = _stream(processor, "r", ids)
    hit = next(i for i, (_, aborts) in enumerate(results) if aborts)
    out, aborts = results[hit]
    assert aborts == ["r"]
    assert out.finished and out.text == "go " and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == "STOP"
    assert out.token_ids == ids[: hit + 1]  # token ids keep what was generated
    assert byte_level_bpe().decode(out.token_ids).endswith("STOP")
    assert all(result == (None, []) for result in results[hit + 1:])  # late engine deltas are ignored
    assert _streamed_text(results) == "go "
    assert not processor.has_unfinished()


def test_a_stop_string_inside_a_multi_token_delta_drops_the_tokens_after_it():
    """Speculative decoding delivers several tokens per delta: the output ends where it would have ended
    one token per delta, token ids and logprobs included."""
    ids = encode("go STOP and more")
    reference = _stream(_processor_with(stop=["STOP"], logprobs=0), "r", ids)
    expected = next(out for out, aborts in reference if aborts)
    processor = _processor_with(stop=["STOP"], logprobs=0)
    entries = [SampleLogprobs(-0.1 * (i + 1), []) for i in range(len(ids))]
    out, aborts = processor.process(RequestDelta("r", ids, new_logprobs=entries), now=10.0)
    assert aborts == ["r"] and out.finished and out.finish_reason == "stop"
    assert out.text == expected.text == "go "
    assert out.token_ids == expected.token_ids and len(out.token_ids) < len(ids)
    assert len(out.outputs[0].logprobs) == len(out.token_ids)


def _processor_with(**params) -> OutputProcessor:
    processor = _processor()
    _add(processor, max_tokens=100, **params)
    return processor


def test_include_stop_str_in_output_keeps_the_stop_string_only():
    processor = _processor()
    _add(processor, stop=["STOP"], include_stop_str_in_output=True)
    results = _stream(processor, "r", encode("go STOP and more"))
    final = next(out for out, aborts in results if aborts)
    assert final.text == "go STOP"
    assert _streamed_text(results) == "go STOP"


def test_earliest_stop_string_wins():
    processor = _processor()
    _add(processor, stop=["world", "lo"])
    ids = encode("Hello world")
    final = next(out for out, aborts in _stream(processor, "r", ids) if aborts)
    assert final.text == "Hel" and final.outputs[0].stop_reason == "lo"


def test_stop_strings_only_count_after_min_tokens():
    processor = _processor()
    _add(processor, stop=["x"], min_tokens=2)
    ids = encode("x") + encode("y") + encode("x") + encode("z")
    final = next(out for out, aborts in _stream(processor, "r", ids) if aborts)
    assert final.text == "xy" and final.token_ids == ids[:3]


def test_streaming_never_shows_part_of_a_stop_string():
    text = "go ST and SToP, then STOP end"
    processor = _processor()
    _add(processor, stop=["STOP"])
    results = _stream(processor, "r", encode(text))
    final = next(out for out, aborts in results if aborts)
    assert final.text == "go ST and SToP, then "
    shown = ""
    for out, _ in results:
        if out is None:
            continue
        shown += out.outputs[0].text_delta
        assert out.outputs[0].text == shown  # cumulative text is the sum of the deltas
        assert final.text.startswith(shown)  # nothing of the stop string ever went out
    # a partial match is held back only while it could still become the stop string
    partial = [out for out, _ in results if out is not None and "go ST and" in out.text]
    assert partial and "go ST" not in [out.text for out, _ in results if out is not None]


def test_held_back_text_is_flushed_when_the_engine_finishes():
    processor = _processor()
    _add(processor, stop=["STOP"])
    results = _stream(processor, "r", encode("the end is ST"), finish_reason="length")
    final = results[-1][0]
    assert final.finished and final.finish_reason == "length"
    assert final.text == "the end is ST" == _streamed_text(results)
    assert final.outputs[0].text_delta.endswith("ST")


def test_without_stop_strings_every_ascii_token_streams_immediately():
    processor = _processor()
    _add(processor)
    ids = encode("plain words here")
    results = _stream(processor, "r", ids)
    assert [out.outputs[0].text_delta for out, _ in results] == [byte_level_bpe().decode([t]) for t in ids]


def test_engine_stop_token_is_not_in_the_text_unless_asked():
    eot = byte_level_bpe().token_to_id("o")  # any token works as a stop token id
    for include, expected in [(False, "go "), (True, "go o")]:
        processor = _processor()
        _add(processor, stop_token_ids=[eot], include_stop_str_in_output=include)
        ids = encode("go ") + [eot]
        final = _stream(processor, "r", ids, finish_reason="stop", stop_reason=eot)[-1][0]
        assert final.text == expected
        assert final.token_ids == ids
        assert final.finish_reason == "stop" and final.outputs[0].stop_reason == eot


def test_n_children_fan_out_with_offset_seeds():
    processor = _processor()
    children = _add(processor, n=3, seed=7, temperature=0.8)
    assert [cid for cid, _ in children] == ["r-0", "r-1", "r-2"]
    assert [p.seed for _, p in children] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.8 for _, p in children)
    unseeded = _add(processor, request_id="u", n=2)
    assert [p.seed for _, p in unseeded] == [None, None]
    single = _add(processor, request_id="s", seed=3)
    assert single == [("s", SamplingParams(seed=3))]


def test_unfinished_children_keep_their_tenancy_for_a_resend():
    processor, tenancy = _processor(), Tenancy(tenant="key:0123456789abcdef", cache_salt="5a" * 16)
    processor.add_request("r", PROMPT, encode(PROMPT), SamplingParams(n=2), arrival_time=1.0, tenancy=tenancy)
    _add(processor, request_id="plain")
    _stream(processor, "r-0", encode("ab"))
    children = {child[0]: child for child in processor.unfinished_children()}
    assert children["r-0"][3] == encode("ab") and children["r-0"][5] == tenancy
    assert children["r-1"][5] == tenancy and children["plain"][5] == Tenancy()


def test_n_children_aggregate_into_one_output():
    processor = _processor()
    _add(processor, n=3, stop=["STOP"])
    texts = {"r-0": "alpha STOP x", "r-1": "beta gamma", "r-2": "delta"}
    out, aborts = processor.process(RequestDelta("r-1", encode("beta ")), now=5.0)
    assert aborts == [] and len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert out.outputs[1].text_delta == "beta " and out.outputs[0].text_delta == "" and not out.finished

    results = _stream(processor, "r-0", encode(texts["r-0"]), start_time=6.0)
    out, aborts = next(r for r in results if r[1])
    assert aborts == ["r-0"] and out.outputs[0].finish_reason == "stop" and not out.finished

    out, _ = processor.process(RequestDelta("r-2", encode("delta"), finish_reason="length"), now=30.0)
    assert out.outputs[2].text == "delta" and not out.finished
    out, _ = processor.process(RequestDelta("r-1", encode("gamma"), finish_reason="length"), now=31.0)
    assert out.finished
    assert [o.text for o in out.outputs] == ["alpha ", "beta gamma", "delta"]
    assert [o.finish_reason for o in out.outputs] == ["stop", "length", "length"]
    assert out.outputs[1].text_delta == "gamma" and out.outputs[0].text_delta == ""
    assert out.metrics.finished_time == 31.0
    assert not processor.has_unfinished()


def test_abort_returns_running_children_and_finishes_the_request():
    processor = _processor()
    _add(processor, n=3, stop=["STOP"])
    _stream(processor, "r-1", encode("a STOP"))  # r-1 already stopped itself
    processor.process(RequestDelta("r-0", encode("x")), now=3.0)
    assert processor.num_unfinished == 1
    assert processor.abort("r") == ["r-0", "r-2"]
    assert not processor.has_unfinished() and processor.num_unfinished == 0
    assert processor.process(RequestDelta("r-0", encode("y")), now=4.0) == (None, [])
    assert processor.abort("r") == []  # aborting twice is harmless


def test_fail_all_finishes_everything_with_error():
    processor = _processor()
    _add(processor, request_id="a", stop=["STOP"])
    _add(processor, request_id="b", n=2)
    _stream(processor, "a", encode("held ST"))
    processor.process(RequestDelta("b-0", encode("fine"), finish_reason="length"), now=2.0)
    outputs = {out.request_id: out for out in processor.fail_all("worker died", now=9.0)}
    assert set(outputs) == {"a", "b"}
    a, b = outputs["a"], outputs["b"]
    assert a.finished and a.error == "worker died" and a.finish_reason == "error"
    assert a.text == "held ST" and a.outputs[0].text_delta == "ST"  # held-back text is flushed
    assert [o.finish_reason for o in b.outputs] == ["length", "error"]
    assert a.metrics.finished_time == 9.0
    assert not processor.has_unfinished()


def test_engine_error_and_abort_deltas_propagate():
    processor = _processor()
    _add(processor, request_id="e")
    _add(processor, request_id="x")
    out, _ = processor.process(RequestDelta("e", [], finish_reason="error", error="out of memory"), now=1.0)
    assert out.finished and out.finish_reason == "error" and out.error == "out of memory"
    out, _ = processor.process(RequestDelta("x", encode("hi"), finish_reason="abort"), now=1.0)
    assert out.finished and out.finish_reason == "abort" and out.text == "hi"


def test_metrics_and_cached_tokens():
    processor = _processor()
    _add(processor)
    assert processor.process(RequestDelta("r", [], num_cached_tokens=4), now=2.0)[0] is None  # nothing visible
    ids = encode("abc def")
    results = _stream(processor, "r", ids, start_time=3.0, finish_reason="length")
    first, final = results[0][0], results[-1][0]
    assert first.metrics.first_token_time == 3.0 and first.metrics.finished_time is None
    assert final.metrics.arrival_time == 1.0
    assert final.metrics.first_token_time == 3.0
    assert final.metrics.last_token_time == final.metrics.finished_time == 3.0 + len(ids) - 1
    assert final.num_cached_tokens == 4


def test_logprobs_carry_decoded_tokens_and_accumulate():
    tokenizer = byte_level_bpe()
    processor = _processor()
    _add(processor, logprobs=2)
    ids = encode("ab c")
    entries = [SampleLogprobs(-0.5 * (i + 1), [(ids[i], -0.5 * (i + 1)), (7, -3.0)]) for i in range(len(ids))]
    outs = [processor.process(RequestDelta("r", [t], new_logprobs=[e]), now=1.0)[0] for t, e in zip(ids, entries)]
    final = outs[-1].outputs[0]
    assert [p.chosen.token_id for p in final.logprobs] == ids
    assert [p.chosen.decoded for p in final.logprobs] == [tokenizer.decode([t]) for t in ids]
    assert final.logprobs[0].top[1].decoded == tokenizer.decode([7])
    assert final.cumulative_logprob == pytest.approx(sum(e.logprob for e in entries))
    assert [len(o.outputs[0].logprobs_delta) for o in outs] == [1] * len(ids)
    assert outs[1].outputs[0].logprobs_delta[0].chosen.logprob == -1.0


def test_no_logprobs_requested_means_none():
    processor = _processor()
    _add(processor)
    out, _ = processor.process(RequestDelta("r", encode("a")), now=1.0)
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_bad_requests_are_rejected():
    processor = _processor()
    _add(processor)
    with pytest.raises(ValueError, match="already in use"):
        _add(processor)
    with pytest.raises(ValueError, match="empty prompt"):
        processor.add_request("q", "", [], SamplingParams(), arrival_time=0.0)
    _add(processor, request_id="z-0")
    with pytest.raises(ValueError, match="already in use"):
        _add(processor, request_id="z", n=2)
    assert processor.process(RequestDelta("unknown", [1]), now=0.0) == (None, [])
