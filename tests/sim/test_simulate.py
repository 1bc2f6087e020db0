"""`meshserve simulate` (meshserve/sim/): the step-time profile and its fit, traces, and a TE's own control plane
on virtual time — the same scheduler class that serves, results that follow its settings, bad input refused in
one line."""
from __future__ import annotations

import dataclasses
import json
import logging
import statistics

import pytest

from meshserve.core import scheduler as served_scheduler
from meshserve.core import waiting_queue as served_queue
from meshserve.entrypoints.cli import main
from meshserve.sim.profile import TERMS, GroupWork, ProfileError, StepProfile, fit
from meshserve.sim.run import simulate
from meshserve.sim.te import SimTE, SimTESettings
from meshserve.sim.trace import TraceError, TraceRequest, poisson, read_jsonl

PROFILE = StepProfile(name="test", source="made up for the tests", base_ms=3.0, per_decode_row_ms=0.25,
                      per_prefill_token_ms=0.1, per_context_kilotoken_ms=0.8, per_prefill_megapair_ms=0.3,
                      delivery_ms=2.0)


def test_a_step_costs_its_slowest_groups_work():
    small, large = GroupWork(decode_rows=4, context_tokens=1000), GroupWork(decode_rows=2, prefill_tokens=100)
    assert PROFILE.group_seconds(small) == pytest.approx(1e-3 * (3.0 + 1.0 + 0.8))
    assert PROFILE.step_seconds([small, large]) == pytest.approx(1e-3 * (3.0 + 0.5 + 10.0))


def test_each_dp_group_with_nothing_to_do_shortens_the_step_by_the_idle_group_term():
    idle = dataclasses.replace(PROFILE, per_idle_group_ms=1.5, dp=4)
    busy, rest = GroupWork(decode_rows=4, context_tokens=1000), GroupWork()
    assert idle.step_seconds([busy, busy]) == PROFILE.step_seconds([busy, busy])
    assert idle.step_seconds([busy, rest, rest]) == pytest.approx(PROFILE.group_seconds(busy) - 2 * 1.5e-3)
    # a step with no group busy: all but one count as idle, and it never comes out below zero
    assert idle.step_seconds([rest] * 4) == pytest.approx(max(0.0, PROFILE.group_seconds(rest) - 3 * 1.5e-3))
    with pytest.raises(ProfileError, match="per_idle_group_ms must be a number >= 0"):
        dataclasses.replace(PROFILE, per_idle_group_ms=-1.0)


def test_the_fit_recovers_the_idle_group_term_where_steps_had_idle_groups():
    truth = dataclasses.replace(PROFILE, per_idle_group_ms=2.5, dp=2)
    decode = [GroupWork(decode_rows=b, context_tokens=c) for b, c in ((1, 50), (2, 200), (8, 800), (2, 2000))]
    steps = [(w, truth.step_seconds([w, w if b > 1 else GroupWork()]), 0 if b > 1 else 1)
             for w, b in zip(decode, (1, 4, 16, 4))]
    prompts = [(GroupWork.prompt(p), idle) for p in (64, 256, 512, 1024) for idle in (1, 0)
               if idle or p <= 256]  # lone prompts, and two side by side
    first_tokens = [(w, truth.step_seconds([w, GroupWork() if idle else w]) + 1e-3 * truth.delivery_ms, idle)
                    for w, idle in prompts]
    fitted = fit("fitted", "test", steps, first_tokens)
    for term in (*TERMS, "per_idle_group_ms"):
        assert getattr(fitted, term) == pytest.approx(getattr(truth, term), rel=1e-3)
    # without steps that had a group idle, the term is not fitted (one TE of one group)
    assert fit("one", "test", [(w, PROFILE.group_seconds(w)) for w in decode],
               [(w, PROFILE.group_seconds(w)) for w, _ in prompts]).per_idle_group_ms == 0.0


def test_the_fit_recovers_the_terms_of_measured_steps():
    steps = [GroupWork(decode_rows=b, context_tokens=c) for b, c in ((1, 50), (4, 200), (16, 800), (4, 2000))]
    prompts = [GroupWork.prompt(p) for p in (64, 256, 512, 1024)]
    fitted = fit("fitted", "test", [(w, PROFILE.group_seconds(w)) for w in steps],
                 [(w, PROFILE.group_seconds(w) + 1e-3 * PROFILE.delivery_ms) for w in prompts])
    for term in TERMS:
        assert getattr(fitted, term) == pytest.approx(getattr(PROFILE, term), rel=1e-3)
    # a term the data would make negative is dropped, never negative
    noisy = fit("noisy", "test", [(GroupWork(decode_rows=b), 1e-3 * (5.0 - 0.1 * b)) for b in (1, 2, 4, 8, 16, 32)])
    assert min(noisy.base_ms, noisy.per_decode_row_ms, noisy.per_prefill_token_ms) >= 0
    with pytest.raises(ProfileError, match="at least as many"):
        fit("short", "test", [(GroupWork(decode_rows=1), 0.003)])


def test_a_profile_file_missing_a_term_is_refused_in_one_line(tmp_path):
    path = tmp_path / "profile.json"
    data = PROFILE.to_dict()
    path.write_text(json.dumps(data))
    assert StepProfile.load(path) == PROFILE
    del data["per_decode_row_ms"]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="lacks per_decode_row_ms") as err:
        StepProfile.load(path)
    assert "\n" not in str(err.value)
    with pytest.raises(ProfileError, match="base_ms must be a number >= 0"):
        StepProfile.from_dict({**PROFILE.to_dict(), "base_ms": -1.0})


def test_traces_are_seeded_and_bad_ones_are_refused(tmp_path):
    trace = poisson(2.0, 50, (8, 16), (4, 8), seed=3)
    assert trace == poisson(2.0, 50, (8, 16), (4, 8), seed=3)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace) and trace[0].arrival_s == 0
    assert all(8 <= r.prompt_len <= 16 and 4 <= r.output_len <= 8 for r in trace)
    with pytest.raises(TraceError, match="prompt_len must be a positive integer"):
        TraceRequest(0.0, -3, 4)
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_s": 1.0, "prompt_len": 5, "output_len": 2}\n'
                    '{"arrival_s": 0.5, "prompt_len": 7, "output_len": 3}\n')
    assert [r.prompt_len for r in read_jsonl(path)] == [7, 5]  # sorted by arrival
    path.write_text('{"arrival_s": 1.0, "prompt_len": 5}\n')
    with pytest.raises(TraceError, match="trace.jsonl:1: missing field 'output_len'"):
        read_jsonl(path)


def test_the_simulated_te_runs_the_schedulers_and_queue_that_serve():
    te = SimTE(SimTESettings(dp=2), PROFILE)
    assert type(te.schedulers[0]) is served_scheduler.Scheduler
    assert type(te.queue) is served_queue.DPWaitingQueue


def test_a_te_that_idled_wakes_slower_by_the_profiles_waking_cost():
    """Two lone requests 2 s apart: with a waking cost of 40 ms after 1 s idle (20 ms after 0.5 s), each first
    step after an idle second pays it; a request of 5 tokens pays it once, not in the steps that follow its first;
    the profile refuses waking points that are not (idle_s rising, extra_ms) pairs >= 0."""
    woken = dataclasses.replace(PROFILE, wake_after_idle=((1.0, 40.0),))
    assert woken.wake_seconds(0.5) == pytest.approx(0.020) and woken.wake_seconds(5.0) == pytest.approx(0.040)
    assert PROFILE.wake_seconds(5.0) == 0.0
    apart = [TraceRequest(2.0, 16, 1), TraceRequest(4.0, 16, 1)]
    plain, slow = (simulate(apart, SimTE(SimTESettings(), p), progress=False)["ttfts"] for p in (PROFILE, woken))
    assert slow == pytest.approx([t + 0.040 for t in plain])
    longer = [TraceRequest(2.0, 16, 5)]
    plain, slow = (simulate(longer, SimTE(SimTESettings(), p), progress=False)["virtual_s"] for p in (PROFILE, woken))
    assert slow == pytest.approx(plain + 0.040)
    for bad in (((1.0, -2.0),), ((1.0, 5.0), (0.5, 9.0)), ((1.0,),)):
        with pytest.raises(ProfileError, match="wake_after_idle"):
            dataclasses.replace(PROFILE, wake_after_idle=bad)


def test_a_request_joining_running_work_takes_its_host_work_from_the_step_after_its_first():
    """30 ms of host work per request: a lone request pays none (its intake is its delivery, as calibrated); one
    that joins a decoding request stretches the step after the one that prefills it, so its first token comes as
    without it, and the run ends 30 ms later."""
    busy = dataclasses.replace(PROFILE, per_request_ms=30.0)
    lone = [TraceRequest(0.0, 16, 4)]
    plain, charged = (simulate(lone, SimTE(SimTESettings(), p), progress=False) for p in (PROFILE, busy))
    assert charged["virtual_s"] == pytest.approx(plain["virtual_s"])
    joining = [TraceRequest(0.0, 16, 40), TraceRequest(0.05, 16, 4)]
    plain, charged = (simulate(joining, SimTE(SimTESettings(), p), progress=False) for p in (PROFILE, busy))
    assert charged["ttfts"] == pytest.approx(plain["ttfts"])
    assert charged["virtual_s"] == pytest.approx(plain["virtual_s"] + 0.030)
    assert charged["tpot_s"]["max"] > plain["tpot_s"]["max"]
    with pytest.raises(ProfileError, match="per_request_ms must be a number >= 0"):
        dataclasses.replace(PROFILE, per_request_ms=-1.0)


def test_a_requests_host_work_follows_the_gap_since_the_request_before_it():
    """Host work of 5 ms a request 10 ms after another, 20 ms after 100 ms: on the line between, flat beyond. A
    request joining a decoding one 50 ms after it stretches the run by the line's figure at 50 ms; the profile
    refuses points that are not (gap_s rising, ms) pairs >= 0."""
    by_gap = dataclasses.replace(PROFILE, per_request_after_gap=((0.01, 5.0), (0.1, 20.0)))
    assert [by_gap.request_host_seconds(gap) for gap in (0.001, 0.01, 0.055, 0.1, 3.0)] == pytest.approx(
        [0.005, 0.005, 0.0125, 0.020, 0.020])
    assert PROFILE.request_host_seconds(0.05) == 0.0  # no points: per_request_ms
    assert StepProfile.from_dict(json.loads(json.dumps(by_gap.to_dict()))) == by_gap  # the file keeps them
    joining = [TraceRequest(0.0, 16, 40), TraceRequest(0.05, 16, 4)]
    plain, charged = (simulate(joining, SimTE(SimTESettings(), p), progress=False) for p in (PROFILE, by_gap))
    assert charged["virtual_s"] == pytest.approx(plain["virtual_s"] + 0.005 + 0.015 * 4 / 9)  # 40 of the 90 ms
    for bad in (((0.1, -2.0),), ((0.1, 5.0), (0.01, 9.0)), ((0.1,),)):
        with pytest.raises(ProfileError, match="per_request_after_gap"):
            dataclasses.replace(PROFILE, per_request_after_gap=bad)


def _run(trace, **settings) -> dict:
    return simulate(trace, SimTE(SimTESettings(**settings), PROFILE), progress=False)


def test_every_request_gets_its_tokens_and_the_metrics_follow_the_settings():
    trace = poisson(20.0, 64, (16, 128), (8, 32), seed=1)
    result = _run(trace, max_num_seqs=16)
    assert result["completed"] == result["requests"] == 64
    assert result["output_tokens"] == sum(r.output_len for r in trace)
    assert result == _run(trace, max_num_seqs=16) | {"wall_s": result["wall_s"], "events_per_s": result["events_per_s"]}
    # the scheduler's own limits change what the clock shows: fewer sequences per step queue the others longer
    narrow = _run(trace, max_num_seqs=2)
    assert narrow["ttft_s"]["p50"] > result["ttft_s"]["p50"] and narrow["steps"] > result["steps"]
    # two DP groups: the balancer spreads the requests, each group's step holds fewer
    two_groups = _run(trace, max_num_seqs=16, dp=2)
    assert two_groups["completed"] == 64 and two_groups["mean_step_ms"] < result["mean_step_ms"]


def test_the_command_writes_json_and_png_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    out = tmp_path / "sim.json"
    assert main(["simulate", "run", "--profile", str(profile), "--rate", "8", "--requests", "20",
                 "--input-len", "16:64", "--output-len", "4:16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 20 and out.with_suffix(".png").stat().st_size > 0
    assert "TTFT ms p50" in capsys.readouterr().out
    for flags, message in ((["--profile", str(tmp_path / "missing.json")], "cannot read profile"),
                           (["--profile", str(profile), "--input-len", "9"], "--input-len must be LOW:HIGH"),
                           (["--profile", str(profile), "--output-len", "5:2"], "output_len range 5:2"),
                           (["--profile", str(profile), "--dp", "0"], "dp must be a positive integer"),
                           (["--profile", str(profile), "--dp", "2"], "fitted on a TE of 1 DP group(s)")):
        assert main(["simulate", "run", *flags, "--json", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1


def test_a_profile_simulates_the_dp_groups_it_was_fitted_on(tmp_path, capsys):
    """A profile's terms are per DP group of the TE it was fitted on: `run` simulates that many groups unless told,
    and `compare` refuses a layout of another DP degree."""
    profile = tmp_path / "dp2.json"
    profile.write_text(json.dumps(dataclasses.replace(PROFILE, dp=2).to_dict()))
    out = tmp_path / "sim.json"
    assert main(["simulate", "run", "--profile", str(profile), "--rate", "8", "--requests", "8",
                 "--input-len", "16:64", "--output-len", "4:16", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["te"]["dp"] == 2
    assert main(["simulate", "compare", "--profile", str(profile), "--requests", "4", "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--parallel has 1 DP group(s)" in err and len(err.splitlines()) == 1
    with pytest.raises(ProfileError, match="dp must be a whole number"):
        dataclasses.replace(PROFILE, dp=0)


def test_a_change_to_the_served_dp_balancer_changes_the_simulated_result(monkeypatch):
    """The simulation places requests with the code the master calls (no copy): every request on group 0 in
    place of the balancer's choice gives group 0 every token."""
    trace = poisson(50.0, 48, (16, 64), (8, 16), seed=2)
    balanced = _run(trace, dp=2)

    def everything_on_group_0(items, block_size, loads, prefix_hits):
        return [(item, 0) for item in items]
    monkeypatch.setattr(served_queue, "place_batch", everything_on_group_0)
    lopsided = _run(trace, dp=2)
    assert lopsided["completed"] == balanced["completed"] == 48
    assert lopsided["mean_step_ms"] > balanced["mean_step_ms"] and lopsided["virtual_s"] > balanced["virtual_s"]


def test_delivery_delays_every_token_a_client_sees_alike():
    """The trip to the client adds to the time to the first token, not to the time between tokens."""
    trace = poisson(10.0, 16, (16, 64), (8, 16), seed=4)
    slow_link = StepProfile.from_dict({**PROFILE.to_dict(), "delivery_ms": 50.0})
    fast, slow = (simulate(trace, SimTE(SimTESettings(), p), progress=False) for p in (PROFILE, slow_link))
    assert slow["ttft_s"]["p50"] == pytest.approx(fast["ttft_s"]["p50"] + 0.048, abs=1e-9)  # 50 ms against 2
    assert slow["tpot_s"]["p50"] == pytest.approx(fast["tpot_s"]["p50"], abs=1e-12)


def test_a_pipelined_master_sees_a_new_request_one_step_later_when_busy():
    trace = poisson(40.0, 48, (16, 64), (16, 32), seed=5)
    pipelined, one_at_a_time = (_run(trace, pipeline_depth=depth) for depth in (2, 1))
    assert pipelined["ttft_s"]["p50"] > one_at_a_time["ttft_s"]["p50"]
    assert pipelined["completed"] == one_at_a_time["completed"] == 48
    with pytest.raises(ValueError, match="pipeline_depth must be 1 or 2"):
        SimTESettings(pipeline_depth=3)


def test_requests_stream_through_an_http_server_as_bench_serve_sends_them():
    """`simulate calibrate --url` measures a running server (any deployment) through its API."""
    import asyncio

    import httpx

    from meshserve.sim.compare import stream_http
    from tests.bench import fake_openai_server as fake

    async def one(url: str, output_len: int):
        async with httpx.AsyncClient(base_url=url) as client:
            arrivals: list[float] = []
            sent, first, last, tokens = await stream_http(client, "fake-model", [5, 6, 7], output_len,
                                                          arrivals=arrivals)
            return sent, first, last, tokens, arrivals

    with fake.running_server() as (url, received):
        sent, first, last, tokens, arrivals = asyncio.run(one(url, 5))
        assert tokens == 5 and len(arrivals) == 5 and arrivals[0] == first and arrivals[-1] == last
        assert first - sent >= fake.FIRST_TOKEN_S and (last - first) / 4 >= fake.TOKEN_S
        assert received[-1]["prompt"] == [5, 6, 7] and received[-1]["ignore_eos"] is True
        with pytest.raises(RuntimeError, match="answered 400"):
            asyncio.run(one(url, fake.MAX_TOKENS + 1))


def test_calibrate_refuses_bad_input_in_one_line(tmp_path, capsys):
    out = str(tmp_path / "profile.json")
    for flags, message in ((["--pd"], "--pd describes the deployment behind --url"),
                           (["--url", "http://127.0.0.1:9"], "cannot list the models of http://127.0.0.1:9"),
                           (["--repeats", "0"], "--repeats must be at least 1")):
        assert main(["simulate", "calibrate", "--out", out, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]
    # a calibration through a server logs its rounds, not a line per request of its thousands
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING


def test_the_other_tes_load_runs_only_while_a_measurement_does():
    """`calibrate --pd` keeps the prefill TE prefilling while a decode step is timed beside it, and only then."""
    import asyncio

    from meshserve.sim.calibrate import _busy

    ticks: list[int] = []

    async def load() -> None:
        while True:
            ticks.append(1)
            await asyncio.sleep(0.001)

    async def measure() -> tuple[int, int]:
        async with _busy(load):
            await asyncio.sleep(0.02)
            during = len(ticks)
        await asyncio.sleep(0.02)
        async with _busy(None):  # no load: nothing runs
            await asyncio.sleep(0.01)
        return during, len(ticks)
    during, after = asyncio.run(measure())
    assert during > 0 and after == during  # cancelled with the block


def test_only_a_prompts_last_chunk_samples_a_token():
    """The engine computes logits for the rows it samples: a prompt chunked over three steps samples in its
    third, and the decode rows beside it in every step."""
    te = SimTE(SimTESettings(max_num_batched_tokens=64, prefix_caching=False), PROFILE)
    te.admit("long", TraceRequest(0.0, 150, 4), 0.0)
    sampled = []
    while te.has_work():
        te.step(0.0)
        sampled.append((te.last_work[0].prefill_tokens, te.last_work[0].sampled_rows))
    assert sampled[:3] == [(64, 0), (64, 0), (22, 1)]  # 150 = 64 + 64 + 22
    assert sampled[3:] == [(0, 1)] * 3  # then one decode row a step for the other three tokens


# the arrivals workload's two rates on a made-up server: a lone request every 5 and 20 ms
FAST_ARRIVALS = ((200.0, (16, 32, 160), (24, 144)), (50.0, (16, 32, 240), (24, 224)))


class ArrivalsWorkload:
    """A made-up server's part for the calibration's arrivals workload (FAST_ARRIVALS): the batch steps every
    `token_s`, and each lone request sent while it decodes makes its later steps longer in all by `per_lone_s`'s
    figure for the batch's rate (by the batch's output tokens); a lone request's first token comes 2 ms after it
    is sent."""

    def __init__(self, token_s: float, per_lone_s: dict[int, float]) -> None:
        self.token_s, self.per_lone_s = token_s, per_lone_s
        self.batch_start, self.lone_sent, self.stretch_s = 0.0, [], 0.0  # the batch's: start, lone sends, stretch

    def is_batch(self, output_len: int) -> bool:
        return output_len in self.per_lone_s

    def stretched(self, moment: float) -> float:
        """`moment` once the lone requests sent before it stretched the batch's steps."""
        return moment + self.stretch_s * sum(self.batch_start <= sent < moment for sent in self.lone_sent)

    async def batch(self, arrivals: list[float], output_len: int) -> tuple:
        """A request of the batch: its tokens, later by the lone requests sent before each."""
        import asyncio
        import time

        start = self.batch_start = time.monotonic()
        self.stretch_s = self.per_lone_s[output_len]
        nominal = [start + i * self.token_s for i in range(output_len)]
        early = FAST_ARRIVALS[0][2][0] // 2
        arrivals.extend(nominal[:early])  # decoding: the workload starts sending its lone requests
        await asyncio.sleep(nominal[-1] - start)
        arrivals.extend(self.stretched(moment) for moment in nominal[early:])
        return start, arrivals[0], arrivals[-1], len(arrivals)

    def lone(self, output_len: int) -> tuple:
        """A lone request sent now: its (sent, first, last, tokens) on the batch's stretched clock."""
        import time

        self.lone_sent.append(time.monotonic())
        sent = self.stretched(self.lone_sent[-1])
        return sent, sent + 0.002, sent + 0.003, output_len


def test_calibration_measures_in_rounds_and_takes_the_mixed_step_the_prompt_came_out_of(capsys, monkeypatch):
    """A made-up server: every workload comes once per round (a host's drift moves every point alike); a decoding
    batch's tokens come every 10 ms but for the step that prefilled the joining prompt (40 ms, ending when the
    prompt's first token comes) and a later hiccup of the host (60 ms): the mixed step is the 40 ms one. A lone
    prompt takes 30 ms more after the server idled 50 ms, 50 ms more after 100 ms: the waking cost, fitted apart
    from the prefill. Each lone request sent while the arrivals workload's batch decodes stretches the batch's
    steps by 8 ms in all when they come 5 ms apart, 14 ms when they come 20 ms apart: the host work per request by
    the gap before it, less the request's own prefill and row."""
    import time

    from meshserve.sim import calibrate as calibration
    from meshserve.sim.calibrate import (
        ARRIVAL_REQUEST,
        DECODE_POINTS,
        MIXED_OUTPUT,
        MIXED_POINTS,
        PREFILL_OUTPUT,
        PREFILL_POINTS,
        calibrate,
    )

    monkeypatch.setattr(calibration, "IDLE_S", 0.0)  # lone prompts one after another
    monkeypatch.setattr(calibration, "WAKE_IDLE_TIMES_S", (0.05, 0.1))  # ... but these after 50 and 100 ms idle
    gaps = [0.010] * (MIXED_OUTPUT - 1)
    gaps[20], gaps[40] = 0.040, 0.060  # the prompt's step; a hiccup
    times = [sum(gaps[:i]) for i in range(MIXED_OUTPUT)]
    monkeypatch.setattr(calibration, "ARRIVAL_RUNS", FAST_ARRIVALS)  # a lone request every 5 and 20 ms ...
    token_s, per_lone_s = 0.001, {160: 0.008, 240: 0.014}  # ... beside a batch stepping every 1 ms, each this more

    class Streamer:
        name, path = "made up", "a made-up server"

        def __init__(self) -> None:
            self.asked: list[tuple[int, int]] = []  # (prompt tokens, output tokens)
            self.idle_before_shortest: list[float] = []  # the idling before each lone prompt of the shortest
            self.batch_decoding = False
            self.last_end = time.monotonic()
            self.arrivals_workload = ArrivalsWorkload(token_s, per_lone_s)

        async def open(self) -> None: ...

        async def close(self) -> None: ...

        async def __call__(self, prompt, output_len, arrivals=None):
            self.asked.append((len(prompt), output_len))
            idle_s, self.last_end = time.monotonic() - self.last_end, time.monotonic()
            if self.arrivals_workload.is_batch(output_len):
                return await self.arrivals_workload.batch(arrivals, output_len)
            if output_len == ARRIVAL_REQUEST[1]:  # a lone request beside it
                return self.arrivals_workload.lone(output_len)
            if arrivals is not None:  # a decoding batch of the mixed workload
                arrivals.extend(times)
                self.batch_decoding = True
                return 0.0, times[0], times[-1], MIXED_OUTPUT
            if output_len == 1 and self.batch_decoding:  # the prompt joining it: out with the 40 ms step
                self.batch_decoding = False
                return 0.0, times[21], times[21], 1
            if output_len == PREFILL_OUTPUT:  # a lone prompt: 2 ms + 0.1 ms a token, 30 or 50 ms more after idling
                if len(prompt) == PREFILL_POINTS[0]:
                    self.idle_before_shortest.append(idle_s)
                ttft = 0.002 + 1e-4 * len(prompt) + (0.050 if idle_s > 0.09 else 0.030 if idle_s > 0.04 else 0.0)
                return 0.0, ttft, ttft + 0.010 * (output_len - 1), output_len
            return 0.0, 0.1, 0.1 + 0.010 * (output_len - 1), output_len

    streamer = Streamer()
    profile = calibrate(streamer, dp=1, repeats=2)
    # every workload once per round, in the same order each round
    one_round = [prompt for size, prompt, _ in DECODE_POINTS for _ in range(size)]
    assert [prompt for prompt, out in streamer.asked if out == 48] == one_round * 2
    # the lone prompts, then the waking's (right after the one before, AWAKE_REPEATS times, then after each idling),
    # all decoding on after their first token (after the warm-up's two requests)
    one_round = [*PREFILL_POINTS, *[PREFILL_POINTS[0]] * (calibration.AWAKE_REPEATS + 2)]
    assert [prompt for prompt, out in streamer.asked if out == PREFILL_OUTPUT][2:] == one_round * 2
    one_round = [prompt for _, prompt in MIXED_POINTS]
    assert [prompt for prompt, out in streamer.asked if out == 1] == one_round * 2
    # each round: the prefill point right after the decode points, then the waking's after AWAKE_PAUSE_S (the step
    # pipelined after the last token ends first), 50 and 100 ms
    paused = [idle >= calibration.AWAKE_PAUSE_S for idle in streamer.idle_before_shortest]
    assert paused == [False, *[True] * (calibration.AWAKE_REPEATS + 2)] * 2
    err = capsys.readouterr().err
    assert "round 1 of 2 done" in err and "round 2 of 2 done" in err
    for size, prompt_len in MIXED_POINTS:
        assert f"{size} decoding + a {prompt_len}-token prompt: 40.0 ms for that step" in err
    assert [x for point in profile.wake_after_idle for x in point] == pytest.approx(
        [0.0, 0.0, 0.05, 30.0, 0.1, 50.0], abs=1e-6)
    assert profile.wake_seconds(0.025) == pytest.approx(0.015) and profile.wake_seconds(0.075) == pytest.approx(0.040)
    assert profile.wake_seconds(1.0) == pytest.approx(0.050)
    prompt_len, output_len = ARRIVAL_REQUEST
    own_ms = (profile.per_decode_row_ms * (output_len - 1) + profile.per_prefill_token_ms * prompt_len
              + profile.per_prefill_megapair_ms * prompt_len ** 2 / 2e6)
    assert [x for point in profile.per_request_after_gap for x in point] == pytest.approx(
        [0.005, 8.0 - own_ms, 0.02, 14.0 - own_ms], abs=0.5)
    assert profile.per_request_ms == profile.per_request_after_gap[0][1]
    assert "200 lone requests a second beside a decoding batch" in err and "50 lone requests a second" in err


def test_a_dp_calibration_sends_prompts_side_by_side_and_fits_the_steps_with_groups_idle(capsys, monkeypatch):
    """A made-up server of two DP groups whose every step takes what a profile with an idle-group term gives it
    (a request alone leaves the other group idle, the side-by-side prompts and larger batches none): the calibration
    sends one prompt per group at once, after the same idling as the lone prompts, and fits the term back. A prompt
    after 50 ms idle takes 4 ms longer than one right after another: on a TE of several groups the waking counts
    from the lone prompts after IDLE_S, whose delivery keeps it."""
    import asyncio
    import time

    from meshserve.sim import calibrate as calibration
    from meshserve.sim.calibrate import (
        MIXED_OUTPUT,
        MIXED_POINTS,
        PREFILL_OUTPUT,
        SIDE_BY_SIDE_POINTS,
        calibrate,
    )

    truth = dataclasses.replace(PROFILE, base_ms=6.0, per_idle_group_ms=2.5, dp=2)
    monkeypatch.setattr(calibration, "IDLE_S", 0.05)
    monkeypatch.setattr(calibration, "WAKE_IDLE_TIMES_S", ())
    monkeypatch.setattr(calibration, "ARRIVAL_RUNS", FAST_ARRIVALS)

    def step(*groups: GroupWork) -> float:
        return truth.step_seconds([*groups, *[GroupWork()] * (2 - len(groups))])

    class Streamer:
        name, path = "made up", "a made-up server"

        def __init__(self) -> None:
            self.in_flight: dict[tuple[int, int], int] = {}
            self.side_by_side: list[tuple[int, float]] = []  # (prompt tokens, idling before): two sent at once
            self.last_end = time.monotonic()
            self.arrivals_workload = ArrivalsWorkload(0.001, {160: 0.0, 240: 0.0})
            self.mixed_index, self.mixed_times = 0, []

        async def open(self) -> None: ...

        async def close(self) -> None: ...

        async def at_once(self, key: tuple[int, int]) -> int:
            """How many requests of this shape were sent at once with this one."""
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            await asyncio.sleep(0)
            count = self.in_flight[key]
            await asyncio.sleep(0)
            self.in_flight[key] -= 1
            return count

        async def __call__(self, prompt, output_len, arrivals=None):
            idle_s = time.monotonic() - self.last_end
            count = await self.at_once((len(prompt), output_len))
            self.last_end = time.monotonic()
            if self.arrivals_workload.is_batch(output_len):
                return await self.arrivals_workload.batch(arrivals, output_len)
            if output_len == 2:  # the arrivals workload's lone requests
                return self.arrivals_workload.lone(output_len)
            if output_len == 1:  # the prompt joining the mixed workload's batch: out with the batch's 21st token
                self.mixed_index += 1
                return 0.0, self.mixed_times[21], self.mixed_times[21], 1
            woken_s = 0.004 if idle_s > 0.04 else 0.0
            if output_len == PREFILL_OUTPUT and count == 1:  # a lone prompt
                ttft = step(GroupWork.prompt(len(prompt))) + 1e-3 * truth.delivery_ms + woken_s
                return 0.0, ttft, ttft, output_len
            if output_len == PREFILL_OUTPUT:  # one of the prompts side by side
                self.side_by_side.append((len(prompt), idle_s))
                ttft = (step(GroupWork.prompt(len(prompt)), GroupWork.prompt(len(prompt))) + 1e-3 * truth.delivery_ms
                        + woken_s)
                return 0.0, ttft, ttft, output_len
            if arrivals is not None:  # the mixed workload's decoding batch: its 21st gap is the joining prompt's
                size, prompt_len = MIXED_POINTS[self.mixed_index % len(MIXED_POINTS)]
                rows = size // 2
                work = GroupWork(decode_rows=rows, context_tokens=rows * (32 + MIXED_OUTPUT // 2))
                joined = dataclasses.replace(work, prefill_tokens=prompt_len, prefill_pairs=prompt_len ** 2 / 2)
                gaps = [step(work, work)] * (MIXED_OUTPUT - 1)
                gaps[20] = step(joined, work)
                self.mixed_times = [sum(gaps[:i]) for i in range(MIXED_OUTPUT)]
                arrivals.extend(self.mixed_times)
                return 0.0, arrivals[0], arrivals[-1], MIXED_OUTPUT
            rows = max(1, count // 2)
            work = GroupWork(decode_rows=rows, context_tokens=rows * (len(prompt) + output_len // 2))
            gap = step(*[work] * min(count, 2))
            return 0.0, 0.1, 0.1 + gap * (output_len - 1), output_len

    streamer = Streamer()
    profile = calibrate(streamer, dp=2, repeats=1)
    # after the warm-up's two requests, each point's two prompts at once, after the lone prompts' idling
    assert [prompt for prompt, _ in streamer.side_by_side[2:]] == [p for p in SIDE_BY_SIDE_POINTS for _ in "ab"]
    assert all(idle >= calibration.IDLE_S for _, idle in streamer.side_by_side[2:])
    err = capsys.readouterr().err
    for prompt_len in SIDE_BY_SIDE_POINTS:
        ttft = 1e3 * step(GroupWork.prompt(prompt_len), GroupWork.prompt(prompt_len)) + truth.delivery_ms + 4.0
        assert f"prefill {prompt_len} tokens side by side, one prompt per group: {ttft:.1f} ms" in err
    assert "2 side-by-side" in profile.source
    assert "the waking counted from the one after 0.05 s idle (2 DP groups): 0.0 ms more after 0.05 s idle" in err
    assert profile.wake_after_idle == ((0.05, 0.0),)
    woken = dataclasses.replace(truth, delivery_ms=truth.delivery_ms + 4.0)
    for term in (*TERMS, "per_idle_group_ms"):
        assert getattr(profile, term) == pytest.approx(getattr(woken, term), rel=0.05, abs=0.02), term


def test_a_pd_calibration_times_each_te_alone_and_measures_each_ones_stretch_beside_the_other(capsys, monkeypatch):
    """A made-up P/D server: a decoding batch steps every 10 ms, 13 ms while the prefill TE prefills; a lone prompt
    takes 20 ms to its first token, 34 ms while the decode TE decodes a batch. The fit's points are taken alone, the
    stretches (1.3x, 1.7x) go to the profile's two tables. Each lone request of the arrivals workload stretches the
    batch's steps by 6 ms in all: the host work per request, less its own decode row and what the prefill TE's step
    for it stretches the batch's beside it (its prompt runs there)."""
    import asyncio
    import time

    from meshserve.sim import calibrate as calibration
    from meshserve.sim.calibrate import (
        ARRIVAL_REQUEST,
        PD_DECODE_BATCH,
        PD_DECODING,
        PD_PROMPT,
        PREFILL_OUTPUT,
        calibrate,
    )

    for constant in ("IDLE_S", "PD_PAUSE_S"):
        monkeypatch.setattr(calibration, constant, 0.0)
    monkeypatch.setattr(calibration, "WAKE_IDLE_TIMES_S", (0.01,))
    monkeypatch.setattr(calibration, "ARRIVAL_RUNS", FAST_ARRIVALS)
    token_s, per_lone_s = 0.001, {160: 0.006, 240: 0.006}

    class Streamer:
        name, path = "made up", "a made-up P/D server"

        def __init__(self) -> None:
            self.prompts_in_flight = self.batches_decoding = 0
            self.asked: list[tuple[int, int]] = []
            self.arrivals_workload = ArrivalsWorkload(token_s, per_lone_s)

        async def open(self) -> None: ...

        async def close(self) -> None: ...

        async def __call__(self, prompt, output_len, arrivals=None):
            self.asked.append((len(prompt), output_len))
            now = time.monotonic()
            if self.arrivals_workload.is_batch(output_len):
                return await self.arrivals_workload.batch(arrivals, output_len)
            if output_len == ARRIVAL_REQUEST[1]:
                return self.arrivals_workload.lone(output_len)
            if output_len in (1, PREFILL_OUTPUT):  # a prompt: the prefill TE's only (what follows: the decode TE's)
                self.prompts_in_flight += 1
                try:
                    await asyncio.sleep(0.002)
                finally:
                    self.prompts_in_flight -= 1
                ttft = (0.034 if self.batches_decoding else 0.020) if len(prompt) == PD_PROMPT \
                    else 0.002 + 1e-4 * len(prompt)
                return now, now + ttft, now + ttft, output_len
            if output_len == PD_DECODING[2]:  # the batch the lone prompts are timed beside
                arrivals.extend(now + 0.001 * i for i in range(8))
                self.batches_decoding += 1
                await asyncio.sleep(0.2)
                self.batches_decoding -= 1
                arrivals.extend(time.monotonic() + 0.001 * i for i in range(output_len - 8))
                return now, arrivals[0], arrivals[-1], output_len
            gap = 0.013 if self.prompts_in_flight else 0.010
            return now, now + 0.01, now + 0.01 + gap * (output_len - 1), output_len

    streamer = Streamer()
    profile = calibrate(streamer, dp=1, repeats=2, mixed=False, pd=True)
    assert profile.stretch_beside_tes == pytest.approx((1.3,)) and profile.prompt_stretch_beside_tes == \
        pytest.approx((1.7,), rel=0.01)
    prompt_len, output_len = ARRIVAL_REQUEST
    own_ms = profile.per_decode_row_ms * (output_len - 1) + 1e3 * profile.group_seconds(
        GroupWork.prompt(prompt_len)) * (1.3 - 1.0)
    assert profile.per_request_ms == pytest.approx(6.0 - own_ms, abs=0.5)
    batch, prompt_len, output_len = PD_DECODE_BATCH
    assert streamer.asked.count((prompt_len, output_len)) >= 2 * 2 * batch  # alone and beside, each round
    err = capsys.readouterr().err
    assert "a decode step beside the prefill TE's prompts: 1.30x alone (rounds: 1.30, 1.30)" in err
    assert "a prompt beside the decode TE's batch: 1.70x alone" in err
    # the fit's points alone: a decode step of any batch 10 ms, not 13
    assert "decode batch 16 prompt 32: 10.0 ms per step" in err and "13.0 ms per step" not in err


def test_a_prompt_that_never_joined_the_decoding_batch_gives_no_mixed_step():
    """Its first token after the batch's last: the batch's last gap is no mixed step, and the sample is dropped."""
    import asyncio

    from meshserve.sim.calibrate import MIXED_OUTPUT, _Workloads

    times = [0.01 * i for i in range(MIXED_OUTPUT)]

    def streamer_with_first_token_at(moment: float):
        async def streamer(prompt, output_len, arrivals=None):
            if arrivals is not None:
                arrivals.extend(times)
                return 0.0, times[0], times[-1], MIXED_OUTPUT
            return 0.0, moment, moment, 1
        return streamer

    for first_token, expected in ((times[-1] + 0.5, None), (times[30] + 1e-4, pytest.approx(0.01))):
        assert asyncio.run(_Workloads(streamer_with_first_token_at(first_token)).mixed_step(8, 128)) == expected


def test_an_arrivals_batch_whose_stream_came_in_fewer_chunks_than_its_window_gives_no_window():
    """A stream that delivered its tokens several at a time has no chunk at the window's end: no window (the
    round is left out), not a failed calibration."""
    import asyncio

    from meshserve.sim.calibrate import ARRIVAL_RUNS, _Workloads

    rate, batch_shape, window = ARRIVAL_RUNS[0]

    async def streamer(prompt, output_len, arrivals=None):
        arrivals.extend(0.01 * i for i in range(window[1]))  # one chunk short
        return 0.0, arrivals[0], arrivals[-1], output_len

    assert asyncio.run(_Workloads(streamer).batch_window(rate, batch_shape, window, arrive=False)) is None


def test_calibrating_tes_on_shared_cores_measures_each_steps_stretch_over_a_te_alone():
    """Each TE of the deployment steps 10 ms per token beside the other (a made-up server); the profile of a TE
    alone gives 4 ms for the same rows: the stretch is 2.5x, kept with the rest of the profile."""
    from meshserve.sim.calibrate import SHARED_ROWS, calibrate_shared

    class Streamer:
        path = "a made-up server"

        def __init__(self) -> None:
            self.asked: list[int] = []

        async def open(self) -> None: ...

        async def close(self) -> None: ...

        async def __call__(self, prompt, output_len, arrivals=None):
            self.asked.append(output_len)
            return 0.0, 0.1, 0.1 + 0.010 * (output_len - 1), output_len

    def alone_seconds(rows: int) -> float:  # what the alone profile below gives a step of `rows`
        return 1e-3 * (2.0 + 0.1 * rows)
    alone = StepProfile(name="alone", source="made up", base_ms=2.0, per_decode_row_ms=0.1, per_prefill_token_ms=0.1)
    streamer = Streamer()
    shared = calibrate_shared(streamer, alone, tes=2, repeats=1)
    expected = statistics.median(0.010 / alone_seconds(rows) for rows in SHARED_ROWS)
    assert shared.stretch_beside_tes == pytest.approx((expected,))
    assert shared.base_ms == alone.base_ms and "beside 1 other TE(s) on a made-up server" in shared.source
    assert streamer.asked.count(48) == 2 * sum(SHARED_ROWS)  # every TE decoded each point's rows
    three = calibrate_shared(Streamer(), alone, tes=3, repeats=1)  # beside one TE: on the line from 1 alone
    assert three.stretch_beside_tes == pytest.approx((1 + (expected - 1) / 2, expected))


def test_calibrating_shared_tes_refuses_what_it_cannot_measure_in_one_line(tmp_path, capsys):
    out = str(tmp_path / "profile.json")
    alone = tmp_path / "alone.json"  # fitted alone, without the stretch beside other TEs
    alone.write_text(json.dumps(StepProfile(name="alone", source="made up", base_ms=2.0, per_decode_row_ms=0.1,
                                            per_prefill_token_ms=0.1).to_dict()))
    for flags, message in ((["--shared-tes", "2", "--alone", "a.json"], "give --url and --alone"),
                           (["--url", "http://127.0.0.1:9", "--shared-tes", "1", "--alone", "a.json"], "at least 2"),
                           (["--alone", "a.json"], "--alone goes with --shared-tes"),
                           (["--url", "http://127.0.0.1:9", "--shared-tes", "2", "--alone", str(tmp_path / "no.json")],
                            "cannot read profile"),
                           (["--url", "http://127.0.0.1:9", "--scale-up", "main/colocated"], "give --url and --alone"),
                           (["--url", "http://127.0.0.1:9", "--scale-up", "main/colocated", "--alone", str(alone)],
                            "has no stretch_beside_tes")):
        assert main(["simulate", "calibrate", "--out", out, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_a_scale_ups_cost_to_the_serving_te_is_weighed_in_stepping_tes(monkeypatch):
    """A made-up managed deployment: its TE steps every 10 ms alone, 13 ms while the added TE starts, 16 ms while
    the pre-warmed replacement starts; beside one stepping TE the profile says 1.6x. A starting TE then weighs 0.5
    stepping TEs and a starting pre-warmed process 1.0; the pool is scaled back to its one TE after."""
    import asyncio
    import time
    from types import SimpleNamespace

    from meshserve.sim import calibrate as calibration

    monkeypatch.setattr(calibration, "SCALE_UP_BATCH", (2, 8, 200))
    start_s, warm_s = 0.4, 0.4
    manager = {"scaled_at": None, "target": 1, "asked": []}

    def phase(now: float) -> str:
        if manager["scaled_at"] is None or manager["target"] == 1:
            return "alone"
        since = now - manager["scaled_at"]
        return "starting" if since < start_s else "warming" if since < start_s + warm_s else "both ready"

    def ask_manager(op: str, **fields):
        manager["asked"].append((op, fields))
        if op == "scale":
            manager["target"] = fields["target"]
            manager["scaled_at"] = time.monotonic() if fields["target"] == 2 else manager["scaled_at"]
        now_phase = phase(time.monotonic())
        ready = 1 if now_phase in ("alone", "starting") else 2
        te = SimpleNamespace(state="ready", group="main", role="colocated")
        return SimpleNamespace(tes=[te] * ready, warm=0 if now_phase in ("starting", "warming") else 1)

    class Streamer:
        path = "a made-up deployment"

        async def open(self) -> None: ...

        async def close(self) -> None: ...

        async def __call__(self, prompt, output_len, arrivals=None):
            sent = time.monotonic()
            for _ in range(output_len):
                step = {"alone": 0.010, "starting": 0.013, "warming": 0.016}.get(phase(time.monotonic()), 0.010)
                await asyncio.sleep(step)
                arrivals.append(time.monotonic())
            return sent, arrivals[0], arrivals[-1], output_len

    shared = StepProfile(name="shared", source="made up", base_ms=2.0, per_decode_row_ms=0.1,
                         per_prefill_token_ms=0.1, stretch_beside_tes=(1.6,))
    scaled = calibration.calibrate_scale_up(Streamer(), shared, ask_manager, "main/colocated", repeats=1)
    assert scaled.starting_te_weight == pytest.approx(0.5, abs=0.15)
    assert scaled.prewarm_weight == pytest.approx(1.0, abs=0.15)
    assert scaled.stretch_beside_tes == shared.stretch_beside_tes and "a scale-up of main/colocated" in scaled.source
    scales = [fields for op, fields in manager["asked"] if op == "scale"]
    assert scales == [{"pool": "main/colocated", "target": 2}, {"pool": "main/colocated", "target": 1}]
