"""Start a multi-TE deployment (TE processes + in-process job executors) for tests, and stop it."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from meshserve.config import RouterConfig
from meshserve.router.deployment import MultiDeployment, launch_tes
from meshserve.router.router import Router
from meshserve.utils.processes import stop_process
from meshserve.wire.sampling_params import SamplingParams


@contextlib.contextmanager
def running_deployment(model: str, deployment: str | MultiDeployment, engine: dict | None = None,
                       num_jes: int = 1, startup_timeout_s: float = 120.0, **router_settings):
    """Yields (job executors, {TE name: process}); every process is stopped on exit. `router_settings`: the
    job executors' (RouterConfig; a heartbeat timeout of 3 s unless given)."""
    if isinstance(deployment, str):
        deployment = MultiDeployment.preset(deployment)
    config = RouterConfig(**{"model": model, "heartbeat_timeout_s": 3.0, **router_settings})
    jes = [Router(config) for _ in range(num_jes)]
    tes = deployment.tes()
    procs = {}
    try:
        procs = dict(zip((t.name for t in tes), launch_tes(
            tes, model, [je.register_addr for je in jes], {"num_threads": 1, **(engine or {})}, logging.WARNING)))

        def alive():
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"TE {name} exited during start-up ({proc.returncode})")

        for je in jes:
            je.wait_for_tes_blocking(deployment.role_counts(), startup_timeout_s, alive=alive)
        yield jes, procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            stop_process(proc, grace_s=10)
        for je in jes:
            je.shutdown()


def kill_te(proc) -> None:
    """SIGKILL a TE's master; its workers notice and exit."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


async def generate_all(je: Router, prompts: list[list[int]], max_tokens: int, policy: str | None = None,
                       ignore_eos: bool = True, timeout_s: float = 120.0) -> list:
    """Greedy outputs (the final RequestOutput) of every prompt, submitted together."""
    from meshserve.router.routing import REQUEST_ROUTING_POLICY

    if policy is not None:
        REQUEST_ROUTING_POLICY.set(policy)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)

    async def one(i: int, prompt: list[int]):
        final = None
        async for out in je.generate(None, prompt, params, f"req-{i}-{id(prompt)}"):
            final = out
        return final

    return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), timeout_s)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]
