"""Fault injection for tests and benchmarks: never armed unless someone asks, and free when nothing is armed.

Two switches arm faults, the way an operator meets them:
- the environment, read once per process: `MESHSERVE_FAULTS="kind:key=value:...;kind:..."`, e.g.
  `MESHSERVE_FAULTS="stall:rank=1:after_steps=20:duration_s=60"` (child processes inherit it, so it reaches
  every worker of a TE started under it);
- at run time, a `Fault` sent to a TE (`POST /admin/faults` on the API, `AdminOp.FAULT_INJECT` on the
  master's socket): the master arms its own faults and forwards the others to its worker ranks.

The code that would fail carries no fault call: a fault fires from a hook wrapped around its target
(`wrap_method`) when a fault of its kind is first armed in the process (`on_arm`). A process registers its
installers once at start (a worker: `meshserve/worker/fault_hooks.py`, which installs the worker loop's,
the MoE dispatch's and the transfer engine's hooks); until a fault is armed nothing is wrapped. Hooking a
new place takes two lines, e.g. the master's `kill_master` around a method of its own that sends a step
(`_send_step` here), registered once when the master starts:

    faults.on_arm({FaultKind.KILL_MASTER}, lambda: faults.wrap_method(
        self, "_send_step", faults.kill_when_fired(FaultKind.KILL_MASTER)))

A hook fires `fire(kind, ...)`: each fault fires `times` times (0: every time) once `after_steps` matching
calls have passed, then disarms; `rank` and `peer` narrow where it fires. A worker fires each of its kinds
once per step (a collective_error at the first MoE dispatch of each attempt at a step), so after_steps
counts steps there.
"""
from __future__ import annotations

import enum
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from meshserve.utils import envs

logger = logging.getLogger(__name__)

ENV = envs.MESHSERVE_FAULTS.name


class FaultKind(enum.StrEnum):
    KILL = "kill"  # a worker rank dies at once (SIGKILL itself), as a lost device does
    STALL = "stall"  # a worker rank stops answering for duration_s (a hung kernel or collective)
    COLLECTIVE_ERROR = "collective_error"  # the first MoE dispatch of a step fails, as a broken link does
    LINK_BREAK = "link_break"  # KV transfers with `peer` fail for duration_s (0: until disarmed)
    LINK_DELAY = "link_delay"  # KV transfers with `peer` wait delay_s first, for duration_s
    KILL_MASTER = "kill_master"  # the TE's master process dies at once


# where each kind fires: the master keeps its own, forwards the others to its worker ranks
MASTER_KINDS = frozenset({FaultKind.KILL_MASTER})


class Fault(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    kind: FaultKind
    rank: int = -1  # the worker rank it fires on (-1: every rank)
    after_steps: int = 0  # matching calls to let pass before it fires
    times: int = 1  # how often it fires (0: every time while armed)
    duration_s: float = 0.0  # stall / link faults: how long (link faults: 0 = until disarmed)
    delay_s: float = 0.0  # link_delay: added to each transfer
    peer: str = ""  # link faults: the far end's name or address contains this ("": any peer)

    def __post_init__(self) -> None:
        if self.after_steps < 0 or self.times < 0 or self.duration_s < 0 or self.delay_s < 0:
            raise ValueError("after_steps, times, duration_s and delay_s must not be negative")


def parse(text: str) -> list[Fault]:
    """`kind:key=value:...;kind:...` (the environment switch's syntax); ValueError names what is wrong."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, *pairs = part.split(":")
        fields: dict[str, object] = {"kind": kind.strip()}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"fault {part!r}: {pair!r} is not key=value")
            fields[key.strip()] = value.strip()
        try:
            faults.append(msgspec.convert(fields, Fault, strict=False))
        except msgspec.ValidationError as exc:
            raise ValueError(f"fault {part!r}: {exc}") from None
    return faults


class _Armed:
    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.calls = 0
        self.fired = 0
        self.first_fired_at: float | None = None


class FaultSwitch:
    """The faults armed in this process. Thread-safe: the transfer engine fires from its own threads."""

    def __init__(self, faults: list[Fault] = ()) -> None:
        self._lock = threading.Lock()
        self._armed: list[_Armed] = [_Armed(f) for f in faults]
        self.fired: list[tuple[float, Fault]] = []  # what fired, when (time.time())
        self._installers: list[tuple[frozenset[FaultKind], Callable[[], None]]] = []  # not installed yet
        self._ever_armed: set[FaultKind] = {f.kind for f in faults}

    def arm(self, fault: Fault) -> None:
        logger.warning("fault armed: %s", msgspec.json.encode(fault).decode())
        with self._lock:
            self._armed.append(_Armed(fault))
            self._ever_armed.add(fault.kind)
        self._install_due()

    def on_arm(self, kinds: Iterable[FaultKind], install: Callable[[], None]) -> None:
        """Run `install` (it wraps the hooks of `kinds` around their targets) once, the first time a fault of
        one of `kinds` is armed here: at once when one is armed already (the environment switch)."""
        with self._lock:
            self._installers.append((frozenset(kinds), install))
        self._install_due()

    def _install_due(self) -> None:
        with self._lock:
            due = [entry for entry in self._installers if entry[0] & self._ever_armed]
            self._installers = [entry for entry in self._installers if entry not in due]
        for _, install in due:  # outside the lock: an installer may look at the switch
            install()

    def disarm(self, kind: FaultKind | None = None) -> None:
        with self._lock:
            self._armed = [a for a in self._armed if kind is not None and a.fault.kind != kind]

    @property
    def armed(self) -> bool:
        return bool(self._armed)

    def fire(self, kind: FaultKind, rank: int = -1, peer: str = "") -> Fault | None:
        """The fault of this kind that fires at this call, or None (the common case costs one check)."""
        if not self._armed:
            return None
        now = time.monotonic()
        with self._lock:
            for armed in list(self._armed):
                fault = armed.fault
                if fault.kind != kind or (fault.rank >= 0 and rank >= 0 and fault.rank != rank):
                    continue
                if fault.peer and fault.peer not in peer:
                    continue
                if armed.first_fired_at is not None and fault.duration_s and kind in _TIMED_KINDS:
                    if now - armed.first_fired_at > fault.duration_s:  # its time is over
                        self._armed.remove(armed)
                        continue
                    return fault
                armed.calls += 1
                if armed.calls <= fault.after_steps:
                    continue
                armed.fired += 1
                if armed.first_fired_at is None:
                    armed.first_fired_at = now
                if fault.times and armed.fired >= fault.times and kind not in _TIMED_KINDS:
                    self._armed.remove(armed)
                self.fired.append((time.time(), fault))
                logger.warning("fault fires: %s (rank %d, peer %r)", kind, rank, peer)
                return fault
        return None


# link faults last for duration_s once they first fire (every transfer in that time is hit)
_TIMED_KINDS = frozenset({FaultKind.LINK_BREAK, FaultKind.LINK_DELAY})

_switch: FaultSwitch | None = None
_switch_lock = threading.Lock()


def switch() -> FaultSwitch:
    """This process's switch, armed from the environment on first use."""
    global _switch
    if _switch is None:
        with _switch_lock:
            if _switch is None:
                text = envs.MESHSERVE_FAULTS.get() or ""
                faults = parse(text) if text else []
                if faults:
                    logger.warning("%s arms %d fault(s): %s", ENV, len(faults), text)
                _switch = FaultSwitch(faults)
    return _switch


def fire(kind: FaultKind, rank: int = -1, peer: str = "") -> Fault | None:
    return switch().fire(kind, rank, peer)


def arm(fault: Fault) -> None:
    switch().arm(fault)


def on_arm(kinds: Iterable[FaultKind], install: Callable[[], None]) -> None:
    """`FaultSwitch.on_arm` on this process's switch."""
    switch().on_arm(kinds, install)


# ---------------------------------------------------------------- hooks

def wrap_method(obj: object, name: str, before: Callable[..., None]) -> None:
    """Call `before` with a method's arguments ahead of each call of it: on an instance, `obj.name` becomes a
    wrapper of the bound method (this object only); on a class, of the function (`before` gets `self` first).
    `before` fires faults: it may raise, sleep or end the process; the method then runs as it would."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)


def kill_when_fired(kind: FaultKind, rank: int = -1) -> Callable[..., None]:
    """A `before` hook that ends this process at once (SIGKILL, as a lost device or host does) when a fault of
    `kind` fires."""

    def before(*args: Any, **kwargs: Any) -> None:
        if fire(kind, rank=rank) is not None:
            os.kill(os.getpid(), signal.SIGKILL)

    return before
