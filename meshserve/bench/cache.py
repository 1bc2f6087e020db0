"""`meshserve bench cache`: the caching cluster's benchmarks, one `--part` at a time.

- `pool`: put/get bandwidth of the memory pool (a controller and `--servers` servers started as
  processes, as a user would) against a plain memory copy of the same bytes, per value size;
  the median of `--repeats` runs each.
- `model-startup`: `load_model` of a model from the pool (warm: the values in the servers' DRAM,
  after a prefetch), from safetensors on disk with a warm page cache, and cold. Cold drops the
  files from the page cache with posix_fadvise(DONTNEED), which needs no privileges; whether it
  worked is checked by timing a raw read of the files, and reported as not measurable if not.
- `kv-reuse`: context caching through the pool (cloudmatrix-infer Fig. 23). Per token reuse
  rate, a warm-up TE computes prompts whose leading `rate x --prompt-len` tokens are prefixes,
  and their blocks reach the pool; then a fresh TE (empty local cache: hits come only from the
  pool) serves new prompts with those prefixes and fresh suffixes, one at a time (TTFT) and as
  one batch (prefill throughput). TTFT is compared with the 0% rate of the same run.

Writes JSON (with the machine's facts), a PNG beside it and summary lines.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from meshserve.models.factory import ensure_default_model
from meshserve.pool.context_keys import block_keys, model_identity, rank_key
from meshserve.utils import page_cache, report
from meshserve.utils.processes import free_tcp_port, stop_process
from meshserve.wire.sampling_params import SamplingParams

DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M"
DEFAULT_REUSE_RATES = "0,12.5,50,90"
TTFT_TARGET = 0.2  # the must-show: at 90% reuse, TTFT <= 0.2x the no-reuse TTFT
GB = 1 << 30
# the sizes --quick changes, for those not given
_FULL = {"sizes": DEFAULT_SIZES, "total_mb": 256.0, "servers": 2, "repeats": 5, "load_repeats": 3, "prompt_len": 2048,
         "reuse_rates": DEFAULT_REUSE_RATES, "kv_requests": 4, "failover_requests": 24, "failover_prompt_len": 256}
_QUICK = {"sizes": "64K,1M", "total_mb": 2.0, "servers": 1, "repeats": 2, "load_repeats": 1, "prompt_len": 64,
          "reuse_rates": "0,50", "kv_requests": 1, "failover_requests": 4, "failover_prompt_len": 48}


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--part", choices=sorted(PARTS) + ["all"], default="all", help="which benchmark (default: all)")
    parser.add_argument("--json", required=True, help="result file; a PNG with the same name is written next to it")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest run (for tests and a first look): the --quick value of every size "
                             "below not given")
    pool = parser.add_argument_group("pool bandwidth")
    pool.add_argument("--sizes", help=f"value sizes (default: {DEFAULT_SIZES}; --quick: {_QUICK['sizes']})")
    pool.add_argument("--total-mb", dest="total_mb", type=float,
                      help="bytes moved per measurement, in values of one size (default: 256; --quick: 2)")
    pool.add_argument("--servers", type=int, help="pool servers started (default: 2; --quick: 1)")
    pool.add_argument("--repeats", type=int, help="repeats per measurement, median taken (default: 5; --quick: 2)")
    model = parser.add_argument_group("model start-up")
    source = model.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="HF-format model directory")
    source.add_argument("--preset", default="small", help="a generated model preset (default: small)")
    model.add_argument("--arch", default="deepseek_v3", help="architecture of --preset (default: deepseek_v3)")
    model.add_argument("--load-repeats", dest="load_repeats", type=int,
                       help="loads per source, median taken (default: 3; --quick: 1)")
    kv = parser.add_argument_group("KV-cache reuse (uses the model of --model/--preset)")
    kv.add_argument("--prompt-len", dest="prompt_len", type=int, help="prompt tokens (default: 2048; --quick: 64)")
    kv.add_argument("--reuse-rates", dest="reuse_rates",
                    help="percent of each prompt that is a prefix held by the pool (default: "
                         f"{DEFAULT_REUSE_RATES}; --quick: {_QUICK['reuse_rates']})")
    kv.add_argument("--kv-requests", dest="kv_requests", type=int,
                    help="requests per rate, timed one at a time and again as one batch (default: 4; --quick: 1)")
    kv.add_argument("--block-size", dest="block_size", type=int, default=16, help="KV block size (default: 16)")
    failover = parser.add_argument_group("failover (a pool server killed during a run, then restarted)")
    failover.add_argument("--failover-requests", dest="failover_requests", type=int,
                          help="requests per phase: before the kill, while down, after the restart (default: 24; "
                               "--quick: 4)")
    failover.add_argument("--failover-prompt-len", dest="failover_prompt_len", type=int,
                          help="prompt tokens of each failover request (default: 256; --quick: 48)")


def with_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with every size not given set to its default, or with --quick to its --quick value."""
    sizes = _QUICK if args.quick else _FULL
    return argparse.Namespace(**{**vars(args), **{key: value if getattr(args, key) is None else getattr(args, key)
                                                  for key, value in sizes.items()}})


def cache_main(args: argparse.Namespace) -> int:
    args = with_sizes(args)
    parts = sorted(PARTS) if args.part == "all" else [args.part]
    results = {"machine": report.machine_info()}
    for part in parts:
        results[part.replace("-", "_")] = PARTS[part](args)
    path = report.write_json(args.json, results)
    plot(results, report.png_path_for(path))
    for line in summary_lines(results):
        print(line)
    print(f"wrote {path} and {report.png_path_for(path)}")
    return 0


# ---------------------------------------------------------------- pool processes
class LocalPool:
    """A controller and servers started with `meshserve pool ...` on free loopback ports."""

    def __init__(self, servers: int, dram_gb: float, log_dir: Path, ssd: bool = False, server_timeout_s: float = 3.0):
        self.controller = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self._start(["controller", "--bind", self.controller, "--server-timeout", f"{server_timeout_s:g}"])
        self.server_args: list[list[str]] = []  # each server's command line, to restart it as it was
        for i in range(servers):
            args = ["server", "--controller", self.controller, "--bind", f"tcp://127.0.0.1:{free_tcp_port()}",
                    "--id", f"bench-s{i}", "--dram-gb", f"{dram_gb:.3f}", "--heartbeat", "0.5"]
            if ssd:
                args += ["--ssd-dir", str(log_dir / f"ssd-{i}"), "--ssd-gb", "4"]
            self.server_args.append(args)
            self._start(args)
        self.num_servers = servers

    def _start(self, args: list[str]) -> subprocess.Popen:
        with open(self.log_dir / f"pool-{len(self.procs)}.log", "a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "meshserve.entrypoints.cli", "pool", *args],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def server_proc(self, index: int) -> subprocess.Popen:
        """The running process of server `index` (the controller is procs[0]; restarts append)."""
        args = self.server_args[index]
        return [p for p in self.procs if p.args[4:] == args][-1]

    def kill_server(self, index: int) -> None:
        proc = self.server_proc(index)
        proc.kill()
        proc.wait(10)

    def restart_server(self, index: int) -> None:
        self._start(self.server_args[index])

    def client(self, timeout_s: float = 30.0):
        # start-up: zmq only once a pool client is opened
        from meshserve.pool.sdk import PoolClient

        client = PoolClient(self.controller, timeout_s=timeout_s, view_refresh_s=0.5)
        deadline = time.monotonic() + 60
        while (view := client.view()) is None or len(view.servers) < self.num_servers:
            if time.monotonic() > deadline:
                client.close()
                self.close()
                raise RuntimeError(f"the pool did not come up in 60 s (logs in {self.log_dir})")
            time.sleep(0.1)
        return client

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
            stop_process(proc, grace_s=5.0)

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": GB}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------- part: pool bandwidth
def _pool_bandwidth_row(client, size: int, total: int, repeats: int) -> dict:
    """Put, get and memcpy of `total` bytes cut into values of `size` bytes."""
    count = max(1, total // size)
    values = {f"v{size}-{i}": os.urandom(size) for i in range(count)}
    keys = list(values)
    moved = count * size

    def put() -> None:
        stored = client.put("bench", values)
        if not all(stored.values()):
            raise RuntimeError(f"the pool refused {sum(not s for s in stored.values())} values of {size} B")

    def get() -> None:
        found = client.get("bench", keys)
        if len(found) != count:
            raise RuntimeError(f"the pool missed {count - len(found)} values of {size} B")

    targets = [bytearray(size) for _ in range(count)]

    def copy() -> None:
        for target, value in zip(targets, values.values()):
            target[:] = value

    put_s, get_s, copy_s = (_median_time(fn, repeats) for fn in (put, get, copy))
    client.delete("bench", keys)
    row = {"value_bytes": size, "values": count, "bytes": moved,
           "put_s": put_s, "get_s": get_s, "memcpy_s": copy_s,
           "put_gbps": moved / put_s / 1e9, "get_gbps": moved / get_s / 1e9,
           "memcpy_gbps": moved / copy_s / 1e9}
    row["get_vs_memcpy"] = row["get_gbps"] / row["memcpy_gbps"]
    row["put_vs_memcpy"] = row["put_gbps"] / row["memcpy_gbps"]
    return row


def pool_bandwidth(args: argparse.Namespace) -> dict:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    total = int(args.total_mb * (1 << 20))
    rows = []
    # each server holds its share of one measurement's values, twice over for headroom
    dram_gb = max(0.05, 2.5 * max(total, max(sizes)) / max(1, args.servers) / GB + 0.01)
    with (tempfile.TemporaryDirectory(prefix="bench-pool-") as logs,
          LocalPool(args.servers, dram_gb, Path(logs)) as pool, pool.client() as client):
        for size in sizes:
            row = _pool_bandwidth_row(client, size, total, args.repeats)
            rows.append(row)
            print(f"pool {size >> 10:>6} KiB x {row['values']:>5}: put {row['put_gbps']:.2f} GB/s, get "
                  f"{row['get_gbps']:.2f} GB/s, memcpy {row['memcpy_gbps']:.2f} GB/s "
                  f"(get/memcpy {row['get_vs_memcpy']:.2f})", flush=True)
    return {"servers": args.servers, "repeats": args.repeats, "rows": rows}


# ---------------------------------------------------------------- part: model start-up
def _model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    return ensure_default_model(args.arch, args.preset)


def model_startup(args: argparse.Namespace) -> dict:
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    import torch

    from meshserve.models.loader import load_model, safetensors_files
    from meshserve.worker.model_cache import model_version, pool_weights, prefetch_model, put_model

    model_dir = _model_dir(args)
    files = safetensors_files(model_dir)
    model_bytes = sum(p.stat().st_size for p in files)
    result = {"model": str(model_dir), "bytes": model_bytes, "repeats": args.load_repeats}

    def timed_load(**kwargs) -> float:
        return _median_time(lambda: load_model(model_dir, **kwargs), args.load_repeats)

    # disk, warm page cache: one untimed load first
    load_model(model_dir)
    result["disk_warm_s"] = timed_load()
    warm_read_s = page_cache.preload(files)[1]
    # disk, cold: drop the files from the page cache before every load
    cold_times, cold_read = [], []
    for _ in range(args.load_repeats):
        page_cache.evict(files)
        cold_read.append(page_cache.preload(files)[1])
        page_cache.evict(files)
        start = time.perf_counter()
        load_model(model_dir)
        cold_times.append(time.perf_counter() - start)
    result["read_warm_gbps"] = model_bytes / warm_read_s / 1e9
    result["read_after_drop_gbps"] = model_bytes / statistics.median(cold_read) / 1e9
    # the drop took effect only if reading after it is clearly slower than from the page cache
    result["cold_measured"] = result["read_after_drop_gbps"] < 0.7 * result["read_warm_gbps"]
    result["disk_cold_s"] = statistics.median(cold_times) if result["cold_measured"] else None
    result["disk_after_drop_s"] = statistics.median(cold_times)

    # pool, warm: stored once, prefetched into the servers' DRAM
    dram_gb = 2.0 * model_bytes / max(1, args.servers) / GB + 0.05
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as logs:
        with LocalPool(args.servers, dram_gb, Path(logs)) as pool, pool.client(timeout_s=60.0) as client:
            start = time.perf_counter()
            put_model(client, model_dir)
            result["put_model_s"] = time.perf_counter() - start
            prefetch_model(client, model_dir.resolve().name, model_version(model_dir))
            result["pool_warm_s"] = timed_load(read_weights=pool_weights(client, model_dir))
            # the same parameters as from disk: a benchmark of a wrong load would be worthless
            a, b = load_model(model_dir), load_model(model_dir, read_weights=pool_weights(client, model_dir))
            result["identical"] = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    result["pool_vs_disk_warm"] = result["pool_warm_s"] / result["disk_warm_s"]
    print(f"model start-up ({model_bytes / GB:.2f} GiB): pool warm {result['pool_warm_s']:.2f} s, disk warm "
          f"{result['disk_warm_s']:.2f} s, cold " + (f"{result['disk_cold_s']:.2f} s" if result["cold_measured"]
                                                     else "not measurable here (the page cache was not dropped)"),
          flush=True)
    return result


# ---------------------------------------------------------------- part: KV-cache reuse
def _random_tokens(rng: random.Random, vocab: int, count: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(count)]


def _ttft_s(output) -> float:
    return output.metrics.first_token_time - output.metrics.arrival_time


def _wait_for_blocks(client, namespace: str, keys: list[str], timeout_s: float) -> float:
    """Polls until the pool holds every key (rank 0 of TP1); the seconds it took."""
    probe = [rank_key(k, 0, 1) for k in keys]
    start = time.monotonic()
    while not all(client.exists(namespace, probe)):
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"the warm-up TE's {len(keys)} prefix blocks did not reach the pool "
                               f"in {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - start


def _measure_rate(args: argparse.Namespace, model_dir: Path, pool: LocalPool, rate: float, vocab: int,
                  engine: dict, seed: int) -> dict:
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.engine.llm import LLM

    n, block, prompt_len = args.kv_requests, args.block_size, args.prompt_len
    # shared prefixes are whole blocks: only full blocks are stored and looked up
    reused = int(rate / 100 * prompt_len) // block * block
    namespace = f"kv-reuse-{seed}-{rate:g}"
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(seed)
    # one prefix per request, so no request is a local prefix hit for another in the fresh TE
    prefixes = [_random_tokens(rng, vocab, reused) for _ in range(2 * n)]
    row = {"rate_pct": rate, "reused_tokens": reused, "reuse": reused / prompt_len, "namespace": namespace}
    te = dict(engine, pool_controller=pool.controller, pool_namespace=namespace)

    if reused:
        warm_prompts = [p + _random_tokens(rng, vocab, prompt_len - reused) for p in prefixes]
        keys = [k for p in prefixes for k in block_keys(p, block, model_identity(str(model_dir), "float32"), namespace)]
        with LLM(model=str(model_dir), **te) as llm, pool.client() as client:
            llm.generate(warm_prompts, one_token)
            row["store_wait_s"] = _wait_for_blocks(client, namespace, keys, timeout_s=120.0)

    fresh = [p + _random_tokens(rng, vocab, prompt_len - reused) for p in prefixes]
    with LLM(model=str(model_dir), **te) as llm:
        llm.generate(_random_tokens(rng, vocab, prompt_len), one_token)  # first-step costs, untimed; no hits
        hits_before = llm.get_stats().pool_hit_tokens
        one_at_a_time = [llm.generate(p, one_token)[0] for p in fresh[:n]]
        batch = llm.generate(fresh[n:], one_token)
        row["pool_hit_tokens"] = llm.get_stats().pool_hit_tokens - hits_before
    ttfts = [_ttft_s(o) for o in one_at_a_time]
    batch_s = max(o.metrics.first_token_time for o in batch) - min(o.metrics.arrival_time for o in batch)
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in batch)
    row |= {"ttft_s": ttfts, "ttft_median_s": statistics.median(ttfts),
            "cached_tokens": [o.num_cached_tokens for o in one_at_a_time + batch],
            "batch_s": batch_s, "prefill_tokens_per_s": n * prompt_len / batch_s,
            "computed_tokens_per_s": computed / batch_s}
    return row


def kv_reuse(args: argparse.Namespace) -> dict:
    rates = [float(r) for r in args.reuse_rates.split(",")]
    if any(not 0 <= r < 100 for r in rates):
        raise ValueError(f"reuse rates are percentages in [0, 100), got {args.reuse_rates}")
    model_dir = _model_dir(args)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    n, block, prompt_len = args.kv_requests, args.block_size, args.prompt_len
    blocks_per_prompt = -(-(prompt_len + 1) // block)
    # a prefill is one step (budget >= the prompt), and the batch plus the cached blocks fit
    # pool_fetch_latency_ms=0: every reusable block is fetched (the fetch-vs-recompute model would
    # compute short matches of a small model instead); reuse itself is what is measured here
    engine = dict(block_size=block, max_num_batched_tokens=max(prompt_len, 2048), max_num_seqs=n,
                  num_kv_blocks=(2 * n + 2) * blocks_per_prompt, max_model_len=prompt_len + 1,
                  pool_fetch_latency_ms=0.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as logs, LocalPool(1, 4.0, Path(logs)) as pool:
        pool.client().close()  # waits for the server to join
        for i, rate in enumerate(rates):
            row = _measure_rate(args, model_dir, pool, rate, vocab, engine, seed=i + 1)
            rows.append(row)
            print(f"kv-reuse {rate:g}% ({row['reused_tokens']}/{prompt_len} tokens): TTFT median "
                  f"{row['ttft_median_s'] * 1e3:.0f} ms, prefill {row['prefill_tokens_per_s']:.0f} tok/s, "
                  f"pool hits {row['pool_hit_tokens']} tokens", flush=True)
    base = next((r["ttft_median_s"] for r in rows if r["rate_pct"] == 0), None)
    for row in rows:
        row["ttft_vs_no_reuse"] = row["ttft_median_s"] / base if base else None
    at_90 = next((r for r in rows if r["rate_pct"] == 90), None)
    holds = None if base is None or at_90 is None else at_90["ttft_vs_no_reuse"] <= TTFT_TARGET
    return {"model": str(model_dir), "prompt_len": prompt_len, "requests": n, "block_size": block,
            "engine": engine, "pool_servers": 1, "rows": rows, "ttft_target": TTFT_TARGET,
            "ttft_target_holds": holds}


def failover(args: argparse.Namespace) -> dict:
    """Context caching while a pool server dies and comes back (issue: hits lost, never requests).

    Two servers with SSD tiers; a TE's prefixes are stored; then three phases of requests that reuse
    them: both servers up, one killed (SIGKILL) at the start of the phase, the same server restarted
    from its SSD directory. Every request must complete in every phase; hits drop to the surviving
    server's share while it is down and come back once its SSD-tier data is served again."""
    # keeps torch out of `meshserve` start-up (the bench parser imports this module)
    from meshserve.engine.llm import LLM

    model_dir = _model_dir(args)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    n, block, prompt_len = args.failover_requests, args.block_size, args.failover_prompt_len
    rng = random.Random(7)
    namespace = "failover"
    prompts = [_random_tokens(rng, vocab, prompt_len) for _ in range(n)]
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine = dict(block_size=block, max_num_seqs=8, num_kv_blocks=4 * (prompt_len // block + 2),
                  enable_prefix_caching=False, pool_namespace=namespace,  # every hit comes from the pool
                  pool_fetch_latency_ms=0.0)
    keys = [k for p in prompts for k in block_keys(p[:-1], block, model_identity(str(model_dir), "float32"),
                                                   namespace)]
    phases = []
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as logs, \
            LocalPool(2, 1.0, Path(logs), ssd=True) as pool:
        with pool.client() as client:
            with LLM(model=str(model_dir), pool_controller=pool.controller, **engine) as llm:
                llm.generate(prompts, one_token)
            store_wait_s = _wait_for_blocks(client, namespace, keys, timeout_s=120.0)
            probe = [rank_key(k, 0, 1) for k in keys]

            def run_phase(name: str) -> None:
                present = sum(client.exists(namespace, probe))  # before this phase's TE stores misses again
                t0 = time.monotonic()
                with LLM(model=str(model_dir), pool_controller=pool.controller, **engine) as llm:
                    outs = llm.generate(prompts, one_token)
                    hits = llm.get_stats().pool_hit_tokens
                completed = sum(1 for o in outs if o.finished and o.outputs[0].finish_reason == "length")
                phases.append({"phase": name, "requests": n, "completed": completed, "pool_hit_tokens": hits,
                               "hit_rate": hits / (n * ((prompt_len - 1) // block * block)),
                               "blocks_in_pool": present, "seconds": time.monotonic() - t0})
                print(f"failover {name}: {completed}/{n} requests completed, pool hits {hits} tokens "
                      f"({phases[-1]['hit_rate']:.0%}), {present}/{len(keys)} blocks reachable at its start",
                      flush=True)

            run_phase("both servers up")
            pool.kill_server(1)
            time.sleep(3.5)  # the controller drops the server (--server-timeout 3) and clients see the new view
            run_phase("server killed")
            pool.restart_server(1)
            deadline = time.monotonic() + 60
            while sum(client.exists(namespace, probe)) < len(keys) and time.monotonic() < deadline:
                time.sleep(0.5)  # the restarted server rejoins and serves its SSD tier
            run_phase("server restarted")
    all_completed = all(p["completed"] == p["requests"] for p in phases)
    return {"model": str(model_dir), "prompt_len": prompt_len, "block_size": block, "blocks": len(keys),
            "store_wait_s": store_wait_s, "phases": phases, "all_requests_completed": all_completed,
            "hits_restored": phases[-1]["pool_hit_tokens"] >= phases[0]["pool_hit_tokens"]}


# Parts by name.
PARTS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "pool": pool_bandwidth,
    "model-startup": model_startup,
    "kv-reuse": kv_reuse,
    "failover": failover,
}


# ---------------------------------------------------------------- report
def summary_lines(results: dict) -> list[str]:
    lines = []
    if "pool" in results:
        for r in results["pool"]["rows"]:
            lines.append(f"pool {r['value_bytes'] >> 10} KiB values: get {r['get_gbps']:.2f} GB/s = "
                         f"{r['get_vs_memcpy']:.2f}x memcpy ({r['memcpy_gbps']:.2f} GB/s), "
                         f"put {r['put_gbps']:.2f} GB/s")
    if "model_startup" in results:
        r = results["model_startup"]
        cold = f"{r['disk_cold_s']:.2f} s" if r["cold_measured"] else "not measurable here"
        lines.append(f"model start-up: pool warm {r['pool_warm_s']:.2f} s, disk warm {r['disk_warm_s']:.2f} s, "
                     f"disk cold {cold}; identical parameters: {r['identical']}")
    if "kv_reuse" in results:
        r = results["kv_reuse"]
        for row in r["rows"]:
            ratio = "" if row["ttft_vs_no_reuse"] is None else f" = {row['ttft_vs_no_reuse']:.2f}x no reuse"
            lines.append(f"kv-reuse {row['rate_pct']:g}%: TTFT median {row['ttft_median_s'] * 1e3:.0f} ms{ratio}, "
                         f"prefill {row['prefill_tokens_per_s']:.0f} tok/s, pool hits {row['pool_hit_tokens']} tokens")
        if r["ttft_target_holds"] is not None:
            lines.append(f"kv-reuse: TTFT at 90% reuse <= {r['ttft_target']}x no reuse: "
                         f"{'holds' if r['ttft_target_holds'] else 'does not hold'}")
    if "failover" in results:
        r = results["failover"]
        for p in r["phases"]:
            lines.append(f"failover, {p['phase']}: {p['completed']}/{p['requests']} completed, "
                         f"pool hit rate {p['hit_rate']:.0%}, {p['blocks_in_pool']}/{r['blocks']} blocks "
                         f"reachable at its start")
        lines.append(f"failover: every request completed: {r['all_requests_completed']}; "
                     f"hits back after the restart: {r['hits_restored']}")
    return lines


def plot(results: dict, path: Path) -> None:
    panels = [p for p in ("pool", "model_startup", "kv_reuse", "failover") if p in results]
    fig, axes = report.new_figure(ncols=len(panels))
    for ax, part in zip(axes[0], panels):
        if part == "pool":
            rows = results["pool"]["rows"]
            sizes = [r["value_bytes"] / 1024 for r in rows]
            for key, label in (("put_gbps", "pool put"), ("get_gbps", "pool get"), ("memcpy_gbps", "memory copy")):
                ax.plot(sizes, [r[key] for r in rows], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("value size (KiB)")
            ax.set_ylabel("GB/s")
            ax.set_title(f"pool bandwidth ({results['pool']['servers']} servers)")
            ax.legend()
        elif part == "kv_reuse":
            _plot_kv_reuse(ax, results["kv_reuse"])
        elif part == "failover":
            phases = results["failover"]["phases"]
            names = [p["phase"] for p in phases]
            ax.bar(names, [p["hit_rate"] * 100 for p in phases], color="tab:green")
            ax.set_ylabel("pool hit rate (%)")
            twin = ax.twinx()
            twin.plot(names, [100 * p["completed"] / p["requests"] for p in phases], marker="o", color="black")
            twin.set_ylim(0, 105)
            twin.set_ylabel("requests completed (%)")
            ax.set_title("a pool server killed, then restarted")
        else:
            r = results["model_startup"]
            labels = ["pool (warm)", "disk (warm cache)", "disk (cold)" if r["cold_measured"] else "disk (after drop*)"]
            ax.bar(labels, [r["pool_warm_s"], r["disk_warm_s"], r["disk_after_drop_s"]])
            ax.set_ylabel("load_model seconds")
            ax.set_title(f"model start-up ({r['bytes'] / GB:.2f} GiB)")
    report.save_figure(fig, path)


def _plot_kv_reuse(ax, result: dict) -> None:
    rows = result["rows"]
    rates = [r["rate_pct"] for r in rows]
    ax.plot(rates, [r["ttft_median_s"] * 1e3 for r in rows], marker="o", color="tab:blue", label="TTFT median")
    ax.set_xlabel("token reuse rate (%)")
    ax.set_ylabel("TTFT (ms)", color="tab:blue")
    twin = ax.twinx()
    twin.plot(rates, [r["prefill_tokens_per_s"] for r in rows], marker="s", color="tab:orange", label="prefill")
    twin.set_ylabel("prefill tokens/s (batch)", color="tab:orange")
    ax.set_title(f"KV reuse through the pool ({result['prompt_len']}-token prompts)")
