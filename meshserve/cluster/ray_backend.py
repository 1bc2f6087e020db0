"""The Ray backend of the cluster manager: each process is a detached, named Ray actor that runs it.

`RayBackend.launch` starts an actor named after the process, in the deployment's namespace and with
`lifetime="detached"`, so it outlives the manager's driver; the actor starts the meshserve process (the
same `python -m meshserve.utils.processes ...` command line as `LocalBackend`) as a subprocess on its
node, logging to `<log_dir>/<name>.log` there, and answers what the manager asks: pid, host (the node's
IP), running, exit code. A restarted manager finds the actor by name (`adopt`).

Placement. A TE (or a pre-warmed TE) gets a detached placement group with one bundle per rank
(`ProcessResources`): STRICT_PACK when all its ranks fit on one node, since the master starts its ranks
as its own children there. A TE larger than any node gets PACK instead: the ranks in the bundles on
bundle 0's node stay the master's children (`local_ranks`), and each bundle on another node gets a rank
actor running `meshserve worker --engine tcp://MASTER:PORT --rank R`, which joins the master over TCP
(`meshserve.core.remote_ranks`); the master's actor picks a free engine port on its node. Other
processes (job executors) get no placement group, only their cores.

Addresses. The manager cannot know on which node a process lands, so a loopback host in the process's
arguments (a TE's `listen` and `master_addr`, a warm TE's or frontend's `host`) becomes the node's IP
when that node is not this loopback address: a process on another node is never reachable on 127.0.0.1.

Lifetimes. The meshserve process runs in its own session and dies with its actor: the kernel sends it
SIGKILL when the actor's process ends (PR_SET_PDEATHSIG), as it does on `ray.kill`; its ranks see their
parent gone and exit, and the actor kills what is left of the process group as soon as it sees the
master dead. `ProcessHandle.kill` is the operator's kill -9 of the meshserve process only (the actor
stays and reports it dead, the manager restarts it); `stop` is SIGTERM (an orderly goodbye).

Secrets. Every process on every node must hold the cluster secret: the driver's secret and its other
MESHSERVE_* settings go to the actor as its process's environment (the actor's own environment is the
raylet's, not the manager's). Ray's own token authentication guards who can create actors.

Cheap watching. `alive()` runs every manager tick: it answers from the last status and keeps at most one
status call in flight per process, collected with a non-blocking `ray.wait`; a node that is gone turns
into "not alive" once its call fails (Ray's node health check) or stays unanswered for `_UNANSWERED_S`.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from meshserve.cluster.backends import Backend, ProcessHandle, ProcessResources, _command
from meshserve.utils import cluster_auth
from meshserve.utils.processes import free_tcp_port

logger = logging.getLogger(__name__)

_PLACED_KINDS = ("te", "warm-te")  # processes whose ranks get one placement bundle each
_STATUS_TTL_S = 0.25  # alive() answers from a status at most this old (the manager ticks every 0.2-0.5 s)
_UNANSWERED_S = 30.0  # a status call unanswered this long: the node is gone (Ray's own check is as slow)
_CALL_TIMEOUT_S = 10.0  # every blocking call to an actor or to Ray gives up after this
_PLACEMENT_TIMEOUT_S = 60.0  # a placement group not ready by then cannot be placed (too few free cores)
_STOP_GRACE_S = 10.0  # remove_all: seconds between SIGTERM and killing what still runs
_DEV_OBJECT_STORE_BYTES = 80 * 1024**2  # the development instance moves no objects: the smallest store Ray takes
_LOOPBACK = ("127.0.0.1", "localhost")
_PR_SET_PDEATHSIG = 1
_ONE_RANK = ProcessResources()


# ---------------------------------------------------------------------------------------------- the actor side
def _die_with_parent() -> Any:
    """A preexec_fn: the child gets SIGKILL when the process that started it ends (Linux; elsewhere: nothing).
    The libc function is looked up before the fork: the child only calls it."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent ended before the call: nothing would signal us now
            os._exit(1)

    return preexec


def _with_host(url: str, host: str) -> str:
    """`tcp://127.0.0.1:PORT` -> `tcp://HOST:PORT`; other addresses unchanged."""
    scheme, sep, rest = url.partition("://")
    old_host, colon, port = rest.rpartition(":")
    return f"{scheme}{sep}{host}{colon}{port}" if sep and colon and old_host in _LOOPBACK else url


def place_kwargs(kind: str, kwargs: dict[str, Any], node_ip: str, engine_port: int | None = None) -> dict[str, Any]:
    """The arguments of a process placed on the node `node_ip`: loopback hosts become the node's IP (and a TE
    with remote ranks listens for them on `engine_port`)."""
    kwargs = dict(kwargs)
    if node_ip not in _LOOPBACK:
        if kwargs.get("host") in _LOOPBACK:
            kwargs["host"] = node_ip
        if isinstance(kwargs.get("listen"), str):
            kwargs["listen"] = _with_host(kwargs["listen"], node_ip)
    config = kwargs.get("config")
    if kind == "te" and isinstance(config, dict):
        parallel = dict(config.get("parallel_config") or {})
        if node_ip not in _LOOPBACK and parallel.get("master_addr", "127.0.0.1") in _LOOPBACK:
            parallel["master_addr"] = node_ip
        if engine_port is not None:
            parallel["engine_port"] = engine_port
        kwargs["config"] = {**config, "parallel_config": parallel}
    return kwargs


class ProcessActor:
    """Runs one process on its node and reports on it. Its methods never block: the manager's driver waits."""

    def __init__(self, argv: list[str] | None, kind: str, kwargs: dict[str, Any], log_path: str,
                 env: dict[str, str], pick_engine_port: bool = False) -> None:
        self.node_ip = _node_ip() or ray.util.get_node_ip_address()
        self.engine_addr = ""
        if argv is None:  # a meshserve process of PROCESS_ENTRY_POINTS, placed on this node
            engine_port = free_tcp_port(self.node_ip) if pick_engine_port else None
            if engine_port is not None:
                self.engine_addr = f"tcp://{self.node_ip}:{engine_port}"
            argv = _command(kind, place_kwargs(kind, kwargs, self.node_ip, engine_port))
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "ab") as log:
            # its own session: a signal to the actor's process group does not reach it, and its ranks share
            # its process group, which `kill_tree` ends at once
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, **env},
                                         preexec_fn=_die_with_parent())
        self._reaped = False

    def status(self) -> dict[str, Any]:
        code = self.proc.poll()
        if code is not None and not self._reaped:
            self._reaped = True
            self.kill_tree()  # a master that died leaves no ranks behind
        return {"pid": self.proc.pid, "host": self.node_ip, "running": code is None, "exit_code": code,
                "log": self.log_path, "engine_addr": self.engine_addr}

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def kill_tree(self) -> None:
        """SIGKILL the process and every process of its group (its ranks)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)


def _node_ip() -> str | None:
    """The IP this process's Ray node was started with (`--node-ip-address`), as Ray's other nodes reach it."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return node.get("NodeManagerAddress")
    return None


_RemoteProcessActor = ray.remote(ProcessActor)


# ---------------------------------------------------------------------------------------------- the manager side
def _pg_name(name: str) -> str:
    return f"{name}.pg"


def _rank_actor_name(name: str, rank: int) -> str:
    return f"{name}.rank{rank}"


class RayHandle(ProcessHandle):
    """One process: its actor, the last status it reported, and at most one status call in flight."""

    def __init__(self, kind: str, name: str, actor: Any, status: dict[str, Any], namespace: str,
                 placement_group: str | None = None, rank_actors: list[str] | None = None) -> None:
        self.kind, self.name = kind, name
        self.actor, self.namespace = actor, namespace
        self.placement_group = placement_group
        self.rank_actors = list(rank_actors or [])
        self._status = status
        self._status_at = time.monotonic()
        self._poll: Any = None  # the status call in flight
        self._poll_since = 0.0
        self._actor_dead = False

    @property
    def pid(self) -> int:
        return int(self._status["pid"])

    @property
    def host(self) -> str:
        return str(self._status["host"])

    @property
    def log_path(self) -> str:
        return str(self._status.get("log", ""))

    def alive(self) -> bool:
        self._refresh()
        return not self._actor_dead and bool(self._status["running"])

    def exit_code(self) -> int | None:
        self._refresh()
        return self._status.get("exit_code")

    def _refresh(self) -> None:
        if self._actor_dead:
            return
        now = time.monotonic()
        if self._poll is None:
            if now - self._status_at < _STATUS_TTL_S:
                return
            self._poll, self._poll_since = self.actor.status.remote(), now
        ready, _ = ray.wait([self._poll], timeout=0)
        if not ready:
            if now - self._poll_since > _UNANSWERED_S:
                logger.warning("%s: no answer from its actor on %s for %.0fs; counting it as gone", self.name,
                               self.host, now - self._poll_since)
                self._actor_dead = True
            return
        poll, self._poll = self._poll, None
        try:
            self._status = ray.get(poll, timeout=0)
            self._status_at = now
        except ActorUnavailableError:
            pass  # a transient loss of the connection (Ray retries it); ask again next time
        except RayActorError:
            self._actor_dead = True  # the actor, and with it the process, is gone (killed, or its node died)

    def _call(self, method: str, *args: Any) -> None:
        try:
            ray.get(getattr(self.actor, method).remote(*args), timeout=_CALL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            pass  # nothing left to signal, or a node that is gone
        self._status_at = 0.0  # the next alive() asks afresh

    def stop(self) -> None:
        self._call("signal", signal.SIGTERM)

    def kill(self) -> None:
        self._call("signal", signal.SIGKILL)

    def record(self) -> dict[str, Any]:
        return {"backend": "ray", "kind": self.kind, "name": self.name, "namespace": self.namespace,
                "pid": self._status["pid"], "host": self._status["host"], "log": self.log_path,
                "placement_group": self.placement_group, "rank_actors": self.rank_actors}


class RayBackend(Backend):
    """Processes as detached Ray actors in the namespace `namespace` of the Ray cluster at `address`
    (None: a Ray instance started in this process for development; it ends with this process)."""

    name = "ray"

    def __init__(self, address: str | None, namespace: str, log_dir: str | Path) -> None:
        self.namespace = namespace
        self.log_dir = Path(log_dir).absolute()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if address is None:
            # Ray reports usage statistics unless told not to; a developer's instance has nothing to report
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            logger.info("starting a local Ray instance for development (one node, no dashboard, %d MiB object store, "
                        "Ray's token authentication); its processes end with this one: for a cluster, "
                        "`ray start --head` and pass its address", _DEV_OBJECT_STORE_BYTES >> 20)
            # Ray replaces a loopback node address with the host's own; its token keeps others out
            ray.init(address="local", namespace=namespace, include_dashboard=False, _node_ip_address="127.0.0.1",
                     object_store_memory=_DEV_OBJECT_STORE_BYTES, log_to_driver=False, configure_logging=False)
        else:
            try:
                ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
            except ConnectionError as exc:
                raise ConnectionError(
                    f"cannot connect to the Ray cluster at {address}: {exc}. A cluster with token authentication "
                    f"(Ray's default once ~/.ray/auth_token exists where it started) needs RAY_AUTH_MODE=token and "
                    f"its token (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) here too") from None
        self._host = _node_ip() or "127.0.0.1"
        logger.info("Ray backend: namespace %s, this node %s", namespace, self._host)

    # ------------------------------------------------------------------ interface
    def launch(self, kind: str, name: str, kwargs: dict[str, Any],
               resources: ProcessResources = _ONE_RANK) -> RayHandle:
        self.remove(name)  # a process restarted under its name replaces what is left of the old one
        log_path = str(self.log_dir / f"{name}.log")
        env = _process_env()
        if kind not in _PLACED_KINDS:
            actor = self._actor(name, resources.cpus_per_rank, None).remote(None, kind, kwargs, log_path, env)
            return RayHandle(kind, name, actor, self._first_status(name, actor), self.namespace)
        pg = self._placement_group(name, resources)
        try:
            bundle_nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
            remote_bundles = [b for b in range(resources.num_ranks) if bundle_nodes[b] != bundle_nodes[0]]
            if remote_bundles and kind == "te":
                # the ranks on bundle 0's node stay the master's children; the others join it over TCP
                local = resources.num_ranks - len(remote_bundles)
                config = kwargs["config"]
                kwargs = {**kwargs, "config": {**config, "parallel_config": {
                    **config.get("parallel_config", {}), "local_ranks": local}}}
            actor = self._actor(name, resources.cpus_per_rank, (pg, 0)).remote(
                None, kind, kwargs, log_path, env, bool(remote_bundles) and kind == "te")
            status = self._first_status(name, actor)
            rank_actors = []
            if remote_bundles and kind == "te":
                for rank, bundle in enumerate(remote_bundles, start=resources.num_ranks - len(remote_bundles)):
                    rank_name = _rank_actor_name(name, rank)
                    # --rejoin: the rank joins the TE's next world itself after a restart (the master cannot
                    # start a process on another node)
                    argv = [sys.executable, "-m", "meshserve.entrypoints.cli", "worker", "--engine",
                            status["engine_addr"], "--rank", str(rank), "--rejoin"]
                    rank_actor = self._actor(rank_name, resources.cpus_per_rank, (pg, bundle)).remote(
                        argv, "worker", {}, str(self.log_dir / f"{rank_name}.log"), env)
                    self._first_status(rank_name, rank_actor)
                    rank_actors.append(rank_name)
        except BaseException:
            self.remove(name)
            raise
        return RayHandle(kind, name, actor, status, self.namespace, _pg_name(name), rank_actors)

    def adopt(self, record: dict[str, Any]) -> RayHandle | None:
        name = record["name"]
        actor = self._get_actor(name)
        status = None
        if actor is not None:
            try:
                status = ray.get(actor.status.remote(), timeout=_CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                status = None
        if status is None or not status["running"]:
            self.remove(name)  # a dead actor or process: clear its name and its cores for the restart
            return None
        return RayHandle(record["kind"], name, actor, status, self.namespace, record.get("placement_group"),
                         record.get("rank_actors"))

    def advertise_host(self) -> str:
        return self._host

    def close(self) -> None:
        ray.shutdown()  # detached actors, and their processes, keep running

    # ------------------------------------------------------------------ removing
    def release(self, handle: ProcessHandle) -> None:
        """A process that ended leaves its actor reporting the exit; free the actor and its placement group."""
        self.remove(handle.name)

    def remove(self, name: str) -> None:
        """End the process `name` at once (its process tree, its rank actors) and free its placement group."""
        names = [name] + [n for n in self._named_actors() if n.startswith(f"{name}.rank")]
        for actor_name in names:
            actor = self._get_actor(actor_name)
            if actor is None:
                continue
            try:
                ray.get(actor.kill_tree.remote(), timeout=_CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                pass  # its death (PR_SET_PDEATHSIG) is the process's too
            ray.kill(actor, no_restart=True)
        try:
            remove_placement_group(ray.util.get_placement_group(_pg_name(name)))
        except ValueError:
            pass  # it had none
        # ray.kill returns before the name is free: a launch under the same name must wait for it
        deadline = time.monotonic() + _CALL_TIMEOUT_S
        while any(self._get_actor(n) is not None for n in names) and time.monotonic() < deadline:
            time.sleep(0.05)

    def remove_all(self, grace_s: float = _STOP_GRACE_S) -> list[str]:
        """`meshserve cluster down`: SIGTERM every process of this namespace, wait up to `grace_s` for them to
        stop in order, then remove every actor and placement group of the namespace. Returns the names."""
        names = [n for n in self._named_actors() if ".rank" not in n]
        handles = [h for h in (self.adopt({"kind": "", "name": n}) for n in names) if h is not None]
        for handle in handles:
            handle.stop()
        deadline = time.monotonic() + grace_s
        while any(h.alive() for h in handles) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in self._named_actors():
            self.remove(name)
        for pg_name in self._named_placement_groups():
            self.remove(pg_name.removesuffix(".pg"))
        return names

    # ------------------------------------------------------------------ helpers
    def _actor(self, name: str, num_cpus: float, bundle: tuple[PlacementGroup, int] | None) -> Any:
        strategy = (None if bundle is None else
                    PlacementGroupSchedulingStrategy(bundle[0], placement_group_bundle_index=bundle[1],
                                                     placement_group_capture_child_tasks=False))
        # max_restarts=0: the manager restarts what died (a new process, with its state file's knowledge)
        return _RemoteProcessActor.options(name=name, namespace=self.namespace, lifetime="detached",
                                           num_cpus=num_cpus, max_restarts=0, scheduling_strategy=strategy)

    def _first_status(self, name: str, actor: Any) -> dict[str, Any]:
        try:
            return ray.get(actor.status.remote(), timeout=_PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise RuntimeError(f"the Ray actor of {name} did not start within {_PLACEMENT_TIMEOUT_S:.0f}s "
                               f"(no node with {name}'s cores free?)") from None

    def _placement_group(self, name: str, resources: ProcessResources) -> PlacementGroup:
        bundles = [{"CPU": resources.cpus_per_rank}] * resources.num_ranks
        need = resources.num_ranks * resources.cpus_per_rank
        one_node = need <= self._largest_node_cpus()
        # detached: a placement group belongs to the driver that made it unless told otherwise
        pg = placement_group(bundles, strategy="STRICT_PACK" if one_node else "PACK", name=_pg_name(name),
                             lifetime="detached")
        if not pg.wait(timeout_seconds=_PLACEMENT_TIMEOUT_S):
            remove_placement_group(pg)
            raise RuntimeError(f"cannot place {name}: {resources.num_ranks} rank(s) of {resources.cpus_per_rank:g} "
                               f"core(s) ({'on one node' if one_node else 'over the nodes'}) are not free in the "
                               f"Ray cluster within {_PLACEMENT_TIMEOUT_S:.0f}s")
        return pg

    @staticmethod
    def _largest_node_cpus() -> float:
        return max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=0.0)

    def _get_actor(self, name: str) -> Any:
        try:
            return ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            return None

    @staticmethod
    def _named_actors() -> list[str]:
        return list(ray.util.list_named_actors())  # the names of this driver's namespace

    def _named_placement_groups(self) -> list[str]:
        # placement groups are named after their process; the namespace is the one their driver had
        return [pg["name"] for pg in ray.util.placement_group_table().values()
                if pg.get("name", "").endswith(".pg") and pg.get("state") != "REMOVED"
                and self._get_pg_in_namespace(pg["name"])]

    @staticmethod
    def _get_pg_in_namespace(pg_name: str) -> bool:
        try:
            ray.util.get_placement_group(pg_name)  # looks in this driver's namespace
            return True
        except ValueError:
            return False


def _process_env() -> dict[str, str]:
    """What a process needs of the manager's environment on any node: the cluster secret (resolved here, so a
    node without the secret file still holds it) and the other MESHSERVE_* settings (API keys, caches)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("MESHSERVE_")}
    env.pop(cluster_auth.ENV_SECRET_FILE, None)  # the secret itself replaces a path that may not exist there
    env[cluster_auth.ENV_SECRET] = cluster_auth.cluster_secret().decode()
    return env
