"""The process of one self-contained DP group (xdeepserve §4.2): the master of that group alone.

It is an `EngineCore` over one DP group (`GroupPlace`): its own scheduler, KV cache manager and output path, its
group's ranks started into the TE's one torch.distributed world beside the other groups'. Requests come from
the TE shell (`te_shell`); each request's outputs go straight to its client (`GroupLink`); its load reports,
readiness and failures go to the shell.
"""
from __future__ import annotations

import logging
import signal
import traceback

import zmq

from meshserve.config import EngineConfig
from meshserve.core.client_links import GroupLink
from meshserve.core.dp_group import GroupPlace
from meshserve.core.master import EngineCore
from meshserve.utils.processes import STOPPED_BY_SIGNAL_EXIT_CODE
from meshserve.wire.client import EngineError


def run_group_master(config: dict, place: dict, shell_addr: str, report_addr: str, client_output_addr: str,
                     te_addr: str, ipc_dir: str, shell_pid: int, log_level: int = logging.INFO) -> None:
    """`place`: the group's `GroupPlace` fields (its index, the world's address and generation)."""
    group_place = GroupPlace(**place)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s dp-group[{group_place.index}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the shell stops us in order
    engine_config = EngineConfig.from_dict(config)
    ctx = zmq.Context()
    link = GroupLink(ctx, group_place, shell_addr, report_addr, client_output_addr, te_addr)
    try:
        core = EngineCore(engine_config, ctx, link, ipc_dir, log_level)
    except Exception as exc:
        logging.getLogger(__name__).error("start-up failed: %s", traceback.format_exc())
        link.report(EngineError(message=f"DP group {group_place.index} failed to start: {exc}", fatal=True))
        link.close()
        ctx.term()
        raise SystemExit(1) from exc
    core.parent = shell_pid
    signal.signal(signal.SIGTERM, lambda signum, frame: core.stop_on_signal())
    core.run()
    if core.stop_requested:
        raise SystemExit(STOPPED_BY_SIGNAL_EXIT_CODE)
    if core.dead_error is not None:
        raise SystemExit(1)
