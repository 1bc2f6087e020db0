"""The cluster manager: owns a deployment's desired state and makes the processes match it (deepserve §3, §6).

It starts every job executor (a frontend process: HTTP + JE) and every TE of a deployment through a
backend (local processes or Ray actors, `backends.py`), watches them and restarts what dies: a TE whose
process exits or whose heartbeats stop, a JE whose process exits (on the same ports, so TEs and clients
find it again). Each TE pool ("GROUP/ROLE") scales between its `min` and `max` as the autoscaler
decides from the TEs' heartbeats and the JEs' demand reports; a scale-down drains a TE (it finishes its
requests, then leaves).

Fast scaling (deepserve §6), each scale-up timed in five steps (`ScaleUp.steps`):
  Scaler-Pre    the decision, until a process is asked to become the TE
  TE-Pre-Load   process start (none for a pre-warmed TE), imports, kernels, ranks, until weights load
  TE-Load       weights: from disk, the page cache, the memory pool or forked from a running TE
  TE-Post-Load  KV cache, a warm-up request (so the first real one is fast), until it can serve
  Scaler-Post   until every JE has it registered (a TE registers only once it can serve)
A new TE comes from a pre-warmed process when one is idle (`prewarm: N` keeps N ready, `warm.py`), and
forks its weights from a running TE of the same pool when there is one (`ModelConfig.fork_from`); the
models of pools that may scale are kept in the page cache (DRAM preload).

Capacity and kill-P-to-preserve-D (xdeepserve §6.2, stage 2): a deployment may give `devices: N`, the ranks
its TEs may hold at once (absent: no limit). The model is plain: a live TE holds its world size in devices, a
dead one holds none, and the capacity is what an operator says is usable now (the file's `devices`, lowered
with `set_capacity` or the control socket's `capacity` query when devices are lost; lowering it stops nothing,
it bounds what starts). No TE starts or restarts beyond it; a dead decode TE's restart comes before any other
start (its devices are reserved while it waits). When a decode TE must restart and its ranks do not fit, the
manager stops the least loaded prefill TE(s) to free theirs: at once when the decode pool has no other serving
TE (the JEs move the prefill TE's jobs), else by a drain; never the last TE able to prefill (a serving prefill
or colocated TE), so new requests always have somewhere to go. Each decision is an event and counts in
`meshserve_cluster_prefill_stopped_for_decode_total`; the prefill pool waits below its target until devices
are back. Pre-warmed processes hold no devices here.

High availability: every process outlives the manager, and the state file (`state.py`) holds what the
manager cannot ask again; a manager restarted on the same state directory adopts the running processes
(their heartbeats reach it on the same ports) and starts only what is missing.

Sockets (CurveZMQ with the cluster secret): `register` (PULL) takes TEs' EngineHeartbeats, JEs'
JobExecutorReports and warm TEs' WarmReady; `control` (ROUTER) answers `meshserve status`,
`meshserve cluster down` and `cluster scale` (ClusterQuery -> ClusterStatus), and `op="capacity"` (`target`:
the devices usable now); Prometheus metrics on `metrics_port`, bound to `metrics_host` (loopback by
default: metrics_http.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from meshserve.cluster.backends import Backend, ProcessHandle, ProcessResources, make_backend
from meshserve.cluster.metrics_http import serve_metrics_http
from meshserve.cluster.state import ClusterState, ProcessRecord, load_state, manager_running, save_state
from meshserve.config import ClusterConfig, ConfigError, EngineConfig, RouterConfig
from meshserve.router.deployment import MultiDeployment, TEGroupSpec, check_pd_layouts
from meshserve.utils import cluster_auth
from meshserve.utils.processes import free_tcp_port
from meshserve.wire import codec
from meshserve.wire.client import AdminOp, AdminRequest, EngineStats
from meshserve.wire.cluster import (
    ClusterQuery,
    ClusterStatus,
    GroupStatus,
    JEStatus,
    JobExecutorReport,
    TEStatus,
    WarmAssign,
    WarmReady,
)
from meshserve.wire.codec import MessageError
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole, StartupTimeline
from meshserve.wire.receive import drop_frame, recv_message

logger = logging.getLogger(__name__)

TICK_S = 0.2
REPORT_TIMEOUT_S = 5.0  # a JE whose reports stop this long no longer counts for Scaler-Post
RESTART_BACKOFF_S = (0.0, 1.0, 5.0, 15.0, 60.0)  # after 0, 1, 2, ... quick deaths in a row
QUICK_DEATH_S = 30.0  # a process that dies sooner than this after its start counts as a quick death
MAX_EVENTS = 50


TREND_WINDOW_S = 30.0  # the load trend the DRAM preloader predicts scale-ups from


class DramPreloader:
    """Reads a model's checkpoint into the page cache in the background (one model at a time), and again
    when most of it was evicted since; checked at most every `RECHECK_S` per model."""

    RECHECK_S = 10.0
    RESIDENT_ENOUGH = 0.9

    def __init__(self) -> None:
        self._checked: dict[str, float] = {}
        self._busy: threading.Thread | None = None
        self.preloaded: list[tuple[str, int, float]] = []  # (model, bytes, seconds), for status and benchmarks

    def keep(self, model: str, now: float) -> None:
        if self._busy is not None and self._busy.is_alive():
            return
        if now - self._checked.get(model, -self.RECHECK_S) < self.RECHECK_S:
            return
        self._checked[model] = now
        self._busy = threading.Thread(target=self._load, args=(model,), name="meshserve-preload", daemon=True)
        self._busy.start()

    def _load(self, model: str) -> None:
        # start-up: the page-cache helpers only when preloading
        from meshserve.utils import page_cache

        try:
            files = page_cache.checkpoint_files(model)
            if page_cache.resident_fraction(files) >= self.RESIDENT_ENOUGH:
                return
            nbytes, seconds = page_cache.preload(files)
            self.preloaded.append((model, nbytes, seconds))
            logger.info("DRAM preload: %s in the page cache (%.0f MB in %.1f s)", model, nbytes / 1e6, seconds)
        except OSError as exc:
            logger.warning("DRAM preload of %s failed: %s", model, exc)


@dataclass
class ScaleUp:
    """One TE start, timed step by step (wall clock)."""

    te: str
    pool: str
    process: str  # cold | prewarmed
    weights: str  # checkpoint | fork
    reason: str
    decided_at: float
    launched_at: float = 0.0
    timeline: StartupTimeline | None = None
    registered_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.registered_at > 0

    def steps(self) -> dict[str, float]:
        """Seconds per step (deepserve §6: Scaler-Pre, TE-Pre-Load, TE-Load, TE-Post-Load, Scaler-Post)."""
        t = self.timeline
        if t is None or not (t.load_start and t.load_end and t.ready and self.registered_at):
            return {}
        return {"scaler_pre": self.launched_at - self.decided_at, "te_pre_load": t.load_start - self.launched_at,
                "te_load": t.load_end - t.load_start, "te_post_load": t.ready - t.load_end,
                "scaler_post": self.registered_at - t.ready, "total": self.registered_at - self.decided_at}

    def to_dict(self) -> dict[str, Any]:
        t = self.timeline
        return {"te": self.te, "pool": self.pool, "process": self.process, "weights": self.weights,
                "reason": self.reason, "load_source": t.load_source if t else "",
                "load_bytes": t.load_bytes if t else 0, "steps": self.steps(),
                "pre_load_parts": t.pre_load_parts(self.launched_at) if t and self.steps() else {}}


@dataclass
class _Process:
    """A process the manager runs: its record (what the state file keeps) and the live handle."""

    record: ProcessRecord
    handle: ProcessHandle | None
    last_seen: float = 0.0  # its last heartbeat / report (monotonic); 0: none yet
    heartbeat: EngineHeartbeat | None = None  # TEs
    report: JobExecutorReport | None = None  # JEs
    assign_addr: str = ""  # warm TEs: where to send WarmAssign (from its WarmReady)
    draining: bool = False  # a TE told to drain: its exit is expected
    quick_deaths: int = 0
    restart_at: float = 0.0  # a dead process waits for its restart until then (backoff)
    preempted: bool = False  # a prefill TE stopped to free its devices for a decode TE (kill-P-to-preserve-D)
    started_mono: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.record.name


class ClusterManager:
    """`config`: the manager's own settings; `engine_overrides`: engine settings for every TE (over the
    deployment's); `server`: the JEs' HTTP settings but the keys (those travel in the environment)."""

    def __init__(self, deployment: MultiDeployment, deployment_source: str, model: str, backend: Backend,
                 state_dir: str | Path, config: ClusterConfig = ClusterConfig(),
                 engine_overrides: dict[str, Any] | None = None, log_level: int = logging.INFO,
                 server: dict[str, Any] | None = None) -> None:
        self.deployment, self.deployment_source, self.model = deployment, deployment_source, model
        self.backend, self.state_dir, self.config = backend, Path(state_dir), config
        self.log_level = log_level
        self.overrides = dict(engine_overrides or {})
        self.server = dict(server or {})
        self.specs: dict[str, TEGroupSpec] = {spec.pool: spec for spec in deployment.groups}
        self.configs = self._pool_configs()
        initial = sum(self.configs[pool].parallel_config.world_size * spec.count for pool, spec in self.specs.items())
        if deployment.devices is not None and initial > deployment.devices:
            raise ConfigError(f"the deployment starts TEs of {initial} ranks, more than its {deployment.devices} "
                              "devices")
        self.warm_workers = max((c.parallel_config.num_local_ranks for c in self.configs.values()), default=1)
        self.tes: dict[str, _Process] = {}
        self.jes: dict[str, _Process] = {}
        self.warm: dict[str, _Process] = {}
        self.targets: dict[str, int] = {pool: spec.count for pool, spec in self.specs.items()}
        self.next_index: dict[str, int] = {}
        self.scale_ups: list[ScaleUp] = []
        self._pending_scale_ups: dict[str, ScaleUp] = {}  # TE name -> its scale-up, until registered
        self.events: deque[str] = deque(maxlen=MAX_EVENTS)
        self.last_reason: dict[str, str] = {}
        self.capacity: int | None = deployment.devices  # devices the TEs may hold now (None: no limit)
        self._waiting_for_devices: set[str] = set()  # TEs and pools told to wait for devices (one event each)
        self.autoscaler = None  # built in start() when the deployment asks for scaling (and `config.autoscale`)
        self.preloader = DramPreloader() if config.preload else None
        self._load_history: dict[str, deque[tuple[float, float]]] = {pool: deque() for pool in self.specs}
        self._last_decision = 0.0
        self.metrics = None  # the Prometheus registry served on the state's metrics port (start())
        self.ctx = zmq.Context()
        self.register = self.control = None
        self.state: ClusterState | None = None
        self._saved = b""  # the state file's bytes as last written
        self._stop = threading.Event()
        self.down_requested = False  # `cluster down` (or a signal) asked to stop the deployment, not just the manager
        self._lock = threading.RLock()  # the loop thread and callers (benchmarks, tests) share the tables

    # ------------------------------------------------------------------ configuration
    def _pool_configs(self) -> dict[str, EngineConfig]:
        """Each pool's engine settings (validated before anything starts). The cores are shared among the ranks
        of every TE the deployment may run at once (its pools at their max)."""
        specs = list(self.specs.values())

        def config(spec: TEGroupSpec, threads: int | None = None) -> EngineConfig:
            extra = {"num_threads": threads} if threads else {}
            return EngineConfig.from_kwargs(spec.model or self.deployment.model or self.model, **{
                **extra, **self.deployment.engine, **spec.engine, **self.overrides,
                "te_name": spec.pool.replace("/", "-"),
                "serve_weights": True})

        ranks = sum(config(spec).parallel_config.world_size * max(spec.bounds[1], 1) for spec in specs)
        threads = max(1, ((os.cpu_count() or 1) - 1) // max(1, ranks))
        configs = {spec.pool: config(spec, threads) for spec in specs}
        tes = [t for spec in specs for t in MultiDeployment([spec], model=self.model).tes()[:1]]
        check_pd_layouts(tes, [configs[t.group + "/" + t.role] for t in tes])
        return configs

    @property
    def register_addr(self) -> str:
        return f"tcp://{self.backend.advertise_host()}:{self.state.register_port}"

    @property
    def control_addr(self) -> str:
        return f"tcp://{self.backend.advertise_host()}:{self.state.control_port}"

    def je_register_addrs(self) -> list[str]:
        return [f"tcp://{self.backend.advertise_host()}:{je.record.register_port}" for je in self.jes.values()]

    def http_addrs(self) -> list[str]:
        return [self._http_addr(je) for je in self.jes.values()]

    def _http_addr(self, je: _Process) -> str:
        """Where a JE serves HTTP: its host, unless it runs on the manager's machine (then --host)."""
        host = je.handle.host if je.handle is not None and je.handle.host != "localhost" else self.config.host
        return f"http://{host}:{je.record.port}"

    # ------------------------------------------------------------------ start, adopt
    def start(self) -> None:
        """Take the deployment over from a state file whose manager is gone, or start it from nothing."""
        previous = load_state(self.state_dir)
        if previous is not None and manager_running(previous) and previous.manager_pid != os.getpid():
            raise ConfigError(f"a cluster manager (pid {previous.manager_pid}) already runs the deployment in "
                              f"{self.state_dir}; stop it with `meshserve cluster down --state-dir {self.state_dir}`")
        # start-up: psutil only where processes are watched
        import psutil

        me = psutil.Process()
        host = self.backend.advertise_host()
        if previous is None:
            self.state = ClusterState(name=self.config.name, backend=self.backend.name,
                                      deployment=self.deployment_source, model=self.model, manager_pid=me.pid,
                                      manager_create_time=me.create_time(),
                                      host=host, control_port=free_tcp_port(host), register_port=free_tcp_port(host),
                                      base_port=self.config.port, targets=dict(self.targets))
        else:
            if previous.deployment != self.deployment_source:
                raise ConfigError(f"{self.state_dir} holds the deployment {previous.deployment!r}, not "
                                  f"{self.deployment_source!r}: stop it first (`meshserve cluster down`)")
            self.state = previous
            self.state.manager_pid, self.state.manager_create_time = me.pid, me.create_time()
            self.targets.update({p: t for p, t in previous.targets.items() if p in self.specs})
            self.next_index = dict(previous.next_index)
        self._bind()
        self._build_autoscaler()
        self._serve_metrics()
        if previous is not None:
            self._adopt(previous)
        else:
            for i in range(self.deployment.job_executors):
                self._launch_je(f"je-{i}", self.config.port + i, free_tcp_port(host))
        for pool in self.specs:  # what the state or the deployment asks for and is not there
            for _ in range(self.targets[pool] - len(self._pool_tes(pool))):
                self._scale_up(pool, "initial deployment" if previous is None else "missing after manager restart")
        self._save()

    def _bind(self) -> None:
        host = self.backend.advertise_host()
        self.register = cluster_auth.server(self.ctx.socket(zmq.PULL))
        self.register.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self.register.bind(f"tcp://{host}:{self.state.register_port}")
        self.control = cluster_auth.server(self.ctx.socket(zmq.ROUTER))
        self.control.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        self.control.bind(f"tcp://{host}:{self.state.control_port}")

    def _serve_metrics(self) -> None:
        """The autoscaler's metrics and the manager's own, on the metrics port (kept across restarts)."""
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.metrics = self.autoscaler.registry if self.autoscaler is not None else CollectorRegistry()
        self._restarts_metric = Counter("meshserve_cluster_restarts", "Processes restarted after a failure.",
                                        ["kind"], registry=self.metrics)
        self._prefill_stopped_metric = Counter(
            "meshserve_cluster_prefill_stopped_for_decode", "Prefill TEs stopped to free devices for restarting a "
            "decode TE (kill-P-to-preserve-D).", registry=self.metrics)
        self._step_metric = Histogram("meshserve_cluster_scale_up_step_seconds", "Seconds per scale-up step.",
                                      ["step", "process", "weights"], registry=self.metrics,
                                      buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
        self.state.metrics_port = serve_metrics_http(self.metrics, self.config.metrics_host, self.state.metrics_port)

    def _adopt(self, previous: ClusterState) -> None:
        kept = gone = 0
        for record in previous.processes:
            handle = self.backend.adopt(record.handle)
            proc = _Process(record, handle)
            if handle is None:
                gone += 1
                self._event(f"{record.kind} {record.name} is gone since the last manager: "
                            + ("restarting it" if record.kind != "warm-te" else "dropped"))
                if record.kind == "warm-te":
                    continue
            else:
                kept += 1
            {"te": self.tes, "frontend": self.jes, "warm-te": self.warm}[record.kind][record.name] = proc
        self._event(f"took over the deployment: {kept} process(es) still running, {gone} gone")

    def _build_autoscaler(self) -> None:
        if self.deployment.autoscaler is None or not self.config.autoscale:
            return
        # start-up: prometheus and the policy only for a deployment that scales
        from meshserve.cluster.autoscaler import Autoscaler, AutoscalerSettings

        settings = AutoscalerSettings.from_dict(self.deployment.autoscaler, "autoscaler")
        self.autoscaler = Autoscaler(settings, {pool: spec.bounds for pool, spec in self.specs.items()})

    # ------------------------------------------------------------------ launching
    def _launch_je(self, name: str, port: int, register_port: int, restarts: int = 0) -> None:
        spec = self.deployment
        config = next(iter(self.configs.values()), None)
        router = RouterConfig(model=self.model, routing=spec.routing, register_port=register_port,
                              served_model_name=config.model_config.served_model_name if config else None,
                              manager_addrs=(self.register_addr,), hold_s=self.config.hold_s, name=name)
        kwargs = dict(router=msgspec.to_builtins(router), host=self.config.host, port=port, heatmap=spec.heatmap,
                      predictor=spec.predictor, max_queue_hint=spec.waiting_room(),
                      log_level=self.log_level, server=self.server)
        handle = self.backend.launch("frontend", name, kwargs)
        self.jes[name] = _Process(ProcessRecord("frontend", name, handle.record(), port=port,
                                                register_port=register_port, started_at=time.time(),
                                                restarts=restarts), handle)

    def _new_te_name(self, pool: str) -> str:
        index = self.next_index.get(pool, 0)
        self.next_index[pool] = index + 1
        return f"{pool.replace('/', '-')}-{index}"

    def _fork_source(self, pool: str) -> list[str]:
        """Weight servers of a ready TE of the pool (same model and layout), least loaded first."""
        ready = [te for te in self._pool_tes(pool) if te.heartbeat is not None and not te.draining
                 and te.heartbeat.weights_addrs and te.handle is not None and te.handle.alive()]
        if not ready:
            return []
        best = min(ready, key=lambda te: te.heartbeat.stats.num_running + te.heartbeat.stats.num_waiting)
        return list(best.heartbeat.weights_addrs)

    def _idle_warm(self) -> _Process | None:
        for warm in self.warm.values():
            if warm.assign_addr and warm.handle is not None and warm.handle.alive():
                return warm
        return None

    def add_te(self, pool: str, reason: str = "asked", process: str = "auto", weights: str = "auto",
               fork_from: list[str] | None = None) -> ScaleUp:
        """Scale `pool` up by one TE now, started as asked (benchmarks and operators); the target follows."""
        with self._lock:
            self.targets[pool] = self.targets.get(pool, 0) + 1
            return self._scale_up(pool, reason, process=process, weights=weights, fork_from=fork_from)

    def set_target(self, pool: str, target: int, reason: str = "asked") -> None:
        """Scale `pool` to `target` TEs (a scale-down drains the least busy ones)."""
        with self._lock:
            self.targets[pool] = target
            self.last_reason[pool] = reason

    def _scale_up(self, pool: str, reason: str, name: str | None = None, process: str = "auto",
                  weights: str = "auto", restarts: int = 0, fork_from: list[str] | None = None) -> ScaleUp:
        """Start one TE of `pool` (or restart `name`): from a pre-warmed process when one is idle (`process`:
        auto | prewarmed | cold), its weights forked from a running TE of the pool when there is one
        (`weights`: auto | fork | checkpoint; `fork_from`: a given TE's weight servers)."""
        decided_at = time.time()
        name = name or self._new_te_name(pool)
        spec = self.specs[pool]
        fork = fork_from or (self._fork_source(pool) if weights in ("auto", "fork") else [])
        if weights == "fork" and not fork:
            raise RuntimeError(f"no running TE of {pool} to fork weights from")
        config = self.configs[pool].replace(te_name=name, fork_from=",".join(fork) if fork else None)
        register = [*self.je_register_addrs(), self.register_addr]
        listen = f"tcp://{self.backend.advertise_host()}:0"
        warm = self._idle_warm() if process in ("auto", "prewarmed") else None
        if process == "prewarmed" and warm is None:
            raise RuntimeError("no idle pre-warmed TE")
        if warm is not None:
            del self.warm[warm.name]
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            cluster_auth.client(sock, warm.assign_addr)
            sock.connect(warm.assign_addr)
            sock.send(codec.encode(WarmAssign(config=config, role=EngineRole(spec.role), group=spec.group,
                                                listen=listen, register=register, assigned_at=time.time())))
            sock.close()
            handle = warm.handle  # the same process (under its backend name), now this TE
        else:
            world = config.parallel_config.world_size
            handle = self.backend.launch("te", name, dict(
                config=config.to_dict(), role=spec.role, group=spec.group, listen=listen, register=register,
                log_level=self.log_level, watch_parent=False, warmup=True),
                ProcessResources(num_ranks=world, cpus_per_rank=float(config.parallel_config.num_threads or 1)))
        source = ("prewarmed" if warm is not None else "cold") + ("+fork" if fork else "")
        record = ProcessRecord("te", name, handle.record(), pool=pool, started_at=time.time(), restarts=restarts,
                               source=source)
        self.tes[name] = _Process(record, handle)
        scale_up = ScaleUp(name, pool, "prewarmed" if warm is not None else "cold", "fork" if fork else "checkpoint",
                           reason, decided_at, launched_at=time.time())
        self._pending_scale_ups[name] = scale_up
        self._event(f"{'restart' if restarts else 'start'} TE {name} ({source}): {reason}")
        return scale_up

    def _launch_warm(self) -> None:
        index = self.next_index.get("warm", 0)
        self.next_index["warm"] = index + 1
        name = f"warm-{index}"
        handle = self.backend.launch("warm-te", name, dict(
            name=name, manager_addr=self.register_addr, host=self.backend.advertise_host(),
            num_workers=self.warm_workers, log_level=self.log_level),
            ProcessResources(num_ranks=self.warm_workers))
        self.warm[name] = _Process(ProcessRecord("warm-te", name, handle.record(), started_at=time.time()), handle)

    def _drain(self, te: _Process, reason: str) -> None:
        te.draining = True
        hb = te.heartbeat
        if hb is None or te.handle is None:  # not registered yet: nothing to finish
            if te.handle is not None:
                te.handle.stop()
        else:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            cluster_auth.client(sock, hb.input_addr)
            sock.connect(hb.input_addr)
            sock.send(codec.encode(AdminRequest(query_id=0, op=AdminOp.DRAIN)))
            sock.close()
        self._event(f"drain TE {te.name}: {reason}")

    # ------------------------------------------------------------------ the loop
    def _pool_tes(self, pool: str, include_draining: bool = False) -> list[_Process]:
        return [te for te in self.tes.values() if te.record.pool == pool and (include_draining or not te.draining)]

    def step(self) -> None:
        """One turn: take messages, answer queries, heal, scale, keep the warm pool, save the state."""
        with self._lock:
            now = time.monotonic()
            self._take_messages(now)
            self._answer_queries()
            self._heal(now)
            self._autoscale(now)
            self._reconcile()
            self._keep_warm_pool()
            self._preload(now)
            self._track_scale_ups()
            self._save()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # noqa: BLE001 - one failed turn must not end the manager
                logger.exception("cluster manager turn failed")
            self._stop.wait(TICK_S)

    def stop(self) -> None:
        self._stop.set()

    def _take_messages(self, now: float) -> None:
        while self.register.poll(0):
            item = recv_message(self.register, "manager-register")
            if isinstance(item, EngineHeartbeat):
                te = self.tes.get(item.name)
                if te is None:
                    continue  # not ours (a TE of another deployment pointed here)
                if item.leaving:
                    te.draining = True
                te.heartbeat, te.last_seen = item, now
            elif isinstance(item, JobExecutorReport):
                je = self.jes.get(item.name)
                if je is not None:
                    je.report, je.last_seen = item, now
                    if self.autoscaler is not None:
                        self.autoscaler.observe_demand(item.name, item.groups, now)
            elif isinstance(item, WarmReady):
                warm = self.warm.get(item.name)
                if warm is not None and not warm.assign_addr:
                    warm.assign_addr = item.assign_addr
                    warm.last_seen = now

    def _answer_queries(self) -> None:
        while self.control.poll(0):
            frames = self.control.recv_multipart()
            if len(frames) != 2:
                continue
            identity, data = frames
            try:
                query = codec.decode(data)
                if not isinstance(query, ClusterQuery):
                    raise MessageError(f"expected a ClusterQuery, got {type(query).__name__}")
            except MessageError as exc:
                drop_frame("manager-control", exc)
                continue
            reply = self.status()
            if query.op == "down":
                self._event("asked to stop the deployment")
                self._stop.set()
                self.down_requested = True
            elif query.op == "scale":
                reply = self._operator_scale(query)
            elif query.op == "capacity":
                reply = self._operator_capacity(query)
            self.control.send_multipart([identity, codec.encode(reply)])

    def _operator_scale(self, query: ClusterQuery) -> ClusterStatus:
        spec = self.specs.get(query.pool)
        if spec is None:
            return ClusterStatus(name=self.config.name, backend=self.backend.name, manager_pid=os.getpid(), ok=False,
                                     error=f"no pool {query.pool!r}; pools: {', '.join(sorted(self.specs))}")
        low, high = spec.bounds
        if not low <= query.target <= high:
            return ClusterStatus(name=self.config.name, backend=self.backend.name, manager_pid=os.getpid(), ok=False,
                                     error=f"pool {query.pool} scales between {low} and {high} TEs, not "
                                           f"{query.target}")
        self.set_target(query.pool, query.target, "operator: meshserve cluster scale")
        self._event(f"scale {query.pool} to {query.target}: asked by an operator")
        return self.status()

    # ------------------------------------------------------------------ capacity (kill-P-to-preserve-D)
    def set_capacity(self, devices: int | None, reason: str = "asked") -> None:
        """The devices the deployment's TEs may hold from now on (None: no limit); what runs keeps running."""
        with self._lock:
            self.capacity = devices
            self._waiting_for_devices.clear()  # a wait that goes on is announced again
            self._event(f"capacity {'unlimited' if devices is None else f'{devices} device(s)'}: {reason}")

    def _operator_capacity(self, query: ClusterQuery) -> ClusterStatus:
        if query.target < 1:
            return ClusterStatus(name=self.config.name, backend=self.backend.name, manager_pid=os.getpid(), ok=False,
                                     error=f"capacity must be at least 1 device, not {query.target}")
        self.set_capacity(query.target, "asked by an operator")
        return self.status()

    def _ranks(self, pool: str) -> int:
        return self.configs[pool].parallel_config.world_size

    def _free_devices(self, for_decode_restart: bool = False) -> float:
        """Devices no live TE holds; a start other than a decode TE's restart also leaves the devices of the
        dead decode TEs waiting for theirs."""
        if self.capacity is None:
            return float("inf")
        held = sum(self._ranks(t.record.pool) for t in self.tes.values() if t.handle is not None and t.handle.alive())
        reserved = 0 if for_decode_restart else sum(
            self._ranks(t.record.pool) for t in self.tes.values()
            if self.specs[t.record.pool].role == "decode" and not t.draining
            and (t.handle is None or not t.handle.alive()))
        return self.capacity - held - reserved

    def _fits(self, pool: str, waiter: str, for_decode_restart: bool = False) -> bool:
        """Whether one more TE of `pool` fits the capacity now; `waiter` (a TE or a pool) is told once if not."""
        free, need = self._free_devices(for_decode_restart), self._ranks(pool)
        if free >= need:
            self._waiting_for_devices.discard(waiter)
            return True
        if waiter not in self._waiting_for_devices:
            self._waiting_for_devices.add(waiter)
            self._event(f"{waiter} waits for devices: needs {need}, {max(0, int(free))} free of {self.capacity}")
        return False

    def _room_to_restart(self, te: _Process) -> bool:
        """Whether the dead `te` may restart now; a decode TE that does not fit has prefill TEs stopped to free
        their devices (kill-P-to-preserve-D) and restarts once they are gone."""
        pool = te.record.pool
        decode = self.specs[pool].role == "decode"
        if self._fits(pool, f"TE {te.name}", for_decode_restart=decode):
            return True
        if decode:
            self._stop_prefill_for(te, self._ranks(pool) - int(self._free_devices(for_decode_restart=True)))
        return False

    def _stop_prefill_for(self, decode_te: _Process, short: int) -> None:
        """Free `short` devices for `decode_te`'s restart by stopping the least loaded prefill TEs (those already
        stopping count), never leaving no serving TE able to prefill (a prefill or colocated TE)."""
        live = [t for t in self.tes.values() if t.handle is not None and t.handle.alive()]
        short -= sum(self._ranks(t.record.pool) for t in live if t.preempted)
        if short <= 0:
            return  # the prefill TEs already stopping free enough
        role = lambda t: self.specs[t.record.pool].role  # noqa: E731
        able = {t.name for t in live if not t.draining and t.heartbeat is not None
                and role(t) in ("prefill", "colocated")}
        candidates = sorted((t for t in live if role(t) == "prefill" and not t.draining),
                            key=lambda t: (t.heartbeat is not None, t.heartbeat.stats.num_running +
                                           t.heartbeat.stats.num_waiting if t.heartbeat else 0))
        # urgent when the decode pool has nothing else serving: stop at once (the JEs move its jobs), else drain
        urgent = not any(t.heartbeat is not None and not t.draining for t in live
                         if t.record.pool == decode_te.record.pool)
        for victim in candidates:
            if short <= 0:
                return
            if not able - {victim.name}:
                waiter = f"TE {decode_te.name} (no prefill TE to spare)"
                if waiter not in self._waiting_for_devices:
                    self._waiting_for_devices.add(waiter)
                    self._event(f"TE {decode_te.name} waits for devices: {victim.name} is the last TE able to "
                                "prefill, it is not stopped")
                return
            able.discard(victim.name)
            victim.preempted = True
            reason = (f"kill-P-to-preserve-D: frees {self._ranks(victim.record.pool)} device(s) for restarting "
                      f"decode TE {decode_te.name}")
            if urgent or victim.heartbeat is None:
                victim.draining = True
                victim.handle.stop()
                self._event(f"stop TE {victim.name} at once: {reason}")
            else:
                self._drain(victim, reason)
            self._prefill_stopped_metric.inc()
            short -= self._ranks(victim.record.pool)

    def _heal_te(self, te: _Process, now: float) -> None:
        """One TE's turn: forget it if it drained, kill it if it hung, restart it (after a back-off when it keeps
        dying young) once it is dead and there is room."""
        alive = te.handle is not None and te.handle.alive()
        if not alive and te.draining:
            self._forget_te(te)
            self._event(f"TE {te.name} drained and left")
            return
        hung = alive and te.heartbeat is not None and now - te.last_seen > self.config.heartbeat_timeout_s
        if hung:
            self._event(f"TE {te.name} sent no heartbeat for {now - te.last_seen:.0f} s: killing it")
            te.handle.kill()
        if alive and not hung:
            return
        if te.restart_at == 0.0:  # just found dead: decide when to restart it
            quick = time.monotonic() - te.started_mono < QUICK_DEATH_S
            te.quick_deaths = te.quick_deaths + 1 if quick else 0
            delay = RESTART_BACKOFF_S[min(te.quick_deaths, len(RESTART_BACKOFF_S) - 1)]
            te.restart_at = now + delay
            code = te.handle.exit_code() if te.handle is not None else None
            self._event(f"TE {te.name} died" + (f" (exit code {code})" if code is not None else "")
                        + (f"; restarting in {delay:.0f} s" if delay else "; restarting"))
        if now < te.restart_at or not self._room_to_restart(te):
            return  # a restart without room waits for devices (a decode TE has a prefill TE's freed for it)
        self._forget_te(te)
        self._restarts_metric.labels("te").inc()
        self._scale_up(te.record.pool, "restart after a failure", name=te.name, restarts=te.record.restarts + 1)
        self.tes[te.name].quick_deaths = te.quick_deaths

    def _forget_te(self, te: _Process) -> None:
        del self.tes[te.name]
        if te.handle is not None:
            self.backend.release(te.handle)
        self._pending_scale_ups.pop(te.name, None)

    def _heal(self, now: float) -> None:
        # decode TEs first: a restart that needs devices frees them from prefill TEs before others take them
        for te in sorted(self.tes.values(), key=lambda t: self.specs[t.record.pool].role != "decode"):
            self._heal_te(te, now)
        for je in list(self.jes.values()):
            if je.handle is not None and je.handle.alive():
                continue
            if je.handle is not None:
                self.backend.release(je.handle)
            self._event(f"JE {je.name} died: restarting it on port {je.record.port}")
            self._restarts_metric.labels("frontend").inc()
            if self.autoscaler is not None:
                self.autoscaler.forget(je.name)  # what it held died with it
            self._launch_je(je.name, je.record.port, je.record.register_port, restarts=je.record.restarts + 1)
        for warm in list(self.warm.values()):
            if warm.handle is None or not warm.handle.alive():
                del self.warm[warm.name]
                if warm.handle is not None:
                    self.backend.release(warm.handle)

    def _autoscale(self, now: float) -> None:
        if self.autoscaler is None or now - self._last_decision < self.autoscaler.settings.interval_s:
            return
        self._last_decision = now
        for decision in self.autoscaler.decide(now, self._signals()):
            if decision.target != self.targets.get(decision.key):
                self.targets[decision.key] = decision.target
                self.last_reason[decision.key] = decision.reason
                self._event(f"scale {decision.key} to {decision.target}: {decision.reason}")

    def _signals(self) -> dict:
        """Per pool: the loads its TEs report and how many run and start (the autoscaler's inputs)."""
        from meshserve.cluster.autoscaler import PoolSignals

        signals = {}
        for pool in self.specs:
            tes = self._pool_tes(pool)
            loads = [te.heartbeat.stats for te in tes if te.heartbeat is not None]
            signals[pool] = PoolSignals(loads=loads, running=len(loads), starting=len(tes) - len(loads))
        return signals

    def _reconcile(self) -> None:
        for pool in self.specs:
            tes = self._pool_tes(pool)
            want = self.targets[pool]
            for _ in range(want - len(tes)):
                if not self._fits(pool, pool):
                    break
                self._scale_up(pool, self.last_reason.get(pool, "below target"))
            if len(tes) > want:
                # the least busy go first; a TE still starting goes before one that serves
                order = sorted(tes, key=lambda te: (te.heartbeat is not None, te.heartbeat.stats.num_running +
                                                    te.heartbeat.stats.num_waiting if te.heartbeat else 0))
                for te in order[:len(tes) - want]:
                    self._drain(te, self.last_reason.get(pool, "above target"))

    def _preload(self, now: float) -> None:
        """DRAM preload: keep the checkpoint of every model whose pool is predicted to scale up in the page
        cache, so the TE that scale-up starts loads from memory, not disk. Predicted: the pool can grow
        (below its max) and its load rose over the last `TREND_WINDOW_S`, or it waits at zero."""
        if self.preloader is None:
            return
        for pool, spec in self.specs.items():
            tes = self._pool_tes(pool)
            load = sum(te.heartbeat.stats.num_running + te.heartbeat.stats.num_waiting for te in tes
                       if te.heartbeat is not None) + self._held(pool)
            history = self._load_history[pool]
            history.append((now, load))
            while history and now - history[0][0] > TREND_WINDOW_S:
                history.popleft()
            can_grow = self.targets[pool] < spec.bounds[1]
            rising = len(history) > 1 and history[-1][1] > history[0][1]
            at_zero = self.targets[pool] == 0
            if can_grow and (rising or at_zero or self._held(pool)):
                self.preloader.keep(self.configs[pool].model_config.model, now)

    def _held(self, pool: str) -> int:
        return sum(d.held for je in self.jes.values() if je.report is not None for d in je.report.groups
                   if d.group == pool)

    def _keep_warm_pool(self) -> None:
        """Keep `prewarm` pre-warmed TEs; a replacement waits while a scale-up is in flight (it would take
        the cores the starting TE needs)."""
        if self._pending_scale_ups:
            return
        for _ in range(self.deployment.prewarm - len(self.warm)):
            self._launch_warm()

    def _track_scale_ups(self) -> None:
        """Close each pending scale-up once every JE that reports has its TE registered (Scaler-Post)."""
        now_wall, now = time.time(), time.monotonic()
        reporting = [je.report for je in self.jes.values() if je.report is not None
                     and now - je.last_seen < REPORT_TIMEOUT_S]
        for name, scale_up in list(self._pending_scale_ups.items()):
            te = self.tes.get(name)
            if te is None or te.heartbeat is None or te.heartbeat.startup is None or not te.heartbeat.startup.ready:
                continue
            scale_up.timeline = te.heartbeat.startup
            if self.jes and not all(name in report.te_names for report in reporting) or \
                    (self.jes and not reporting):
                continue
            scale_up.registered_at = now_wall
            del self._pending_scale_ups[name]
            self.scale_ups.append(scale_up)
            steps = scale_up.steps()
            for step, seconds in steps.items():
                self._step_metric.labels(step, scale_up.process, scale_up.weights).observe(max(0.0, seconds))
            if steps:
                self._event(f"TE {name} serving {steps['total']:.2f} s after the decision (" + ", ".join(
                    f"{k} {v:.2f}" for k, v in steps.items() if k != "total") + ")")

    def _event(self, text: str) -> None:
        logger.info("%s", text)
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    def _save(self) -> None:
        procs = [*self.jes.values(), *self.tes.values(), *self.warm.values()]
        for p in procs:
            if p.handle is not None:
                p.record.handle = p.handle.record()
        self.state.processes = [p.record for p in procs]
        self.state.targets = dict(self.targets)
        self.state.next_index = dict(self.next_index)
        self._saved = save_state(self.state_dir, self.state, self._saved)  # every turn, written only on change

    # ------------------------------------------------------------------ views
    def status(self) -> ClusterStatus:
        now = time.monotonic()
        tes = []
        for te in sorted(self.tes.values(), key=lambda p: p.name):
            hb = te.heartbeat
            alive = te.handle is not None and te.handle.alive()
            state = ("dead" if not alive else "draining" if te.draining else "ready" if hb is not None
                     and hb.startup is not None and hb.startup.ready else "starting")
            stats = hb.stats if hb is not None else EngineStats()
            tes.append(TEStatus(
                name=te.name, group=self.specs[te.record.pool].group, role=self.specs[te.record.pool].role,
                state=state, pid=te.handle.pid if te.handle is not None else 0,
                host=te.handle.host if te.handle is not None else "", source=te.record.source,
                restarts=te.record.restarts, num_running=stats.num_running, num_waiting=stats.num_waiting,
                kv_usage=stats.kv_usage, uptime_s=now - te.started_mono))
        groups = [GroupStatus(group=spec.group, role=spec.role, current=len(self._pool_tes(pool)),
                                  target=self.targets[pool], min_count=spec.bounds[0], max_count=spec.bounds[1],
                                  reason=self.last_reason.get(pool, "")) for pool, spec in self.specs.items()]
        jes = [JEStatus(name=je.name, http_addr=self._http_addr(je),
                            pid=je.handle.pid if je.handle is not None else 0,
                            state="dead" if je.handle is None or not je.handle.alive() else
                            "ready" if je.report is not None else "starting") for je in self.jes.values()]
        return ClusterStatus(name=self.config.name, backend=self.backend.name, manager_pid=os.getpid(), tes=tes,
                                 groups=groups, jes=jes, warm=sum(1 for w in self.warm.values() if w.assign_addr),
                                 events=list(self.events))

    def wait_serving(self, timeout_s: float, alive=None) -> None:
        """Until every pool has its target TEs ready and registered with every JE; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            ready = {pool: sum(1 for te in self._pool_tes(pool) if te.name not in self._pending_scale_ups
                               and te.heartbeat is not None) for pool in self.specs}
            jes_ready = all(je.report is not None for je in self.jes.values())
            if jes_ready and all(ready[pool] >= self.targets[pool] for pool in self.specs):
                return
            if self._stop.is_set():
                raise RuntimeError("stopped before the deployment served")
            if time.monotonic() > deadline:
                missing = ", ".join(f"{pool} {ready[pool]}/{self.targets[pool]}" for pool in self.specs)
                raise TimeoutError(f"deployment not serving after {timeout_s:.0f} s (TEs ready: {missing}; "
                                   f"logs in {self.state_dir / 'logs'})")
            if alive is not None:
                alive()
            time.sleep(TICK_S)

    # ------------------------------------------------------------------ stopping
    def close(self) -> None:
        """Leave the deployment running (a manager that stops alone); release sockets and the backend."""
        for sock in (self.register, self.control):
            if sock is not None:
                sock.close(0)
        self.ctx.term()
        self.backend.close()

    def down(self, grace_s: float = 15.0) -> None:
        """Stop every process of the deployment and forget it (the state file goes)."""
        with self._lock:
            procs = [*self.tes.values(), *self.warm.values(), *self.jes.values()]
            for p in procs:
                if p.handle is not None:
                    p.handle.stop()
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(p.handle is not None and p.handle.alive() for p in procs):
                time.sleep(0.1)
            for p in procs:
                if p.handle is not None and p.handle.alive():
                    p.handle.kill()
            remove_all = getattr(self.backend, "remove_all", None)
            if remove_all is not None:
                remove_all()
            self.tes.clear(), self.warm.clear(), self.jes.clear()
            state_file = self.state_dir / "state.json"
            state_file.unlink(missing_ok=True)
            self._event("deployment stopped")


@contextlib.contextmanager
def serving_in_background(manager: ClusterManager, timeout_s: float = 600.0):
    """Start the manager's deployment, wait until it serves, run the manager's loop on a thread; on exit stop
    the loop and take down everything it started (benchmarks and tests)."""
    loop = None
    try:
        manager.start()
        manager.wait_serving(timeout_s)
        loop = threading.Thread(target=manager.run, name="cluster-manager", daemon=True)
        loop.start()
        yield manager
    finally:
        manager.stop()
        if loop is not None:
            loop.join(10)
        manager.down()
        manager.close()


def run_manager(deployment: str, model: str, state_dir: str, cluster: dict[str, Any] | None = None,
                engine_overrides: dict | None = None, log_level: int = logging.INFO, server: dict | None = None,
                ready_file: str | None = None) -> None:
    """`meshserve cluster up` (also run as its own process with `--detach`): start or take over the
    deployment and manage it until SIGTERM/SIGINT (which stop the deployment) or `cluster down`.
    `cluster`: the ClusterConfig settings (by name; the rest keep their defaults)."""
    # start-up: the deployment loader only here
    from meshserve.router.deployment import load_multi

    logging.basicConfig(level=log_level, format="%(asctime)s manager %(levelname)s %(message)s", force=True)
    config = ClusterConfig.from_dict(cluster or {})
    spec = load_multi(deployment)
    backend_impl = make_backend(config.backend, Path(state_dir) / "logs", host=config.host,
                                ray_address=config.ray_address, namespace=f"meshserve-{config.name}")
    manager = ClusterManager(spec, deployment, model, backend_impl, state_dir, config,
                             engine_overrides=engine_overrides, log_level=log_level, server=server)

    def on_signal(signum, frame):
        manager.down_requested = True
        manager.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    taking_over = load_state(state_dir) is not None
    try:
        try:
            manager.start()
            timeout = max((c.parallel_config.startup_timeout_s for c in manager.configs.values()), default=0) + 60
            manager.wait_serving(timeout)
        except BaseException:
            # a deployment that never served is stopped again; one taken over keeps running
            manager.down_requested |= not taking_over and manager.state is not None
            raise
        logger.info("serving %s on %s (manager: %s, status: `meshserve status --state-dir %s`)", model,
                    ", ".join(manager.http_addrs()), manager.control_addr, state_dir)
        if ready_file:
            Path(ready_file).write_text(" ".join(manager.http_addrs()))
        manager.run()
    finally:
        if manager.down_requested:
            manager.down()
        manager.close()
