"""Iteration rollback (xdeepserve §6.2, token recomputation): a step that fails with a transient collective error
is rolled back and run again on every rank, without restarting anything; a step that keeps failing, or a rollback
the ranks cannot agree on, ends the worker and the master recovers the ranks.

In process, a one-rank runner whose model raises stands in for the failing collective; the worker loop's fault
hooks are wrapped around their targets only once a fault is armed. Then DP2+EP2 engines: a MoE dispatch failed by
an injected `collective_error` (MESHSERVE_FAULTS, and one rank's fault that its peer meets as a collective
timeout), the gloo connections between the two worker processes shut down from outside as a network glitch
would, and a step that keeps failing."""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import threading

import psutil
import pytest
import torch
import torch.distributed as dist
import zmq

from meshserve import LLM, SamplingParams
from meshserve.config import EngineConfig
from meshserve.moe import fault_hooks as moe_fault_hooks
from meshserve.moe.comm import EPDispatcher, HybridMoEComm
from meshserve.utils import faults
from meshserve.utils.faults import Fault, FaultKind, FaultSwitch
from meshserve.utils.gc_pauses import StepCollector
from meshserve.utils.processes import free_tcp_port, rank_processes
from meshserve.wire import codec
from meshserve.wire.base import Shutdown
from meshserve.wire.worker import (
    CachedRequestData,
    InjectFault,
    NewRequestData,
    SchedulerOutput,
    StepBatch,
    WorkerEventKind,
    WorkerPing,
    WorkerPong,
)
from meshserve.worker import fault_hooks, worker
from meshserve.worker.model_runner import MAX_STEP_ATTEMPTS, ModelRunner, StepRetriesExhausted

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9]
NUM_DECODES = 3


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2}))


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(EngineConfig.from_kwargs(model_dir, num_kv_blocks=16, block_size=16))


@pytest.fixture(autouse=True)
def no_process_faults(monkeypatch):
    """Each test arms its own faults in a switch of its own; the MoE dispatchers lose any hook it wrapped."""
    monkeypatch.setattr(faults, "_switch", FaultSwitch())
    for comm in (EPDispatcher, HybridMoEComm):
        monkeypatch.setattr(comm, "dispatch", comm.dispatch)


class FlakyModel:
    """The runner's model, raising a transient collective error on the given calls (after the forward, so
    the failed attempt has written the KV cache: the re-run must cope with that)."""

    def __init__(self, model, fail_calls) -> None:
        self.model = model
        self.fail_calls = fail_calls  # a set of 1-based call numbers, or None: every call
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        hidden = self.model(*args)
        if self.fail_calls is None or self.calls in self.fail_calls:
            raise dist.DistNetworkError(f"injected at call {self.calls}")
        return hidden

    def __getattr__(self, name):
        return getattr(self.model, name)


class _Steps:
    """Drives two requests (greedy, seeded) through a runner: their prefill, then one decode per step."""

    def __init__(self, runner: ModelRunner, prefix: str, first_block: int) -> None:
        self.runner = runner
        self.ids = [f"{prefix}-greedy", f"{prefix}-seeded"]
        self.blocks = [first_block, first_block + 1]
        self.step_id = 0

    def prefill(self) -> SchedulerOutput:
        self.step_id += 1
        new = [NewRequestData(req_id=req_id, token_ids=PROMPT, sampling_params=params, block_ids=[block],
                              num_computed_tokens=0, num_prompt_tokens=len(PROMPT))
               for req_id, params, block in zip(self.ids, (GREEDY, SEEDED), self.blocks)]
        return SchedulerOutput(step_id=self.step_id, new_reqs=new,
                               num_scheduled_tokens={req_id: len(PROMPT) for req_id in self.ids})

    def decode(self) -> SchedulerOutput:
        self.step_id += 1
        cached = [CachedRequestData(req_id, [], self.runner.requests[req_id].num_computed_tokens)
                  for req_id in self.ids]
        return SchedulerOutput(step_id=self.step_id, cached_reqs=cached,
                               num_scheduled_tokens=dict.fromkeys(self.ids, 1))

    def finish(self) -> None:
        self.runner.execute(SchedulerOutput(step_id=self.step_id + 1, finished_req_ids=self.ids))

    def tokens(self) -> list[list[int]]:
        return [self.runner.requests[req_id].output_token_ids for req_id in self.ids]


def _state(runner: ModelRunner, ids: list[str]) -> list[tuple]:
    return [(runner.requests[i].token_ids[:], runner.requests[i].block_ids[:], runner.requests[i].num_computed_tokens,
             runner.requests[i].draft_token_ids[:]) for i in ids]


def test_a_failed_step_is_rolled_back_and_run_again_with_the_same_tokens(runner, monkeypatch):
    reference = _Steps(runner, "ref", first_block=0)
    runner.execute_rolling_back(reference.prefill())
    for _ in range(NUM_DECODES):
        runner.execute_rolling_back(reference.decode())
    expected = reference.tokens()
    ref_generator = runner.requests[reference.ids[1]].generator.get_state()

    steps = _Steps(runner, "run", first_block=4)
    flaky = FlakyModel(runner.model, fail_calls={1, 3})  # the prefill and the first decode fail once each
    monkeypatch.setattr(runner, "model", flaky)
    rollbacks = runner.num_rollbacks
    runner.poll_background()
    outs = [runner.execute_rolling_back(steps.prefill())]
    outs += [runner.execute_rolling_back(steps.decode()) for _ in range(NUM_DECODES)]
    assert flaky.calls == 2 + 1 + NUM_DECODES  # two steps ran twice, the others once
    assert steps.tokens() == expected
    assert [out.sampled[steps.ids[0]] for out in outs] == [[t] for t in expected[0]]
    assert all(not out.failed for out in outs)
    # the seeded generator drew once per produced token: nothing on the failed attempts
    assert torch.equal(runner.requests[steps.ids[1]].generator.get_state(), ref_generator)
    assert runner.num_rollbacks == rollbacks + 2
    events = runner.poll_background()
    assert [kind for kind, _ in events] == [WorkerEventKind.ROLLED_BACK] * 2
    assert "step 1 attempt 1 of 3 failed (DistNetworkError" in events[0][1]
    assert "step 2 attempt 1 of 3" in events[1][1]
    reference.finish()
    steps.finish()


def test_a_failure_after_sampling_rewinds_the_tokens_and_the_seeded_generator(runner, monkeypatch):
    reference = _Steps(runner, "ref2", first_block=8)
    runner.execute_rolling_back(reference.prefill())
    runner.execute_rolling_back(reference.decode())
    expected, ref_generator = reference.tokens(), runner.requests[reference.ids[1]].generator.get_state()

    steps = _Steps(runner, "run2", first_block=12)
    runner.execute_rolling_back(steps.prefill())
    sample = runner._sample
    calls = []

    def sample_then_fail(logits, rows):
        out = sample(logits, rows)  # the generators have drawn
        calls.append(len(rows))
        if len(calls) == 1:
            raise dist.DistNetworkError("after sampling")
        return out

    monkeypatch.setattr(runner, "_sample", sample_then_fail)
    runner.execute_rolling_back(steps.decode())
    assert calls == [2, 2]
    assert steps.tokens() == expected
    assert torch.equal(runner.requests[steps.ids[1]].generator.get_state(), ref_generator)
    runner.poll_background()
    reference.finish()
    steps.finish()


def test_a_step_that_keeps_failing_gives_up_after_the_bounded_attempts(runner, monkeypatch):
    steps = _Steps(runner, "doomed", first_block=4)
    runner.execute_rolling_back(steps.prefill())
    before = _state(runner, steps.ids)
    known = set(runner.requests)
    flaky = FlakyModel(runner.model, fail_calls=None)
    monkeypatch.setattr(runner, "model", flaky)
    rollbacks = runner.num_rollbacks
    runner.poll_background()
    with pytest.raises(StepRetriesExhausted, match=f"failed {MAX_STEP_ATTEMPTS} times in a row") as info:
        runner.execute_rolling_back(steps.decode())
    assert isinstance(info.value.__cause__, dist.DistNetworkError)
    assert flaky.calls == MAX_STEP_ATTEMPTS
    assert runner.num_rollbacks == rollbacks + MAX_STEP_ATTEMPTS - 1
    assert len(runner.poll_background()) == MAX_STEP_ATTEMPTS - 1
    # the state is the one from before the step: the worker's error report names it, nothing is half-booked
    assert set(runner.requests) == known and _state(runner, steps.ids) == before
    monkeypatch.undo()
    steps.finish()


def test_other_errors_are_not_retried(runner, monkeypatch):
    steps = _Steps(runner, "broken", first_block=4)

    def broken(*args):
        raise RuntimeError("not transient")

    monkeypatch.setattr(runner, "model", broken)
    with pytest.raises(RuntimeError, match="not transient"):
        runner.execute_rolling_back(steps.prefill())
    assert runner.poll_background() == []
    monkeypatch.undo()
    steps.finish()


# ---------------------------------------------------------------- the MoE dispatch's fault hook
def test_an_injected_collective_error_fires_at_the_first_dispatch_of_its_step():
    hook = moe_fault_hooks.CollectiveFault(rank=0)
    faults.arm(Fault(kind=FaultKind.COLLECTIVE_ERROR, after_steps=1))
    hook.on_step()
    for _ in range(3):  # three MoE layers: one counted call
        hook.on_dispatch()
    hook.on_step()
    with pytest.raises(dist.DistNetworkError, match="rank 0"):  # what a broken link raises: a transient error
        hook.on_dispatch()
    hook.on_dispatch()  # the step's later layers do not fire again
    hook.on_step()
    hook.on_dispatch()  # fired its one time: disarmed
    assert not faults.switch().armed


def test_a_collective_error_for_another_rank_does_not_fire_here():
    faults.arm(Fault(kind=FaultKind.COLLECTIVE_ERROR, rank=1, times=0))
    here, there = moe_fault_hooks.CollectiveFault(rank=0), moe_fault_hooks.CollectiveFault(rank=1)
    for _ in range(3):
        here.on_step()
        here.on_dispatch()
    there.on_step()
    with pytest.raises(dist.DistNetworkError, match="rank 1"):
        there.on_dispatch()


# ---------------------------------------------------------------- the worker loop
class StepCounter:
    """Stands in for a rank's runner in its loop: counts the steps it is given."""

    background_busy = False
    background_wakeup = None

    def __init__(self) -> None:
        self.steps: list[int] = []

    def poll_background(self):
        return []

    def take_kv_connector_report(self):
        return None

    def run_batch(self, batch: StepBatch):
        self.steps.append(batch.per_dp[0].step_id)

    def execute(self, sched: SchedulerOutput):
        """One attempt at a step (what the collective_error hook marks)."""


def _serve(items: list, rank: int = 1, master_gone=lambda: False,
           collector: StepCollector | None = None) -> tuple[StepCounter, list]:
    """Run a rank's loop over `items` (then Shutdown); what it ran and what it sent back."""
    ctx = zmq.Context()
    sockets = {name: ctx.socket(kind) for name, kind in
               (("to_worker", zmq.PUSH), ("work", zmq.PULL), ("results", zmq.PUSH), ("from_worker", zmq.PULL))}
    try:
        sockets["work"].bind("inproc://work")
        sockets["to_worker"].connect("inproc://work")
        sockets["from_worker"].bind("inproc://results")
        sockets["results"].connect("inproc://results")
        for item in [*items, Shutdown()]:
            sockets["to_worker"].send(codec.encode(item))
        runner = StepCounter()
        worker._serve(rank, runner, sockets["work"], sockets["results"], master_gone=master_gone, collector=collector)
        sent = []
        while sockets["from_worker"].poll(100):
            sent.append(codec.decode(sockets["from_worker"].recv()))
        return runner, sent
    finally:
        for sock in sockets.values():
            sock.close(0)
        ctx.term()


def _step(step_id: int, collect_garbage: bool = False) -> StepBatch:
    return StepBatch(per_dp=[SchedulerOutput(step_id=step_id)], collect_garbage=collect_garbage)


def test_the_rank_collects_garbage_after_the_steps_the_master_marks(monkeypatch):
    """Only after marked steps, and after the step ran: every rank pauses at the same step index."""
    order = []
    ran = StepCounter.run_batch
    monkeypatch.setattr(StepCounter, "run_batch", lambda self, batch: order.append(ran(self, batch) or self.steps[-1]))
    collector = StepCollector(0)
    monkeypatch.setattr(collector, "collect", lambda: order.append("collect"))
    _serve([_step(1), _step(2, collect_garbage=True), WorkerPing(seq=1), _step(3), _step(4, True)], collector=collector)
    assert order == [1, 2, "collect", 3, 4, "collect"]


def test_the_loop_answers_pings_between_steps_and_arms_forwarded_faults():
    injected = Fault(kind=FaultKind.COLLECTIVE_ERROR, after_steps=5)
    runner, sent = _serve([_step(1), WorkerPing(seq=7), InjectFault(fault=injected), _step(2)])
    assert runner.steps == [1, 2]
    assert sent == [WorkerPong(rank=1, seq=7)]
    assert faults.fire(FaultKind.COLLECTIVE_ERROR) is None and faults.switch().armed  # armed, waiting its steps
    # arming it wrapped its hooks: the runner's attempt at a step and the MoE dispatchers
    assert "execute" in vars(runner) and "run_batch" not in vars(runner)
    assert all(hasattr(comm.dispatch, "__wrapped__") for comm in (EPDispatcher, HybridMoEComm))


def test_nothing_is_wrapped_while_no_fault_is_armed():
    runner, _ = _serve([_step(1), WorkerPing(seq=1), _step(2)])
    assert runner.steps == [1, 2]
    assert not {"run_batch", "execute"} & set(vars(runner))  # the class's own methods run, unwrapped
    assert not any(hasattr(comm.dispatch, "__wrapped__") for comm in (EPDispatcher, HybridMoEComm))


def test_a_stall_fires_before_its_step_then_the_rank_steps_on():
    faults.arm(Fault(kind=FaultKind.STALL, rank=1, after_steps=1, duration_s=0.05))
    runner, sent = _serve([_step(1), _step(2), WorkerPing(seq=1)])
    assert runner.steps == [1, 2] and sent == [WorkerPong(rank=1, seq=1)]
    assert [fault.kind for _, fault in faults.switch().fired] == [FaultKind.STALL]


def test_a_stalled_rank_leaves_once_its_master_is_gone(monkeypatch):
    faults.arm(Fault(kind=FaultKind.STALL, rank=1, duration_s=600))
    monkeypatch.setattr(fault_hooks, "_MASTER_CHECK_S", 0.005)
    answers = iter([False, False, True])
    assert fault_hooks.fire_step_faults(1, master_gone=lambda: next(answers)) is False
    assert next(answers, "asked three times") == "asked three times"
    assert fault_hooks.fire_step_faults(0, master_gone=lambda: True) is True  # not this rank's fault


def test_a_stalled_rank_ends_its_loop_once_its_master_is_gone(monkeypatch):
    faults.arm(Fault(kind=FaultKind.STALL, rank=1, duration_s=600))
    monkeypatch.setattr(fault_hooks, "_MASTER_CHECK_S", 0.005)
    with pytest.raises(SystemExit):
        _serve([_step(1), _step(2)], master_gone=lambda: True)


def test_a_kill_fault_kills_the_rank_at_once(monkeypatch):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    faults.arm(Fault(kind=FaultKind.KILL, rank=0, after_steps=1))
    fault_hooks.fire_step_faults(0, master_gone=lambda: False)
    assert killed == []
    fault_hooks.fire_step_faults(0, master_gone=lambda: False)
    assert killed == [(os.getpid(), signal.SIGKILL)]


# ---------------------------------------------------------------- a TE of two ranks (DP2 + EP2)
# no prefix caching: the clean run after the faulted one computes the same steps again
ENGINE_ARGS = dict(parallel="attn=TP1+DP2 moe=TP1+EP2", max_num_batched_tokens=64, block_size=8, max_num_seqs=8,
                   num_kv_blocks=64, enable_prefix_caching=False)
PROMPTS = [[100 + 7 * i for i in range(n)] for n in (5, 40, 17, 9)]
ROLLED_BACK_LINE = re.compile(r"worker\[(\d+)\] WARNING step (\d+) attempt 1 of 3 failed "
                              r"\(DistNetworkError: injected collective error")


def _worker_pids(master_pid: int) -> set[int]:
    return set(rank_processes(master_pid).values())


def _generate(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_a_collective_error_on_every_rank_rolls_one_step_back_without_a_restart(model_dir, monkeypatch, capfd):
    """The fault fires once, in the first run (its ranks' 4th step); the second run is the clean reference."""
    monkeypatch.setenv(faults.ENV, "collective_error:after_steps=3")
    with LLM(model=model_dir, **ENGINE_ARGS) as llm:
        pids = _worker_pids(llm.engine.proc.pid)
        faulted = _generate(llm)
        stats = llm.get_stats()
        clean = _generate(llm)
        assert llm.get_stats().num_rollbacks == 1
        assert _worker_pids(llm.engine.proc.pid) == pids and len(pids) == 2  # the same processes throughout
    assert faulted == clean
    assert all(len(t) == GREEDY.max_tokens for t in faulted)
    assert stats.healthy and stats.num_rollbacks == 1  # one rollback of the TE, though both ranks report it
    # each rank failed its 4th step once and ran it again: one rollback each, of the same step
    rolled_back = ROLLED_BACK_LINE.findall(capfd.readouterr().err)
    assert sorted(rank for rank, _ in rolled_back) == ["0", "1"]
    assert len({step for _, step in rolled_back}) == 1


# ---------------------------------------------------------------- real transient errors on a DP2 + EP2 TE
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
COLLECTIVE_TIMEOUT_S = 2.0
PIDFD_GETFD = 438  # the Linux syscall (the same number on x86-64 and arm64)
GLOO_FAILURE = re.compile(r"worker\[(\d+)\] WARNING step (\d+) attempt 1 of 3 failed \(RuntimeError: [^)]*gloo[^)]*"
                          r"(?:Connection closed by peer|Connection reset by peer|Broken pipe|Timed out waiting)")


@pytest.fixture(scope="module")
def reference(model_dir):
    """LONG's greedy tokens of PROMPTS on the single-rank engine (the oracle of every parallel path)."""
    single_rank = {key: value for key, value in ENGINE_ARGS.items() if key != "parallel"}
    with LLM(model=model_dir, **single_rank) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, LONG)]


class EngineLog:
    """A TE's processes' stderr, in a file (a module-scoped TE outlives each test's own capture)."""

    def __init__(self, path) -> None:
        self.path = path
        self.path.touch()
        self.offset = 0

    @contextlib.contextmanager
    def capturing(self):
        """Processes started inside write their stderr to the file."""
        saved = os.dup(2)
        with open(self.path, "ab") as log:
            os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    def new_lines(self) -> str:
        """What the processes wrote since the last call."""
        text = self.path.read_bytes()[self.offset:]
        self.offset += len(text)
        return text.decode(errors="replace")


@pytest.fixture(scope="module")
def dp2_ep2(model_dir, tmp_path_factory):
    """A DP2+EP2 TE whose step collectives time out after COLLECTIVE_TIMEOUT_S; its store's port, its log."""
    store_port = free_tcp_port()
    log = EngineLog(tmp_path_factory.mktemp("dp2_ep2") / "stderr.log")
    with log.capturing():
        llm = LLM(model=model_dir, **ENGINE_ARGS, collective_timeout_s=COLLECTIVE_TIMEOUT_S, master_port=store_port)
    with llm:
        yield llm, store_port, log


def _duplicate_fd(pid: int, fd: int) -> socket.socket:
    """Another process's socket, as a descriptor of ours (pidfd_getfd): the same open socket, so a shutdown
    here is one there."""
    pidfd = os.pidfd_open(pid)
    try:
        dup = ctypes.CDLL(None, use_errno=True).syscall(PIDFD_GETFD, pidfd, fd, 0)
    finally:
        os.close(pidfd)
    if dup < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"pidfd_getfd({pid}, {fd}): {os.strerror(errno)}")
    return socket.socket(fileno=dup)


def _break_links(pids: set[int], store_port: int) -> int:
    """Shut down every established TCP connection between the worker processes but the store's (the world's
    rendezvous, rank 0's): the gloo pairs of their process groups, as a network glitch breaks them. How many."""
    ports = {pid: {conn.laddr.port for conn in psutil.Process(pid).net_connections("tcp")} for pid in pids}
    broken = 0
    for pid in pids:
        peer_ports = set().union(*(ports[other] for other in pids if other != pid))
        for conn in psutil.Process(pid).net_connections("tcp"):
            if (conn.status != psutil.CONN_ESTABLISHED or not conn.raddr or conn.raddr.port not in peer_ports
                    or store_port in (conn.laddr.port, conn.raddr.port)):
                continue
            with _duplicate_fd(pid, conn.fd) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            broken += 1
    return broken


def _generate_meanwhile(llm: LLM, disturb, after_messages: int = 3):
    """LONG over PROMPTS; `disturb()` runs from this thread once the engine has sent `after_messages` messages
    (tokens are streaming). The tokens, and what disturb returned."""
    streaming = threading.Event()
    received = []
    on_message = llm.core.on_message

    def counting(item):
        on_message(item)
        received.append(type(item).__name__)
        if len(received) >= after_messages:
            streaming.set()

    llm.core.on_message = counting
    outcome = {}

    def generate():
        try:
            outcome["tokens"] = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, LONG)]
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            outcome["error"] = exc
        finally:
            streaming.set()

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        assert streaming.wait(120), "no tokens within 120 s"
        done_early = not thread.is_alive()
        result = disturb()
    finally:
        thread.join(300)
        llm.core.on_message = on_message
    assert not thread.is_alive(), "generation did not finish"
    if "error" in outcome:
        raise outcome["error"]
    assert not done_early, "the generation was over before the disturbance"
    return outcome["tokens"], result


def test_a_broken_gloo_link_rolls_the_step_back_on_new_groups_without_a_restart(dp2_ep2, reference):
    """The operator's network glitch: the TCP connections between the two ranks' processes go down mid-stream.
    Both ranks fail the step with gloo's own error, agree on it through the store, rebuild their groups and
    run it again: the same processes, the single-rank engine's tokens."""
    llm, store_port, log = dp2_ep2
    pids = _worker_pids(llm.engine.proc.pid)
    before = llm.get_stats()
    log.new_lines()
    tokens, broken = _generate_meanwhile(llm, lambda: _break_links(pids, store_port))
    assert broken >= 2  # at least the WORLD group's pair and the EP group's, seen from either end
    assert tokens == reference
    stats = llm.get_stats()
    assert stats.healthy and stats.num_rollbacks >= before.num_rollbacks + 1
    assert stats.num_recoveries == before.num_recoveries
    assert _worker_pids(llm.engine.proc.pid) == pids and len(pids) == 2  # no restart
    failures = GLOO_FAILURE.findall(log.new_lines())
    assert {rank for rank, _ in failures} == {"0", "1"}  # both ranks met the broken link as gloo reports it


def test_a_peer_waiting_on_a_failed_rank_times_out_and_both_roll_back(dp2_ep2, reference):
    """Rank 1's dispatch fails before it sends anything; rank 0 waits in the collective until its timeout fails
    it too (rather than hanging), and both run the step again."""
    llm, _, log = dp2_ep2
    pids = _worker_pids(llm.engine.proc.pid)
    before = llm.get_stats()
    log.new_lines()
    llm.admin("fault.inject", {"fault": {"kind": "collective_error", "rank": 1, "after_steps": 2}})
    tokens = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, LONG)]
    assert tokens == reference
    stats = llm.get_stats()
    assert stats.healthy and stats.num_rollbacks == before.num_rollbacks + 1
    assert stats.num_recoveries == before.num_recoveries and _worker_pids(llm.engine.proc.pid) == pids
    err = log.new_lines()
    assert [rank for rank, _ in ROLLED_BACK_LINE.findall(err)] == ["1"]
    assert [rank for rank, _ in GLOO_FAILURE.findall(err)] == ["0"]  # its collective timed out
    assert f"Timed out waiting {COLLECTIVE_TIMEOUT_S * 1000:.0f}ms" in err


def test_a_step_that_keeps_failing_escalates_to_the_masters_recovery(dp2_ep2, reference):
    """Every attempt at a step fails on every rank: after MAX_STEP_ATTEMPTS the ranks give up, the master
    restarts them and every request continues from its tokens, to the same greedy tokens."""
    llm, _, _ = dp2_ep2
    pids = _worker_pids(llm.engine.proc.pid)
    before = llm.get_stats()
    llm.admin("fault.inject", {"fault": {"kind": "collective_error", "after_steps": 3, "times": 0}})
    tokens = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, LONG)]
    assert tokens == reference
    stats = llm.get_stats()
    assert stats.healthy and stats.num_recoveries == before.num_recoveries + 1
    assert f"failed {MAX_STEP_ATTEMPTS} times in a row" in (stats.last_failure or "")
    assert _worker_pids(llm.engine.proc.pid).isdisjoint(pids)  # new ranks (the fault was armed in the old ones)
