"""The devices a deployment's TEs may hold, and kill-P-to-preserve-D (xdeepserve §6.2, stage 2).

The model is plain: a live TE holds its world size in devices, a dead one holds none, and the capacity is what
an operator says is usable now (the deployment file's `devices`, lowered when devices are lost; lowering it
stops nothing, it bounds what starts). No TE starts or restarts beyond it; a dead decode TE's restart comes
before any other start (its devices are reserved while it waits). When a decode TE must restart and its ranks
do not fit, the least loaded prefill TE(s) stop to free theirs: at once when the decode pool has no other
serving TE (the JEs move the prefill TE's jobs), else by a drain; never the last TE able to prefill, so new
requests always have somewhere to go; the prefill pool waits below its target until devices are back. Each
decision is an event. Pre-warmed processes hold no devices here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from meshserve.cluster.managed import ManagedProcess

if TYPE_CHECKING:
    from meshserve.cluster.manager import ClusterManager


class DeviceCapacity:
    """The capacity of `manager`'s deployment (`devices`: None for no limit) and the decisions it bounds."""

    def __init__(self, manager: ClusterManager, devices: int | None) -> None:
        self.manager = manager
        self.devices = devices
        self._waiting: set[str] = set()  # TEs and pools told to wait for devices (one event each)

    def set(self, devices: int | None, reason: str) -> None:
        self.devices = devices
        self._waiting.clear()  # a wait that goes on is announced again
        self.manager.event(f"capacity {'unlimited' if devices is None else f'{devices} device(s)'}: {reason}")

    def ranks(self, pool: str) -> int:
        return self.manager.configs[pool].parallel_config.world_size

    def free(self, for_decode_restart: bool = False) -> float:
        """Devices no live TE holds; a start other than a decode TE's restart also leaves the devices of the
        dead decode TEs waiting for theirs."""
        if self.devices is None:
            return float("inf")
        tes, specs = self.manager.tes.values(), self.manager.specs
        held = sum(self.ranks(t.record.pool) for t in tes if t.handle is not None and t.handle.alive())
        reserved = 0 if for_decode_restart else sum(
            self.ranks(t.record.pool) for t in tes
            if specs[t.record.pool].role == "decode" and not t.draining
            and (t.handle is None or not t.handle.alive()))
        return self.devices - held - reserved

    def fits(self, pool: str, waiter: str, for_decode_restart: bool = False) -> bool:
        """Whether one more TE of `pool` fits the capacity now; `waiter` (a TE or a pool) is told once if not."""
        free, need = self.free(for_decode_restart), self.ranks(pool)
        if free >= need:
            self._waiting.discard(waiter)
            return True
        self._announce_wait(waiter, f"{waiter} waits for devices: needs {need}, {max(0, int(free))} free of "
                                    f"{self.devices}")
        return False

    def room_to_restart(self, te: ManagedProcess) -> bool:
        """Whether the dead `te` may restart now; a decode TE that does not fit has prefill TEs stopped to free
        their devices (kill-P-to-preserve-D) and restarts once they are gone."""
        pool = te.record.pool
        decode = self.manager.specs[pool].role == "decode"
        if self.fits(pool, f"TE {te.name}", for_decode_restart=decode):
            return True
        if decode:
            self._stop_prefill_for(te, self.ranks(pool) - int(self.free(for_decode_restart=True)))
        return False

    def _announce_wait(self, waiter: str, text: str) -> None:
        if waiter not in self._waiting:
            self._waiting.add(waiter)
            self.manager.event(text)

    def _stop_prefill_for(self, decode_te: ManagedProcess, short: int) -> None:
        """Free `short` devices for `decode_te`'s restart by stopping the least loaded prefill TEs (those already
        stopping count), never leaving no serving TE able to prefill (a prefill or colocated TE)."""
        manager = self.manager
        live = [t for t in manager.tes.values() if t.handle is not None and t.handle.alive()]
        short -= sum(self.ranks(t.record.pool) for t in live if t.preempted)
        if short <= 0:
            return  # the prefill TEs already stopping free enough
        role = lambda t: manager.specs[t.record.pool].role  # noqa: E731
        able = {t.name for t in live if not t.draining and t.heartbeat is not None
                and role(t) in ("prefill", "colocated")}
        candidates = sorted((t for t in live if role(t) == "prefill" and not t.draining),
                            key=lambda t: (t.heartbeat is not None, t.heartbeat.stats.num_running +
                                           t.heartbeat.stats.num_waiting if t.heartbeat else 0))
        # urgent when the decode pool has nothing else serving: stop at once (the JEs move its jobs), else drain
        urgent = not any(t.heartbeat is not None and not t.draining for t in live
                         if t.record.pool == decode_te.record.pool)
        for victim in candidates:
            if short <= 0:
                return
            if not able - {victim.name}:
                self._announce_wait(f"TE {decode_te.name} (no prefill TE to spare)",
                                    f"TE {decode_te.name} waits for devices: {victim.name} is the last TE able "
                                    "to prefill, it is not stopped")
                return
            able.discard(victim.name)
            victim.preempted = True
            reason = (f"kill-P-to-preserve-D: frees {self.ranks(victim.record.pool)} device(s) for restarting "
                      f"decode TE {decode_te.name}")
            if urgent or victim.heartbeat is None:
                victim.draining = True
                victim.handle.stop()
                manager.event(f"stop TE {victim.name} at once: {reason}")
            else:
                manager.drain(victim, reason)
            manager.prefill_stopped_metric.inc()
            short -= self.ranks(victim.record.pool)
