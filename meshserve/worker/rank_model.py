"""What every rank's runner does with its model's weights, attention rank or expert rank alike: load them (forked
from a running TE, from the memory pool's model cache, or from the checkpoint files), and move experts between
slots when the master reconfigures the expert placement (xdeepserve §4.5: the phases of
meshserve/moe/balancer.py, one per command, and the background work's end reported as events)."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from meshserve.config import EngineConfig
from meshserve.models.loader import iter_safetensors, load_model
from meshserve.moe.placement import ExpertPlacement, describe_placement_source, load_placement_file
from meshserve.parallel.context import ParallelContext
from meshserve.utils import page_cache
from meshserve.wire.eplb import EplbCommand, EplbPhase
from meshserve.wire.worker import WorkerEventKind
from meshserve.worker.model_cache import pool_weights
from meshserve.worker.weight_fork import fork_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadInfo:
    """How a rank got its weights (`WorkerReady.load_*`): wall-clock times, source, bytes read."""

    start: float
    end: float
    source: str  # disk | page-cache | pool | fork
    nbytes: int


@contextlib.contextmanager
def load_threads(ranks_on_host: int):
    """Load with this host's cores shared among the TE's ranks, then serve with the configured threads: the rank
    serves nothing while it loads, and its load time is the new TE's start-up (copies and prepacking scale)."""
    serving = torch.get_num_threads()
    torch.set_num_threads(max(serving, (os.cpu_count() or 1) // max(1, ranks_on_host)))
    try:
        yield
    finally:
        torch.set_num_threads(serving)


def pool_client(config: EngineConfig, parallel: ParallelContext):
    """This rank's client of the memory pool, or None without one."""
    if not config.pool_config.pool_controller:
        return None
    from meshserve.pool.sdk import PoolClient  # only ranks of a TE with a pool talk to one

    # a generous timeout: background block stores must survive a busy host (a dead server still fails fast after
    # its first timeout)
    return PoolClient(config.pool_config.pool_controller, timeout_s=5.0, name=f"worker-{parallel.rank}")


def load_rank_model(config: EngineConfig, parallel: ParallelContext, dtype: torch.dtype, device: torch.device,
                    pool=None):
    """This rank's model and how it got its weights: forked from a running TE (`fork_from`), from the memory
    pool's model cache (`pool`: this rank's client), else from the checkpoint files (page cache or disk, as they
    were before)."""
    model_config = config.model_config
    model_dir = model_config.model
    start = time.time()
    if model_config.fork_from:
        sources = [a.strip() for a in model_config.fork_from.split(",")]
        if len(sources) != parallel.world_size:
            raise ValueError(f"fork_from names {len(sources)} weight server(s); this TE has "
                             f"{parallel.world_size} rank(s), one each")
        model, nbytes = fork_model(sources[parallel.rank], model_dir, dtype, device, parallel,
                                   model_config.quantization, config.parallel_config.startup_timeout_s)
        return model, LoadInfo(start, time.time(), "fork", nbytes)
    # with a pool, weights come from its model cache when the model is there (`meshserve pool put-model`)
    if pool is not None and config.pool_config.pool_load_weights:
        source, read = "pool", pool_weights(pool, model_dir)
    else:
        try:
            resident = page_cache.resident_fraction(page_cache.checkpoint_files(model_dir))
        except (OSError, ValueError):
            resident = 0.0  # the load itself reports what is wrong with the files
        source = "page-cache" if resident >= page_cache.RESIDENT_THRESHOLD else "disk"

        def read(wanted, shard_of):
            return iter_safetensors(model_dir, wanted, shard_of)
    counted = [0]

    def counting(wanted, shard_of):
        for name, tensor in read(wanted, shard_of):
            counted[0] += tensor.numel() * tensor.element_size()
            yield name, tensor
    model = load_model(model_dir, dtype=dtype, device=device, parallel=parallel, read_weights=counting,
                       quantization=model_config.quantization)
    return model, LoadInfo(start, time.time(), source, counted[0])


class RankExperts:
    """A rank's side of the expert placement: the master's reconfiguration commands applied to the model's
    `ExpertBalancer` (None: a dense model), the background work's end reported, load counts handed over."""

    def __init__(self, balancer) -> None:
        self.balancer = balancer
        # reconfiguration phase: "prefetching" / "loading" run in the background, then "prefetched" / "loaded"
        self.phase: str | None = None

    @property
    def moe_layers(self) -> list[int]:
        return list(self.balancer.moe_layers) if self.balancer is not None else []

    @property
    def num_logical_experts(self) -> int:
        return self.balancer.shape.num_logical if self.balancer is not None else 0

    @property
    def busy(self) -> bool:
        return self.phase in ("prefetching", "loading")

    def apply_initial_placement(self, source: str) -> None:
        """Load the experts of a planned placement (a file, or inline JSON: a shrunk layout's) before serving:
        primary slots may move here too, and the slots of a shrunk layout are all planned."""
        placement = load_placement_file(source)
        what = describe_placement_source(source)
        if self.balancer is None:
            raise ValueError(f"--eplb-placement {what}: the model has no MoE layers")
        t0 = time.perf_counter()
        self.balancer.reconfigure(placement, offline=True)
        logger.info("applied expert placement %s in %.2fs", what, time.perf_counter() - t0)

    def apply(self, command: EplbCommand) -> None:
        """One phase of an expert-placement reconfiguration; every rank applies it at the same step boundary."""
        if self.balancer is None:
            raise RuntimeError("expert placement command for a model without MoE layers")
        self._PHASES[command.phase](self, self.balancer, command)

    def _prefetch(self, balancer, command: EplbCommand) -> None:
        balancer.start_prefetch(ExpertPlacement.from_dict(command.placement.to_dict()))
        self.phase = "prefetching"

    def _disable_and_load(self, balancer, command: EplbCommand) -> None:
        balancer.disable_changing_slots()
        balancer.start_load()
        self.phase = "loading"

    def _enable(self, balancer, command: EplbCommand) -> None:
        balancer.enable()
        self.phase = None

    def _abort(self, balancer, command: EplbCommand) -> None:
        """Some rank failed a phase: all drop it at this same step boundary."""
        balancer.abort()
        self.phase = None

    _PHASES: ClassVar[dict[EplbPhase, Callable]] = {
        EplbPhase.PREFETCH: _prefetch, EplbPhase.DISABLE_AND_LOAD: _disable_and_load,
        EplbPhase.ENABLE: _enable, EplbPhase.ABORT: _abort}

    def poll(self) -> list[tuple[WorkerEventKind, str]]:
        """The background phase that finished since the last call, or failed (the master then stops the
        reconfiguration on every rank)."""
        if not self.busy:
            return []
        try:
            done = self.balancer.prefetch_done() if self.phase == "prefetching" else self.balancer.load_done()
        except Exception as exc:  # reported to the master, which stops the reconfiguration on every rank
            self.phase = None
            return [(WorkerEventKind.EPLB_FAILED, f"{type(exc).__name__}: {exc}")]
        if not done:
            return []
        prefetched = self.phase == "prefetching"
        self.phase = "prefetched" if prefetched else "loaded"
        return [(WorkerEventKind.EPLB_PREFETCHED if prefetched else WorkerEventKind.EPLB_LOADED, "")]

    def take_load(self) -> list[list[int]] | None:
        return self.balancer.take_counts() if self.balancer is not None else None
