"""What a TE tells others about itself: its stats (the reply to a StatsQuery, summed over its DP groups with
`EngineStats.merge`, the same sum the router makes over TEs) and its heartbeat to the routers."""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshserve.wire.client import EngineStats
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole
from meshserve.wire.receive import dropped_frames

if TYPE_CHECKING:
    from meshserve.core.master import EngineCore
    from meshserve.core.request import Request
    from meshserve.core.scheduler import Scheduler


def load_stats(schedulers: Sequence[Scheduler], pending: Sequence[Request], **more) -> EngineStats:
    """The DP groups' counters summed, with the requests still waiting for a DP group counted as waiting."""
    parts = [s.stats() for s in schedulers]
    return EngineStats.merge(
        parts,
        num_waiting=sum(p.num_waiting for p in parts) + len(pending),
        waiting_tokens=sum(p.waiting_tokens for p in parts) + sum(r.num_tokens for r in pending),
        **more)


def engine_stats(core: EngineCore) -> EngineStats:
    """The TE's counters: its schedulers' summed, plus the requests still waiting for a DP group and the
    ranks' recovery state."""
    recovery = core.recovery.state
    return load_stats(
        core.schedulers, core.queue.pending,
        dropped_frames=dropped_frames(),
        num_rollbacks=core.recovery.health.num_rollbacks,
        num_recoveries=recovery.total,
        num_migrated=recovery.migrated,
        requests_received=core.requests_received,
        world_size=core.workers.world_size,
        microbatched_steps=core.microbatched_steps,
        recovering=recovery.in_progress,
        last_failure=recovery.last_failure,
        last_failure_silent_s=recovery.last_failure_silent_s,
        gc_marked_steps=core.gc_schedule.marked_steps,
        healthy=core.dead_error is None,
        error=core.dead_error,
    )


def engine_heartbeat(core: EngineCore) -> EngineHeartbeat:
    """The TE's heartbeat: where to reach it, what it serves, its stats and how it started."""
    config = core.config
    strategy = config.parallel_config.strategy
    return EngineHeartbeat(name=config.te_name, role=EngineRole(core.role), group=core.group,
                           input_addr=core.link.listen_addr, kv_events_addr=core.kv_events.addr,
                           model=config.model_config.served_model_name or config.model_config.model,
                           max_model_len=core.max_model_len, block_size=config.cache_config.block_size,
                           attn_tp=strategy.attn_tp, attn_dp=strategy.attn_dp, stats=engine_stats(core),
                           kv_event_seq=core.kv_events.seq, timestamp=time.time(),
                           draining=core.drain.active, pid=os.getpid(), startup=core.startup,
                           weights_addrs=core.weight_servers.addrs)
