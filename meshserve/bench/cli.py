"""`meshserve bench offline|serve`: their flags and entry points; `python -m meshserve.bench.cli` runs any benchmark."""
from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from meshserve.bench import BENCH_ENGINE_SETTINGS
from meshserve.bench.commands import register_bench_commands
from meshserve.bench.offline import OfflineOptions, plot_offline, run_offline_benchmark, summary_lines
from meshserve.bench.workload import WorkloadError, make_offline_workload, parse_range, special_token_ids
from meshserve.config.arguments import add_engine_arguments, given_engine_settings
from meshserve.models.factory import ensure_default_model
from meshserve.models.tokenizer_assets import special_token_ids as house_special_ids
from meshserve.utils import report


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, required=True, help="number of requests")
    parser.add_argument("--input-len", required=True, help="prompt length range A:B (tokens, inclusive)")
    parser.add_argument("--output-len", required=True, help="output length range A:B (tokens, inclusive)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar or log lines")


def add_offline_parser(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="HF-format model directory")
    source.add_argument("--preset", help="a generated random model preset (tiny, small, ...)")
    parser.add_argument("--arch", default="deepseek_v3", help="architecture of --preset (default: deepseek_v3)")
    _add_workload_arguments(parser)
    parser.add_argument("--baseline", choices=["hf", "none"], default="hf")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="HF generate batch size (default: 16)")
    add_engine_arguments(parser, (*BENCH_ENGINE_SETTINGS, "enable_prefix_caching"))
    roof = parser.add_argument_group("decode roofline")
    roof.add_argument("--skip-roofline", dest="roofline", action="store_false")
    roof.add_argument("--roofline-batch", type=int, help="decode batch B (default: min(max-num-seqs, requests))")
    roof.add_argument("--roofline-context", type=int, help="context length L (default: middle of --input-len)")
    roof.add_argument("--roofline-decode-tokens", type=int, default=32, help="decode steps D timed (default: 32)")
    roof.add_argument("--roofline-repeats", type=int, default=3, help="repeats, median taken (default: 3)")
    roof.add_argument("--bandwidth-mib", type=int, default=256,
                      help="buffer copied to measure memory bandwidth; keep well beyond the caches (default: 256)")
    roof.add_argument("--matmul-size", type=int, default=2048, help="square fp32 matmul size timed (default: 2048)")
    parser.set_defaults(func=offline_command)


def add_serve_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="Poisson arrival rate, requests/s (inf: all at once)")
    load.add_argument("--concurrency", type=int, help="requests kept in flight")
    _add_workload_arguments(parser)
    parser.add_argument("--slo-ttft-ms", type=float, help="TTFT objective for goodput")
    parser.add_argument("--slo-tpot-ms", type=float, help="TPOT objective for goodput")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit on the whole run, seconds (default: 600)")
    parser.add_argument("--record-trace", help="also write the requests sent as a JSONL trace (arrival_s, prompt_len, "
                                               "output_len) that `meshserve simulate run --trace` replays")
    vocab = parser.add_mutually_exclusive_group()
    vocab.add_argument("--model-dir", help="the served checkpoint: prompt ids use its vocabulary, minus special tokens")
    vocab.add_argument("--vocab-size", type=int, default=1000,
                       help="draw prompt ids below this (default: 1000, valid for any house model)")
    parser.set_defaults(func=serve_command)


def _fail(command: str, exc: BaseException) -> int:
    print(f"meshserve bench {command}: error: {exc}", file=sys.stderr)
    return 2


def _check_requests(n: int) -> None:
    if n < 1:
        raise WorkloadError(f"--requests must be at least 1, got {n}")


def _resolve_model_dir(args: argparse.Namespace) -> str:
    if args.model:
        if not Path(args.model).is_dir():
            raise FileNotFoundError(f"model directory {args.model!r} does not exist")
        return args.model
    return str(ensure_default_model(args.arch, args.preset))


def offline_command(args: argparse.Namespace) -> int:
    try:
        _check_requests(args.requests)
        input_len = parse_range(args.input_len, "--input-len")
        output_len = parse_range(args.output_len, "--output-len")
        engine_args = given_engine_settings(args)
        engine_args.setdefault("max_num_seqs", 64)
        engine_args.setdefault("dtype", "float32")
        options = OfflineOptions(
            model_dir="", num_requests=args.requests, input_len=input_len,
            output_len=output_len, json_path=args.json, baseline=args.baseline, hf_batch_size=args.hf_batch_size,
            seed=args.seed, engine_args=engine_args, roofline=args.roofline, roofline_batch=args.roofline_batch,
            roofline_context=args.roofline_context, roofline_decode_tokens=args.roofline_decode_tokens,
            roofline_repeats=args.roofline_repeats, bandwidth_bytes=args.bandwidth_mib * 2**20,
            matmul_size=args.matmul_size, progress=args.progress)
        options.model_dir = _resolve_model_dir(args)  # after validation: a preset may be written on first use
        result = run_offline_benchmark(options)
    except (ValueError, OSError) as exc:  # bad arguments, missing model, unknown preset or engine setting
        return _fail("offline", exc)
    json_path = report.write_json(args.json, result)
    png_path = plot_offline(result, report.png_path_for(json_path))
    for line in summary_lines(result):
        print(line)
    print(f"wrote {json_path} and {png_path}")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    # start-up: httpx only for `bench serve`
    import httpx

    from meshserve.bench.serve import ServeOptions, plot_serve, run_serve_benchmark, summary_lines

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the progress bar
    try:
        _check_requests(args.requests)
        input_len = parse_range(args.input_len, "--input-len")
        output_len = parse_range(args.output_len, "--output-len")
        if args.rate is not None and (math.isnan(args.rate) or args.rate <= 0):
            raise ValueError(f"--rate must be positive, got {args.rate}")
        if args.model_dir:
            # keeps torch out of `bench serve` (a client: no model runs here)
            from meshserve.models.loader import load_hf_config

            vocab_size = int(load_hf_config(args.model_dir)["vocab_size"])
            excluded = special_token_ids(args.model_dir)
        else:
            vocab_size = args.vocab_size
            excluded = set(house_special_ids().values())
        options = ServeOptions(
            url=args.url, num_requests=args.requests, input_len=input_len, output_len=output_len,
            json_path=args.json, model=args.model, rate=args.rate, concurrency=args.concurrency,
            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, seed=args.seed, timeout_s=args.timeout,
            progress=args.progress)
        workload = make_offline_workload(args.requests, input_len, output_len, vocab_size, seed=args.seed,
                                         exclude_token_ids=excluded)
        result = run_serve_benchmark(options, workload)
    except (ValueError, OSError) as exc:
        return _fail("serve", exc)
    except httpx.HTTPError as exc:  # the server could not be asked for its model list
        return _fail("serve", f"{args.url}: {type(exc).__name__}: {exc}")
    json_path = report.write_json(args.json, result)
    png_path = plot_serve(result, report.png_path_for(json_path))
    for line in summary_lines(result):
        print(line)
    print(f"wrote {json_path} and {png_path}")
    if args.record_trace:
        from meshserve.sim.trace import TraceRequest, write_jsonl

        sent = [r for r in result["requests"] if r["send_time_s"] is not None]
        write_jsonl([TraceRequest(r["send_time_s"], r["prompt_tokens"], r["requested_output_tokens"]) for r in sent],
                    args.record_trace)
        print(f"wrote the trace of {len(sent)} requests to {args.record_trace}")
        cached = result.get("cached_prompt_tokens_total", 0)
        if cached:  # e.g. an earlier run's prompts, sent again with the same --seed to the same server
            print(f"warning: the server took {cached} of {result['prompt_tokens_total']} prompt tokens from its prefix "
                  "cache; the trace does not hold them, and a simulation of it prefills every prompt (send prompts "
                  "the server has not seen: another --seed)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the bench commands on their own: `python -m meshserve.bench.cli offline ...`."""
    parser = argparse.ArgumentParser(prog="meshserve bench")
    register_bench_commands(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
