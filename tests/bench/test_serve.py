import json
import time

import pytest

from meshserve.bench.cli import main as bench_main
from meshserve.bench.serve import (
    TIME_LIMIT_ERROR,
    RequestRecord,
    base_url,
    goodput,
    meets_slo,
    poisson_offsets,
    summarize_run,
)
from meshserve.sim.trace import read_jsonl
from tests.bench import fake_openai_server as fake


@pytest.fixture(scope="module")
def server():
    with fake.running_server() as (url, received):
        yield url, received


def _record(i, ttft, e2e, tokens, ok=True, error=None):
    return RequestRecord(index=i, prompt_tokens=10, requested_output_tokens=tokens, ttft_s=ttft, e2e_s=e2e,
                         output_tokens=tokens, ok=ok, error=error)


def test_tpot_is_time_after_first_token_per_remaining_token():
    assert _record(0, 0.1, 0.5, 5).tpot_s == pytest.approx((0.5 - 0.1) / 4)
    assert _record(0, 0.1, 0.1, 1).tpot_s is None
    assert _record(0, 0.1, 0.5, 5, ok=False).tpot_s is None


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        _record(0, 0.05, 0.45, 5),   # ttft 50 ms, tpot 100 ms
        _record(1, 0.30, 0.50, 5),   # ttft 300 ms, tpot 50 ms
        _record(2, 0.05, 0.25, 5),   # ttft 50 ms, tpot 50 ms
        _record(3, 0.05, 0.05, 1),   # single token: no TPOT to miss
        _record(4, 0.01, 0.02, 3, ok=False, error="HTTP 500"),
    ]
    assert goodput(records, 2.0) == pytest.approx(4 / 2.0)  # no SLOs: successful requests/s
    assert goodput(records, 2.0, slo_ttft_ms=100) == pytest.approx(3 / 2.0)
    assert goodput(records, 2.0, slo_tpot_ms=60) == pytest.approx(3 / 2.0)
    assert goodput(records, 2.0, slo_ttft_ms=100, slo_tpot_ms=60) == pytest.approx(2 / 2.0)
    assert not meets_slo(records[4], None, None)
    assert goodput(records, 0.0) == 0.0


def test_summarize_run_on_hand_made_records():
    records = [_record(0, 0.1, 0.5, 5), _record(1, 0.3, 0.9, 4), _record(2, None, None, 0, ok=False, error="boom")]
    records[0].itls_s = [0.1, 0.1, 0.1, 0.1]
    records[1].itls_s = [0.2, 0.2, 0.2]
    summary = summarize_run(records, duration_s=2.0, slo_ttft_ms=200)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["error_counts"] == {"boom": 1}
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_token_throughput"] == pytest.approx(9 / 2.0)
    assert summary["total_token_throughput"] == pytest.approx((9 + 20) / 2.0)
    assert summary["goodput"] == pytest.approx(0.5)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["max"] == pytest.approx(200.0)  # (0.9-0.3)/3
    assert summary["itl_ms"]["count"] == 7
    assert summary["second_token_ms"]["count"] == 2 and summary["second_token_ms"]["max"] == pytest.approx(200.0)
    assert summary["e2e_ms"]["p90"] == pytest.approx(500 + 0.9 * 400)


def test_poisson_offsets_are_seeded_with_the_right_mean_gap():
    offsets = poisson_offsets(2001, rate=50.0, seed=1)
    assert offsets == poisson_offsets(2001, rate=50.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 2000 == pytest.approx(1 / 50.0, rel=0.1)
    assert poisson_offsets(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_base_url_strips_v1_and_slashes():
    assert base_url("http://h:1/v1/") == "http://h:1"
    assert base_url("http://h:1") == "http://h:1"


def _run(tmp_path, url, *extra, name="out/serve.json"):
    path = tmp_path / name
    rc = bench_main(["serve", "--url", url, "--json", str(path), "--no-progress", *extra])
    return rc, path


def test_a_trace_of_prompts_the_server_had_cached_comes_with_a_warning(server, tmp_path, capsys):
    """The same --seed sent twice to one server: the second run's prompts come from its prefix cache, which a trace
    cannot hold; the run says so and counts them. Fresh prompts (another seed) are not counted."""
    url, _ = server
    args = ("--concurrency", "4", "--requests", "6", "--input-len", "4:8", "--output-len", "2:3")
    first = [_run(tmp_path, url, *args, "--seed", str(seed), "--record-trace", str(tmp_path / f"t{seed}.jsonl"),
                  name=f"r{seed}.json") for seed in (101, 102)]
    assert all(rc == 0 for rc, _ in first) and "prefix cache" not in capsys.readouterr().err
    rc, path = _run(tmp_path, url, *args, "--seed", "101", "--record-trace", str(tmp_path / "again.jsonl"),
                    name="again.json")
    result = json.loads(path.read_text())
    assert rc == 0 and result["cached_prompt_tokens_total"] == result["prompt_tokens_total"] - 6
    assert all(r["cached_tokens"] == r["prompt_tokens"] - 1 for r in result["requests"])
    assert "warning: the server took" in capsys.readouterr().err
    assert json.loads((tmp_path / "r102.json").read_text())["cached_prompt_tokens_total"] == 0


def test_a_stream_event_that_is_not_an_object_fails_its_request_not_the_run(server, tmp_path):
    url, _ = server
    rc, path = _run(tmp_path, url, "--model", "garbage-model", "--concurrency", "2", "--requests", "3",
                    "--input-len", "4:8", "--output-len", "2:3", name="garbage.json")
    result = json.loads(path.read_text())
    assert rc == 0 and result["completed"] == 0 and result["failed"] == 3
    assert all("not a JSON object" in r["error"] for r in result["requests"])


def test_bench_serve_concurrency_measures_latency_and_writes_reports(server, tmp_path, capsys):
    url, received = server
    received.clear()
    trace = tmp_path / "trace.jsonl"
    rc, path = _run(tmp_path, url, "--concurrency", "4", "--requests", "12", "--input-len", "4:8",
                    "--output-len", "3:6", "--slo-ttft-ms", "5000", "--seed", "3", "--record-trace", str(trace))
    assert rc == 0
    result = json.loads(path.read_text())
    # the requests sent, as a trace `meshserve simulate run --trace` replays
    replay = read_jsonl(trace)
    assert sorted((r.arrival_s, r.prompt_len, r.output_len) for r in replay) == sorted(
        (r["send_time_s"], r["prompt_tokens"], r["requested_output_tokens"]) for r in result["requests"])
    assert result["model"] == "fake-model"  # discovered from /v1/models
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["load"]["concurrency"] == 4
    # the server waits FIRST_TOKEN_S before the first token and TOKEN_S between tokens
    assert result["ttft_ms"]["min"] >= fake.FIRST_TOKEN_S * 1000
    for r in result["requests"]:
        assert r["ok"] and r["output_tokens"] == r["requested_output_tokens"]
        assert 3 <= r["output_tokens"] <= 6
        assert r["e2e_s"] >= fake.FIRST_TOKEN_S + (r["output_tokens"] - 1) * fake.TOKEN_S
        assert len(r["itls_s"]) == r["output_tokens"] - 1
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1))
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    assert result["output_token_throughput"] > 0
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    # what went over the wire
    assert len(received) == 12
    for body in received:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert all(isinstance(t, int) and 7 <= t < 1000 for t in body["prompt"])  # house special ids 0..6 avoided
        assert 4 <= len(body["prompt"]) <= 8
    assert "TTFT ms" in capsys.readouterr().out


def test_bench_serve_rate_counts_failed_requests_without_crashing(server, tmp_path):
    url, received = server
    received.clear()
    rc, path = _run(tmp_path, url, "--model", "fake-model", "--rate", "200", "--requests", "10",
                    "--input-len", "2:3", "--output-len", f"{fake.MAX_TOKENS - 1}:{fake.MAX_TOKENS + 1}",
                    "--seed", "5")
    assert rc == 0
    result = json.loads(path.read_text())
    too_long = sum(1 for body in received if body["max_tokens"] > fake.MAX_TOKENS)
    assert 0 < too_long < 10  # the seed gives a mix
    assert result["failed"] == too_long and result["completed"] == 10 - too_long
    [(message, count)] = result["error_counts"].items()
    assert message.startswith("HTTP 400") and "too large" in message and count == too_long


def test_bench_serve_stops_at_the_time_limit(server, tmp_path):
    url, _ = server
    start = time.monotonic()
    rc, path = _run(tmp_path, url, "--model", "slow-model", "--concurrency", "2", "--requests", "6",
                    "--input-len", "2", "--output-len", "8", "--timeout", "0.6")
    assert rc == 0
    assert time.monotonic() - start < 5  # 6 requests x 8 tokens x 0.5 s, 2 at a time, would take 12 s
    result = json.loads(path.read_text())
    assert result["completed"] == 0 and result["failed"] == 6
    assert result["error_counts"] == {TIME_LIMIT_ERROR: 6}
    assert path.with_suffix(".png").exists()


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "2", "--requests", "2", "--input-len", "5:2", "--output-len", "2"], "--input-len"),
    (["--concurrency", "0", "--requests", "2", "--input-len", "2", "--output-len", "2"], "concurrency"),
    (["--rate", "-1", "--requests", "2", "--input-len", "2", "--output-len", "2"], "rate"),
    (["--concurrency", "1", "--requests", "0", "--input-len", "2", "--output-len", "2"], "--requests"),
])
def test_bench_serve_bad_input_is_one_line_and_nonzero(server, tmp_path, capsys, args, message):
    url, _ = server
    rc, path = _run(tmp_path, url, *args)
    err = capsys.readouterr().err.strip()
    assert rc != 0 and not path.exists()
    assert len(err.splitlines()) == 1 and message in err


def test_bench_serve_unreachable_server_is_a_clean_error(tmp_path, capsys):
    url = f"http://127.0.0.1:{fake.free_port()}"
    rc, path = _run(tmp_path, url, "--concurrency", "1", "--requests", "1", "--input-len", "2", "--output-len", "2")
    err = capsys.readouterr().err.strip()
    assert rc != 0 and not path.exists()
    assert len(err.splitlines()) == 1 and "127.0.0.1" in err
