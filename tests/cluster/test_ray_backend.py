"""The Ray backend on a Ray cluster of this machine: a TE runs as a detached actor's process, heartbeats, dies
by kill -9 and is started again, outlives the manager's driver and is adopted by the next one, dies with its
actor, and everything of the namespace is removed at the end.

The module starts its own Ray head (`ray start --head --block` on 127.0.0.1, in a private temp dir) and
ends it, and every process under it, whatever the tests did."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
import ray
import zmq

from meshserve.cluster.backends import ProcessResources
from meshserve.cluster.ray_backend import RayBackend
from meshserve.config import EngineConfig
from meshserve.utils import cluster_auth
from meshserve.utils.processes import process_tree
from meshserve.wire import codec
from meshserve.wire.heartbeat import EngineHeartbeat

pytestmark = pytest.mark.slow

NAMESPACE = "meshserve-test"
HEAD_START_S = 60.0
TE_START_S = 120.0
GONE_S = 30.0


@pytest.fixture(scope="module")
def heartbeats():
    """A job executor's registration socket, as far as TEs see it: it collects their EngineHeartbeats."""
    ctx = zmq.Context()
    sock = cluster_auth.server(ctx.socket(zmq.PULL))
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(0)
    ctx.term()


def _te_kwargs(model: str, register: str) -> dict:
    config = EngineConfig.from_kwargs(model, num_threads=1, te_name="ray-te")
    return {"config": config.to_dict(), "role": "colocated", "group": "colocated", "listen": "tcp://127.0.0.1:0",
            "register": [register], "log_level": 20, "watch_parent": False}


def _wait_heartbeat(sock, pid: int) -> EngineHeartbeat:
    deadline = time.monotonic() + TE_START_S
    while time.monotonic() < deadline:
        if sock.poll(500):
            beat = codec.decode(sock.recv())
            if isinstance(beat, EngineHeartbeat) and beat.pid == pid and not beat.leaving:
                return beat
    raise AssertionError(f"no heartbeat from the TE (pid {pid}) within {TE_START_S:.0f}s")


def _wait_until(check, what: str, timeout_s: float = GONE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} after {timeout_s:.0f}s"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(pids: list[int]) -> bool:
    return not any(_running(pid) for pid in pids)


def test_a_te_lives_dies_restarts_and_is_adopted_through_ray(ray_address, heartbeats, tiny_model, tmp_path):
    model = str(tiny_model("deepseek_v3", seed=0))
    heartbeats, register_addr = heartbeats
    kwargs = _te_kwargs(model, register_addr)
    resources = ProcessResources(num_ranks=1, cpus_per_rank=1.0)
    backend = RayBackend(address=ray_address, namespace=NAMESPACE, log_dir=tmp_path)
    try:
        handle = backend.launch("te", "te-0", kwargs, resources)
        assert handle.host == backend.advertise_host() and handle.alive()
        assert _wait_heartbeat(heartbeats, handle.pid).name == "ray-te"
        ranks = [child.pid for child in psutil.Process(handle.pid).children()]
        assert ranks, "the TE started no worker process"

        # the operator's kill -9: the actor stays and reports the process dead, its ranks follow it
        handle.kill()
        _wait_until(lambda: not handle.alive(), "the killed TE still counts as alive")
        assert handle.exit_code() == -signal.SIGKILL
        _wait_until(lambda: _gone(ranks), "the killed TE's ranks still run")

        # the manager restarts it under the same name
        handle = backend.launch("te", "te-0", kwargs, resources)
        _wait_heartbeat(heartbeats, handle.pid)
        record = handle.record()
        assert record["backend"] == "ray" and record["pid"] == handle.pid
    finally:
        backend.close()  # the manager's driver ends; the detached actor and its TE keep running

    backend = RayBackend(address=ray_address, namespace=NAMESPACE, log_dir=tmp_path)
    try:
        adopted = backend.adopt(record)
        assert adopted is not None and adopted.alive() and adopted.pid == record["pid"]
        _wait_heartbeat(heartbeats, adopted.pid)  # it kept serving while no manager ran

        # killing the actor kills its process tree
        tree = [adopted.pid] + [child.pid for child in process_tree(adopted.pid)]
        ray.kill(adopted.actor, no_restart=True)
        _wait_until(lambda: _gone(tree), "a TE outlived its actor")
        _wait_until(lambda: not adopted.alive(), "a TE whose actor was killed still counts as alive")
        assert backend.adopt(record) is None

        backend.launch("te", "te-1", kwargs, resources)
        assert "te-1" in backend.remove_all(grace_s=2.0)
        assert ray.util.list_named_actors() == []
    finally:
        backend.close()


@pytest.mark.parametrize("dp_groups", ["lockstep", "self-contained"])
def test_a_te_larger_than_a_node_spans_two_nodes_with_a_rank_actor(heartbeats, tiny_model, tmp_path, dp_groups):
    """Two Ray nodes of one core each (two raylets on this machine): a TE of two ranks gets a PACK placement
    group over both; rank 1 runs as a rank actor on the other node and joins the master over TCP (a self-contained
    TE's shell sends it on to its group's master)."""
    from ray.cluster_utils import Cluster

    heartbeats, register_addr = heartbeats
    model = str(tiny_model("deepseek_v3", seed=0))
    config = EngineConfig.from_kwargs(model, num_threads=1, te_name="wide-te", parallel="attn=TP1+DP2 moe=TP1+EP2",
                                      dp_groups=dp_groups)
    kwargs = {**_te_kwargs(model, register_addr), "config": config.to_dict()}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 1024**2})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=80 * 1024**2)
        cluster.wait_for_nodes()
        ray.shutdown()  # the cluster's own driver: the backend connects as the manager would
        backend = RayBackend(address=cluster.address, namespace=NAMESPACE, log_dir=tmp_path)
        try:
            handle = backend.launch("te", "wide", kwargs, ProcessResources(num_ranks=2, cpus_per_rank=1.0))
            assert handle.record()["rank_actors"] == ["wide.rank1"]
            beat = _wait_heartbeat(heartbeats, handle.pid)
            assert beat.attn_dp == 2
            assert "remote worker rank 1 joined" in Path(handle.log_path).read_text()
            assert backend.remove_all(grace_s=5.0) == ["wide"]
            assert ray.util.list_named_actors() == []
        finally:
            backend.close()
    finally:
        cluster.shutdown()
