"""`meshserve bench tenants`: a noisy neighbour against per-tenant limits.

One `meshserve serve` on the model, with two API keys (a polite tenant and a noisy one), a token budget per
tenant (`--tokens-per-minute-per-tenant`, its bucket 10 s of it: `--token-burst-s`) and a cap on each tenant's
running requests (`--max-requests-per-tenant`, 4). Two phases on the same server:

1. alone: the polite tenant sends its requests at a fixed rate (open loop), each a streaming completion of a
   fixed prompt and length; its time to first token is measured;
2. beside: the same polite schedule again while the noisy tenant sends, from a thread of its own, at
   10x its budget (in the tokens a request uses: prompt plus max_tokens) for as long as the polite tenant
   sends.

The polite tenant runs at half its budget, so the limits should never refuse it; the noisy one gets
429s for most of its requests, for its running requests and its tokens. Reported:
the polite tenant's TTFT (p50/p90/p99) alone and beside the noisy one, their p99 ratio (the target is
within 2x), every polite failure, and the noisy tenant's answers by status. Writes JSON and a PNG (the polite
TTFT's CDF in both phases, the noisy tenant's answers) and prints a summary.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from meshserve.bench.deployment_load import log, one_line_errors, run_bench_cli
from meshserve.bench.serve import RequestRecord, send_request
from meshserve.bench.workload import WorkloadRequest, make_offline_workload, special_token_ids
from meshserve.utils import envs, report
from meshserve.utils.processes import free_tcp_port

PROG = "meshserve bench tenants"
LOG_PREFIX = "bench tenants"
DEFAULT_OUT = "bench-results/tenants"
RESULT_FILE = "tenants.json"
NOISY_FACTOR = 10.0  # the noisy tenant's sending rate, in budgets
POLITE_SHARE = 0.5  # the polite tenant's sending rate, in budgets
TARGET_RATIO = 2.0
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0

# what --quick changes, for the options not given
_FULL = {"requests": 30, "rate": 0.5, "prompt_len": 32, "max_tokens": 8}
_QUICK = {"requests": 8, "rate": 1.0, "prompt_len": 16, "max_tokens": 4}


@dataclasses.dataclass(frozen=True)
class TenantsBenchSettings:
    model_dir: str
    requests: int  # the polite tenant's, per phase
    rate: float  # the polite tenant's requests per second
    prompt_len: int
    max_tokens: int
    tokens_per_minute: int | None  # the budget per tenant (default: the polite rate / POLITE_SHARE)
    max_requests_per_tenant: int
    token_burst_s: float
    out_dir: str


def add_tenants_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format model directory (default: the deepseek_v3 tiny model, made on "
                                        "first use)")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest shape, for tests: 8 polite requests per phase, 16-token prompts, "
                             "4 tokens each")
    parser.add_argument("--requests", type=int, default=None,
                        help="the polite tenant's requests per phase (default: 30; --quick: 8)")
    parser.add_argument("--rate", type=float, default=None,
                        help="the polite tenant's requests per second (default: 0.5; --quick: 1)")
    parser.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default: 32; --quick: 16)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens generated per request (default: 8; --quick: 4)")
    parser.add_argument("--tokens-per-minute", type=int, default=None,
                        help="each tenant's token budget (default: twice what the polite tenant uses a minute)")
    parser.add_argument("--max-requests-per-tenant", type=int, default=4,
                        help="each tenant's running requests at most (default: 4)")
    parser.add_argument("--token-burst-s", type=float, default=10.0,
                        help="seconds of its budget a tenant may spend at once (default: 10)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.set_defaults(func=tenants_main)


def settings_from_args(args: argparse.Namespace) -> TenantsBenchSettings:
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else (_QUICK if args.quick else _FULL)[key]
             for key in _FULL}
    for flag, value in (("--requests", sizes["requests"]), ("--prompt-len", sizes["prompt_len"]),
                        ("--max-tokens", sizes["max_tokens"]), ("--tokens-per-minute", args.tokens_per_minute or 1),
                        ("--max-requests-per-tenant", args.max_requests_per_tenant)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    for flag, value in (("--rate", sizes["rate"]), ("--token-burst-s", args.token_burst_s)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model: directory {args.model!r} does not exist")
    return TenantsBenchSettings(model_dir=args.model or "", tokens_per_minute=args.tokens_per_minute,
                                max_requests_per_tenant=args.max_requests_per_tenant,
                                token_burst_s=args.token_burst_s, out_dir=args.out, **sizes)


def tenants_main(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the log
    return run_bench_cli(PROG, args, settings_from_args, run_tenants_benchmark, (OSError, RuntimeError,
                                                                                 TimeoutError), _report)


def _report(settings: TenantsBenchSettings, result: dict) -> None:
    json_path = report.write_json(Path(settings.out_dir) / RESULT_FILE, result)
    png_path = plot_tenants(result, report.png_path_for(json_path))
    print("\n".join(summary_lines(result)))
    print(f"wrote {json_path} and {png_path}")


# ---------------------------------------------------------------- the server
class _Server:
    """`meshserve serve` with two API keys and a token budget per tenant, on a free loopback port."""

    def __init__(self, settings: TenantsBenchSettings, model_dir: str, tokens_per_minute: int,
                 log_path: Path) -> None:
        self.keys = {"polite": secrets.token_hex(16), "noisy": secrets.token_hex(16)}
        port = free_tcp_port()
        self.base = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "meshserve.entrypoints.cli", "serve", "--model", model_dir,
                   "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
                   "--tokens-per-minute-per-tenant", str(tokens_per_minute),
                   "--max-requests-per-tenant", str(settings.max_requests_per_tenant),
                   "--token-burst-s", str(settings.token_burst_s)]
        env = {**os.environ, envs.MESHSERVE_API_KEY.name: ",".join(self.keys.values())}  # not in `ps`
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log_file:
            self.proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.log_path = log_path

    def wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        # one client for every probe: each one-shot httpx call builds a TLS context (tens of ms of CPU)
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.proc.returncode} (log: {self.log_path})")
                try:
                    if client.get(f"{self.base}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"the server was not healthy within {STARTUP_TIMEOUT_S:g} s (log: {self.log_path})")

    def stop(self) -> None:
        """Ctrl-C as a user would, then whatever is left of its process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


# ---------------------------------------------------------------- the load
async def _send_at_rate(base: str, key: str, model: str, requests: list[WorkloadRequest],
                        rate: float) -> list[RequestRecord]:
    """Each request at its slot of a fixed-rate schedule (open loop), all streamed; their records."""
    import httpx

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    headers = {"Authorization": f"Bearer {key}"}
    records = [RequestRecord(i, len(r.prompt_token_ids), r.output_len) for i, r in enumerate(requests)]
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        origin = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            await asyncio.sleep(max(0.0, origin + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(send_request(client, model, request, records[i], origin)))
        await asyncio.gather(*tasks)
    return records


def _noisy_in_thread(base: str, key: str, model: str, requests: list[WorkloadRequest], rate: float,
                     out: list[RequestRecord]) -> threading.Thread:
    """The noisy tenant on a thread and event loop of its own (its many answers do not queue behind the
    polite tenant's on one loop)."""
    def run() -> None:
        out.extend(asyncio.run(_send_at_rate(base, key, model, requests, rate)))

    thread = threading.Thread(target=run, name="bench-tenants-noisy", daemon=True)
    thread.start()
    return thread


def _ttft_ms(records: list[RequestRecord]) -> list[float]:
    return [r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None]


def _status(record: RequestRecord) -> str:
    if record.ok:
        return "ok"
    error = record.error or ""
    return error.split(":", 1)[0] if error.startswith("HTTP ") else "other"


def run_tenants_benchmark(settings: TenantsBenchSettings) -> dict[str, Any]:
    # start-up: the model factory (torch) only when the benchmark runs
    from meshserve.models.factory import ensure_default_model
    from meshserve.models.loader import load_hf_config

    model_dir = settings.model_dir or str(ensure_default_model())
    config = load_hf_config(model_dir)
    requests = make_offline_workload(settings.requests, (settings.prompt_len,) * 2, (settings.max_tokens,) * 2,
                                     int(config["vocab_size"]), seed=0,
                                     exclude_token_ids=special_token_ids(model_dir))
    cost = settings.prompt_len + settings.max_tokens  # tokens one request uses (ignore_eos: every one)
    budget = settings.tokens_per_minute or int(settings.rate * 60 * cost / POLITE_SHARE)
    noisy_rate = NOISY_FACTOR * budget / 60 / cost
    noisy_requests = [requests[i % len(requests)] for i in range(int(noisy_rate * settings.requests / settings.rate))]
    server = _Server(settings, model_dir, budget, Path(settings.out_dir) / "server.log")
    try:
        server.wait_healthy()
        model = _served_model(server)
        log(LOG_PREFIX, f"budget {budget} tokens/min per tenant, {cost} used per request; polite at "
                        f"{settings.rate:g}/s, noisy at {noisy_rate:.1f}/s")
        asyncio.run(_send_at_rate(server.base, server.keys["polite"], model, requests[:2], settings.rate))  # warm-up
        alone = asyncio.run(_send_at_rate(server.base, server.keys["polite"], model, requests, settings.rate))
        noisy: list[RequestRecord] = []
        thread = _noisy_in_thread(server.base, server.keys["noisy"], model, noisy_requests, noisy_rate, noisy)
        beside = asyncio.run(_send_at_rate(server.base, server.keys["polite"], model, requests, settings.rate))
        thread.join(REQUEST_TIMEOUT_S + len(noisy_requests) / noisy_rate)
    finally:
        server.stop()
    return _result(settings, model, budget, cost, noisy_rate, alone, beside, noisy)


def _served_model(server: _Server) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {server.keys['polite']}"}
    return httpx.get(f"{server.base}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]


def _result(settings: TenantsBenchSettings, model: str, budget: int, cost: int, noisy_rate: float,
            alone: list[RequestRecord], beside: list[RequestRecord], noisy: list[RequestRecord]) -> dict[str, Any]:
    alone_ttft, beside_ttft = report.summarize(_ttft_ms(alone)), report.summarize(_ttft_ms(beside))
    ratio = beside_ttft["p99"] / alone_ttft["p99"] if alone_ttft["p99"] and beside_ttft["p99"] else None
    return {
        "benchmark": "tenants",
        "model": model,
        "settings": {**dataclasses.asdict(settings), "tokens_per_minute": budget, "tokens_per_request": cost,
                     "noisy_rate": noisy_rate, "noisy_factor": NOISY_FACTOR, "polite_share": POLITE_SHARE},
        "polite_alone": {"ttft_ms": alone_ttft, "statuses": dict(Counter(_status(r) for r in alone))},
        "polite_beside_noisy": {"ttft_ms": beside_ttft, "statuses": dict(Counter(_status(r) for r in beside))},
        "noisy": {"sent": len(noisy), "statuses": dict(Counter(_status(r) for r in noisy))},
        "ttft_p99_ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "machine": report.machine_info(),
        "requests": {"polite_alone": [r.to_dict() for r in alone], "polite_beside_noisy": [r.to_dict() for r in beside],
                     "noisy": [{"index": r.index, "ok": r.ok, "error": r.error} for r in noisy]},
    }


# ---------------------------------------------------------------- report
def summary_lines(result: dict[str, Any]) -> list[str]:
    def ttft(phase: str) -> str:
        s = result[phase]["ttft_ms"]
        return "n/a" if s["p99"] is None else f"p50 {s['p50']:.1f} / p90 {s['p90']:.1f} / p99 {s['p99']:.1f} ms"

    ratio = result["ttft_p99_ratio"]
    verdict = "n/a" if ratio is None else f"{ratio:.2f}x ({'within' if ratio <= TARGET_RATIO else 'beyond'} the " \
                                          f"{TARGET_RATIO:g}x target)"
    s = result["settings"]
    return [
        f"budget {s['tokens_per_minute']} tokens/min per tenant; noisy tenant at {s['noisy_factor']:g}x it "
        f"({s['noisy_rate']:.1f} req/s)",
        f"polite alone:        TTFT {ttft('polite_alone')}  {result['polite_alone']['statuses']}",
        f"polite beside noisy: TTFT {ttft('polite_beside_noisy')}  {result['polite_beside_noisy']['statuses']}",
        f"noisy: {result['noisy']['sent']} sent, {result['noisy']['statuses']}",
        f"polite p99 TTFT beside / alone: {verdict}",
    ]


def plot_tenants(result: dict[str, Any], path: str | Path) -> Path:
    """The polite tenant's TTFT CDF alone and beside the noisy one; the noisy tenant's answers."""
    fig, axes = report.new_figure(ncols=2, width_per_panel=5.0, height=3.6)
    ttft_ax, noisy_ax = axes[0]
    for phase, label in (("polite_alone", "polite alone"), ("polite_beside_noisy", "polite beside noisy")):
        report.plot_cdf(ttft_ax, [r["ttft_s"] * 1000 for r in result["requests"][phase]
                                  if r["ok"] and r["ttft_s"] is not None], label=label, xlabel="TTFT (ms)")
    ttft_ax.set_title("polite tenant's time to first token")
    statuses = result["noisy"]["statuses"]
    noisy_ax.bar(list(statuses), list(statuses.values()))
    noisy_ax.set_title(f"noisy tenant at {result['settings']['noisy_factor']:g}x its budget")
    noisy_ax.set_ylabel("requests")
    ratio = result["ttft_p99_ratio"]
    shown = "n/a" if ratio is None else f"{ratio:.2f}x"
    fig.suptitle(f"{result['model']}: polite p99 TTFT beside / alone = {shown}")
    return report.save_figure(fig, path)
