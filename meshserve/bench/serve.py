"""`bench serve`: an async load generator against an OpenAI-compatible `/v1/completions` server.

Requests stream (SSE) with token-id prompts and `ignore_eos`, so each one
produces exactly the output length asked for. Arrivals are Poisson at a given
rate or keep a fixed number in flight. Every request gets a record; a failed or
unfinished request is counted and reported, never raised.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshserve.bench.workload import WorkloadRequest
from meshserve.utils import report

TIME_LIMIT_ERROR = "benchmark time limit reached"


@dataclass
class ServeOptions:
    url: str
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    json_path: str
    model: str | None = None
    rate: float | None = None  # requests/s, Poisson arrivals (inf: all at once)
    concurrency: int | None = None  # requests kept in flight
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    seed: int = 0
    timeout_s: float = 600.0  # the whole run
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of rate and concurrency")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name.replace('_', ' ')} must be positive, got {value}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    requested_output_tokens: int
    send_time_s: float | None = None  # since the run started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache (its usage's cached_tokens)
    ok: bool = False
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def base_url(url: str) -> str:
    """The server root: trailing slashes and a trailing /v1 are dropped."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A successful request whose TTFT and TPOT are within every SLO given (single-token requests have no TPOT)."""
    if not record.ok:
        return False
    if slo_ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1000 > slo_ttft_ms):
        return False
    tpot = record.tpot_s
    if slo_tpot_ms is not None and tpot is not None and tpot * 1000 > slo_tpot_ms:
        return False
    return True


def goodput(records: Sequence[RequestRecord], duration_s: float,
            slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> float:
    """Requests/s that succeeded within all given SLOs (with none given: successful requests/s)."""
    if duration_s <= 0:
        return 0.0
    return sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records) / duration_s


def summarize_run(records: Sequence[RequestRecord], duration_s: float,
                  slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Latency percentiles (ms), throughputs and error counts of a finished run."""
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.error or "unknown error"
            errors[key] = errors.get(key, 0) + 1
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    ms = lambda values: [v * 1000 for v in values]  # noqa: E731
    return {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "error_counts": errors,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(output_tokens + prompt_tokens),
        "goodput": goodput(records, duration_s, slo_ttft_ms, slo_tpot_ms),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "output_tokens_total": output_tokens,
        "prompt_tokens_total": prompt_tokens,
        "cached_prompt_tokens_total": sum(r.cached_tokens for r in ok),
        "ttft_ms": report.summarize(ms(r.ttft_s for r in ok if r.ttft_s is not None)),
        "tpot_ms": report.summarize(ms(r.tpot_s for r in ok if r.tpot_s is not None)),
        "itl_ms": report.summarize(ms(itl for r in ok for itl in r.itls_s)),
        # the gap before a request's second token: on a P/D deployment, its hand-off to the decode TE
        "second_token_ms": report.summarize(ms(r.itls_s[0] for r in ok if r.itls_s)),
        "e2e_ms": report.summarize(ms(r.e2e_s for r in ok if r.e2e_s is not None)),
        "output_tokens": report.summarize(r.output_tokens for r in ok),
    }


# ---- the load generator ------------------------------------------------------

def _error_message(status: int, body: bytes) -> str:
    try:
        detail = json.loads(body)
        if isinstance(detail, dict):
            detail = detail.get("error", detail)
            if isinstance(detail, dict):
                detail = detail.get("message", detail)
    except (ValueError, UnicodeDecodeError):
        detail = body[:200].decode(errors="replace")
    return f"HTTP {status}: {detail}"


def _take_usage(record: RequestRecord, usage: dict) -> Any:
    """A stream's usage: the prompt tokens the server took from its prefix cache go to `record`; the completion
    tokens it counted are returned."""
    details = usage.get("prompt_tokens_details")
    record.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    return usage.get("completion_tokens")


async def send_request(client: httpx.AsyncClient, model: str, request: WorkloadRequest,
                       record: RequestRecord, run_start: float) -> None:
    """Stream one completion, filling `record`; any failure lands in `record.error`."""
    payload = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    record.send_time_s = start - run_start
    last = start
    chunks = 0
    usage_tokens = None
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                record.error = _error_message(response.status_code, await response.aread())
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if not isinstance(event, dict):
                    raise ValueError(f"a stream event that is not a JSON object: {data[:80]}")
                if event.get("error"):
                    error = event["error"]
                    record.error = f"stream error: {error.get('message', error) if isinstance(error, dict) else error}"
                    return
                now = time.perf_counter()
                if event.get("choices"):
                    if chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itls_s.append(now - last)
                    last = now
                    chunks += 1
                if isinstance(event.get("usage"), dict):
                    usage_tokens = _take_usage(record, event["usage"])
        record.e2e_s = time.perf_counter() - start
        record.output_tokens = int(usage_tokens) if usage_tokens is not None else chunks
        if not done:
            record.error = "stream ended without [DONE]"
        elif chunks == 0:
            record.error = "stream carried no tokens"
        else:
            record.ok = True
    except asyncio.CancelledError:
        record.error = TIME_LIMIT_ERROR
        raise
    except (httpx.HTTPError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def poisson_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times (s since start) with exponential gaps of mean 1/rate; the first request goes at 0."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(rate) if rate != float("inf") else 0.0
        offsets.append(t)
    return offsets


async def run_load(options: ServeOptions, model: str, workload: Sequence[WorkloadRequest],
                   on_done=None) -> tuple[list[RequestRecord], float]:
    """Send `workload`; returns every request's record and the run's wall time (start to last finish or time limit)."""
    records = [RequestRecord(i, len(r.prompt_token_ids), r.output_len) for i, r in enumerate(workload)]
    width = options.concurrency or len(workload)
    # idle connections dropped before the server's keep-alive (uvicorn: 5 s) closes them under a request sent on one
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width, keepalive_expiry=3.0)
    timeout = httpx.Timeout(options.timeout_s, connect=min(options.timeout_s, 30.0))
    async with httpx.AsyncClient(base_url=base_url(options.url), limits=limits, timeout=timeout,
                                 trust_env=False) as client:
        run_start = time.perf_counter()

        async def one(i: int) -> None:
            try:
                await send_request(client, model, workload[i], records[i], run_start)
            finally:
                if on_done is not None and records[i].error != TIME_LIMIT_ERROR:
                    on_done(records[i])

        if options.rate is not None:
            offsets = poisson_offsets(len(workload), options.rate, options.seed)

            async def scheduled(i: int) -> None:
                await asyncio.sleep(max(0.0, offsets[i] - (time.perf_counter() - run_start)))
                await one(i)

            tasks = [asyncio.create_task(scheduled(i)) for i in range(len(workload))]
        else:
            queue = iter(range(len(workload)))

            async def worker() -> None:
                for i in queue:
                    await one(i)

            tasks = [asyncio.create_task(worker()) for _ in range(min(width, len(workload)))]

        _, pending = await asyncio.wait(tasks, timeout=options.timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - run_start

    for record in records:
        if not record.ok and record.error is None:
            record.error = TIME_LIMIT_ERROR  # never sent, or cut off before it finished
    return records, duration


def discover_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model id the server lists at /v1/models."""
    response = httpx.get(base_url(url) + "/v1/models", timeout=timeout_s, trust_env=False)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{url} lists no models at /v1/models; pass --model")
    return str(models[0]["id"])


def run_serve_benchmark(options: ServeOptions, workload: Sequence[WorkloadRequest]) -> dict[str, Any]:
    model = options.model or discover_model(options.url)
    bar = None
    if options.progress:
        # start-up: tqdm only with a progress bar
        from tqdm import tqdm

        bar = tqdm(total=len(workload), desc="requests", unit="req", file=sys.stderr)
    try:
        on_done = (lambda _: bar.update(1)) if bar else None
        records, duration = asyncio.run(run_load(options, model, workload, on_done=on_done))
    finally:
        if bar is not None:
            bar.close()
    return {
        "benchmark": "serve",
        "url": options.url,
        "model": model,
        "load": {
            "rate": options.rate,
            "concurrency": options.concurrency,
            "num_requests": options.num_requests,
            "input_len": list(options.input_len),
            "output_len": list(options.output_len),
            "seed": options.seed,
            "timeout_s": options.timeout_s,
        },
        **summarize_run(records, duration, options.slo_ttft_ms, options.slo_tpot_ms),
        "machine": report.machine_info(),
        "requests": [r.to_dict() for r in records],
    }


def plot_serve(result: dict[str, Any], path: str | Path) -> Path:
    """Latency CDFs: TTFT, TPOT, ITL, E2E (ms), over successful requests."""
    fig, axes = report.new_figure(ncols=2, nrows=2, width_per_panel=5.0, height=3.6)
    ok = [r for r in result["requests"] if r["ok"]]
    panels = [
        ("TTFT", [r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None], "fraction of requests"),
        ("TPOT", [r["tpot_s"] * 1000 for r in ok if r["tpot_s"] is not None], "fraction of requests"),
        ("ITL", [itl * 1000 for r in ok for itl in r["itls_s"]], "fraction of token gaps"),
        ("E2E", [r["e2e_s"] * 1000 for r in ok if r["e2e_s"] is not None], "fraction of requests"),
    ]
    for ax, (name, values, ylabel) in zip([a for row in axes for a in row], panels):
        report.plot_cdf(ax, values, label=name, xlabel=f"{name} (ms)", ylabel=ylabel)
        ax.set_title(name)
    load = result["load"]
    shape = f"rate {load['rate']}/s" if load["rate"] is not None else f"concurrency {load['concurrency']}"
    fig.suptitle(f"{result['model']}: {shape}, {result['completed']} ok, {result['failed']} failed")
    return report.save_figure(fig, path)


def summary_lines(result: dict[str, Any]) -> list[str]:
    def p(name: str) -> str:
        s = result[name]
        return "n/a" if s["p50"] is None else f"p50 {s['p50']:.1f} / p90 {s['p90']:.1f} / p99 {s['p99']:.1f}"

    return [
        f"{result['completed']} ok, {result['failed']} failed in {result['duration_s']:.2f}s: "
        f"{result['request_throughput']:.2f} req/s, {result['output_token_throughput']:.1f} output tok/s, "
        f"goodput {result['goodput']:.2f} req/s",
        f"TTFT ms {p('ttft_ms')}",
        f"TPOT ms {p('tpot_ms')}",
        f"ITL ms  {p('itl_ms')}",
        f"2nd token gap ms {p('second_token_ms')}",
        f"E2E ms  {p('e2e_ms')}",
    ]
