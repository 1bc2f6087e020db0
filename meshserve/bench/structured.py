"""`meshserve bench structured`: decoding under a JSON schema against free decoding on the same engine, and the
first-token latency of a schema the engine has not seen.

One engine is started once. Each round runs, per batch size, the same batch twice in turn, free and
constrained by a JSON schema (an array of objects with enums, bounded integers and short strings, too long to
finish within the output: every step computes a real mask), the order alternating between rounds so drift on
a shared machine reaches both alike. Greedy and EOS ignored, so both decode the same number of tokens; prefix
caching is off, so both prefill alike. The decode rate is the batch's tokens after each request's first over
the window from the median first token to the median last one; the constrained/free ratio is taken within a
round and the median over rounds reported.

First-token latency, one request at a time: free; a schema never seen before (compiled for this request);
the same schema again (from the compiled-grammar cache). The very first constrained request of the process
also builds the grammar engine's view of the tokenizer and is reported on its own.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

from meshserve.bench.deployment_load import check_model_dir, log, one_line_errors, quick_or_full, run_bench_cli
from meshserve.config.base import ConfigError
from meshserve.engine.core_client import EngineStartupError
from meshserve.utils import report
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams, StructuredOutputs

PROG = "meshserve bench structured"
LOG_PREFIX = "bench structured"
DEFAULT_JSON = "bench-results/structured.json"
FREE, CONSTRAINED = "free", "json_schema"
_FULL = {"batch_sizes": "1,32", "output_len": 64, "prompt_len": 16, "rounds": 3, "schemas": 5}
_QUICK = {"batch_sizes": "1,2", "output_len": 8, "prompt_len": 8, "rounds": 1, "schemas": 1}
_ERRORS = (ConfigError, EngineStartupError, EngineDeadError, OSError, RuntimeError, TimeoutError)


def schema(variant: int = 0) -> dict:
    """Records of an order; `variant` renames one field, so each variant is a schema the engine has not seen."""
    item = {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "state"],
            "properties": {"sku": {"type": "string", "maxLength": 8},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 500},
                           "state": {"enum": ["open", "held", "sent"]}}}
    return {"type": "object", "additionalProperties": False, "required": [f"order_{variant}", "items"],
            "$defs": {"Item": item},
            "properties": {f"order_{variant}": {"type": "integer", "minimum": 0},
                           "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 64}}}


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format model directory (default: the DeepSeek-V3 model of --preset, "
                                        "written on first use)")
    parser.add_argument("--preset", default="small",
                        help="preset of the default model when --model is not given: small (hidden 768, 8 layers) or "
                             "tiny (hidden 256, 4 layers, where a mask weighs most against a step) (default: small)")
    parser.add_argument("--num-threads", type=int, help="torch threads of the engine (default: the engine's)")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest run (for tests): the --quick value of every option below not given")
    parser.add_argument("--batch-sizes", help="decode batch sizes (default: 1,32; --quick: 1,2)")
    parser.add_argument("--output-len", type=int, help="tokens per request (default: 64; --quick: 8)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per request (default: 16; --quick: 8)")
    parser.add_argument("--rounds", type=int, help="rounds, medians reported (default: 3; --quick: 1)")
    parser.add_argument("--schemas", type=int,
                        help="new schemas timed for first-token latency (default: 5; --quick: 1)")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"result file; a PNG with the same name is written next to it (default: {DEFAULT_JSON})")
    parser.set_defaults(func=structured_main)


@dataclasses.dataclass(frozen=True)
class StructuredSettings:
    model_dir: str | None
    preset: str
    num_threads: int | None
    batch_sizes: tuple[int, ...]
    output_len: int
    prompt_len: int
    rounds: int
    schemas: int
    json_path: str

    def engine_args(self) -> dict:
        args = {"max_num_seqs": max(8, *self.batch_sizes), "enable_prefix_caching": False,
                "kv_cache_memory_gb": 0.25}
        if self.num_threads is not None:
            args["num_threads"] = self.num_threads
        return args


def settings_from_args(args: argparse.Namespace) -> StructuredSettings:
    given = quick_or_full(args, _FULL, _QUICK)
    try:
        batch_sizes = tuple(int(size) for size in str(given.pop("batch_sizes")).split(","))
    except ValueError:
        raise ValueError(f"--batch-sizes must be integers separated by commas, got {args.batch_sizes!r}") from None
    for key, value in {"batch_sizes": min(batch_sizes), **given}.items():
        if value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    if given["output_len"] < 3:
        raise ValueError("--output-len must be at least 3: the first token is left out of the decode rate")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"{args.model} is not a model directory (no config.json)")
    if args.preset not in ("tiny", "small"):
        raise ValueError(f"--preset must be tiny or small, got {args.preset!r}")
    return StructuredSettings(model_dir=args.model, preset=args.preset, num_threads=args.num_threads,
                              batch_sizes=batch_sizes, json_path=args.json, **given)


def structured_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_structured_benchmark, _ERRORS, _report)


# ---------------------------------------------------------------- the run
def run_structured_benchmark(settings: StructuredSettings) -> dict:
    # start-up: the engine client (and the tokenizer) only when the benchmark runs
    from meshserve.config import EngineConfig
    from meshserve.engine.async_client import AsyncEngineClient
    from meshserve.models.factory import ensure_default_model

    model = settings.model_dir or str(ensure_default_model("deepseek_v3", settings.preset))
    check_model_dir(model)
    log(LOG_PREFIX, f"starting the engine ({model})")
    engine = AsyncEngineClient(EngineConfig.from_kwargs(model, **settings.engine_args()), log_level=logging.WARNING)
    try:
        latency, rounds = asyncio.run(_measure(engine, settings))
    finally:
        engine.shutdown()
    return _result(settings, model, rounds, latency)


async def _measure(engine, settings: StructuredSettings) -> tuple[dict, list[dict]]:
    # one event loop for the whole run: the engine client's streams belong to the loop that started them
    return await _first_token_latency(engine, settings), await _decode_rounds(engine, settings)


def _prompts(settings: StructuredSettings, count: int, salt: int = 0) -> list[list[int]]:
    return [[(7 + 31 * (i + salt) + 13 * j) % 1000 + 100 for j in range(settings.prompt_len)] for i in range(count)]


def _params(settings: StructuredSettings, config: str, variant: int = 0, max_tokens: int | None = None):
    spec = StructuredOutputs(json=json.dumps(schema(variant))) if config == CONSTRAINED else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens or settings.output_len, ignore_eos=True,
                          structured_outputs=spec)


async def _stream(engine, prompt: list[int], params: SamplingParams, request_id: str) -> tuple[float, float, int]:
    """(first token time, last token time, tokens) of one streamed request."""
    first = last = None
    tokens = 0
    async for out in engine.generate(None, prompt, params, request_id):
        if out.error is not None:
            raise RuntimeError(f"request {request_id} failed: {out.error}")
        new = len(out.outputs[0].token_ids_delta)
        if not new:
            continue
        last = time.perf_counter()
        first = first or last
        tokens += new
    if first is None:
        raise RuntimeError(f"request {request_id} produced no token")
    return first, last, tokens


async def _decode_rate(engine, settings: StructuredSettings, batch: int, config: str, tag: str) -> float:
    prompts = _prompts(settings, batch)
    params = _params(settings, config)
    streams = await asyncio.gather(*(_stream(engine, p, params, f"structured-{tag}-{i}")
                                     for i, p in enumerate(prompts)))
    window = statistics.median(s[1] for s in streams) - statistics.median(s[0] for s in streams)
    return sum(s[2] - 1 for s in streams) / max(window, 1e-9)


async def _decode_rounds(engine, settings: StructuredSettings) -> list[dict]:
    """Per round and batch size: tokens/s free and constrained, and their ratio."""
    for config in (FREE, CONSTRAINED):  # first-call costs out of the measured rounds
        await _decode_rate(engine, settings, 1, config, f"warm-{config}")
    rounds = []
    for index in range(settings.rounds):
        order = (FREE, CONSTRAINED) if index % 2 == 0 else (CONSTRAINED, FREE)
        row = {}
        for batch in settings.batch_sizes:
            rates = {config: await _decode_rate(engine, settings, batch, config, f"r{index}-b{batch}-{config}")
                     for config in order}
            row[batch] = {**rates, "ratio": rates[CONSTRAINED] / rates[FREE]}
            log(LOG_PREFIX, f"round {index + 1}/{settings.rounds} batch {batch}: free {rates[FREE]:.1f} tok/s, "
                            f"json_schema {rates[CONSTRAINED]:.1f} tok/s ({row[batch]['ratio']:.3f}x)")
        rounds.append(row)
    return rounds


async def _first_token_latency(engine, settings: StructuredSettings) -> dict:
    """Milliseconds to the first token of one request at a time: the process's first constrained request, new
    schemas, the same schemas again, and free requests between them."""
    async def ttft(config: str, variant: int, tag: str) -> float:
        started = time.perf_counter()
        prompt = _prompts(settings, 1, salt=variant)[0]
        first, _, _ = await _stream(engine, prompt, _params(settings, config, variant, max_tokens=2), tag)
        return (first - started) * 1e3

    await ttft(FREE, 0, "ttft-warm")
    first_ever = await ttft(CONSTRAINED, 1000, "ttft-first")  # builds the tokenizer's grammar view
    samples = {"free": [], "new_schema": [], "cached_schema": []}
    for variant in range(1, settings.schemas + 1):
        samples["free"].append(await ttft(FREE, variant, f"ttft-free-{variant}"))
        samples["new_schema"].append(await ttft(CONSTRAINED, variant, f"ttft-new-{variant}"))
        samples["cached_schema"].append(await ttft(CONSTRAINED, variant, f"ttft-cached-{variant}"))
    log(LOG_PREFIX, "first token: " + ", ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in samples.items()))
    return {"first_constrained_request_ms": first_ever,
            **{f"{key}_ms": statistics.median(values) for key, values in samples.items()}, "samples_ms": samples}


def _result(settings: StructuredSettings, model: str, rounds: list[dict], latency: dict) -> dict:
    per_batch = {}
    for batch in settings.batch_sizes:
        per_batch[str(batch)] = {key: statistics.median(r[batch][key] for r in rounds)
                                 for key in (FREE, CONSTRAINED, "ratio")}
    return {
        "config": {"model": model, "batch_sizes": list(settings.batch_sizes), "output_len": settings.output_len,
                   "prompt_len": settings.prompt_len, "rounds": settings.rounds, "schemas": settings.schemas,
                   "engine_args": settings.engine_args()},
        "machine": report.machine_info(),
        "decode_tokens_per_s": per_batch,
        "rounds": [{str(batch): row for batch, row in r.items()} for r in rounds],
        "first_token": latency,
    }


# ---------------------------------------------------------------- the report
def table_lines(result: dict) -> list[str]:
    lines = [f"{'batch':>6}{'free tok/s':>13}{'json_schema tok/s':>20}{'ratio':>8}"]
    for batch, row in result["decode_tokens_per_s"].items():
        lines.append(f"{batch:>6}{row[FREE]:>13.1f}{row[CONSTRAINED]:>20.1f}{row['ratio']:>8.3f}")
    first = result["first_token"]
    lines.append(f"first token (ms): free {first['free_ms']:.1f}, new schema {first['new_schema_ms']:.1f}, "
                 f"cached schema {first['cached_schema_ms']:.1f}, the process's first constrained request "
                 f"{first['first_constrained_request_ms']:.1f}")
    config = result["config"]
    lines.append(f"({config['output_len']} tokens per request, greedy; medians over {config['rounds']} round(s); "
                 "ratio: json_schema / free in the same round)")
    return lines


def plot_structured(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2)
    rates, latency = axes[0][0], axes[0][1]
    batches = list(result["decode_tokens_per_s"])
    width = 0.38
    for offset, config in ((-width / 2, FREE), (width / 2, CONSTRAINED)):
        values = [result["decode_tokens_per_s"][b][config] for b in batches]
        rates.bar([i + offset for i in range(len(batches))], values, width, label=config)
    rates.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    rates.set_ylabel("decode tokens/s")
    rates.set_title("free vs JSON-schema decoding")
    rates.legend()
    first = result["first_token"]
    labels = ["free", "new schema", "cached schema", "first constrained"]
    values = [first["free_ms"], first["new_schema_ms"], first["cached_schema_ms"],
              first["first_constrained_request_ms"]]
    latency.bar(labels, values, color=["C0", "C1", "C2", "C3"])
    latency.set_ylabel("time to first token (ms)")
    latency.set_title("first-token latency")
    return report.save_figure(fig, path)


def _report(settings: StructuredSettings, result: dict) -> None:
    report.publish(settings.json_path, result, plot_structured, table_lines(result))
