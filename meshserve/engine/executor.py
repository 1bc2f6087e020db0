"""An executor process: one model runner (one rank), fed by the master over ZMQ.

The master PUSHes `SchedulerOutput`s; the executor runs them in order and PUSHes
back `ModelRunnerOutput`s. If the master disappears the executor exits on its own.
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


def run_executor(rank: int, config: dict, work_addr: str, result_addr: str, log_level: int = logging.INFO) -> None:
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

        engine_config = EngineConfig.from_dict(config)
        threads = configure_threads(engine_config.num_threads)
        runner = ModelRunner(engine_config)
        logger.info("ready (%d torch threads)", threads)
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
            results.send(msg.encode(runner.execute(item)))
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


if __name__ == "__main__":
    import sys

    from meshserve.engine.processes import module_arguments

    run_executor(**module_arguments(sys.argv))
