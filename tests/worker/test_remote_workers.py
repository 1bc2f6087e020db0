"""A TE spanning "hosts": the master starts rank 0 and rank 1 joins on its own with
`meshserve worker --engine tcp://HOST:PORT --rank 1` (loopback here, as another host would).
Each case runs on both kinds of TE: one master in lockstep, and self-contained DP groups, whose
shell sends the rank on to its group's master and whose ranks agree on each step over TCP.

One world of each kind serves every case that leaves it healthy (same greedy tokens as the
single-rank engine, refused ranks); killing the remote rank comes last and ends it.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from meshserve import LLM, SamplingParams
from meshserve.config import EngineConfig
from meshserve.core.remote_ranks import JoinDirectory, RemoteRanks
from meshserve.utils import cluster_auth
from meshserve.utils.processes import launch, stop_process
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.client import EngineError
from meshserve.wire.worker import WorkerHandshake

PARALLEL = "attn=TP1+DP2 moe=TP1+EP2"
ENGINE_ARGS = dict(max_num_batched_tokens=64, block_size=8, max_num_seqs=8, num_kv_blocks=128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[101, 2000, 3000, 77, 5], list(range(200, 260)), [9, 8, 7], list(range(1000, 1033))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what the remote ranks count themselves on: a host of their own (a self-contained TE's step board then reaches them
# over TCP, as it reaches ranks of other hosts)
ANOTHER_HOST = {**os.environ, "MESHSERVE_HOST_ID": "another-host"}


def _worker_command(port: int, rank: int) -> list[str]:
    return [sys.executable, "-m", "meshserve.entrypoints.cli", "--log-level", "warning", "worker",
            "--engine", f"tcp://127.0.0.1:{port}", "--rank", str(rank), "--timeout", "60"]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("deepseek_v3", seed=3))


@pytest.fixture(scope="module")
def reference(model_dir):
    with LLM(model=model_dir, **ENGINE_ARGS) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=["lockstep", "self-contained"])
def remote_te(model_dir, tmp_path_factory, request):
    """(LLM, the remote rank's process, the master's port for remote ranks), for each way of running DP groups."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("remote") / "worker-1.log", "w")
    # started before the master on purpose: a rank waits for its master to come up
    remote = subprocess.Popen(_worker_command(port, 1), env=ANOTHER_HOST, stdin=subprocess.DEVNULL, stdout=log,
                              stderr=log)
    try:
        llm = LLM(model=model_dir, **ENGINE_ARGS, parallel=PARALLEL, local_ranks=1, engine_port=port,
                  startup_timeout_s=60, dp_groups=request.param)
    except BaseException:
        _stop(remote)
        log.close()
        raise
    try:
        yield llm, remote, port
    finally:
        llm.shutdown()
        try:
            remote.wait(15)  # the master's Shutdown ends a live remote rank on its own
        finally:
            _stop(remote)
            log.close()


def test_remote_rank_gives_the_single_rank_tokens(remote_te, reference):
    llm, remote, _ = remote_te
    outs = llm.generate(PROMPTS, GREEDY)
    assert [out.outputs[0].token_ids for out in outs] == reference
    assert all(out.outputs[0].finish_reason == "length" for out in outs)
    assert remote.poll() is None


def test_wrong_ranks_are_refused_with_one_line(remote_te, reference):
    llm, remote, port = remote_te
    cases = {5: "rank 5 is outside this engine's world of 2 ranks (0..1)",
             0: "rank 0 is started by the engine itself; it expects remote rank(s) 1",
             1: "rank 1 has already joined this engine"}
    procs = {rank: subprocess.Popen(_worker_command(port, rank), env=ANOTHER_HOST, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in cases}
    try:
        for rank, expected in cases.items():
            _, err = procs[rank].communicate(timeout=60)
            assert procs[rank].returncode == 2
            lines = err.strip().splitlines()
            assert len(lines) == 1, err
            # a self-contained TE sends rank 1 on to its group's master, which finds it joined
            engine = f"tcp://127.0.0.1:{port}" if rank != 1 or llm.config.parallel_config.dp_groups == "lockstep" \
                else "tcp://127.0.0.1:"
            assert lines[0].startswith(f"meshserve: error: the engine at {engine}")
            assert f" refused rank {rank}: " in lines[0]
            assert lines[0].endswith(expected)
    finally:
        for proc in procs.values():
            _stop(proc)
    # the refusals left the engine as it was
    assert remote.poll() is None
    assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids == reference[0]


def test_a_killed_remote_rank_that_joins_again_is_recovered_with_no_token_lost(remote_te, tmp_path):
    """The remote rank is killed mid-generation; its host starts it again (as its supervisor would): the master
    restarts its ranks, the new remote rank joins, and the requests continue from their tokens so far."""
    llm, remote, port = remote_te
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    replacement = []

    def kill_and_rejoin():
        os.kill(remote.pid, signal.SIGKILL)
        remote.wait(10)
        log = open(tmp_path / "worker-1-again.log", "w")
        replacement.append(subprocess.Popen(_worker_command(port, 1), env=ANOTHER_HOST, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=log))

    recoveries = llm.get_stats().num_recoveries
    expected = [out.outputs[0].token_ids for out in llm.generate([[5, 6, 7], [8, 9, 10, 11]], long)]
    timer = threading.Timer(1.5, kill_and_rejoin)
    timer.start()
    try:
        outs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], long)
        assert [out.outputs[0].token_ids for out in outs] == expected
        assert remote.returncode == -signal.SIGKILL  # it was killed mid-generation, not finished
        stats = llm.get_stats()
        # lockstep: the master saw the rank go; self-contained: rank 0's step board saw its connection close
        assert stats.num_recoveries == recoveries + 1
        assert re.search(r"remote worker 1 disconnected|waiting for rank 1's row", stats.last_failure or "")
    finally:
        timer.cancel()
        timer.join()
        llm.shutdown()  # the module's engine ends here: its remote rank is the replacement
        for proc in replacement:
            _stop(proc)


@pytest.mark.parametrize("dp_groups", ["lockstep", "self-contained"])
def test_start_up_fails_naming_a_remote_rank_that_never_joins(model_dir, tmp_path, dp_groups):
    """The master's own verdict, read off its output socket (a client gives up on its own clock)."""
    config = EngineConfig.from_kwargs(model_dir, **ENGINE_ARGS, parallel=PARALLEL, local_ranks=1,
                                      engine_port=_free_port(), startup_timeout_s=3, dp_groups=dp_groups)
    ctx = zmq.Context()
    to_master, from_master = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_master.bind(f"ipc://{tmp_path}/input")
    from_master.bind(f"ipc://{tmp_path}/output")
    master = launch("master", config=config.to_dict(), input_addr=f"ipc://{tmp_path}/input",
                    output_addr=f"ipc://{tmp_path}/output", ipc_dir=str(tmp_path), log_level=logging.CRITICAL)
    try:
        assert from_master.poll(30_000), "the master said nothing"
        error = codec.decode(from_master.recv())
        assert isinstance(error, EngineError)
        assert "remote worker rank(s) [1] did not join within 3s" in error.message
        port = config.parallel_config.engine_port
        assert f"meshserve worker --engine tcp://127.0.0.1:{port} --rank R" in error.message
        assert master.wait(30) == 1  # it stopped its own rank 0 and exited
    finally:
        stop_process(master, grace_s=5)
        to_master.close(0)
        from_master.close(0)
        ctx.term()


def test_master_side_answers_strangers_and_notices_a_dropped_rank():
    """The handshake and liveness machinery alone, without processes: quick and deterministic."""
    config = EngineConfig.from_kwargs("unused", parallel=PARALLEL, local_ranks=1, engine_port=_free_port())
    ctx = zmq.Context()
    works = [ctx.socket(zmq.PUSH) for _ in range(2)]
    addrs = [f"tcp://127.0.0.1:{w.bind_to_random_port('tcp://127.0.0.1')}" for w in works]
    ranks = RemoteRanks(ctx, config, range(2), works, addrs, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2",
                        config.parallel_config.engine_port)
    peer = cluster_auth.client(ctx.socket(zmq.DEALER))
    peer.connect(ranks.endpoint)
    rank_work = ctx.socket(zmq.PULL)

    def ask(payload: bytes) -> WorkerHandshake:
        peer.send(payload)
        for _ in range(100):  # bounded: 5 s
            ranks.answer_handshakes()
            if peer.poll(50):
                return codec.decode(peer.recv())
        raise AssertionError("no answer")

    try:
        assert ask(b"not msgpack").error == "expected an WorkerHandshake message"
        assert ask(codec.encode(Shutdown())).error == "expected an WorkerHandshake message"
        assert ranks.missing() == [1]
        joined = ask(codec.encode(WorkerHandshake(rank=1)))
        assert joined.error is None and joined.work_addr == addrs[1] and joined.dist_init_method == "tcp://127.0.0.1:2"
        assert joined.config == config
        assert ranks.missing() == []
        # the same rank asking again from the same socket (it asks until answered) gets the same answer
        assert ask(codec.encode(WorkerHandshake(rank=1))) == joined
        rank_work.connect(joined.work_addr)
        for _ in range(100):
            ranks.lost_rank()
            if ranks.monitors[1].connected:
                break
            time.sleep(0.05)
        assert ranks.monitors[1].connected and ranks.lost_rank() is None
        rank_work.close(0)  # the rank's process goes away
        lost = None
        for _ in range(100):
            lost = ranks.lost_rank()
            if lost is not None:
                break
            time.sleep(0.05)
        assert lost == 1
        # a replacement that asks before the master has recovered is told to ask again, not refused
        again = ask(codec.encode(WorkerHandshake(rank=1)))
        assert again.retry and again.error == "rank 1 is being recovered" and again.config is None
    finally:
        ranks.close()
        for sock in (peer, rank_work, *works):
            sock.close(0)
        ctx.term()


def test_a_joining_rank_asks_again_until_the_master_answers():
    """A question the master never read (it closed its handshake socket to recover) is asked again; an answer
    that says `retry` is followed by another question, and the first real answer ends the wait."""
    from meshserve.worker.worker import _handshake

    ctx = zmq.Context()
    master = cluster_auth.server(ctx.socket(zmq.ROUTER), "tcp://127.0.0.1")
    port = master.bind_to_random_port("tcp://127.0.0.1")
    config = EngineConfig.from_kwargs("unused", parallel=PARALLEL, local_ranks=1)
    answers = [None, WorkerHandshake(rank=1, error="rank 1 is being recovered", retry=True),
               WorkerHandshake(rank=1, config=config, work_addr="tcp://127.0.0.1:9", result_addr="tcp://127.0.0.1:8")]
    asked = []

    def serve() -> None:
        for answer in answers:
            if not master.poll(20_000):
                return
            identity, payload = master.recv_multipart()
            asked.append(codec.decode(payload).rank)
            if answer is not None:  # the first question goes unanswered, as one a recovering master dropped
                master.send_multipart([identity, codec.encode(answer)])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        assignment = _handshake(f"tcp://127.0.0.1:{port}", 1, timeout_s=30)
        assert assignment.work_addr == "tcp://127.0.0.1:9" and assignment.config == config
        assert asked == [1, 1, 1]
    finally:
        server.join(30)
        master.close(0)
        ctx.term()


def test_a_self_contained_te_sends_each_remote_rank_on_to_its_groups_master():
    """The TE shell's join directory and a group master's handshake socket, without processes: a rank asking at
    the TE's engine port is sent on to its group's port and joins there; ranks no master takes are refused at the
    directory."""
    from meshserve.worker.worker import WorkerJoinError, _handshake

    config = EngineConfig.from_kwargs("unused", parallel="attn=TP1+DP4 moe=TP1+EP4", local_ranks=2,
                                      dp_groups="self-contained", engine_port=_free_port())
    ctx = zmq.Context()
    works = [ctx.socket(zmq.PUSH) for _ in range(1)]
    addrs = [f"tcp://127.0.0.1:{w.bind_to_random_port('tcp://127.0.0.1')}" for w in works]
    group_ports = {2: _free_port(), 3: _free_port()}
    directory = JoinDirectory(ctx, config.parallel_config, group_ports)
    group_two = RemoteRanks(ctx, config, range(2, 3), works, addrs, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2",
                            group_ports[2])
    endpoint = f"tcp://127.0.0.1:{config.parallel_config.engine_port}"
    answered: dict[int, object] = {}

    def join(rank: int) -> None:
        try:
            answered[rank] = _handshake(endpoint, rank, timeout_s=20)
        except WorkerJoinError as exc:
            answered[rank] = exc

    joiners = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in (2, 0, 7)]
    for thread in joiners:
        thread.start()
    try:
        for _ in range(400):  # bounded: 20 s
            directory.answer()
            group_two.answer_handshakes()
            if len(answered) == 3:
                break
            time.sleep(0.05)
        assignment = answered[2]
        assert isinstance(assignment, WorkerHandshake), assignment
        assert assignment.work_addr == addrs[0] and assignment.config == config
        assert group_two.missing() == []
        assert str(answered[0]).endswith("rank 0 is started by the engine itself; it expects remote rank(s) 2..3")
        assert str(answered[7]).endswith("rank 7 is outside this engine's world of 4 ranks (0..3)")
        assert str(answered[0]).startswith(f"the engine at {endpoint} refused rank 0")
    finally:
        for thread in joiners:
            thread.join(20)
        directory.close()
        group_two.close()
        for sock in works:
            sock.close(0)
        ctx.term()


def test_a_self_contained_group_with_one_rank_here_and_one_on_another_host(model_dir, reference, tmp_path):
    """attn=TP2+DP2: group 0's ranks 0-1 run here; group 1 has rank 2 here and rank 3 on "another host", which the
    shell sends on to group 1's master. Its attention TP spans the hosts; the tokens are the single rank's."""
    port = _free_port()
    log = open(tmp_path / "worker-3.log", "w")
    remote = subprocess.Popen(_worker_command(port, 3), env=ANOTHER_HOST, stdin=subprocess.DEVNULL, stdout=log,
                              stderr=log)
    try:
        with LLM(model=model_dir, **ENGINE_ARGS, parallel="attn=TP2+DP2 moe=TP2+EP2", local_ranks=3,
                 engine_port=port, startup_timeout_s=60, dp_groups="self-contained") as llm:
            outs = llm.generate(PROMPTS, GREEDY)
            assert [out.outputs[0].token_ids for out in outs] == reference
        remote.wait(15)  # the TE's shutdown ended it
    finally:
        _stop(remote)
        log.close()


def test_a_rank_on_another_host_that_rejoins_keeps_the_te_serving_through_a_failure_here(model_dir, tmp_path):
    """Self-contained DP2+EP2, rank 1 on "another host" under `meshserve worker --rejoin`: rank 0 (here) is
    killed mid-generation, the world restarts, rank 1's world ends with it and it joins the next one on its own;
    no token is lost. Once the TE stops, the rejoining rank finds no TE and stops too."""
    port = _free_port()
    log = open(tmp_path / "worker-1.log", "w")
    remote = subprocess.Popen([*_worker_command(port, 1), "--rejoin", "--rejoin-timeout", "5"], env=ANOTHER_HOST,
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    try:
        with LLM(model=model_dir, **ENGINE_ARGS, parallel=PARALLEL, local_ranks=1, engine_port=port,
                 startup_timeout_s=60, dp_groups="self-contained") as llm:
            expected = [out.outputs[0].token_ids for out in llm.generate(prompts, long)]
            llm.admin("fault.inject", {"fault": {"kind": "kill", "rank": 0, "after_steps": 6}})
            outs = llm.generate(prompts, long)
            assert [out.outputs[0].token_ids for out in outs] == expected
            assert llm.get_stats().num_recoveries == 1
        assert remote.wait(60) == 0  # the TE is gone: no world to join
    finally:
        _stop(remote)
        log.close()
    lines = (tmp_path / "worker-1.log").read_text()
    assert "rank 1's world 1 ended" in lines and "served 2 world(s)" in lines
