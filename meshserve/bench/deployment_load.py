"""Load a multi-TE deployment through an in-process job executor, for profiling and benchmarks.

`started_deployment` starts the TEs of a deployment (each as its own processes, as `meshserve serve
--deployment` does) and yields the Router they registered with; `run_fixed_rate` sends requests at
a fixed rate through it and times each one (TTFT, TPOT, JCT), failures recorded, never raised. Requests
use token-id prompts, greedy sampling and ignore_eos, so each produces exactly its output length.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from meshserve.bench import BENCH_ENGINE_SETTINGS
from meshserve.bench.workload import WorkloadRequest, make_offline_workload, special_token_ids
from meshserve.config import EngineConfig, RouterConfig
from meshserve.config.arguments import add_engine_arguments, given_engine_settings
from meshserve.models.factory import ensure_default_model
from meshserve.utils import report
from meshserve.utils.processes import stop_process
from meshserve.wire.sampling_params import SamplingParams

# a TE busy on a shared core may miss heartbeats for a while; benchmarks measure load, not failover
HEARTBEAT_TIMEOUT_S = 30.0
NOT_FINISHED = "not finished"


@dataclass
class RequestTiming:
    index: int
    prompt_tokens: int
    requested_output_tokens: int
    kind: str = ""  # the workload's class of the request, if any
    send_s: float | None = None  # since the run started
    ttft_s: float | None = None
    jct_s: float | None = None  # completion - arrival
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the serving TE found in its prefix cache
    error: str | None = NOT_FINISHED

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if not self.ok or self.ttft_s is None or self.jct_s is None or self.output_tokens < 2:
            return None
        return (self.jct_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s, "ok": self.ok}


@contextlib.contextmanager
def started_deployment(model: str, deployment, engine: dict | None = None, policy: str = "round_robin",
                       heatmap=None, predictor=None, startup_timeout_s: float = 300.0,
                       log_level: int = logging.WARNING) -> Iterator[Any]:
    """Start `deployment` (a MultiDeployment or a preset name) and yield its Router; every TE is
    stopped on exit. `engine` settings apply to every TE; without num_threads the cores are divided
    among all the TEs' ranks."""
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.router.deployment import MultiDeployment, launch_tes
    from meshserve.router.router import Router

    if isinstance(deployment, str):
        deployment = MultiDeployment.preset(deployment)
    je = Router(RouterConfig(model=model, routing=policy, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S), heatmap=heatmap,
                predictor=predictor)
    tes = deployment.tes()
    procs = []
    try:
        procs = launch_tes(tes, model, [je.register_addr], dict(engine or {}), log_level)

        def alive() -> None:
            for spec, proc in zip(tes, procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"TE {spec.name} exited during start-up (exit code {proc.returncode})")

        je.wait_for_tes_blocking(deployment.role_counts(), startup_timeout_s, alive=alive)
        yield je
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            stop_process(proc, grace_s=15)
        je.shutdown()


async def run_fixed_rate(je, requests: Sequence[WorkloadRequest], rate: float, policy: str | None = None,
                         kinds: Sequence[str] | None = None, tag: str = "run",
                         timeout_s: float = 600.0) -> list[RequestTiming]:
    """Send `requests` evenly spaced at `rate` per second (inf: all at once) and time each; `policy`
    routes them (the JE's own when None). Requests unfinished after `timeout_s` are aborted and recorded
    as failed."""
    # start-up: zmq only when load is sent
    from meshserve.router.routing import REQUEST_ROUTING_POLICY

    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")
    loop = asyncio.get_running_loop()
    start = loop.time()
    timings = [RequestTiming(i, len(r.prompt_token_ids), r.output_len, kinds[i] if kinds else "")
               for i, r in enumerate(requests)]

    async def one(timing: RequestTiming, request: WorkloadRequest) -> None:
        if math.isfinite(rate):
            await asyncio.sleep(max(0.0, start + timing.index / rate - loop.time()))
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        sent = loop.time()
        timing.send_s = sent - start
        final = None
        try:
            async for out in je.generate(None, list(request.prompt_token_ids), params, f"{tag}-{timing.index}"):
                if timing.ttft_s is None and out.outputs[0].token_ids:
                    timing.ttft_s = loop.time() - sent
                final = out
        except Exception as exc:  # a refused or failed request is a measurement, not a crash
            timing.error = f"{type(exc).__name__}: {exc}"
            return
        timing.jct_s = loop.time() - sent
        timing.output_tokens = len(final.outputs[0].token_ids) if final is not None else 0
        timing.cached_tokens = final.num_cached_tokens if final is not None else 0
        reason = final.outputs[0].finish_reason if final is not None else None
        timing.error = None if reason in ("length", "stop") else (
            (final.error if final is not None else None) or f"finished with {reason}")

    token = REQUEST_ROUTING_POLICY.set(policy)  # the tasks below copy this context
    try:
        tasks = [asyncio.create_task(one(t, r)) for t, r in zip(timings, requests)]
    finally:
        REQUEST_ROUTING_POLICY.reset(token)
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()  # the JE aborts a cancelled generate on its TEs
    await asyncio.gather(*pending, return_exceptions=True)
    for timing in timings:
        if timing.error == NOT_FINISHED:
            timing.error = f"not finished within {timeout_s:g} s"
    return timings


async def warm_up(je, prompt_len: int, vocab_size: int, exclude_token_ids=(), seed: int = 12345,
                  max_tokens: int = 8) -> None:
    """A few requests through every TE (round robin) so first-use costs stay out of the measurements."""
    units = max(1, len(je.registry.live()))
    requests = make_offline_workload(2 * units, (prompt_len, prompt_len), (max_tokens, max_tokens), vocab_size,
                                     seed=seed, exclude_token_ids=exclude_token_ids)
    timings = await run_fixed_rate(je, requests, math.inf, policy="round_robin", tag=f"warmup{seed}")
    failed = [t.error for t in timings if not t.ok]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed[0]}")


async def te_counters(je) -> dict[str, dict]:
    """Each live TE's fresh stats (role added), asked of the TE itself rather than its last heartbeat."""
    out = {}
    for record in je.registry.live():
        reply = await je.admin("stats", {"te": record.name})
        if not reply.ok:
            raise RuntimeError(f"TE {record.name} did not report its stats: {reply.error}")
        out[record.name] = {"role": record.role, **reply.to_json()}
    return out


def counter_deltas(before: dict[str, dict], after: dict[str, dict],
                   keys: Sequence[str] = ("prefix_cache_queries", "prefix_cache_hits", "kv_pulled",
                                          "kv_pull_recomputed")) -> dict[str, dict]:
    """Per TE, how much each cumulative counter grew between two `te_counters` readings."""
    return {name: {"role": stats["role"], **{k: stats[k] - before.get(name, {}).get(k, 0) for k in keys}}
            for name, stats in after.items()}


def summarize_timings(timings: Sequence[RequestTiming]) -> dict[str, Any]:
    """Completed/failed counts and TTFT, TPOT and JCT summaries (ms) of the successful requests."""
    ok = [t for t in timings if t.ok]
    ms = lambda values: [v * 1000 for v in values if v is not None]  # noqa: E731
    errors: dict[str, int] = {}
    for t in timings:
        if not t.ok:
            errors[t.error] = errors.get(t.error, 0) + 1
    prompt_tokens = sum(t.prompt_tokens for t in ok)
    return {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "error_counts": errors,
        "ttft_ms": report.summarize(ms(t.ttft_s for t in ok)),
        "tpot_ms": report.summarize(ms(t.tpot_s for t in ok)),
        "jct_ms": report.summarize(ms(t.jct_s for t in ok)),
        "cached_token_share": sum(t.cached_tokens for t in ok) / prompt_tokens if prompt_tokens else 0.0,
    }


def vocabulary(model: str) -> tuple[int, set[int]]:
    """The model's vocabulary size and the ids prompts must not use (special tokens)."""
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.models.loader import load_hf_config

    return int(load_hf_config(model)["vocab_size"]), special_token_ids(model)


def model_max_len(model: str, engine: dict) -> int:
    """Longest prompt + output a TE of this model accepts (the engine's max_model_len when given)."""
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.models.loader import load_hf_config

    return int(engine.get("max_model_len") or load_hf_config(model)["max_position_embeddings"])


# ---------------------------------------------------------------- command-line helpers
def parse_list(text: str, name: str, kind=float, positive: bool = True) -> list:
    """A comma-separated list of numbers, e.g. "64,256,1024"."""
    items = [p.strip() for p in str(text).split(",")]
    if not items or any(not p for p in items):
        raise ValueError(f"{name} must be a comma-separated list, got {text!r}")
    try:
        values = [kind(p) for p in items]
    except ValueError:
        raise ValueError(f"{name} must be a list of {kind.__name__}s, got {text!r}") from None
    bad = [v for v in values if not math.isfinite(v) or (positive and v <= 0)]
    if bad:
        raise ValueError(f"{name} must be {'positive and ' if positive else ''}finite, got {bad[0]}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} has repeated values: {text!r}")
    return values


def check_model_dir(model: str | None) -> str:
    """--model, or the default tiny model (written on first use) when not given."""
    if model is None:
        return str(ensure_default_model())
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"{model} is not a model directory (no config.json)")
    return model


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """EngineConfig settings every TE of the deployment gets (only the flags given are passed on)."""
    add_engine_arguments(parser, (*BENCH_ENGINE_SETTINGS, "num_kv_blocks", "kv_transfer_backend",
                                  "enable_prefix_caching"))


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine flags given on the command line, validated as EngineConfig fields."""
    settings = given_engine_settings(args)
    EngineConfig.from_kwargs("", **settings)  # raises ConfigError on a bad value
    return settings


def quick_or_full(args: argparse.Namespace, full: dict, quick: dict) -> dict:
    """Each option of `full` as given on the command line, else its --quick or full-run default."""
    defaults = quick if args.quick else full
    return {key: getattr(args, key) if getattr(args, key) is not None else defaults[key] for key in full}


def one_line_errors(parser: argparse.ArgumentParser, prog: str) -> argparse.ArgumentParser:
    """Argument errors print one line (no usage block) and exit with 2, as the house's CLI rule asks."""

    def error(message: str) -> NoReturn:
        parser.exit(2, f"{prog}: error: {message}\n")

    parser.error = error
    return parser


def run_bench_cli(prog: str, args: argparse.Namespace, parse: Callable, run: Callable,
                  errors: tuple[type[BaseException], ...], report: Callable) -> int:
    """A benchmark command's frame: its settings from `args` (a ValueError is one line and exit 2), the run (an
    exception in `errors` is one line and exit 1), then `report(settings, result)` writes and prints."""
    try:
        settings = parse(args)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run(settings)
    except errors as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    report(settings, result)
    return 0


def log(prefix: str, message: str) -> None:
    print(f"[{prefix}] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)
