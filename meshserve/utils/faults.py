"""Fault injection for tests and benchmarks: never armed unless someone asks.

Two switches arm faults, the way an operator meets them:
- the environment, read once per process: `MESHSERVE_FAULTS="kind:key=value:...;kind:..."`, e.g.
  `MESHSERVE_FAULTS="stall:rank=1:after_steps=20:duration_s=60"` (child processes inherit it, so it reaches
  every worker of a TE started under it);
- at run time, a `Fault` sent to a TE (`POST /admin/faults` on the API, `AdminOp.FAULT_INJECT` on the
  master's socket): the master arms its own faults and forwards the others to its worker ranks.

A fault fires where the code that would fail calls `fire(kind, ...)`: a worker's step loop (kill, stall),
a MoE collective (collective_error), the transfer engine (link_break, link_delay), the master's loop
(kill_master). Each fault fires `times` times (0: every time) once `after_steps` matching calls have
passed, then disarms; `rank` and `peer` narrow where it fires. A worker fires each of its kinds once per
step (a collective_error at the step's first MoE dispatch), so after_steps counts steps there.
"""
from __future__ import annotations

import enum
import logging
import threading
import time

import msgspec

from meshserve.utils import envs

logger = logging.getLogger(__name__)

ENV = envs.MESHSERVE_FAULTS.name


class FaultKind(enum.StrEnum):
    KILL = "kill"  # a worker rank dies at once (SIGKILL itself), as a lost device does
    STALL = "stall"  # a worker rank stops answering for duration_s (a hung kernel or collective)
    COLLECTIVE_ERROR = "collective_error"  # every rank's next MoE collective fails (a network glitch)
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

    def arm(self, fault: Fault) -> None:
        logger.warning("fault armed: %s", msgspec.json.encode(fault).decode())
        with self._lock:
            self._armed.append(_Armed(fault))

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


class TransientCollectiveError(RuntimeError):
    """A collective failed in a way worth retrying (a glitch in the network): the step is rolled back
    and run again, without restarting the TE."""
