"""Injected link faults (tests and benchmarks, meshserve/utils/faults.py), hooked around one transfer engine
once such a fault is armed: until then its pulls and probes run unwrapped.

They fire on the pulling side: `link_break` fails pulls and probes from the matching peer as a reset
connection would, `link_delay` holds each pull (not probes) for `delay_s`. A pull's fault fires on the
transfer's worker thread, where its reader starts, so it ends as a FAILED completion like a real one.
"""
from __future__ import annotations

import time

from meshserve.transfer import tcp as tcp_mod
from meshserve.transfer.engine import TransferEngine, peer_address
from meshserve.utils import faults


def peer_label(peer) -> str:
    """A linked peer as link faults match it: its name, and its block server's address where it has one."""
    address = peer_address(peer)
    return peer.name if address is None else f"{peer.name}@{address[0]}:{address[1]}"


def _fire_link_faults(peer, data: bool) -> None:
    """A broken link fails as a reset connection does; a delay holds a pull (`data`), not a probe."""
    where = peer_label(peer)
    if faults.fire(faults.FaultKind.LINK_BREAK, peer=where) is not None:
        raise tcp_mod.TransferError(f"connection to {where} failed: [Errno 104] Connection reset by peer "
                                    "(injected link_break)")
    delay = faults.fire(faults.FaultKind.LINK_DELAY, peer=where) if data else None
    if delay is not None:
        time.sleep(delay.delay_s)


def install(engine: TransferEngine) -> None:
    """Hook `engine`'s pulls from linked peers (their block readers) and its probes."""
    original_source = engine._source

    def source(src):
        shapes, prepare = original_source(src)
        peer = engine._peers.get(src.engine) if src.engine not in (None, engine.name) else None
        if peer is None:  # a local copy: no link to break
            return shapes, prepare

        def prepare_after_faults(block_ids, layer_ids):
            _fire_link_faults(peer, data=True)
            return prepare(block_ids, layer_ids)

        return shapes, prepare_after_faults

    def before_probe(peer_name: str, *args, **kwargs) -> None:
        peer = engine._peers.get(peer_name)
        if peer is not None:  # an unknown peer: the probe says so itself
            _fire_link_faults(peer, data=False)

    engine._source = source
    faults.wrap_method(engine, "probe", before_probe)
