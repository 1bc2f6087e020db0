"""The runner of an expert rank in a disaggregated layout (xdeepserve §5.2): it holds only routed experts, no KV
cache and no request. The master sends it every step as it does to all ranks; for each step with a forward it
serves the attention ranks' A2E rows, layer by layer and DP domain by DP domain (meshserve/models/expert_rank.py),
and reports nothing but background events (expert moves, rollbacks): the attention ranks' drivers report the
tokens.

A step's transient collective error is rolled back as on the attention ranks (meshserve/worker/model_runner.py):
every rank agrees on the failed step through the world's store, the process groups are rebuilt and the forward
runs again (an expert rank holds no request state to restore).
"""
from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import torch

from meshserve.config import EngineConfig
from meshserve.models.loader import load_hf_config, resolve_dtype
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.rollback import is_transient
from meshserve.wire.worker import SchedulerOutput, StepBatch, WorkerEventKind
from meshserve.worker.rank_model import RankExperts, load_rank_model, load_threads, pool_client
from meshserve.worker.sampler import describe_error

logger = logging.getLogger(__name__)

MAX_STEP_ATTEMPTS = 3  # as on the attention ranks: a forward failing this often ends the rank


class ExpertRankRunner:
    """`ModelRunner`'s interface to the worker loop, for a rank that holds experts only."""

    def __init__(self, config: EngineConfig, parallel: ParallelContext) -> None:
        if not parallel.is_expert_rank:
            raise ValueError(f"rank {parallel.rank} is not an expert rank of {parallel.strategy}")
        self.config, self.parallel = config, parallel
        self.device = torch.device(config.model_config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        hf_config = load_hf_config(config.model_config.model)
        dtype = resolve_dtype(config.model_config.dtype, hf_config)
        # the pool's model cache serves the weights where the TE has a pool (no context cache here: no KV)
        self.pool = pool_client(config, parallel)
        with load_threads(config.parallel_config.num_local_ranks):
            self.model, self.load_info = load_rank_model(config, parallel, dtype, self.device, self.pool)
        self.experts = RankExperts(self.model.expert_balancer)
        if config.eplb_config.eplb_placement:
            self.experts.apply_initial_placement(config.eplb_config.eplb_placement)
        self.vocab_size = int(hf_config["vocab_size"])
        spec = config.speculative_config
        self.num_draft_tokens = spec.num_draft_tokens if spec.enabled else 0
        # no KV cache: the master sizes the DP groups' caches from the attention ranks alone
        self.num_blocks, self.layout, self.kv_region = 0, SimpleNamespace(bytes_per_token=0), None
        self.weights_addr = ""
        self.background_wakeup = None  # no KV connectors: expert moves are polled for (`background_busy`)
        self.num_rollbacks = 0
        self.rows_served = 0  # A2E rows computed here (logs, benchmarks)
        self._rollback_events: list[str] = []

    @property
    def moe_layers(self) -> list[int]:
        return self.experts.moe_layers

    @property
    def num_logical_experts(self) -> int:
        return self.experts.num_logical_experts

    @property
    def background_busy(self) -> bool:
        return self.experts.busy

    def run_batch(self, batch: StepBatch, agreed=None) -> None:
        """Apply the batch's expert-placement control; serve its forward when it has one."""
        if batch.eplb is not None:
            self.experts.apply(batch.eplb)
        if batch.per_dp:  # the attention ranks all run a forward, idle DP groups too
            self._serve_rolling_back(batch.per_dp[0], batch.microbatches)

    def _mtp_forwards(self, sched: SchedulerOutput) -> int:
        """The MTP forwards the attention ranks run this step (`ModelRunner.mtp_forwards_of`; every DP group's
        scheduler speculates alike): the catch-up, and the drafting ones when the step drafts."""
        if not self.num_draft_tokens or not sched.mtp_catch_up:
            return 0
        return self.num_draft_tokens if sched.num_draft_tokens > 0 else 1

    def _serve_rolling_back(self, sched: SchedulerOutput, microbatches: int) -> None:
        step_id = sched.step_id
        for attempt in itertools.count(1):
            try:
                self.rows_served += self.model.serve_forward(microbatches)
                self.rows_served += self.model.serve_mtp(self._mtp_forwards(sched), microbatches)
                return
            except Exception as exc:
                if not is_transient(exc) or attempt == MAX_STEP_ATTEMPTS:
                    raise
                self.parallel.agree_on_rollback(step_id)
                self.parallel.rebuild_groups()
                self.num_rollbacks += 1
                detail = (f"step {step_id} attempt {attempt} of {MAX_STEP_ATTEMPTS} failed ({describe_error(exc)}); "
                          f"rollback {self.num_rollbacks} of this rank")
                logger.warning("%s: rolled back, serving it again", detail)
                self._rollback_events.append(detail)

    def poll_background(self) -> list[tuple[str, str]]:
        events = [(WorkerEventKind.ROLLED_BACK, detail) for detail in self._rollback_events]
        self._rollback_events.clear()
        return events + self.experts.poll()

    def take_kv_connector_report(self) -> None:
        return None  # no KV cache, no connector

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
