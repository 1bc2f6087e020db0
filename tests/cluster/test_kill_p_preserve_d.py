"""kill-P-to-preserve-D (xdeepserve §6.2): with a capacity in devices, a decode TE whose restart does not fit
has a prefill TE stopped to free its devices; never the last TE able to prefill; the prefill pool waits for
devices. First the policy on a backend of stand-in processes (every turn by hand), then end to end on the local
backend with the tiny model: a decode TE killed after a device was lost comes back in the prefill TE's place,
and the requests sent meanwhile complete (on the colocated TE)."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import pytest
import zmq

from meshserve.cluster.backends import Backend, ProcessHandle, ProcessResources
from meshserve.cluster.manager import ClusterManager
from meshserve.cluster.run import serving_in_background
from meshserve.config import ClusterConfig, ConfigError
from meshserve.router.deployment import MultiDeployment
from meshserve.utils import cluster_auth
from meshserve.utils.processes import free_tcp_port
from meshserve.wire import codec
from meshserve.wire.client import AdminOp
from meshserve.wire.cluster import ClusterQuery, ClusterStatus, TEStatus
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole
from tests.cluster.cluster_processes import kill9, wait_for

STOPPED_METRIC = "meshserve_cluster_prefill_stopped_for_decode_total"


# ---------------------------------------------------------------- the policy, on stand-in processes
class StandInHandle(ProcessHandle):
    """A process that runs until stopped or killed (a stop ends it at once)."""

    def __init__(self, kind: str, name: str, pid: int) -> None:
        self.kind, self.name, self._pid = kind, name, pid
        self.running, self.stopped = True, False

    def alive(self) -> bool:
        return self.running

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def host(self) -> str:
        return "localhost"

    def stop(self) -> None:
        self.running, self.stopped = False, True

    def kill(self) -> None:
        self.running = False

    def record(self) -> dict:
        return {"backend": "stand-in", "kind": self.kind, "name": self.name, "pid": self._pid}


class StandInBackend(Backend):
    name = "stand-in"

    def __init__(self) -> None:
        self.launched: list[StandInHandle] = []

    def launch(self, kind, name, kwargs, resources: ProcessResources | None = None) -> StandInHandle:
        handle = StandInHandle(kind, name, 10_000 + len(self.launched))
        self.launched.append(handle)
        return handle

    def adopt(self, record):
        return None

    def advertise_host(self) -> str:
        return "127.0.0.1"


def _deployment(devices: int | None, prefill: int = 1, decode: int = 1, colocated: int = 0) -> MultiDeployment:
    groups = [{"group": "pd", "role": "prefill", "count": prefill}, {"group": "pd", "role": "decode", "count": decode}]
    if colocated:
        groups.append({"group": "main", "role": "colocated", "count": colocated})
    return MultiDeployment.from_dict({"te_groups": groups, **({"devices": devices} if devices else {})})


@contextlib.contextmanager
def stand_in_manager(model: Path, tmp_path: Path, deployment: MultiDeployment):
    manager = ClusterManager(deployment, "test", str(model), StandInBackend(), tmp_path / "state",
                             ClusterConfig(port=free_tcp_port(), preload=False), log_level=30)
    try:
        manager.start()
        serve_all(manager)
        yield manager
    finally:
        manager.close()


def serve_all(manager: ClusterManager) -> None:
    """Every live TE sends a heartbeat now (it serves, idle unless told otherwise), started long enough ago that
    a death is no quick death (restarted at once, no backoff)."""
    now = time.monotonic()
    for te in manager.tes.values():
        te.started_mono = now - 60
        if te.handle.alive() and te.heartbeat is None:
            spec = manager.specs[te.record.pool]
            te.heartbeat = EngineHeartbeat(
                name=te.name, role=EngineRole(spec.role), group=spec.group, input_addr="tcp://127.0.0.1:1",
                kv_events_addr="tcp://127.0.0.1:2", model="m", max_model_len=64, block_size=16, attn_tp=1, attn_dp=1)
        te.last_seen = now


def te_of(manager: ClusterManager, role: str, alive: bool | None = True):
    return [te for te in manager.tes.values() if manager.specs[te.record.pool].role == role
            and (alive is None or te.handle.alive() == alive)]


def stopped_count(manager: ClusterManager) -> float:
    return manager.metrics.get_sample_value(STOPPED_METRIC) or 0.0


@pytest.fixture(scope="module")
def small_model(tiny_model):
    return tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})


def test_a_dead_decode_te_restarts_in_a_prefill_tes_place(small_model, tmp_path):
    with stand_in_manager(small_model, tmp_path, _deployment(devices=3, colocated=1)) as manager:
        [prefill], [decode] = te_of(manager, "prefill"), te_of(manager, "decode")
        manager.set_capacity(2, "a device was lost")
        decode.handle.kill()
        manager.step()
        # urgent (no other decode TE serves): the prefill TE is stopped at once, not drained
        assert prefill.handle.stopped and not prefill.handle.alive()
        assert stopped_count(manager) == 1
        manager.step()  # the prefill TE is gone: the decode TE restarts on its devices
        [restarted] = te_of(manager, "decode")
        assert restarted.name == decode.name and restarted.record.restarts == 1
        assert not te_of(manager, "prefill")  # the prefill pool waits below its target
        manager.step()
        assert not te_of(manager, "prefill") and manager.targets["pd/prefill"] == 1
        events = "\n".join(manager.events)
        assert f"stop TE {prefill.name} at once: kill-P-to-preserve-D" in events
        assert "pd/prefill waits for devices" in events
        manager.set_capacity(3, "the device is back")
        manager.step()
        assert len(te_of(manager, "prefill")) == 1  # back once the devices are
        assert stopped_count(manager) == 1


def test_the_last_te_able_to_prefill_is_never_stopped(small_model, tmp_path):
    with stand_in_manager(small_model, tmp_path, _deployment(devices=2)) as manager:
        [prefill], [decode] = te_of(manager, "prefill"), te_of(manager, "decode")
        manager.set_capacity(1, "a device was lost")
        decode.handle.kill()
        for _ in range(3):
            manager.step()
        assert prefill.handle.alive() and not prefill.draining
        assert te_of(manager, "decode", alive=False) == [decode]  # waits for devices
        assert stopped_count(manager) == 0
        assert any("last TE able to prefill" in event for event in manager.events)


def test_a_decode_te_with_a_serving_peer_drains_the_least_loaded_prefill_te(small_model, tmp_path):
    with stand_in_manager(small_model, tmp_path, _deployment(devices=4, prefill=2, decode=2)) as manager:
        busy, idle = te_of(manager, "prefill")
        busy.heartbeat.stats.num_running = 5
        decode = te_of(manager, "decode")[0]
        inbox = cluster_auth.server(manager.ctx.socket(zmq.PULL))
        try:
            port = inbox.bind_to_random_port("tcp://127.0.0.1")
            idle.heartbeat.input_addr = f"tcp://127.0.0.1:{port}"
            manager.set_capacity(3, "a device was lost")
            decode.handle.kill()
            manager.step()
            # another decode TE serves: not urgent, the idle prefill TE drains (finishes its jobs), then leaves
            assert inbox.poll(10_000), "no drain request reached the idle prefill TE"
            assert codec.decode(inbox.recv()).op is AdminOp.DRAIN
        finally:
            inbox.close(0)
        assert idle.draining and idle.handle.alive() and not idle.handle.stopped
        assert busy.handle.alive() and not busy.draining
        assert manager.tes[decode.name] is decode  # waits for the drain to end
        assert any(f"drain TE {idle.name}: kill-P-to-preserve-D" in event for event in manager.events)
        idle.handle.kill()  # the drain ended
        manager.step()
        assert manager.tes[decode.name] is not decode and manager.tes[decode.name].handle.alive()
        assert stopped_count(manager) == 1


def test_without_a_capacity_nothing_is_stopped(small_model, tmp_path):
    with stand_in_manager(small_model, tmp_path, _deployment(devices=None)) as manager:
        [prefill], [decode] = te_of(manager, "prefill"), te_of(manager, "decode")
        decode.handle.kill()
        manager.step()
        assert prefill.handle.alive() and manager.tes[decode.name].handle.alive()
        assert stopped_count(manager) == 0


def test_a_deployment_larger_than_its_devices_is_refused(small_model, tmp_path):
    with pytest.raises(ConfigError, match="more than its 1 devices"):
        ClusterManager(_deployment(devices=1), "test", str(small_model), StandInBackend(), tmp_path / "state",
                       ClusterConfig(preload=False))
    with pytest.raises(ConfigError, match="devices must be a positive integer"):
        MultiDeployment.from_dict({"te_groups": [], "devices": 0})


# ---------------------------------------------------------------- end to end on the local backend
DEPLOYMENT = {
    "te_groups": [{"group": "pd", "role": "prefill", "count": 1}, {"group": "pd", "role": "decode", "count": 1},
                  {"group": "main", "role": "colocated", "count": 1}],
    "engine": {"num_kv_blocks": 64, "num_threads": 1}, "devices": 3,
}


@contextlib.contextmanager
def local_manager(model: Path, tmp_path: Path):
    # start-up: the local backend only for this test
    from meshserve.cluster.backends import LocalBackend

    state_dir = tmp_path / "state"
    manager = ClusterManager(MultiDeployment.from_dict(DEPLOYMENT), "test", str(model),
                             LocalBackend(state_dir / "logs"), state_dir,
                             ClusterConfig(port=free_tcp_port(), preload=False, hold_s=120.0), log_level=30)
    with serving_in_background(manager, 300):
        yield manager


def ask_capacity(manager: ClusterManager, devices: int) -> ClusterStatus:
    """The operator's way: a ClusterQuery on the manager's control socket."""
    ctx = zmq.Context()
    sock = cluster_auth.client(ctx.socket(zmq.DEALER), manager.control_addr)
    try:
        sock.connect(manager.control_addr)
        sock.send(codec.encode(ClusterQuery(op="capacity", target=devices)))
        assert sock.poll(10_000), "the manager did not answer"
        return codec.decode(sock.recv())
    finally:
        sock.close(0)
        ctx.term()


def te_status(manager: ClusterManager, role: str) -> list[TEStatus]:
    return [t for t in manager.status().tes if t.role == role]


def pd_group(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()["disaggregated"]["groups"].get("pd")


def complete(url: str, model: str, prompt: list[int]) -> httpx.Response:
    with httpx.Client(timeout=120) as client:
        return client.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                          "temperature": 0.0, "ignore_eos": True})


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_kill_p_to_preserve_d_on_the_local_backend(small_model, tmp_path):
    with local_manager(small_model, tmp_path) as manager:
        url, model = manager.http_addrs()[0], small_model.name
        [prefill], [decode] = te_status(manager, "prefill"), te_status(manager, "decode")
        assert complete(url, model, [5, 6, 7, 8]).status_code == 200
        refused = ask_capacity(manager, 0)
        assert not refused.ok and "at least 1 device" in refused.error
        assert ask_capacity(manager, 2).ok  # a device was lost: the decode TE's, once it dies
        kill9(decode.pid)
        # the manager stops the prefill TE at once (no decode TE serves), and the JE sees it leave
        wait_for(lambda: manager.metrics.get_sample_value(STOPPED_METRIC) == 1, 60, "the prefill TE stopped")
        wait_for(lambda: prefill.name not in pd_group(url)["prefill"], 60, "the prefill TE gone at the JE")
        # requests sent while the decode TE restarts: the colocated TE takes them (or they wait), all complete
        replies = [complete(url, model, [9 + i, 10, 11, 12]) for i in range(3)]
        assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in replies)
        back = wait_for(lambda: [t for t in te_status(manager, "decode") if t.state == "ready" and t.restarts == 1],
                        240, "the decode TE restarted and ready")
        assert back[0].name == decode.name and back[0].pid != decode.pid
        assert prefill.name not in {t.name for t in manager.status().tes if t.state != "dead"}
        assert manager.metrics.get_sample_value(STOPPED_METRIC) == 1
        events = "\n".join(manager.status().events)
        assert f"TE {prefill.name} at once: kill-P-to-preserve-D" in events, events
        assert complete(url, model, [13, 14, 15, 16]).status_code == 200
        # the device comes back: so does the prefill pool's TE
        assert ask_capacity(manager, 3).ok
        wait_for(lambda: [t for t in te_status(manager, "prefill") if t.state == "ready"], 240,
                 "a prefill TE back once the devices are")
