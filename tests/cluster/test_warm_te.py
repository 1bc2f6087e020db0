"""A pre-warmed TE becomes the TE it is handed (its spare worker takes rank 0, a new process the other rank),
reports its start-up steps, serves, and on a drain finishes its running request before it leaves."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from meshserve.cluster.backends import LocalBackend
from meshserve.config import EngineConfig
from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.client import AddRequest, AdminOp, AdminRequest, EngineOutputs
from meshserve.wire.cluster import WarmAssign, WarmReady
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole
from meshserve.wire.sampling_params import SamplingParams

TIMEOUT_S = 120.0


def _next(sock: zmq.Socket, kind: type, timeout_s: float = TIMEOUT_S, where=lambda item: True):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(200):
            item = codec.decode(sock.recv())
            if isinstance(item, kind) and where(item):
                return item
    raise AssertionError(f"no {kind.__name__} within {timeout_s:.0f} s")


@pytest.fixture
def inbox():
    ctx = zmq.Context()
    sock = cluster_auth.server(ctx.socket(zmq.PULL))
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}", ctx
    sock.close(0)
    ctx.term()


def test_a_warm_te_becomes_a_two_rank_te_serves_and_drains(inbox, tiny_model, tmp_path):
    sock, addr, ctx = inbox
    model = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    handle = LocalBackend(tmp_path / "logs").launch("warm-te", "warm-0", dict(
        name="warm-0", manager_addr=addr, num_workers=1, log_level=20))
    try:
        ready = _next(sock, WarmReady)
        assert ready.pid == handle.pid and ready.num_workers == 1
        config = EngineConfig.from_kwargs(str(model), te_name="te-warm", num_kv_blocks=64, num_threads=1,
                                          serve_weights=True, parallel="attn=TP1+DP2 moe=TP1+EP2")
        assign = cluster_auth.client(ctx.socket(zmq.PUSH), ready.assign_addr)
        assign.setsockopt(zmq.LINGER, 1000)
        assign.connect(ready.assign_addr)
        assigned_at = time.time()
        assign.send(codec.encode(WarmAssign(config=config, role=EngineRole.COLOCATED, group="main",
                                              listen="tcp://127.0.0.1:0", register=[addr], assigned_at=assigned_at)))
        assign.close()
        beat = _next(sock, EngineHeartbeat)
        assert beat.pid == handle.pid and beat.attn_dp == 2  # the warm process is the TE's master now
        t = beat.startup
        assert t.prewarmed and t.process_start == assigned_at
        assert assigned_at <= t.load_start <= t.load_end <= t.ready
        assert t.pre_load_parts(assigned_at) == {}  # its process, imports and ranks were there before the TE
        assert t.load_source in ("disk", "page-cache") and t.load_bytes > 0
        # every rank serves its weights for forks once its snapshot (written in the background) is whole
        served = _next(sock, EngineHeartbeat, where=lambda hb: bool(hb.weights_addrs))
        assert len(served.weights_addrs) == 2 and len(set(served.weights_addrs)) == 2

        # a long request runs; a drain lets it finish, then the TE leaves
        te = cluster_auth.client(ctx.socket(zmq.PUSH), beat.input_addr)
        te.setsockopt(zmq.LINGER, 1000)
        te.connect(beat.input_addr)
        te.send(codec.encode(AddRequest(req_id="long", prompt_token_ids=[5, 6, 7, 8],
                                          sampling_params=SamplingParams(temperature=0.0, max_tokens=200,
                                                                         ignore_eos=True),
                                          arrival_time=time.time(), reply_to=addr)))
        _next(sock, EngineOutputs, where=lambda out: any(d.new_token_ids for d in out.deltas))
        te.send(codec.encode(AdminRequest(query_id=0, op=AdminOp.DRAIN)))
        tokens, finished, saw_draining = 0, None, False
        deadline = time.monotonic() + TIMEOUT_S
        while finished is None and time.monotonic() < deadline:
            if not sock.poll(200):
                continue
            item = codec.decode(sock.recv())
            if isinstance(item, EngineHeartbeat):
                saw_draining |= item.draining
            elif isinstance(item, EngineOutputs):
                for delta in item.deltas:
                    tokens += len(delta.new_token_ids)
                    finished = delta.finish_reason or finished
        assert finished == "length"
        _next(sock, EngineHeartbeat, where=lambda hb: hb.leaving)
        assert saw_draining
        deadline = time.monotonic() + 30
        while handle.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not handle.alive() and handle.exit_code() == 0
        te.close(0)
    finally:
        handle.kill()


def test_a_spare_whose_warm_te_died_before_it_started_ends(tmp_path):
    """The warm TE that launched a spare can be gone before the spare first asks for its parent (a manager
    stopped during preload): the spare knows the launcher's pid and ends instead of waiting forever."""
    from meshserve.utils.processes import launch, stop_process

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    proc = launch("warm-worker", assign_addr=f"ipc://{tmp_path}/spare", ready_addr=f"ipc://{tmp_path}/ready",
                  log_level=30, parent_pid=gone.pid)
    try:
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        stop_process(proc, grace_s=0)
