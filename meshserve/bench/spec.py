"""`meshserve bench spec`: MTP speculative decoding against plain decoding, per batch size and draft length.

One engine per configuration (no drafts; MTP with each k of `--num-speculative-tokens`) is started once and
kept alive. Each repetition runs every batch size on every engine in turn, the order rotating between
repetitions, so drift on a shared machine hits all of them; every speedup is the ratio of two runs of the
same repetition, and the medians over repetitions are reported. Prompts are windows of the corpus's held-out
files (meshserve/train/corpus.py), and a batch size below --min-requests runs that many requests in consecutive
batches; greedy, EOS ignored, so every run decodes the same number of tokens, and prefix caching is off, so
every run prefills the same way.

Prefill is left out: TPOT is each request's (last token - first token) / (tokens - 1) from the engine's
token timestamps, and the decode rate is the batch's tokens after the first over the window from the
median first token to the median last one (as the decode roofline measures it). Acceptance comes from the
engine's counters (EngineStats.spec_*), differenced around each run: per draft position, the share of drafts
accepted (with every draft before it), and the tokens a verifying step produced.

The large-batch rule: for the k that pays most at the smallest batch size, the largest batch size up to
which MTP pays at every size (each repetition's speedup above 1) becomes `speculative_max_batch`. An engine
with that threshold and one that measures its own (`speculative_max_batch=-1`) then run the smallest and
the largest batch sizes again, alternating with the plain engine and the always-drafting one.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from meshserve.bench import BENCH_ENGINE_SETTINGS
from meshserve.bench.deployment_load import log, one_line_errors, run_bench_cli
from meshserve.config.arguments import add_engine_arguments, given_engine_settings
from meshserve.config.base import ConfigError
from meshserve.config.cache import CacheConfig
from meshserve.core.spec_controller import MEASURE
from meshserve.engine.core_client import EngineStartupError
from meshserve.utils import report
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

PROG = "meshserve bench spec"
LOG_PREFIX = "bench spec"
BASELINE = "baseline"
DEFAULT_OUT = "bench-results/spec"
RESULT_FILE = "spec.json"
DEFAULT_DRAFT_VOCAB = 4096
MIN_REQUESTS = 8  # a batch size below this runs that many requests in consecutive batches
# the large-batch rule's engines: MTP with the chosen k always, up to the measured threshold, self-measuring
ALWAYS, THRESHOLD, AUTO = "always", "threshold", "auto"


class SpecBenchError(RuntimeError):
    """The benchmark cannot run or a run came back wrong (one line for the user)."""


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format model directory with MTP layers (default: the trained model of "
                                        "--arch/--preset, trained and cached on first use)")
    parser.add_argument("--arch", default="deepseek_v3",
                        help="architecture of the trained model (default: deepseek_v3)")
    parser.add_argument("--preset", default="small", help="preset of the trained model (default: small)")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest run (for tests and a first look): the --quick value of every option "
                             "below not given")
    parser.add_argument("--batch-sizes", help="decode batch sizes (default: 1,8,32,64; --quick: 1,2)")
    parser.add_argument("--num-speculative-tokens",
                        help="draft lengths k compared with plain decoding (default: 1,2,3; --quick: 1)")
    parser.add_argument("--speculative-draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB,
                        help="tokens the MTP head scores (the most frequent); 0: the whole vocabulary "
                             f"(default: {DEFAULT_DRAFT_VOCAB})")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per request (default: 64; --quick: 32)")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default: 64; --quick: 8)")
    parser.add_argument("--runs", type=int, help="repetitions, medians reported (default: 3; --quick: 1)")
    parser.add_argument("--min-requests", type=int,
                        help=f"requests per batch size at least: a smaller batch runs that many in consecutive "
                             f"batches (default: {MIN_REQUESTS}; --quick: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out prompt offsets (default: 0)")
    parser.add_argument("--skip-rule", dest="rule", action="store_false",
                        help="do not run the large-batch rule (speculative_max_batch) afterwards")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"output directory: {RESULT_FILE} and its PNG (default: {DEFAULT_OUT})")
    add_engine_arguments(parser, BENCH_ENGINE_SETTINGS)
    parser.set_defaults(func=spec_main)


@dataclasses.dataclass(frozen=True)
class SpecBenchSettings:
    model_dir: str  # "" until resolved: the trained model of arch/preset
    arch: str
    preset: str
    batch_sizes: tuple[int, ...]
    ks: tuple[int, ...]
    draft_vocab: int
    prompt_len: int
    output_len: int
    runs: int
    min_requests: int
    seed: int
    rule: bool
    out_dir: str
    engine_args: dict

    @property
    def configs(self) -> list[str]:
        return [BASELINE, *(k_name(k) for k in self.ks)]


def k_name(k: int) -> str:
    return f"k{k}"


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise ValueError(f"{flag} needs positive integers, got {text!r}")
    return values


# the options --quick changes, for those not given
_FULL = {"batch_sizes": "1,8,32,64", "num_speculative_tokens": "1,2,3", "prompt_len": 64, "output_len": 64,
         "runs": 3, "min_requests": MIN_REQUESTS}
_QUICK = {"batch_sizes": "1,2", "num_speculative_tokens": "1", "prompt_len": 32, "output_len": 8, "runs": 1,
          "min_requests": 2}


def settings_from_args(args: argparse.Namespace) -> SpecBenchSettings:
    """Validated settings (the trained model is not made yet); ValueError names the bad flag."""
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else (_QUICK if args.quick else _FULL)[key]
             for key in _FULL}
    batch_sizes = _int_list(sizes["batch_sizes"], "--batch-sizes")
    ks = _int_list(sizes["num_speculative_tokens"], "--num-speculative-tokens")
    for flag, value, low in (("--prompt-len", sizes["prompt_len"], 1), ("--output-len", sizes["output_len"], 2),
                             ("--runs", sizes["runs"], 1), ("--min-requests", sizes["min_requests"], 1),
                             ("--speculative-draft-vocab", args.speculative_draft_vocab, 0)):
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model: directory {args.model!r} does not exist")
    engine_args = _engine_args(given_engine_settings(args), batch_sizes, ks, sizes["prompt_len"],
                               sizes["output_len"])
    return SpecBenchSettings(
        model_dir=args.model or "", arch=args.arch, preset=args.preset, batch_sizes=batch_sizes, ks=ks,
        draft_vocab=args.speculative_draft_vocab, prompt_len=sizes["prompt_len"], output_len=sizes["output_len"],
        runs=sizes["runs"], min_requests=sizes["min_requests"], seed=args.seed, rule=args.rule, out_dir=args.out,
        engine_args=engine_args)


def _engine_args(given: dict, batch_sizes: tuple[int, ...], ks: tuple[int, ...], prompt_len: int,
                 output_len: int) -> dict:
    """The engine settings every configuration shares: the largest batch decodes together and prefills in one
    step (the decode window then holds no prefill), a KV cache just large enough (several engines are alive)."""
    largest = batch_sizes[-1]
    args = dict(given)
    args.setdefault("dtype", "float32")
    args.setdefault("max_num_seqs", largest)
    if args["max_num_seqs"] < largest:
        raise ValueError(f"--max-num-seqs {args['max_num_seqs']} is below the largest batch size {largest}")
    args.setdefault("max_num_batched_tokens", largest * max(prompt_len, 1 + ks[-1]))
    if "kv_cache_memory_gb" not in args:
        block_size = args.get("block_size", CacheConfig().block_size)
        per_sequence = -(-(prompt_len + output_len + ks[-1] + 1) // block_size) + 1
        args["num_kv_blocks"] = largest * per_sequence + 16
    args["enable_prefix_caching"] = False  # the same prompts run again: each run prefills from scratch
    return args


# a model without MTP layers, an engine that died, a short run, ...
_SPEC_ERRORS = (SpecBenchError, ConfigError, EngineStartupError, EngineDeadError, OSError, ValueError)


def spec_main(args: argparse.Namespace) -> int:
    return run_bench_cli(PROG, args, settings_from_args, run_spec_benchmark, _SPEC_ERRORS, _report_spec)


def _report_spec(settings, result: dict) -> None:
    json_path = report.write_json(Path(settings.out_dir) / RESULT_FILE, result)
    png_path = plot_spec(result, report.png_path_for(json_path))
    print(result["table_text"])
    print(result["summary"])
    print(f"wrote {json_path} and {png_path}")


# ---------------------------------------------------------------- engines and runs
def resolve_model(settings: SpecBenchSettings) -> SpecBenchSettings:
    if settings.model_dir:
        return settings
    log(LOG_PREFIX, f"no --model: the trained {settings.arch} {settings.preset} model (trained on first use)")
    # start-up: the training code (and torch) only when the trained model is asked for
    from meshserve.train.cache import ensure_trained_model

    model_dir = ensure_trained_model(arch=settings.arch, preset=settings.preset)
    return dataclasses.replace(settings, model_dir=str(model_dir))


def spec_engine_args(k: int, draft_vocab: int, max_batch: int = 0) -> dict:
    return {"speculative": "mtp", "num_speculative_tokens": k, "speculative_draft_vocab": draft_vocab,
            "speculative_max_batch": max_batch}


def start_engine(settings: SpecBenchSettings, name: str, extra: dict):
    # start-up: the engine client only when the benchmark runs
    from meshserve.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM(settings.model_dir, **settings.engine_args, **extra)
    log(LOG_PREFIX, f"engine {name} ready in {time.perf_counter() - start:.1f} s ({extra or 'no drafts'})")
    return llm


def start_engines(settings: SpecBenchSettings, extras: dict[str, dict], engines: dict) -> None:
    """Start the engines named in `extras`, one after the other, into `engines` (the caller shuts them down)."""
    for name, extra in extras.items():
        engines[name] = start_engine(settings, name, extra)


def warm_up(llm, prompts: list[list[int]], batch_sizes: tuple[int, ...]) -> None:
    """One short run per batch size: the first step of each shape pays one-off costs."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    for batch in batch_sizes:
        llm.generate(prompts[:batch], params)


def _counter_delta(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in itertools.zip_longest(after, before, fillvalue=0)]


def batch_groups(prompts: list[list[int]], batch: int, min_requests: int = MIN_REQUESTS) -> list[list[list[int]]]:
    """The prompts a batch size runs: one batch of `batch`, or below `min_requests`, that many requests in
    consecutive batches (one prompt's acceptance says little: greedy outputs fall into loops the MTP layer
    guesses all or nothing of)."""
    groups = max(1, -(-min_requests // batch))
    if groups * batch > len(prompts):
        raise SpecBenchError(f"batch {batch} needs {groups * batch} prompts, got {len(prompts)}")
    return [prompts[i * batch:(i + 1) * batch] for i in range(groups)]


def measure(llm, groups: list[list[list[int]]], output_len: int) -> tuple[dict, list[list[int]]]:
    """Greedy runs of each group of prompts in turn: decode rate, TPOT, the speculative counters' change; and
    the tokens of every request."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    before = llm.get_stats()
    start = time.perf_counter()
    outputs, window, spread = [], 0.0, 0.0
    for group in groups:
        outs = llm.generate(group, params)
        short = [len(o.token_ids) for o in outs if len(o.token_ids) != output_len]
        if short:
            raise SpecBenchError(f"expected {output_len} tokens per request, got {short[:4]}")
        firsts = [o.metrics.first_token_time for o in outs]
        window += statistics.median(o.metrics.last_token_time for o in outs) - statistics.median(firsts)
        spread = max(spread, max(firsts) - min(firsts))
        outputs += outs
    elapsed = time.perf_counter() - start
    after = llm.get_stats()
    if window <= 0:
        raise SpecBenchError("decode took no measurable time: increase --output-len")
    tpots = [(o.metrics.last_token_time - o.metrics.first_token_time) / (output_len - 1) for o in outputs]
    record = {
        "requests": len(outputs),
        "decode_tokens_per_s": len(outputs) * (output_len - 1) / window,
        "tpot_ms": statistics.fmean(tpots) * 1e3,
        "ttft_ms": statistics.fmean(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs) * 1e3,
        "decode_window_s": window,
        "elapsed_s": elapsed,
        "first_token_spread_ms": spread * 1e3,
        "spec_drafted": _counter_delta(after.spec_drafted, before.spec_drafted),
        "spec_accepted": _counter_delta(after.spec_accepted, before.spec_accepted),
        "spec_verify_steps": after.spec_verify_steps - before.spec_verify_steps,
        "spec_tokens": after.spec_tokens - before.spec_tokens,
        "load_average_1m": os.getloadavg()[0],  # the machine is shared: what else ran is part of the result
    }
    return record, [list(o.token_ids) for o in outputs]


def _rotated(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


def run_rounds(engines: dict, prompts: list[list[int]], batch_sizes: tuple[int, ...], settings: SpecBenchSettings,
               phase: str, after_run: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """`settings.runs` repetitions; in each, every batch size on every engine, the engines' order rotating.
    Each record names its run, batch size and engine; `mismatching_requests` counts the requests whose greedy
    tokens differ from the plain engine's in the same run. `after_run` gets the records so far after each run."""
    records: list[dict] = []
    names = list(engines)
    for run in range(settings.runs):
        for batch in batch_sizes:
            tokens = {}
            for name in _rotated(names, run):
                record, tokens[name] = measure(engines[name], batch_groups(prompts, batch, settings.min_requests),
                                               settings.output_len)
                record |= {"phase": phase, "run": run, "batch_size": batch, "config": name}
                records.append(record)
                log(LOG_PREFIX, f"{phase} run {run + 1}/{settings.runs} batch {batch:>3} {name:<9}: "
                                f"{record['decode_tokens_per_s']:8.1f} tok/s  TPOT {record['tpot_ms']:7.1f} ms"
                                + _acceptance_text(record))
            for record in records[-len(names):]:
                record["mismatching_requests"] = sum(a != b for a, b in zip(tokens[record["config"]],
                                                                           tokens[BASELINE]))
        if after_run is not None:
            after_run(records)
    return records


def _acceptance_text(record: dict) -> str:
    if not record["spec_verify_steps"]:
        return ""
    rates = acceptance_rates(record["spec_drafted"], record["spec_accepted"])
    return (f"  accepted {' '.join(f'{r:.2f}' for r in rates)}  "
            f"{record['spec_tokens'] / record['spec_verify_steps']:.2f} tokens/step")


# ---------------------------------------------------------------- aggregation
def acceptance_rates(drafted: list[int], accepted: list[int]) -> list[float]:
    """Per draft position: the share of its drafts accepted (each with every draft before it)."""
    return [a / d if d else 0.0 for d, a in zip(drafted, accepted)]


def conditional_rates(drafted: list[int], accepted: list[int]) -> list[float]:
    """Per draft position: accepted given that every draft before it was."""
    reached = [drafted[0], *accepted[:-1]] if drafted else []
    return [a / r if r else 0.0 for r, a in zip(reached, accepted)]


def relative_range(values: list[float]) -> float:
    """(max - min) / median: the run-to-run noise of a figure (0 for one run)."""
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def _summed(records: list[dict], key: str) -> list[int]:
    return [sum(column) for column in itertools.zip_longest(*(r[key] for r in records), fillvalue=0)]


def summarize_config(records: list[dict], baseline: list[dict], output_len: int) -> dict:
    """One engine at one batch size over the runs: medians, the speedups against the same runs' plain engine,
    and the acceptance over all runs."""
    by_run = {r["run"]: r for r in baseline}
    rates = [r["decode_tokens_per_s"] for r in records]
    speedups = [r["decode_tokens_per_s"] / by_run[r["run"]]["decode_tokens_per_s"] for r in records]
    summary = {
        "decode_tokens_per_s": statistics.median(rates), "decode_tokens_per_s_runs": rates,
        "tpot_ms": statistics.median(r["tpot_ms"] for r in records), "tpot_ms_runs": [r["tpot_ms"] for r in records],
        "ttft_ms": statistics.median(r["ttft_ms"] for r in records),
        "noise": relative_range(rates),
        "speedup": statistics.median(speedups), "speedup_runs": speedups, "speedup_low": min(speedups),
        "pays": min(speedups) > 1.0,  # every run faster than the plain engine in the same run
        "mismatching_requests": sum(r.get("mismatching_requests", 0) for r in records),
    }
    drafted, accepted = _summed(records, "spec_drafted"), _summed(records, "spec_accepted")
    steps, tokens = sum(r["spec_verify_steps"] for r in records), sum(r["spec_tokens"] for r in records)
    decode_tokens = sum(r["requests"] * (output_len - 1) for r in records)
    summary |= {
        "spec_drafted": drafted, "spec_accepted": accepted, "spec_verify_steps": steps, "spec_tokens": tokens,
        "acceptance_rate": acceptance_rates(drafted, accepted) if steps else None,
        "conditional_acceptance_rate": conditional_rates(drafted, accepted) if steps else None,
        "tokens_per_verify_step": tokens / steps if steps else None,
        "drafting_token_share": tokens / decode_tokens,  # of the decoded tokens, those from verifying steps
    }
    return summary


def summarize_batches(records: list[dict], names: list[str], batch_sizes: tuple[int, ...],
                      output_len: int) -> list[dict]:
    rows = []
    for batch in batch_sizes:
        at_batch = [r for r in records if r["batch_size"] == batch]
        baseline = [r for r in at_batch if r["config"] == BASELINE]
        configs = {name: summarize_config([r for r in at_batch if r["config"] == name], baseline, output_len)
                   for name in names}
        rows.append({"batch_size": batch, "configs": configs})
    return rows


def acceptance_by_k(records: list[dict], ks: tuple[int, ...]) -> dict[str, dict]:
    """Each k's acceptance over every batch size and run (greedy: it depends on the text, not the batch)."""
    out = {}
    for k in ks:
        mine = [r for r in records if r["config"] == k_name(k)]
        drafted, accepted = _summed(mine, "spec_drafted"), _summed(mine, "spec_accepted")
        steps, tokens = sum(r["spec_verify_steps"] for r in mine), sum(r["spec_tokens"] for r in mine)
        out[k_name(k)] = {"k": k, "acceptance_rate": acceptance_rates(drafted, accepted),
                          "conditional_acceptance_rate": conditional_rates(drafted, accepted),
                          "tokens_per_verify_step": tokens / steps if steps else None,
                          "verify_steps": steps}
    return out


def choose_rule(batches: list[dict], ks: tuple[int, ...]) -> tuple[int, int | None]:
    """The k that pays most at the smallest batch size, and the largest batch size up to which it pays at every
    measured size (None: it pays at none)."""
    smallest = batches[0]["configs"]
    k = max(ks, key=lambda k: smallest[k_name(k)]["speedup"])
    threshold = None
    for row in batches:
        if not row["configs"][k_name(k)]["pays"]:
            break
        threshold = row["batch_size"]
    return k, threshold


# ---------------------------------------------------------------- the benchmark
def run_spec_benchmark(settings: SpecBenchSettings) -> dict:
    # start-up: the corpus (torch, the tokenizer) only when the benchmark runs
    from meshserve.train.corpus import heldout_prompts, load_corpus

    trained = not settings.model_dir
    settings = resolve_model(settings)
    needed = max(batch * len(range(0, settings.min_requests, batch)) for batch in settings.batch_sizes)
    prompts = heldout_prompts(max(needed, settings.batch_sizes[-1]), settings.prompt_len, seed=settings.seed)
    log(LOG_PREFIX, f"{len(prompts)} held-out prompts of {settings.prompt_len} tokens; model {settings.model_dir}")
    engines: dict = {}
    try:
        start_engines(settings, {BASELINE: {}, **{k_name(k): spec_engine_args(k, settings.draft_vocab)
                                                  for k in settings.ks}}, engines)
        for name, llm in engines.items():
            log(LOG_PREFIX, f"warming up {name}")
            warm_up(llm, prompts, settings.batch_sizes)
        config = _config_record(settings, trained, load_corpus().summary())

        def save_so_far(records: list[dict]) -> None:
            # a long run on a shared machine can be cut short: what was measured stays on disk
            path = report.write_json(Path(settings.out_dir) / RESULT_FILE,
                                     build_result(settings, config, records, None, complete=False))
            log(LOG_PREFIX, f"results so far in {path}")

        records = run_rounds(engines, prompts, settings.batch_sizes, settings, "main", after_run=save_so_far)
        rule = None
        if settings.rule and len(settings.batch_sizes) > 1:
            batches = summarize_batches(records, settings.configs, settings.batch_sizes, settings.output_len)
            rule = run_rule(settings, engines, prompts, batches)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return build_result(settings, config, records, rule, complete=True)


def build_result(settings: SpecBenchSettings, config: dict, records: list[dict], rule: dict | None,
                 complete: bool) -> dict:
    result = {
        "complete": complete,
        "runs_done": len({r["run"] for r in records}),
        "machine": report.machine_info(),
        "config": config,
        "batches": summarize_batches(records, settings.configs, settings.batch_sizes, settings.output_len),
        "acceptance": acceptance_by_k(records, settings.ks),
        "max_batch_rule": rule,
        "runs": records,
    }
    result["table"] = ablation_rows(result)
    result["table_text"] = ablation_text(result)
    result["summary"] = summary_line(result)
    return result


def _config_record(settings: SpecBenchSettings, trained: bool, corpus: dict) -> dict:
    return {"model": settings.model_dir, "trained_model": trained,
            "arch": settings.arch if trained else None, "preset": settings.preset if trained else None,
            "batch_sizes": list(settings.batch_sizes),
            "num_speculative_tokens": list(settings.ks), "speculative_draft_vocab": settings.draft_vocab,
            "prompt_len": settings.prompt_len, "output_len": settings.output_len, "runs": settings.runs,
            "min_requests": settings.min_requests,
            "seed": settings.seed, "sampling": "greedy, ignore_eos", "prompts": "held-out corpus windows",
            "corpus": corpus, "engine_args": settings.engine_args,
            "order": "per run: each batch size, the engines in turn (order rotated each run)",
            "decode_rate": "batch * (output_len - 1) / (median last token time - median first token time)",
            "tpot": "per request (last token time - first token time) / (output_len - 1), mean over requests",
            "pays": "every run's decode rate above the plain engine's in the same run"}


def run_rule(settings: SpecBenchSettings, engines: dict, prompts: list[list[int]], batches: list[dict]) -> dict:
    """The large-batch rule: the threshold engine and the self-measuring one against the plain and the
    always-drafting engines, at the smallest and largest batch sizes. Engines of the other k are shut down
    first (memory); those started here join `engines`, so the caller shuts them down."""
    k, threshold = choose_rule(batches, settings.ks)
    smallest, largest = settings.batch_sizes[0], settings.batch_sizes[-1]
    for name in [n for n in engines if n not in (BASELINE, k_name(k))]:
        engines.pop(name).shutdown()
    new = {AUTO: spec_engine_args(k, settings.draft_vocab, MEASURE)}
    if threshold is not None and threshold < largest:
        new[THRESHOLD] = spec_engine_args(k, settings.draft_vocab, threshold)
    start_engines(settings, new, engines)
    rule_engines = {BASELINE: engines[BASELINE], ALWAYS: engines[k_name(k)],
                    **{name: engines[name] for name in (THRESHOLD, AUTO) if name in new}}
    for name in new:
        log(LOG_PREFIX, f"warming up {name}")
        warm_up(engines[name], prompts, (smallest, largest))
    records = run_rounds(rule_engines, prompts, (smallest, largest), settings, "rule")
    rows = summarize_batches(records, list(rule_engines), (smallest, largest), settings.output_len)
    main_noise = next(row for row in batches if row["batch_size"] == largest)["configs"][BASELINE]["noise"]
    noise = max(main_noise, rows[-1]["configs"][BASELINE]["noise"])
    verdict = {name: {"speedup": rows[-1]["configs"][name]["speedup"],
                      "within_noise": rows[-1]["configs"][name]["speedup"] >= 1.0 - noise}
               for name in rule_engines if name != BASELINE}
    return {"k": k, "threshold": threshold, "batch_sizes": [smallest, largest], "largest_batch": largest,
            "noise_at_largest": noise, "verdict_at_largest": verdict, "note": _rule_note(k, threshold, largest),
            "criterion": "threshold: the largest batch size up to which every measured size pays (every run's "
                         "speedup above 1) for the k with the best median speedup at the smallest batch size; "
                         "within noise: median speedup >= 1 - (max - min) / median of the plain engine's runs",
            "batches": rows, "runs": records}


def _rule_note(k: int, threshold: int | None, largest: int) -> str:
    if threshold is None:
        return f"MTP k={k} pays at no measured batch size: no threshold to set (the auto engine decides alone)"
    if threshold >= largest:
        return f"MTP k={k} pays at every measured batch size up to {largest}: no threshold needed"
    return (f"MTP k={k} pays up to batch {threshold}: with speculative_max_batch={threshold}, larger decode "
            "batches run without drafts")


# ---------------------------------------------------------------- report
def _label(name: str) -> str:
    if name == BASELINE:
        return "no MTP"
    if name.startswith("k") and name[1:].isdigit():
        return f"+MTP k={name[1:]}"
    return f"+MTP {name}"


def _row(phase: str, batch: int, name: str, summary: dict) -> dict:
    return {"phase": phase, "batch_size": batch, "config": name, "label": _label(name),
            "decode_tokens_per_s": summary["decode_tokens_per_s"], "speedup": summary["speedup"],
            "speedup_low": summary["speedup_low"], "speedup_high": max(summary["speedup_runs"]),
            "tpot_ms": summary["tpot_ms"], "acceptance_rate": summary["acceptance_rate"],
            "tokens_per_verify_step": summary["tokens_per_verify_step"],
            "drafting_token_share": summary["drafting_token_share"], "pays": summary["pays"],
            "mismatching_requests": summary["mismatching_requests"]}


def ablation_rows(result: dict) -> list[dict]:
    """The cloudmatrix-infer Table 4 style ablation: per batch size, plain decoding and what each k adds;
    then the large-batch rule's runs."""
    rows = [_row("main", b["batch_size"], name, summary)
            for b in result["batches"] for name, summary in b["configs"].items()]
    rule = result["max_batch_rule"]
    if rule:
        rows += [_row("rule", b["batch_size"], name, summary)
                 for b in rule["batches"] for name, summary in b["configs"].items()]
    return rows


def _format_row(row: dict) -> str:
    baseline = row["config"] == BASELINE
    speedup = "1.00" if baseline else f"{row['speedup']:.2f}x ({row['speedup_low']:.2f}-{row['speedup_high']:.2f})"
    acceptance = " ".join(f"{a:.2f}" for a in row["acceptance_rate"]) if row["acceptance_rate"] else "-"
    per_step = f"{row['tokens_per_verify_step']:.2f}" if row["tokens_per_verify_step"] else "-"
    return (f"{row['batch_size']:>5}  {row['label']:<18} {row['decode_tokens_per_s']:>9.1f}  {speedup:<20} "
            f"{row['tpot_ms']:>8.1f}  {acceptance:<17} {per_step:>8}")


def ablation_text(result: dict) -> str:
    config = result["config"]
    model = (f"trained {config['arch']} {config['preset']} model" if config["trained_model"]
             else f"model {config['model']}")
    header = (f"MTP ablation: {model}, draft vocab {config['speculative_draft_vocab']}, prompts "
              f"{config['prompt_len']} + {config['output_len']} output tokens, medians of {result['runs_done']} runs; "
              "speedup (run range) against no MTP in the same run")
    columns = (f"{'batch':>5}  {'config':<18} {'tok/s':>9}  {'speedup':<20} {'TPOT ms':>8}  "
               f"{'accepted/position':<17} {'tok/step':>8}")
    lines = [header, columns]
    phase = "main"
    for row in result["table"]:
        if row["phase"] != phase:
            phase = row["phase"]
            lines.append(f"large-batch rule: {result['max_batch_rule']['note']}")
        lines.append(_format_row(row))
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    first = result["batches"][0]
    batch, configs = first["batch_size"], first["configs"]
    first_k = k_name(result["config"]["num_speculative_tokens"][0])
    k1 = configs[first_k]
    best = max((name for name in configs if name != BASELINE), key=lambda n: configs[n]["speedup"])
    parts = [f"MTP at batch {batch}: {_label(first_k)} {k1['speedup']:.2f}x "
             f"at acceptance {' '.join(f'{a:.2f}' for a in k1['acceptance_rate'] or [])} "
             f"({k1['tokens_per_verify_step'] or 0:.2f} tokens/step); best {_label(best)} "
             f"{configs[best]['speedup']:.2f}x"]
    rule = result["max_batch_rule"]
    if rule:
        largest = rule["largest_batch"]
        parts.append(f"pays up to batch {rule['threshold']}" if rule["threshold"] else "pays at no batch size")
        parts += [f"batch {largest} {_label(name)}: {v['speedup']:.2f}x"
                  f"{'' if v['within_noise'] else ' (slower beyond noise)'}"
                  for name, v in rule["verdict_at_largest"].items()]
        parts.append(f"noise {rule['noise_at_largest']:.1%}")
    return "; ".join(parts)


def plot_spec(result: dict, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=3, width_per_panel=5.2, height=4.2)
    batches = result["batches"]
    sizes = [b["batch_size"] for b in batches]
    names = list(batches[0]["configs"])
    rate_ax, speedup_ax, accept_ax = axes[0]
    for name in names:
        rate_ax.plot(sizes, [b["configs"][name]["decode_tokens_per_s"] for b in batches], marker="o",
                     label=_label(name), color="black" if name == BASELINE else None)
        if name != BASELINE:
            speedup_ax.plot(sizes, [b["configs"][name]["speedup"] for b in batches], marker="o", label=_label(name))
    rule = result["max_batch_rule"]
    if rule:
        for name in (THRESHOLD, AUTO):
            points = [(b["batch_size"], b["configs"][name]) for b in rule["batches"] if name in b["configs"]]
            if points:
                speedup_ax.scatter([p[0] for p in points], [p[1]["speedup"] for p in points], marker="x", s=60,
                                   label=f"{_label(name)} (rule runs)")
    speedup_ax.axhline(1.0, color="black", linewidth=0.8)
    for ax, ylabel in ((rate_ax, "decode tokens/s (median)"), (speedup_ax, "speedup against no MTP (same run)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    rate_ax.set_title(f"decode rate, draft vocab {result['config']['speculative_draft_vocab']}")
    speedup_ax.set_title("what MTP adds")
    _plot_acceptance(accept_ax, result)
    return report.save_figure(fig, path)


def _plot_acceptance(ax, result: dict) -> None:
    acceptance = result["acceptance"]
    smallest = result["batches"][0]
    width = 0.8 / max(1, len(acceptance))
    for i, (name, record) in enumerate(acceptance.items()):
        rates = record["acceptance_rate"]
        xs = [p + 1 + (i - (len(acceptance) - 1) / 2) * width for p in range(len(rates))]
        per_step = record["tokens_per_verify_step"] or 0.0
        speedup = smallest["configs"][name]["speedup"]  # the speedup this acceptance explains
        ax.bar(xs, rates, width=width, label=f"{_label(name)}: {per_step:.2f} tokens/step, "
                                             f"batch {smallest['batch_size']} {speedup:.2f}x")
    positions = max((len(r["acceptance_rate"]) for r in acceptance.values()), default=1)
    ax.set_xticks(range(1, positions + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted (with every draft before it)")
    ax.set_ylim(0, 1)
    ax.set_title("acceptance per draft position, all batch sizes")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
