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

Capacity and kill-P-to-preserve-D (xdeepserve §6.2, stage 2, `capacity.py`): a deployment may give `devices: N`,
the ranks its TEs may hold at once; a dead decode TE that does not fit has prefill TEs stopped to free devices. Each
such decision is an event and counts in `meshserve_cluster_prefill_stopped_for_decode_total`.

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

import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import zmq

from meshserve.cluster.backends import Backend, ProcessResources
from meshserve.cluster.capacity import DeviceCapacity
from meshserve.cluster.dram_preload import DramPreloader
from meshserve.cluster.managed import ManagedProcess, ScaleUp
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
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole
from meshserve.wire.receive import drop_frame, recv_message

logger = logging.getLogger(__name__)

TICK_S = 0.2
REPORT_TIMEOUT_S = 5.0  # a JE whose reports stop this long no longer counts for Scaler-Post
RESTART_BACKOFF_S = (0.0, 1.0, 5.0, 15.0, 60.0)  # after 0, 1, 2, ... quick deaths in a row
QUICK_DEATH_S = 30.0  # a process that dies sooner than this after its start counts as a quick death
MAX_EVENTS = 50




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
        self.tes: dict[str, ManagedProcess] = {}
        self.jes: dict[str, ManagedProcess] = {}
        self.warm: dict[str, ManagedProcess] = {}
        self.targets: dict[str, int] = {pool: spec.count for pool, spec in self.specs.items()}
        self.next_index: dict[str, int] = {}
        self.scale_ups: list[ScaleUp] = []
        self._pending_scale_ups: dict[str, ScaleUp] = {}  # TE name -> its scale-up, until registered
        self.events: deque[str] = deque(maxlen=MAX_EVENTS)
        self.last_reason: dict[str, str] = {}
        self.capacity = DeviceCapacity(self, deployment.devices)  # the devices the TEs may hold now
        self.autoscaler = None  # built in start() when the deployment asks for scaling (and `config.autoscale`)
        self.preloader = DramPreloader() if config.preload else None
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

    def _http_addr(self, je: ManagedProcess) -> str:
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
        self.prefill_stopped_metric = Counter(
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
            proc = ManagedProcess(record, handle)
            if handle is None:
                gone += 1
                self.event(f"{record.kind} {record.name} is gone since the last manager: "
                            + ("restarting it" if record.kind != "warm-te" else "dropped"))
                if record.kind == "warm-te":
                    continue
            else:
                kept += 1
            {"te": self.tes, "frontend": self.jes, "warm-te": self.warm}[record.kind][record.name] = proc
        self.event(f"took over the deployment: {kept} process(es) still running, {gone} gone")

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
        self.jes[name] = ManagedProcess(ProcessRecord("frontend", name, handle.record(), port=port,
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

    def _idle_warm(self) -> ManagedProcess | None:
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
        self.tes[name] = ManagedProcess(record, handle)
        scale_up = ScaleUp(name, pool, "prewarmed" if warm is not None else "cold", "fork" if fork else "checkpoint",
                           reason, decided_at, launched_at=time.time())
        self._pending_scale_ups[name] = scale_up
        self.event(f"{'restart' if restarts else 'start'} TE {name} ({source}): {reason}")
        return scale_up

    def _launch_warm(self) -> None:
        index = self.next_index.get("warm", 0)
        self.next_index["warm"] = index + 1
        name = f"warm-{index}"
        handle = self.backend.launch("warm-te", name, dict(
            name=name, manager_addr=self.register_addr, host=self.backend.advertise_host(),
            num_workers=self.warm_workers, log_level=self.log_level),
            ProcessResources(num_ranks=self.warm_workers))
        record = ProcessRecord("warm-te", name, handle.record(), started_at=time.time())
        self.warm[name] = ManagedProcess(record, handle)

    def drain(self, te: ManagedProcess, reason: str) -> None:
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
        self.event(f"drain TE {te.name}: {reason}")

    # ------------------------------------------------------------------ the loop
    def _pool_tes(self, pool: str, include_draining: bool = False) -> list[ManagedProcess]:
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
                self.event("asked to stop the deployment")
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
        self.event(f"scale {query.pool} to {query.target}: asked by an operator")
        return self.status()

    # ------------------------------------------------------------------ capacity (kill-P-to-preserve-D)
    def set_capacity(self, devices: int | None, reason: str = "asked") -> None:
        """The devices the deployment's TEs may hold from now on (None: no limit); what runs keeps running."""
        with self._lock:
            self.capacity.set(devices, reason)

    def _operator_capacity(self, query: ClusterQuery) -> ClusterStatus:
        if query.target < 1:
            return ClusterStatus(name=self.config.name, backend=self.backend.name, manager_pid=os.getpid(), ok=False,
                                 error=f"capacity must be at least 1 device, not {query.target}")
        self.set_capacity(query.target, "asked by an operator")
        return self.status()

    def _heal_te(self, te: ManagedProcess, now: float) -> None:
        """One TE's turn: forget it if it drained, kill it if it hung, restart it (after a back-off when it keeps
        dying young) once it is dead and there is room."""
        alive = te.handle is not None and te.handle.alive()
        if not alive and te.draining:
            self._forget_te(te)
            self.event(f"TE {te.name} drained and left")
            return
        hung = alive and te.heartbeat is not None and now - te.last_seen > self.config.heartbeat_timeout_s
        if hung:
            self.event(f"TE {te.name} sent no heartbeat for {now - te.last_seen:.0f} s: killing it")
            te.handle.kill()
        if alive and not hung:
            return
        if te.restart_at == 0.0:  # just found dead: decide when to restart it
            quick = time.monotonic() - te.started_mono < QUICK_DEATH_S
            te.quick_deaths = te.quick_deaths + 1 if quick else 0
            delay = RESTART_BACKOFF_S[min(te.quick_deaths, len(RESTART_BACKOFF_S) - 1)]
            te.restart_at = now + delay
            code = te.handle.exit_code() if te.handle is not None else None
            self.event(f"TE {te.name} died" + (f" (exit code {code})" if code is not None else "")
                        + (f"; restarting in {delay:.0f} s" if delay else "; restarting"))
        if now < te.restart_at or not self.capacity.room_to_restart(te):
            return  # a restart without room waits for devices (a decode TE has a prefill TE's freed for it)
        self._forget_te(te)
        self._restarts_metric.labels("te").inc()
        self._scale_up(te.record.pool, "restart after a failure", name=te.name, restarts=te.record.restarts + 1)
        self.tes[te.name].quick_deaths = te.quick_deaths

    def _forget_te(self, te: ManagedProcess) -> None:
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
            self.event(f"JE {je.name} died: restarting it on port {je.record.port}")
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
                self.event(f"scale {decision.key} to {decision.target}: {decision.reason}")

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
                if not self.capacity.fits(pool, pool):
                    break
                self._scale_up(pool, self.last_reason.get(pool, "below target"))
            if len(tes) > want:
                # the least busy go first; a TE still starting goes before one that serves
                order = sorted(tes, key=lambda te: (te.heartbeat is not None, te.heartbeat.stats.num_running +
                                                    te.heartbeat.stats.num_waiting if te.heartbeat else 0))
                for te in order[:len(tes) - want]:
                    self.drain(te, self.last_reason.get(pool, "above target"))

    def _preload(self, now: float) -> None:
        """DRAM preload: keep the checkpoint of every model whose pool is predicted to scale up in the page cache,
        so the TE that scale-up starts loads from memory, not disk."""
        if self.preloader is None:
            return
        for pool, spec in self.specs.items():
            load = sum(te.heartbeat.stats.num_running + te.heartbeat.stats.num_waiting for te in self._pool_tes(pool)
                       if te.heartbeat is not None) + self._held(pool)
            if self.preloader.predicts_scale_up(pool, now, load, target=self.targets[pool], held=self._held(pool),
                                                most=spec.bounds[1]):
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
                self.event(f"TE {name} serving {steps['total']:.2f} s after the decision (" + ", ".join(
                    f"{k} {v:.2f}" for k, v in steps.items() if k != "total") + ")")

    def event(self, text: str) -> None:
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
            self.event("deployment stopped")
