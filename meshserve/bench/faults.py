"""`meshserve bench faults`: what each kind of failure costs a serving deployment (xdeepserve §6).

One in-process cluster manager (local backend) runs a deployment of a prefill TE, a decode TE on DP2+EP2 (two
ranks, experts split between them), a colocated TE, two JE replicas and, with `--pool`, a memory pool (a
controller and two servers, the TEs' context cache). A steady, bounded load (`faults_load`: N streaming greedy
requests in flight over fixed prompts, round robin over the JEs, a client that resends to the other JE when its
connection fails) runs through every phase. A fault-free phase comes first, as long as the others: its answers
are the reference each later answer is compared with, token by token. Then, one phase each, after a warm-up: a
fault is injected and the system left to recover; the next phase waits until every TE, JE and pool server
serves again (at most --settle-s).

  kill_decode_rank       kill -9 worker rank 1 of the decode TE (found in the TE's process tree)
  kill_colocated_master  kill -9 the colocated TE's master alone (its ranks are left; killed after the phase)
  kill_prefill_te        kill -9 the prefill TE, master and ranks
  kill_decode_te         kill -9 the decode TE, master and ranks
  kill_je                kill -9 the second JE replica (its clients resend to the first)
  kill_pool_server       kill -9 a memory pool server (restarted after the phase, as its operator would)
  stall_decode_rank      POST /admin/faults: rank 1 of the decode TE stops answering for --stall-s
  link_break             POST /admin/faults: KV transfers of the prefill and decode TEs fail for --link-break-s
  collective_error       POST /admin/faults: the decode TE's next MoE collective fails once (a network glitch)

Per phase: requests accepted (sent), completed, failed, hung (past --deadline-s); client resends; tokens lost,
repeated or wrong against the reference; time to detect, from the injection to the first change the system
shows (a sampler reads, every 0.25 s, the manager's view of every TE and JE and the stats in each TE's
heartbeat: recoveries, rollbacks, world size, KV link states; each JE's /health: which TEs it routes to; the
pool controller's live servers); time until the target is routable again (waited for after the load, at most
--settle-s); time until the token rate is back to 80% of what it was; the dip (1 - the lowest 2 s token rate /
the rate before); and every change seen about the target (`changes`). What a phase shows is reported as it
happened: a fault nothing noticed says "not observed", a phase that never recovered says so. The dip and the
recovery of the token rate are measured against the phase's own rate before its injection (the reference
phase's when that is unknown), so a machine whose other load drifts between phases reads right. A killed pool
server is restarted by the benchmark after its phase: its "routable again" is not the system's and reads "-".
The load is a closed loop: a request stuck on a failed TE holds its slot, so with
few requests in flight the token rate drops to nothing until the stuck ones move, finish or fail; the dip and
its length show how long requests were stuck rather than the capacity lost.

Writes JSON (every phase, the samples' summary, each request), a PNG timeline (tokens/s, every injection
marked, detection and recovery beside it) and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from meshserve.bench.deployment_load import log, one_line_errors, run_bench_cli
from meshserve.bench.faults_load import (
    COMPLETED,
    FAILED,
    HUNG,
    LoadSettings,
    RequestResult,
    SteadyLoad,
    compare_tokens,
    reference_tokens,
    throughput_series,
)
from meshserve.bench.faults_observe import BIN_S, SAMPLE_S, Sampler, detection, throughput_effect, whole
from meshserve.config import ClusterConfig
from meshserve.config.base import ConfigError
from meshserve.parallel.strategy import StrategyError, parse_strategy
from meshserve.utils import report
from meshserve.utils.processes import rank_processes

PROG = "meshserve bench faults"
LOG_PREFIX = "bench faults"
DEFAULT_OUT = "bench-results/faults"
RESULT_FILE = "faults.json"
DECODE_PARALLEL = "attn=TP1+DP2 moe=TP1+EP2"


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    name: str
    what: str
    target: str  # the role of the TE it hits (prefill, decode, colocated), or je, pool, pd (both P/D TEs)
    how: str  # kill_rank | kill_master | kill_te | kill_je | kill_pool_server | inject
    inject: dict[str, Any] | None = None  # POST /admin/faults body (without "te")
    rank: int = 1  # kill_rank: the rank killed (-1: the last, an expert rank of a disaggregated decode TE)


FAULTS = (
    FaultSpec("kill_decode_rank", "kill -9 rank 1 of the decode TE", "decode", "kill_rank"),
    FaultSpec("kill_decode_expert_rank", "kill -9 the last rank of the decode TE (an expert rank of a "
              "disaggregated --decode-parallel)", "decode", "kill_rank", rank=-1),
    FaultSpec("kill_colocated_master", "kill -9 the colocated TE's master", "colocated", "kill_master"),
    FaultSpec("kill_prefill_te", "kill -9 the prefill TE (master and ranks)", "prefill", "kill_te"),
    FaultSpec("kill_decode_te", "kill -9 the decode TE (master and ranks)", "decode", "kill_te"),
    FaultSpec("kill_je", "kill -9 a JE replica", "je", "kill_je"),
    FaultSpec("kill_pool_server", "kill -9 a memory pool server", "pool", "kill_pool_server"),
    FaultSpec("stall_decode_rank", "stall rank 1 of the decode TE", "decode", "inject", {"kind": "stall", "rank": 1}),
    FaultSpec("link_break", "break the P/D link (both ends)", "pd", "inject", {"kind": "link_break"}),
    FaultSpec("collective_error", "one transient MoE collective error", "decode", "inject",
              {"kind": "collective_error"}),
)
FAULT_NAMES = tuple(f.name for f in FAULTS)
QUICK_FAULTS = ("kill_je", "collective_error")


class FaultsBenchError(RuntimeError):
    """The benchmark cannot run (one line for the user)."""


def add_faults_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser, PROG)
    parser.add_argument("--model", help="HF-format model directory (default: the deepseek_v3 tiny model, made on "
                                        "first use)")
    parser.add_argument("--faults", default=None,
                        help="faults to inject, one phase each, in this order (default: all: "
                             + ", ".join(FAULT_NAMES) + ")")
    parser.add_argument("--quick", action="store_true",
                        help="a short run for tests: faults " + ",".join(QUICK_FAULTS) + " (unless --faults), "
                             "short phases, 2 requests in flight, 8 tokens each, no pool (unless --pool)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="streaming requests in flight (default: 4; --quick: 2)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default: 32; --quick: 8)")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts, reused in turn (default: 8)")
    parser.add_argument("--prompt-len", type=int, default=24, help="tokens per prompt (default: 24)")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="steady load before each injection (default: 10; --quick: 4)")
    parser.add_argument("--observe-s", type=float, default=None,
                        help="load after each injection, while the system recovers (default: 45; --quick: 15)")
    parser.add_argument("--deadline-s", type=float, default=60.0,
                        help="a request not finished this long after it was sent is hung (default: 60)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="requests per phase at most; the phase's time is the usual bound (default: 2000; "
                             "--quick: 1000)")
    parser.add_argument("--settle-s", type=float, default=180.0,
                        help="longest wait for the deployment to be whole again before the next phase (default: 180)")
    parser.add_argument("--stall-s", type=float, default=20.0, help="stall_decode_rank: how long (default: 20)")
    parser.add_argument("--link-break-s", type=float, default=10.0, help="link_break: how long (default: 10)")
    parser.add_argument("--pool", action=argparse.BooleanOptionalAction, default=None,
                        help="run a memory pool the TEs cache context in (default: on, off with --quick)")
    parser.add_argument("--decode-parallel", default=DECODE_PARALLEL,
                        help=f"the decode TE's layout, e.g. 'attn=DP2 moe=EP2 disagg' (default: {DECODE_PARALLEL})")
    parser.add_argument("--runs", type=int, default=1,
                        help="repetitions of each fault phase; times are reported as medians (default: 1)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.set_defaults(func=faults_main)


@dataclasses.dataclass(frozen=True)
class FaultsBenchSettings:
    model_dir: str
    faults: tuple[str, ...]
    concurrency: int
    max_tokens: int
    prompts: int
    prompt_len: int
    warmup_s: float
    observe_s: float
    deadline_s: float
    max_requests: int
    settle_s: float
    stall_s: float
    link_break_s: float
    pool: bool
    runs: int
    out_dir: str
    decode_parallel: str = DECODE_PARALLEL


# what --quick changes, for the options not given
_FULL = {"concurrency": 4, "max_tokens": 32, "warmup_s": 10.0, "observe_s": 45.0, "max_requests": 2000}
_QUICK = {"concurrency": 2, "max_tokens": 8, "warmup_s": 4.0, "observe_s": 15.0, "max_requests": 1000}


def settings_from_args(args: argparse.Namespace) -> FaultsBenchSettings:
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else (_QUICK if args.quick else _FULL)[key]
             for key in _FULL}
    try:
        decode_strategy = parse_strategy(args.decode_parallel)
    except StrategyError as exc:
        raise ValueError(f"--decode-parallel: {exc}") from None
    # every fault by default; an expert rank's kill where the decode TE has expert ranks
    every = tuple(name for name in FAULT_NAMES if name != "kill_decode_expert_rank" or decode_strategy.disagg)
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip()) if args.faults else \
        (QUICK_FAULTS if args.quick else every)
    unknown = sorted(set(faults) - set(FAULT_NAMES))
    if unknown or not faults:
        raise ValueError(f"--faults: unknown {', '.join(unknown) or 'empty list'} (known: {', '.join(FAULT_NAMES)})")
    pool = (not args.quick) if args.pool is None else args.pool
    if "kill_pool_server" in faults and not pool:
        raise ValueError("--faults kill_pool_server needs the memory pool (--pool)")
    for flag, value, low in (("--concurrency", sizes["concurrency"], 1), ("--max-tokens", sizes["max_tokens"], 2),
                             ("--prompts", args.prompts, 1), ("--prompt-len", args.prompt_len, 1),
                             ("--max-requests", sizes["max_requests"], 1), ("--runs", args.runs, 1)):
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    for flag, value in (("--warmup-s", sizes["warmup_s"]), ("--observe-s", sizes["observe_s"]),
                        ("--deadline-s", args.deadline_s), ("--settle-s", args.settle_s),
                        ("--stall-s", args.stall_s), ("--link-break-s", args.link_break_s)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if "kill_decode_expert_rank" in faults and not decode_strategy.disagg:
        raise ValueError("--faults kill_decode_expert_rank needs a disaggregated --decode-parallel (its last rank "
                         "holds experts)")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model: directory {args.model!r} does not exist")
    return FaultsBenchSettings(
        model_dir=args.model or "", faults=faults, prompts=args.prompts, prompt_len=args.prompt_len,
        deadline_s=args.deadline_s, settle_s=args.settle_s, stall_s=args.stall_s, link_break_s=args.link_break_s,
        pool=pool, runs=args.runs, out_dir=args.out, decode_parallel=args.decode_parallel, **sizes)


_ERRORS = (FaultsBenchError, ConfigError, TimeoutError, OSError, ValueError, RuntimeError)


def faults_main(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the sampler asks every JE's /health 4 times a second
    return run_bench_cli(PROG, args, settings_from_args, run_faults_benchmark, _ERRORS, _report)


def _report(settings: FaultsBenchSettings, result: dict) -> None:
    json_path = report.write_json(Path(settings.out_dir) / RESULT_FILE, result)
    png_path = plot_faults(result, report.png_path_for(json_path))
    print("\n".join(result["summary"]))
    print(f"wrote {json_path} and {png_path}")


# ---------------------------------------------------------------- the deployment
HANG_TIMEOUT_S = 5.0


def bench_deployment(pool_controller: str | None, decode_parallel: str = DECODE_PARALLEL) -> dict:
    # a rank silent for 5 s is hung (the default 30 s would outlast a phase); the stall lasts longer than that
    engine: dict[str, Any] = {"num_kv_blocks": 128, "hang_timeout_s": HANG_TIMEOUT_S}
    if pool_controller:
        engine["pool_controller"] = pool_controller
    return {"te_groups": [{"group": "pd", "role": "prefill", "count": 1},
                          {"group": "pd", "role": "decode", "count": 1, "parallel": decode_parallel},
                          {"group": "main", "role": "colocated", "count": 1}],
            "job_executors": 2, "routing": "round_robin", "engine": engine}


@contextlib.contextmanager
def managed(model: str, deployment: dict, work_dir: Path, hold_s: float):
    """A ClusterManager (local backend, fault injection open on its JEs), its loop on a thread; everything it
    started is stopped on exit."""
    # start-up: the manager only when the benchmark runs
    from meshserve.cluster.backends import LocalBackend
    from meshserve.cluster.manager import ClusterManager
    from meshserve.cluster.run import serving_in_background
    from meshserve.router.deployment import MultiDeployment
    from meshserve.utils.processes import free_tcp_port

    spec = MultiDeployment.from_dict(deployment, "bench deployment")
    state_dir = Path(tempfile.mkdtemp(prefix="state-", dir=work_dir))
    config = ClusterConfig(port=free_tcp_port(), hold_s=hold_s, autoscale=False, preload=False)
    manager = ClusterManager(spec, "bench-faults", model, LocalBackend(state_dir / "logs"), state_dir, config,
                             log_level=30, server={"enable_fault_injection": True})
    with serving_in_background(manager, 600):
        yield manager


# ---------------------------------------------------------------- injecting
def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


class Injector:
    """Finds each fault's target in the running deployment and injects the fault."""

    def __init__(self, manager, jes: dict[str, str], pool, settings: FaultsBenchSettings) -> None:
        self.manager, self.jes, self.pool, self.settings = manager, jes, pool, settings
        self.leftovers: list[int] = []  # processes a fault left behind, killed after its phase

    def te_named(self, role: str):
        tes = [t for t in self.manager.status().tes if t.role == role and t.state != "dead"]
        if not tes:
            raise FaultsBenchError(f"no live {role} TE to inject into")
        return tes[0]

    def targets(self, fault: FaultSpec) -> list[str]:
        if fault.target == "je":
            return [self._je_victim()[0]]
        if fault.target == "pool":
            return ["pool"]
        if fault.target == "pd":
            return [self.te_named("prefill").name, self.te_named("decode").name]
        return [self.te_named(fault.target).name]

    def _je_victim(self) -> tuple[str, int]:
        jes = self.manager.status().jes
        victim = jes[-1]  # the second replica: the first keeps serving the resent requests
        return victim.name, victim.pid

    def inject(self, fault: FaultSpec) -> dict[str, Any]:
        """Do it; what was done (or why it could not be) as a dict."""
        try:
            detail = getattr(self, f"_{fault.how}")(fault)
            return {"injected": True, "detail": detail}
        except (FaultsBenchError, OSError) as exc:
            return {"injected": False, "detail": str(exc)}

    def _kill_rank(self, fault: FaultSpec) -> str:
        te = self.te_named(fault.target)
        ranks = rank_processes(te.pid)
        rank = max(ranks, default=-1) if fault.rank == -1 else fault.rank
        if rank not in ranks:
            raise FaultsBenchError(f"TE {te.name} has no rank {rank} process (ranks found: {sorted(ranks)})")
        _kill(ranks[rank])
        return f"killed rank {rank} (pid {ranks[rank]}) of TE {te.name}"

    def _kill_master(self, fault: FaultSpec) -> str:
        te = self.te_named(fault.target)
        ranks = rank_processes(te.pid)
        self.leftovers += list(ranks.values())
        _kill(te.pid)
        return f"killed the master (pid {te.pid}) of TE {te.name}; its ranks {sorted(ranks.values())} left running"

    def _kill_te(self, fault: FaultSpec) -> str:
        te = self.te_named(fault.target)
        ranks = rank_processes(te.pid)
        _kill(te.pid)
        for pid in ranks.values():
            _kill(pid)
        return f"killed TE {te.name}: master pid {te.pid}, ranks {sorted(ranks.values())}"

    def _kill_je(self, fault: FaultSpec) -> str:
        name, pid = self._je_victim()
        _kill(pid)
        return f"killed JE {name} (pid {pid})"

    def _kill_pool_server(self, fault: FaultSpec) -> str:
        if self.pool is None:
            raise FaultsBenchError("no memory pool runs (--no-pool)")
        proc = self.pool.server_proc(0)
        self.pool.kill_server(0)
        return f"killed pool server 0 (pid {proc.pid})"

    def _inject(self, fault: FaultSpec) -> str:
        import httpx

        body = dict(fault.inject or {})
        if body["kind"] == "stall":
            body["duration_s"] = self.settings.stall_s
        elif body["kind"] == "link_break":
            body["duration_s"] = self.settings.link_break_s
        names = self.targets(fault)
        url = next(iter(self.jes.values()))
        answers = []
        with httpx.Client(timeout=30) as client:
            for name in names:
                try:
                    reply = client.post(f"{url}/admin/faults", json={"te": name, **body})
                except httpx.HTTPError as exc:
                    raise FaultsBenchError(f"POST /admin/faults for {name}: {type(exc).__name__}: {exc}") from None
                if reply.status_code != 200:
                    raise FaultsBenchError(f"POST /admin/faults for {name}: HTTP {reply.status_code}: "
                                           f"{reply.text[:200]}")
                answers.append(f"{name}: {json.dumps(body)}")
        return "armed " + "; ".join(answers)

    def clean_up(self, fault: FaultSpec) -> str:
        """After a phase: kill what the fault left behind, restart a killed pool server."""
        notes = []
        left = [pid for pid in self.leftovers if _alive(pid)]
        for pid in left:
            _kill(pid)
        if self.leftovers:
            notes.append(f"{len(left)} of {len(self.leftovers)} orphaned rank(s) still ran and were killed")
        self.leftovers = []
        if fault.how == "kill_pool_server" and self.pool is not None:
            self.pool.restart_server(0)
            notes.append("pool server 0 restarted")
        return "; ".join(notes)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------- the run
def _prompts(settings: FaultsBenchSettings) -> list[list[int]]:
    return [[(13 * i + 7 * j) % 900 + 20 for j in range(settings.prompt_len)] for i in range(settings.prompts)]


def run_faults_benchmark(settings: FaultsBenchSettings) -> dict:
    if not settings.model_dir:
        from meshserve.models.factory import ensure_default_model

        settings = dataclasses.replace(settings, model_dir=str(ensure_default_model("deepseek_v3", "tiny")))
        log(LOG_PREFIX, f"no --model: the deepseek_v3 tiny model ({settings.model_dir})")
    work_dir = Path(settings.out_dir) / "work"
    work_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": report.machine_info(), "model": settings.model_dir,
                              "settings": dataclasses.asdict(settings), "decode_parallel": settings.decode_parallel}
    with contextlib.ExitStack() as stack:
        pool = pool_client = None
        if settings.pool:
            from meshserve.bench.cache import LocalPool

            log(LOG_PREFIX, "starting a memory pool: a controller and 2 servers")
            pool = stack.enter_context(LocalPool(2, 0.25, work_dir))
            pool_client = pool.client()
            stack.callback(pool_client.close)
        log(LOG_PREFIX, f"starting the deployment: prefill TE, decode TE ({settings.decode_parallel}), colocated TE, "
                        "2 JEs" + (", memory pool" if pool else ""))
        t0 = time.perf_counter()
        manager = stack.enter_context(managed(settings.model_dir, bench_deployment(pool and pool.controller,
                                                                                   settings.decode_parallel),
                                              work_dir, hold_s=settings.deadline_s))
        result["startup_s"] = time.perf_counter() - t0
        jes = {je.name: je.http_addr for je in manager.status().jes}
        origin = time.perf_counter()
        sampler = stack.enter_context(Sampler(manager, jes, pool_client, origin))
        injector = Injector(manager, jes, pool, settings)
        load = LoadSettings(urls=list(jes.values()), model=Path(settings.model_dir).name, prompts=_prompts(settings),
                            max_tokens=settings.max_tokens, concurrency=settings.concurrency,
                            deadline_s=settings.deadline_s)
        log(LOG_PREFIX, f"serving after {result['startup_s']:.0f} s; JEs {', '.join(jes.values())}")
        phases: list[dict] = []
        next_index = 0
        # the fault-free phase: the reference answers and token rate
        reference_phase, results = _run_phase(None, settings, load, origin, next_index, sampler, injector)
        next_index += len(results)
        reference, differing = reference_tokens(results)
        reference_rate = reference_phase["tokens_per_s"]
        reference_phase["reference_differing"] = differing
        _summarize_requests(reference_phase, results, reference)
        phases.append(reference_phase)
        log(LOG_PREFIX, f"reference: {reference_rate:.1f} tokens/s, {reference_phase['completed']} of "
                        f"{reference_phase['accepted']} completed, {differing} answer(s) differing from their "
                        f"prompt's most common one")
        if not reference:
            raise FaultsBenchError("no request completed in the fault-free phase; nothing to compare with")
        for run in range(settings.runs):
            for name in settings.faults:
                fault = next(f for f in FAULTS if f.name == name)
                settle = _wait_whole(sampler, settings.settle_s, pool is not None)  # e.g. the pool server back
                phase, results = _run_phase(fault, settings, load, origin, next_index, sampler, injector,
                                            reference_rate=reference_rate, pool_servers=2 if pool else 0)
                next_index += len(results)
                phase["run"] = run
                phase["settled_before"] = settle
                _summarize_requests(phase, results, reference)
                phases.append(phase)
                log(LOG_PREFIX, f"{name}: " + _phase_line(phase))
        result["phases"] = phases
        result["timeline"] = {"tokens_per_s": throughput_series_all(phases), "bin_s": BIN_S}
    result["faults"] = _fault_medians(phases)
    result["summary"] = summary_lines(result)
    return result


def throughput_series_all(phases: list[dict]) -> list[dict]:
    return [p for phase in phases for p in phase.pop("_series")]


def _wait_whole(sampler: Sampler, timeout_s: float, with_pool: bool) -> dict[str, Any]:
    """Until every TE and JE serves and is routed to (and the pool has its servers): the next phase starts from
    a whole deployment. Returns how long that took, or that it never was."""
    start = time.perf_counter()
    deadline = start + timeout_s
    while time.perf_counter() < deadline:
        obs = sampler.latest()
        names = sorted({k.split(":")[1] for k in obs if k.startswith(("te:", "je:"))})
        if obs and whole(obs, names + (["pool"] if with_pool else []), 2 if with_pool else 0):
            return {"whole": True, "waited_s": time.perf_counter() - start}
        time.sleep(SAMPLE_S)
    log(LOG_PREFIX, f"the deployment was not whole again within {timeout_s:.0f} s; the next phase starts anyway")
    return {"whole": False, "waited_s": time.perf_counter() - start}


def _run_phase(fault: FaultSpec | None, settings: FaultsBenchSettings, load_settings: LoadSettings, origin: float,
               first_index: int, sampler: Sampler, injector: Injector, reference_rate: float = 0.0,
               pool_servers: int = 0) -> tuple[dict, list[RequestResult]]:
    name = fault.name if fault else "none"
    load = SteadyLoad(load_settings, origin, first_index)
    duration = settings.warmup_s + settings.observe_s  # the reference phase as long as the others
    start = load.now()
    log(LOG_PREFIX, f"phase {name}: {duration:.0f} s of load ({settings.concurrency} in flight)"
                    + (f", {fault.what} after {settings.warmup_s:.0f} s" if fault else " (fault-free reference)"))
    load.start(duration, settings.max_requests)
    phase: dict[str, Any] = {"fault": name, "what": fault.what if fault else "no fault (the reference)",
                             "start_s": start}
    if fault is not None:
        _sleep_until(load, start + settings.warmup_s)
        targets = injector.targets(fault)
        before = sampler.latest()
        t_inject = load.now()
        phase.update(injector.inject(fault), inject_s=t_inject, targets=targets)
        log(LOG_PREFIX, f"phase {name}: injected at {t_inject:.1f} s: {phase['detail']}")
    _sleep_until(load, start + duration)
    t_stop = load.now()
    load.stop_sending()
    results = load.join()
    end = load.now()
    if len(results) >= settings.max_requests:
        last_sent = max(r.sent_at for r in results)
        phase["requests_ran_out_s"] = last_sent
        log(LOG_PREFIX, f"phase {name}: its {settings.max_requests} requests were all sent by "
                        f"{last_sent - start:.0f} s of {duration:.0f} s; later token rates read low (raise "
                        "--max-requests)")
    series = throughput_series(results, start, t_stop, BIN_S)
    warm = [p["tokens_per_s"] for p in series if p["t"] >= start + min(settings.warmup_s, duration) / 4
            and p["t"] <= start + settings.warmup_s]
    phase.update(stop_sending_s=t_stop, end_s=end, warmup_tokens_per_s=statistics.mean(warm) if warm else 0.0,
                 _series=series)
    if fault is None:
        rates = [p["tokens_per_s"] for p in series if p["t"] >= start + duration / 4]
        phase["tokens_per_s"] = statistics.mean(rates) if rates else 0.0
    else:
        # a killed pool server comes back only when the benchmark restarts it: its recovery is not the system's
        seen_until = end
        phase["clean_up"] = injector.clean_up(fault)
        if fault.how != "kill_pool_server":  # a recovery slower than the load still counts: wait for it
            phase["settled_after"] = _wait_whole(sampler, settings.settle_s, pool_servers > 0)
            seen_until = load.now()
        phase.update(detection(sampler.window(t_inject - 1.0, seen_until), before, targets, t_inject, pool_servers))
        # the dip against this phase's own rate before the injection (other load on the machine drifts), else the
        # reference phase's
        baseline = phase["warmup_tokens_per_s"] or reference_rate
        phase.update(throughput_effect(series, baseline, t_inject, t_stop), baseline_tokens_per_s=baseline)
    return phase, results


def _sleep_until(load: SteadyLoad, t: float) -> None:
    while (left := t - load.now()) > 0:
        time.sleep(min(left, 0.2))


def _summarize_requests(phase: dict, results: list[RequestResult], reference: dict[int, list[str]]) -> None:
    """Counts (accepted = completed + failed + hung), client resends, and tokens against the reference."""
    counts = {status: sum(1 for r in results if r.status == status) for status in (COMPLETED, FAILED, HUNG)}
    diffs = {"lost": 0, "repeated": 0, "wrong": 0}
    differing = uncompared = 0
    for r in results:
        if r.status != COMPLETED:
            continue
        if r.prompt_index not in reference:
            uncompared += 1
            continue
        diff = compare_tokens(reference[r.prompt_index], r.tokens)
        differing += any(diff.values())
        for key, value in diff.items():
            diffs[key] += value
    errors: dict[str, int] = {}
    for r in results:
        if r.error and r.status != COMPLETED:
            errors[r.error[:160]] = errors.get(r.error[:160], 0) + 1
    phase.update(accepted=len(results), **counts, retries=sum(r.retries for r in results),
                 resumes=sum(r.resumes for r in results),
                 resume_mismatches=sum(r.resume_mismatches for r in results),
                 tokens_lost=diffs["lost"], tokens_repeated=diffs["repeated"], tokens_wrong=diffs["wrong"],
                 requests_differing=differing, requests_uncompared=uncompared,
                 errors=dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
                 requests=[r.to_dict() for r in results])


def _fault_medians(phases: list[dict]) -> dict[str, dict]:
    """Per fault, over its runs: summed request counts, median times (None where a run saw nothing)."""
    out = {}
    for phase in phases:
        if phase["fault"] == "none":
            continue
        entry = out.setdefault(phase["fault"], {"runs": 0, **{k: 0 for k in _COUNTS}, **{k: [] for k in _TIMES}})
        entry["runs"] += 1
        for key in _COUNTS:
            entry[key] += phase.get(key, 0)
        for key in _TIMES:
            entry[key].append(phase.get(key))
    for entry in out.values():
        for key in _TIMES:
            seen = [v for v in entry[key] if v is not None]
            entry[key] = statistics.median(seen) if seen else None
    return out


_COUNTS = ("accepted", COMPLETED, FAILED, HUNG, "retries", "resumes", "tokens_lost", "tokens_repeated", "tokens_wrong",
           "requests_differing")
_TIMES = ("detect_s", "routable_again_s", "throughput_back_s", "dip")


# ---------------------------------------------------------------- summary and plot
def _fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if unit == "%" else f"{value:.1f}"


def _dip(phase: dict) -> str:
    """The dip and when its lowest window was (a dip long after the detection may be the machine's, not the
    fault's)."""
    if phase.get("dip") is None:
        return "-"
    return f"{phase['dip']:.0%} @{phase['lowest_at_s']:.0f}s" if phase.get("lowest_at_s") is not None else \
        f"{phase['dip']:.0%}"


def _phase_line(phase: dict) -> str:
    if not phase.get("injected", True):
        return f"not injected ({phase.get('detail')}); {phase['completed']}/{phase['accepted']} completed"
    return (f"{phase['completed']}/{phase['accepted']} completed, {phase['failed']} failed, {phase['hung']} hung; "
            f"detected {_fmt(phase.get('detect_s'))} s ({phase.get('detected_by') or 'not observed'}), routable "
            f"again {_fmt(phase.get('routable_again_s'))} s, throughput back {_fmt(phase.get('throughput_back_s'))} "
            f"s, dip {_dip(phase)}")


HEADER = ("fault", "accepted", "done", "failed", "hung", "resent", "lost/rep/wrong", "detect", "routable",
          "tput back", "dip")


def table_rows(result: dict) -> list[tuple[str, ...]]:
    rows = []
    for phase in result["phases"]:
        injected = phase.get("injected", True)
        rows.append((phase["fault"] + ("" if injected else " (not injected)"), str(phase["accepted"]),
                     str(phase[COMPLETED]), str(phase[FAILED]), str(phase[HUNG]),
                     f"{phase['retries']}+{phase['resumes']}",
                     f"{phase['tokens_lost']}/{phase['tokens_repeated']}/{phase['tokens_wrong']}",
                     _fmt(phase.get("detect_s")), _fmt(phase.get("routable_again_s")),
                     _fmt(phase.get("throughput_back_s")), _dip(phase)))
    return rows


def summary_lines(result: dict) -> list[str]:
    rows = [HEADER, *table_rows(result)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = [f"faults on prefill + decode ({result.get('decode_parallel', DECODE_PARALLEL)}) + colocated TEs, "
             f"2 JEs{', memory pool' if result['settings'].get('pool') else ''}; resent = before + after the first "
             "token; times in s from the injection (-: not observed); dip @ when its lowest 2 s were"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    for phase in result["phases"]:
        if phase["fault"] != "none" and phase.get("detected_by"):
            lines.append(f"  {phase['fault']}: first seen as {phase['detected_by']}")
    reference = next((p for p in result["phases"] if p["fault"] == "none"), None)
    if reference is not None:
        lines.append(f"  reference: {reference['tokens_per_s']:.1f} tokens/s; {reference['reference_differing']} "
                     "fault-free answer(s) differed from their prompt's most common one (the comparison's noise)")
    return lines


def plot_faults(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["timeline"]["tokens_per_s"]
    bin_s = result["timeline"].get("bin_s", BIN_S)
    ts, rates = [], []
    for p in series:  # no line across the waits between phases (no load ran then)
        if ts and p["t"] - ts[-1] > 1.5 * bin_s:
            ts.append(float("nan"))
            rates.append(float("nan"))
        ts.append(p["t"])
        rates.append(p["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(min(18.0, max(8.0, 0.04 * len(series))), 4.5))
    ax.plot(ts, rates, lw=1, color="tab:blue", label="tokens/s")
    top = max((p["tokens_per_s"] for p in series), default=1.0) or 1.0
    for phase in result["phases"]:
        if phase["fault"] == "none" or "inject_s" not in phase:
            continue
        t = phase["inject_s"]
        ax.axvline(t, color="tab:red", lw=1.2)
        ax.text(t, top * 1.02, phase["fault"], rotation=60, fontsize=7, va="bottom", ha="left")
        for key, color in (("detect_s", "tab:orange"), ("routable_again_s", "tab:green")):
            if phase.get(key) is not None:
                ax.axvline(t + phase[key], color=color, lw=0.8, ls="--")
    ax.plot([], [], color="tab:red", label="injection")
    ax.plot([], [], color="tab:orange", ls="--", label="detected")
    ax.plot([], [], color="tab:green", ls="--", label="routable again")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens/s received")
    ax.set_ylim(0, top * 1.35)
    ax.set_title("steady load through faults")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return report.save_figure(fig, path)
