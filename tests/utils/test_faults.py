"""Fault injection switches: the environment syntax, and when an armed fault fires."""
from __future__ import annotations

import os
import signal
import types

import pytest

from meshserve.utils import faults
from meshserve.utils.faults import Fault, FaultKind, FaultSwitch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """The faults module's clock, moved by hand (timed faults without sleeping)."""
    clock = Clock()
    monkeypatch.setattr(faults, "time", types.SimpleNamespace(monotonic=clock.monotonic, time=lambda: clock.now))
    return clock


def _fires(switch: FaultSwitch, kind: FaultKind, calls: int, **where) -> list[bool]:
    return [switch.fire(kind, **where) is not None for _ in range(calls)]


# ---------------------------------------------------------------- parse
def test_parse_reads_kinds_and_typed_fields():
    parsed = faults.parse(" stall:rank=1:after_steps=20:duration_s=60 ; link_delay:peer=decode-0:delay_s=0.5;")
    assert parsed == [Fault(kind=FaultKind.STALL, rank=1, after_steps=20, duration_s=60.0),
                      Fault(kind=FaultKind.LINK_DELAY, peer="decode-0", delay_s=0.5)]
    assert faults.parse("collective_error") == [Fault(kind=FaultKind.COLLECTIVE_ERROR)]
    assert faults.parse("") == [] and faults.parse(" ; ") == []


@pytest.mark.parametrize("text, says", [
    ("meltdown", "meltdown"),  # no such kind
    ("stall:rank", "not key=value"),
    ("stall:colour=red", "colour"),  # no such field
    ("stall:after_steps=soon", "after_steps"),
    ("stall:times=-1", "negative"),
    ("link_delay:delay_s=-0.5", "negative"),
])
def test_parse_rejects_bad_specs_naming_the_fault(text, says):
    with pytest.raises(ValueError, match=says) as info:
        faults.parse(text)
    assert text.split(":")[0] in str(info.value)


def test_a_fault_built_directly_is_checked_too():
    with pytest.raises(ValueError, match="negative"):
        Fault(kind=FaultKind.STALL, duration_s=-1)


# ---------------------------------------------------------------- fire
def test_after_steps_lets_calls_pass_then_fires_times_then_disarms():
    switch = FaultSwitch([Fault(kind=FaultKind.KILL, after_steps=2, times=2)])
    assert _fires(switch, FaultKind.KILL, 6) == [False, False, True, True, False, False]
    assert not switch.armed
    assert [fault.kind for _, fault in switch.fired] == [FaultKind.KILL, FaultKind.KILL]


def test_times_zero_fires_every_time_until_disarmed():
    switch = FaultSwitch([Fault(kind=FaultKind.COLLECTIVE_ERROR, after_steps=1, times=0)])
    assert _fires(switch, FaultKind.COLLECTIVE_ERROR, 5) == [False, True, True, True, True]
    switch.disarm(FaultKind.COLLECTIVE_ERROR)
    assert _fires(switch, FaultKind.COLLECTIVE_ERROR, 2) == [False, False]


def test_other_kinds_neither_fire_nor_count():
    switch = FaultSwitch([Fault(kind=FaultKind.STALL, after_steps=1)])
    assert _fires(switch, FaultKind.KILL, 3) == [False] * 3
    assert _fires(switch, FaultKind.STALL, 2) == [False, True]


def test_rank_narrows_where_it_fires_and_what_counts():
    switch = FaultSwitch([Fault(kind=FaultKind.STALL, rank=1, after_steps=1)])
    assert _fires(switch, FaultKind.STALL, 3, rank=0) == [False] * 3  # rank 0's calls do not count
    assert _fires(switch, FaultKind.STALL, 3, rank=1) == [False, True, False]
    # rank -1 on the fault: every rank, each counting its own calls here (one switch per process)
    everywhere = FaultSwitch([Fault(kind=FaultKind.STALL, times=0)])
    assert _fires(everywhere, FaultKind.STALL, 1, rank=0) == _fires(everywhere, FaultKind.STALL, 1, rank=3) == [True]


def test_peer_matches_part_of_the_far_end_name():
    switch = FaultSwitch([Fault(kind=FaultKind.LINK_BREAK, peer="decode-1", times=0)])
    assert switch.fire(FaultKind.LINK_BREAK, peer="te/decode-0/rank0") is None
    assert switch.fire(FaultKind.LINK_BREAK, peer="te/decode-1/rank0") is not None


def test_a_link_fault_hits_every_transfer_for_its_duration(clock):
    switch = FaultSwitch([Fault(kind=FaultKind.LINK_BREAK, after_steps=1, duration_s=2.0)])
    assert _fires(switch, FaultKind.LINK_BREAK, 2) == [False, True]  # the second transfer starts it
    clock.now += 1.5
    assert _fires(switch, FaultKind.LINK_BREAK, 3) == [True] * 3  # times does not limit a timed fault
    clock.now += 1.0  # 2.5 s after it first fired
    assert _fires(switch, FaultKind.LINK_BREAK, 2) == [False, False]
    assert not switch.armed


def test_a_link_fault_without_duration_lasts_until_disarmed(clock):
    switch = FaultSwitch([Fault(kind=FaultKind.LINK_DELAY, delay_s=0.2)])
    clock.now += 3600
    assert _fires(switch, FaultKind.LINK_DELAY, 3) == [True] * 3
    switch.disarm()
    assert switch.fire(FaultKind.LINK_DELAY) is None


def test_arm_adds_a_fault_at_run_time():
    switch = FaultSwitch()
    assert not switch.armed and switch.fire(FaultKind.KILL) is None
    switch.arm(Fault(kind=FaultKind.KILL, rank=2))
    assert switch.fire(FaultKind.KILL, rank=2) == Fault(kind=FaultKind.KILL, rank=2)


# ---------------------------------------------------------------- the environment switch
@pytest.fixture
def fresh_switch(monkeypatch):
    """The process switch built anew from the environment on its next use, and forgotten after the test."""
    monkeypatch.setattr(faults, "_switch", None)


def test_the_environment_arms_the_process_switch_once(monkeypatch, fresh_switch):
    monkeypatch.setenv(faults.ENV, "collective_error:after_steps=1")
    assert faults.fire(FaultKind.COLLECTIVE_ERROR) is None
    monkeypatch.setenv(faults.ENV, "")  # read once: a later change does not count
    assert faults.fire(FaultKind.COLLECTIVE_ERROR) is not None
    assert not faults.switch().armed


def test_no_environment_arms_nothing(monkeypatch, fresh_switch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert not faults.switch().armed
    faults.arm(Fault(kind=FaultKind.STALL))
    assert faults.fire(FaultKind.STALL) is not None


def test_a_bad_environment_switch_fails_loudly(monkeypatch, fresh_switch):
    monkeypatch.setenv(faults.ENV, "stall:rank=one")
    with pytest.raises(ValueError, match="rank"):
        faults.switch()


# ---------------------------------------------------------------- hooks
class Target:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def step(self, n: int) -> int:
        self.calls.append(n)
        return n * 2


def test_an_installer_runs_once_when_a_fault_of_its_kinds_is_first_armed():
    switch = FaultSwitch()
    installed = []
    switch.on_arm({FaultKind.KILL, FaultKind.STALL}, lambda: installed.append("step hooks"))
    switch.on_arm({FaultKind.LINK_BREAK}, lambda: installed.append("link hooks"))
    assert installed == []  # nothing armed: nothing wrapped
    switch.arm(Fault(kind=FaultKind.STALL))
    switch.arm(Fault(kind=FaultKind.KILL))
    switch.disarm()
    switch.arm(Fault(kind=FaultKind.STALL))
    assert installed == ["step hooks"]


def test_an_installer_for_a_fault_armed_from_the_environment_runs_at_once():
    switch = FaultSwitch([Fault(kind=FaultKind.LINK_DELAY, delay_s=1.0)])
    installed = []
    switch.on_arm({FaultKind.LINK_BREAK, FaultKind.LINK_DELAY}, lambda: installed.append(True))
    assert installed == [True]


def test_wrap_method_calls_the_hook_first_on_that_instance_only():
    target, other = Target(), Target()
    seen = []
    faults.wrap_method(target, "step", lambda n: seen.append(n))
    assert target.step(3) == 6 and seen == [3] and target.calls == [3]
    assert other.step(4) == 8 and seen == [3]  # another instance runs unwrapped
    assert "step" not in vars(other)


def test_wrap_method_on_a_class_hooks_every_instance_and_a_raising_hook_stops_the_call(monkeypatch):
    monkeypatch.setattr(Target, "step", Target.step)  # undone after the test

    def refuse(self, n):
        if n < 0:
            raise RuntimeError("injected")

    faults.wrap_method(Target, "step", refuse)
    target = Target()
    assert target.step(1) == 2
    with pytest.raises(RuntimeError, match="injected"):
        target.step(-1)
    assert target.calls == [1]


def test_kill_when_fired_kills_this_process_when_its_fault_fires(monkeypatch, fresh_switch):
    monkeypatch.delenv(faults.ENV, raising=False)
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    hook = faults.kill_when_fired(FaultKind.KILL_MASTER)
    hook("any", "arguments")
    assert killed == []
    faults.arm(Fault(kind=FaultKind.KILL_MASTER, after_steps=1))
    hook()
    assert killed == []
    hook()
    assert killed == [(os.getpid(), signal.SIGKILL)]
