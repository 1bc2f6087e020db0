"""`meshserve bench faults`: the load client's resend to another JE (before and after the first token) and its
hung requests, on stand-in servers; the token comparison, detection and throughput measures on made-up data;
the table and plot; one-line argument errors; and a quick run end to end on the tiny model (two faults, short
phases) whose JSON holds every field, with consistent counts."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from meshserve.bench.faults import FAULT_NAMES, QUICK_FAULTS, plot_faults, summary_lines
from meshserve.bench.faults_load import (
    COMPLETED,
    FAILED,
    HUNG,
    LoadSettings,
    SteadyLoad,
    compare_tokens,
    reference_tokens,
    throughput_series,
)
from meshserve.bench.faults_observe import detection, throughput_effect
from meshserve.entrypoints.cli import main
from meshserve.utils.processes import free_tcp_port

TOKENS = [f" w{i}" for i in range(8)]


# ---------------------------------------------------------------- stand-in JEs
def _app(break_after: int | None = None, token_s: float = 0.002) -> FastAPI:
    """Streams TOKENS (one per chunk, with their logprobs); with `break_after` the connection drops after that
    many tokens, as when a JE dies mid-stream."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        count = int(body["max_tokens"])

        async def events():
            for i in range(count):
                if break_after is not None and i == break_after:
                    raise RuntimeError("the JE went away")
                await asyncio.sleep(token_s)
                choice = {"index": 0, "text": TOKENS[i], "finish_reason": "length" if i == count - 1 else None,
                          "logprobs": {"tokens": [TOKENS[i]], "token_logprobs": [-0.1]}}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def stand_in(app: FastAPI):
    port = free_tcp_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stand-in server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _run(urls: list[str], requests: int = 1, max_tokens: int = 8, deadline_s: float = 10.0):
    load = SteadyLoad(LoadSettings(urls=urls, model="m", prompts=[[1, 2, 3]], max_tokens=max_tokens, concurrency=1,
                                   deadline_s=deadline_s), time.perf_counter())
    load.start(duration_s=30.0, max_requests=requests)
    return load.join()


def test_a_request_whose_je_refuses_the_connection_is_resent_to_the_other():
    with stand_in(_app()) as good:
        closed = f"http://127.0.0.1:{free_tcp_port()}"
        [result] = _run([closed, good])
    assert result.status == COMPLETED and result.tokens == TOKENS
    assert (result.retries, result.resumes) == (1, 0)


def test_a_request_cut_mid_stream_resumes_on_the_other_je_without_repeating_tokens():
    with stand_in(_app(break_after=3)) as breaking, stand_in(_app()) as good:
        [result] = _run([breaking, good])
    assert result.status == COMPLETED, result.error
    assert result.tokens == TOKENS  # the three tokens received first are not taken twice
    assert (result.retries, result.resumes, result.resume_mismatches) == (0, 1, 0)
    assert len(result.token_times) == len(TOKENS)


def test_connections_lost_on_every_attempt_fail_the_request():
    with stand_in(_app(break_after=0)) as breaking:
        [result] = _run([breaking])
    assert result.status == FAILED and "every attempt" in result.error


def test_a_request_past_its_deadline_is_hung():
    with stand_in(_app(token_s=0.5)) as slow:
        [result] = _run([slow], deadline_s=0.6)
    assert result.status == HUNG and result.finished_at is not None


# ---------------------------------------------------------------- measures
def test_token_comparison():
    ref = ["a", "b", "c", "d", "e"]
    assert compare_tokens(ref, ref) == {"lost": 0, "repeated": 0, "wrong": 0}
    assert compare_tokens(ref, ["a", "b", "c", "c", "d", "e"]) == {"lost": 0, "repeated": 1, "wrong": 0}
    # a stream that went back two tokens after "c" and sent them again
    assert compare_tokens(ref, ["a", "b", "c", "b", "c", "d", "e"]) == {"lost": 0, "repeated": 2, "wrong": 0}
    assert compare_tokens(ref, ["a", "b", "c", "x", "y", "d", "e"]) == {"lost": 0, "repeated": 0, "wrong": 2}
    assert compare_tokens(ref, ["a", "b", "e"]) == {"lost": 2, "repeated": 0, "wrong": 0}
    assert compare_tokens(ref, ["a", "x", "c", "d", "e"]) == {"lost": 0, "repeated": 0, "wrong": 1}


def test_the_reference_is_each_prompts_most_common_answer():
    from meshserve.bench.faults_load import RequestResult

    def answer(prompt: int, tokens: list[str], status: str = COMPLETED) -> RequestResult:
        return RequestResult(0, prompt, 0, 0.0, status=status, tokens=tokens)

    reference, differing = reference_tokens([answer(0, ["a"]), answer(0, ["a"]), answer(0, ["b"]),
                                             answer(1, ["c"]), answer(2, ["x"], status=FAILED)])
    assert reference == {0: ["a"], 1: ["c"]} and differing == 1


def test_throughput_series_and_effect():
    from meshserve.bench.faults_load import RequestResult

    times = [0.1 * i for i in range(100)] + [10.0 + 0.5 * i for i in range(4)] + [12.0 + 0.1 * i for i in range(80)]
    series = throughput_series([RequestResult(0, 0, 0, 0.0, token_times=times)], 0.0, 20.0, 1.0)
    assert [p["tokens_per_s"] for p in series[:10]] == [10.0] * 10 and series[10]["tokens_per_s"] == 2.0
    effect = throughput_effect(series, 10.0, 10.0, 20.0)
    assert effect["dip"] == pytest.approx(0.8) and effect["lowest_tokens_per_s"] == pytest.approx(2.0)
    assert effect["throughput_back_s"] == pytest.approx(2.0)  # full rate from 12 s on
    assert throughput_effect(series, 1.0, 0.0, 9.0)["throughput_back_s"] == 0.0  # no dip at all
    # the lowest window right at the injection: back no earlier than the bin after it
    assert throughput_effect(series, 10.0, 11.0, 20.0)["throughput_back_s"] == pytest.approx(1.0)


def test_detection_and_recovery_from_samples():
    before = {"te:d:state": "ready", "te:d:num_recoveries": 0, "te:d:recovering": None, "route:je-0:d": True,
              "je:je-0:health": "ok", "te:c:state": "ready"}
    samples = [(9.0, before),
               (10.5, {**before, "te:c:state": "dead"}),  # another TE: not this fault's
               (11.0, {**before, "te:d:num_recoveries": 1, "te:d:recovering": "rank 1 died"}),
               (12.0, {**before, "te:d:num_recoveries": 1, "te:d:recovering": "rank 1 died", "route:je-0:d": False}),
               (14.0, {**before, "te:d:num_recoveries": 1, "te:d:recovering": None})]
    seen = detection(samples, before, ["d"], 10.0, pool_servers=0)
    assert seen["detect_s"] == pytest.approx(1.0) and seen["detected_by"] == "te:d:recovering: None -> 'rank 1 died'"
    assert seen["routable_again_s"] == pytest.approx(4.0)
    assert [c[1:] for c in seen["changes"]] == [
        ["te:d:recovering", None, "rank 1 died"], ["te:d:num_recoveries", 0, 1], ["route:je-0:d", True, False],
        ["route:je-0:d", False, True], ["te:d:recovering", "rank 1 died", None]]
    assert [c[0] for c in seen["changes"]] == [1.0, 1.0, 2.0, 4.0, 4.0]
    nothing = detection(samples[:2], before, ["d"], 10.0, pool_servers=0)
    assert nothing == {"detect_s": None, "detected_by": None, "routable_again_s": None, "changes": []}


def test_a_link_down_is_seen_and_keeps_its_ends_from_being_whole():
    before = {"te:p:state": "ready", "te:d:state": "ready", "link:d:p": "ok"}
    samples = [(9.0, before), (10.5, {**before, "link:d:p": "down"}), (12.0, {"te:p:state": "ready"}),  # no d stats
               (13.0, {**before, "link:d:p": "down"}), (14.0, before)]
    seen = detection(samples, before, ["p"], 10.0, pool_servers=0)
    assert seen["detected_by"] == "link:d:p: 'ok' -> 'down'" and seen["routable_again_s"] == pytest.approx(4.0)
    assert [c[1:] for c in seen["changes"]] == [["link:d:p", "ok", "down"], ["link:d:p", "down", "ok"]]


def _phase(fault: str, **fields) -> dict:
    base = {"fault": fault, "what": fault, "accepted": 10, "completed": 8, "failed": 1, "hung": 1, "retries": 2,
            "resumes": 1, "tokens_lost": 0, "tokens_repeated": 3, "tokens_wrong": 0, "requests_differing": 1,
            "errors": {}, "requests": []}
    return {**base, **fields}


def test_summary_table_and_plot(tmp_path):
    result = {"settings": {"pool": False}, "phases": [
        _phase("none", tokens_per_s=40.0, reference_differing=0),
        _phase("kill_je", injected=True, inject_s=20.0, detect_s=0.3, detected_by="je:je-1:health: 'ok' -> "
               "'unreachable'", routable_again_s=9.5, throughput_back_s=1.0, dip=0.4, lowest_at_s=0.5),
        _phase("collective_error", injected=False, detail="HTTP 400", inject_s=60.0, detect_s=None,
               routable_again_s=None, throughput_back_s=0.0, dip=0.0)],
        "timeline": {"bin_s": 1.0, "tokens_per_s": [{"t": float(t), "tokens_per_s": 40.0 - (t == 21)} for t in
                                                     range(80)]}}
    lines = summary_lines(result)
    table = "\n".join(lines)
    assert "kill_je" in table and "0.3" in table and "40% @0s" in table and "2+1" in table
    assert "collective_error (not injected)" in table
    assert "first seen as je:je-1:health" in table
    assert plot_faults(result, tmp_path / "faults.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--faults", "kill_je,nonsense"], "--faults: unknown nonsense"),
    (["--faults", "kill_pool_server", "--no-pool"], "needs the memory pool"),
    (["--runs", "0"], "--runs must be at least 1"),
    (["--quick", "--observe-s", "0"], "--observe-s must be positive"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--faults", "kill_decode_expert_rank"], "needs a disaggregated --decode-parallel"),
    (["--decode-parallel", "attn=DP3 moe=EP2 disagg domains=2"], "--decode-parallel: domains=2 must divide"),
])
def test_bad_arguments_are_one_line(args, message, capsys):
    assert main(["bench", "faults", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_quick_run_on_the_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "faults"
    model = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    # the shortest phases that still hold load before and after each injection
    assert main(["bench", "faults", "--quick", "--warmup-s", "2", "--observe-s", "6", "--model", str(model),
                 "--out", str(out), "--settle-s", "120"]) == 0
    result = json.loads((out / "faults.json").read_text())
    assert (out / "faults.png").stat().st_size > 0
    phases = result["phases"]
    assert [p["fault"] for p in phases] == ["none", *QUICK_FAULTS]
    assert set(QUICK_FAULTS) <= set(FAULT_NAMES) and set(result["faults"]) == set(QUICK_FAULTS)
    for phase in phases:
        assert phase["accepted"] == phase["completed"] + phase["failed"] + phase["hung"] == len(phase["requests"])
        assert phase["accepted"] > 0
        for key in ("retries", "resumes", "tokens_lost", "tokens_repeated", "tokens_wrong", "requests_differing"):
            assert phase[key] >= 0, key
    reference = phases[0]
    assert reference["completed"] > 0 and reference["tokens_per_s"] > 0 and reference["failed"] == 0
    for phase in phases[1:]:
        assert {"injected", "detail", "inject_s", "detect_s", "detected_by", "routable_again_s",
                "throughput_back_s", "dip", "lowest_at_s", "changes", "clean_up"} <= set(phase)
        assert phase["start_s"] <= phase["inject_s"] <= phase["stop_sending_s"] <= phase["end_s"]
    kill_je = next(p for p in phases if p["fault"] == "kill_je")
    # a killed process is always injected, and the JE's /health stops answering: seen without new features
    assert kill_je["injected"] and kill_je["detect_s"] is not None
    series = result["timeline"]["tokens_per_s"]
    assert series and all(p["tokens_per_s"] >= 0 for p in series)
    printed = capsys.readouterr().out
    assert "fault" in printed and "kill_je" in printed and "wrote" in printed
