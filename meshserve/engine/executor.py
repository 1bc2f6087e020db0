"""An executor process: one rank's model runner, fed by the master over ZMQ.

The master PUSHes the same `StepBatch` to every rank; each rank runs its DP
group's part of it, in order, in lockstep with the others (the ranks meet in the
model's collectives over torch.distributed). The driver rank of each DP group
PUSHes back the group's `ModelRunnerOutput`. If the master disappears the
executor exits on its own.
"""
from __future__ import annotations

import logging
import os
import signal
import traceback

import zmq

from meshserve.config import EngineConfig
from meshserve.engine import messages as msg

logger = logging.getLogger(__name__)

_PARENT_CHECK_MS = 1000


def init_distributed(config: EngineConfig, rank: int, init_method: str | None) -> None:
    """Join the TE's torch.distributed world (nothing to do for one rank)."""
    world = config.world_size
    if world == 1:
        return
    import datetime

    import torch
    import torch.distributed as dist

    backend = config.dist_backend or ("nccl" if config.device.startswith("cuda") else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=config.startup_timeout_s))


def run_executor(rank: int, config: dict, work_addr: str, result_addr: str, dist_init_method: str | None = None,
                 log_level: int = logging.INFO) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s executor[{rank}] %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the parent stops us in order instead
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    ctx = zmq.Context()
    work = ctx.socket(zmq.PULL)
    work.connect(work_addr)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(result_addr)
    try:
        from meshserve.engine.runner import ModelRunner, configure_threads
        from meshserve.parallel.context import ParallelContext

        engine_config = EngineConfig.from_dict(config)
        threads = configure_threads(engine_config.num_threads, engine_config.world_size)
        init_distributed(engine_config, rank, dist_init_method)
        parallel = ParallelContext.build(engine_config.strategy, moe_comm=engine_config.moe_comm,
                                         int8_dispatch=engine_config.int8_dispatch,
                                         max_tokens_per_step=engine_config.max_num_batched_tokens)
        runner = ModelRunner(engine_config, parallel)
        logger.info("ready (%d torch threads; DP group %d, attention TP rank %d, EP rank %d, MoE TP rank %d)",
                    threads, parallel.dp_rank, parallel.attn_tp_rank, parallel.ep_rank, parallel.moe_tp_rank)
        results.send(msg.encode(msg.ExecutorReady(rank=rank, num_kv_blocks=runner.num_blocks,
                                                  kv_bytes_per_token=runner.layout.bytes_per_token)))
        poller = zmq.Poller()
        poller.register(work, zmq.POLLIN)
        while True:
            if not poller.poll(_PARENT_CHECK_MS):
                if os.getppid() != parent:
                    logger.warning("master is gone; exiting")
                    return
                continue
            item = msg.decode(work.recv())
            if isinstance(item, msg.Shutdown):
                logger.info("shutting down")
                return
            out = runner.execute(item.per_dp[parallel.dp_rank])
            if parallel.is_driver:
                out.dp_rank = parallel.dp_rank
                results.send(msg.encode(out))
    except Exception as exc:  # report, then die: the master fails in-flight requests
        logger.error("executor failed: %s", traceback.format_exc())
        try:
            results.send(msg.encode(msg.ExecutorFailure(rank=rank, message=f"{type(exc).__name__}: {exc}")))
        except zmq.ZMQError:
            pass
        raise SystemExit(1)
    finally:
        work.close(0)
        results.close()
        ctx.term()
        _leave_distributed()


def _leave_distributed() -> None:
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    from meshserve.engine.processes import module_arguments

    run_executor(**module_arguments(sys.argv))
