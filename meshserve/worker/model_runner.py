"""The model runner: the one place where scheduling decisions meet tensors.

It keeps, per request, the token ids it has seen or sampled, the block table and
the sampling state, so the master only sends what changed each step. Decode
inputs come from the runner's own last sampled token; this is what lets the
master schedule step n+1 before step n has returned.

Under speculative decoding (MTP) the runner also keeps each sequence's drafts:
a decode scheduled for 1 + j tokens verifies up to j of them as one-token rows
(each attends to the cache up to its own position, so the decode attention
kernels serve verification unchanged), accepts or rejects them here, and
reports the tokens it produced; the MTP proposer then drafts the next ones.

A request whose settings make it fail here (its sampler raises, its token ids
lie outside the vocabulary) fails alone: it is reported in
`ModelRunnerOutput.failed`, this rank stops running it at once (a step already
queued for it skips it), and the step's other requests go on.

A step that fails with a transient collective error (a network glitch: a connection
closed or reset under gloo or NCCL, or a collective that outlasted
`collective_timeout_s` waiting for a failed peer; meshserve/parallel/rollback.py) is
rolled back and run again, up to MAX_STEP_ATTEMPTS times, without restarting
anything (xdeepserve §6.2, Stage 3): the request state a step changes (the request
table, each scheduled request's token, block and draft lists, its progress and its
seeded generator) is snapshotted before the step and restored after the failure; the
ranks agree through the world's store that all of them failed this step, replace
their process groups with new ones (the broken communicators cannot be reused) and
run the same `SchedulerOutput` again. The KV cache needs no restoring: the re-run
writes the same entries. Only the forward part of a batch is retried (its KV
connector and expert-placement control ran once, before it). Expert-load counts keep
what the failed attempt routed (statistics only). Every rank reports each rollback
(`WorkerEventKind.ROLLED_BACK`). A rollback the ranks cannot agree on
(`RollbackAbandoned`: they failed different steps, or a rank never came) and the last
failed attempt (`StepRetriesExhausted`) end the worker as any other error does, and
the master recovers the ranks.
"""
from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from meshserve.config import EngineConfig
from meshserve.layers.kv_quant import cache_dtype
from meshserve.layers.metadata import AttentionMetadata
from meshserve.models.draft_vocab import load_draft_vocab
from meshserve.models.generation_config import eos_token_ids
from meshserve.models.loader import load_hf_config, resolve_dtype
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.rollback import is_transient
from meshserve.utils import envs
from meshserve.utils.wakeup import Wakeup
from meshserve.wire.eplb import EplbCommand
from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport, KVRegion
from meshserve.wire.worker import (
    ModelRunnerOutput,
    NewRequestData,
    SampleLogprobs,
    SchedulerOutput,
    StepBatch,
    WorkerEventKind,
)
from meshserve.worker.grammar_masks import GrammarMasks, StepMasks
from meshserve.worker.kv_connector.base import KVConnectorWorker
from meshserve.worker.kv_connector.pool import PoolConnectorWorker
from meshserve.worker.mtp_proposer import CatchUp, MTPProposer
from meshserve.worker.rank_model import RankExperts, load_rank_model, load_threads, pool_client
from meshserve.worker.request_state import RequestState, StepSeq, StepSnapshot
from meshserve.worker.sampler import (
    FAILED_TOKEN,
    Sampler,
    SamplerOutput,
    SamplingRow,
    describe_error,
    is_process_fault,
    make_generator,
)
from meshserve.worker.spec_decode import DraftRow, VerifyOutput, verify_drafts
from meshserve.worker.step_agreement import AgreedStep
from meshserve.worker.weight_fork import WeightServer, fork_identity

logger = logging.getLogger(__name__)

_NO_TOKEN = -2  # padding of the verified tokens a driver shares with its attention TP group
MAX_STEP_ATTEMPTS = 3  # a step failing with a transient error runs at most this often before the rank gives up


class StepRetriesExhausted(RuntimeError):
    """A step failed with a transient error on each of its MAX_STEP_ATTEMPTS attempts."""


def kv_blocks_for_budget(bytes_per_token: int, block_size: int, budget_bytes: float) -> int:
    return max(1, int(budget_bytes // (bytes_per_token * block_size)))


class ModelRunner:
    """One rank's runner. With several ranks, every rank of a DP group runs the same step; the
    group's driver samples and shares the tokens, so all of them keep the same token state."""

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None) -> None:
        self.config = config
        self.parallel = parallel or ParallelContext.single()
        self.device = torch.device(config.model_config.device)
        if self.device.type == "cuda" and self.device.index is None and self.parallel.world_size > 1:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.hf_config = load_hf_config(config.model_config.model)
        self.dtype = resolve_dtype(config.model_config.dtype, self.hf_config)
        # this rank's client of the memory pool (None without one): model weights and context (KV) caching
        self.pool = pool_client(config, self.parallel)
        with load_threads(config.parallel_config.num_local_ranks):
            self.model, self.load_info = load_rank_model(config, self.parallel, self.dtype, self.device, self.pool)
        logger.info("loaded %s from %s in %.1fs (%.1f MiB)", config.model_config.model, self.load_info.source,
                    self.load_info.end - self.load_info.start, self.load_info.nbytes / 2**20)
        # new TEs of this layout fork their weights from here; started before an initial placement moves experts
        self.weight_server = None
        if config.model_config.serve_weights:
            self.weight_server = WeightServer(
                self.model, fork_identity(config.model_config.model, self.dtype, config.model_config.quantization,
                                          self.parallel),
                host=config.parallel_config.master_addr, name=f"{config.te_name}/rank{self.parallel.rank}/weights",
                background=True)
        if config.parallel_config.microbatches == 2 and not self.model.supports_microbatches:
            raise ValueError(f"--microbatches 2: {type(self.model).__name__} runs a step as one batch only "
                             "(two micro-batches are built for DeepSeek-V3 models)")
        spec = config.speculative_config
        if spec.enabled and not self.model.num_mtp_layers:
            raise ValueError(f"--speculative mtp: {config.model_config.model} has no MTP layers "
                             "(its config.json counts no num_nextn_predict_layers, or the checkpoint holds none)")
        num_mtp_caches = 1 if spec.enabled else 0  # one MTP layer, reused for k > 1 drafts
        self.layout = self.model.kv_cache_layout(cache_dtype(config.cache_config.kv_cache_dtype, self.dtype),
                                                 num_mtp_caches)
        self.num_model_layers = self.layout.num_layers - num_mtp_caches
        self._allocate_kv_cache(config)
        self.eos_token_ids = eos_token_ids(config.model_config.model)
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.sampler = Sampler()
        # structured outputs: the rank that samples keeps each constrained request's grammar
        self.grammar = (GrammarMasks(config.model_config.model, self.vocab_size, self.eos_token_ids)
                        if self.parallel.is_driver else None)
        self.requests: dict[str, RequestState] = {}
        # requests that failed on this rank; steps skip them until the master says to drop them
        self.failed_ids: set[str] = set()
        self.num_rollbacks = 0  # steps rolled back after a transient error and run again
        self._rollback_events: list[str] = []  # rollbacks not reported yet (`poll_background`)
        self.model_kv_caches = self.kv_caches[:self.num_model_layers]
        self.proposer = None
        if spec.enabled:
            self.proposer = MTPProposer(self.model, spec.num_draft_tokens, self.kv_caches[self.num_model_layers],
                                        self.block_size, self.device, lockstep=self.parallel.world_size > 1,
                                        draft_vocab=self._draft_vocab(spec.speculative_draft_vocab))
        # a prefill TE hands its requests over after their first token: it fills the MTP cache, never drafts
        self.drafts_wanted = config.kv_transfer_config.kv_transfer != "producer"
        self.experts = RankExperts(getattr(self.model, "expert_balancer", None))
        if config.eplb_config.eplb_placement:
            self.experts.apply_initial_placement(config.eplb_config.eplb_placement)

    def _allocate_kv_cache(self, config: EngineConfig) -> None:
        """This rank's KV cache (its blocks from the memory budget unless counted) and the KV connectors' worker
        halves: P/D transfer (its region is the KV cache), the memory pool."""
        cache = config.cache_config
        if cache.num_kv_blocks is not None:
            self.num_blocks = cache.num_kv_blocks
        else:
            self.num_blocks = kv_blocks_for_budget(self.layout.bytes_per_token, cache.block_size,
                                                   cache.kv_cache_memory_gb * 2**30)
        self.block_size = cache.block_size
        # KV connectors' worker halves: P/D transfer (its region is the KV cache), the memory pool; their threads
        # wake the rank's loop as a pull or fetch ends
        self.background_wakeup = Wakeup()
        self.kv_connectors: list[KVConnectorWorker] = []
        self.pd_connector = None  # disaggregated prefill/decode: this rank's KV cache as a transfer region
        if config.kv_transfer_config.kv_transfer != "none":
            # imported here: only P/D TEs start a transfer engine
            from meshserve.worker.kv_connector.pd import PDConnectorWorker

            self.pd_connector = PDConnectorWorker(
                f"{config.te_name}/rank{self.parallel.rank}", config.parallel_config.master_addr,
                config.kv_transfer_config.kv_transfer_backend,
                self.layout.num_layers, self.num_blocks, self.block_size, self.layout.entry_shape,
                self.layout.dtype, self.device, self.parallel.attn_tp_rank)
            self.kv_connectors.append(self.pd_connector)
            self.kv_caches = self.pd_connector.kv_caches
        else:
            self.kv_caches = self.layout.allocate(self.num_blocks, self.block_size, self.device)
        # context caching: blocks go to the pool and populate the KV cache from it in the background
        self.kv_connectors.append(PoolConnectorWorker(
            self.pool, config.pool_config.pool_namespace, self.parallel.attn_tp_rank, self.parallel.attn_tp_size,
            self.kv_caches))
        for connector in self.kv_connectors:
            connector.wake_with(self.background_wakeup.notify)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB, %d B/token, %s)", self.num_blocks, self.block_size,
                    self.num_blocks * self.block_size * self.layout.bytes_per_token / 2**20,
                    self.layout.bytes_per_token, str(self.layout.dtype).removeprefix("torch."))

    @property
    def weights_addr(self) -> str:
        """This rank's weight server once its snapshot is whole ("" before: a `WEIGHTS_SERVED` event follows)."""
        return self.weight_server.address if self.weight_server is not None and self.weight_server.ready else ""

    def _draft_vocab(self, size: int) -> list[int] | None:
        """The tokens drafts choose from; None: the whole vocabulary (also under attention TP, where each rank
        already holds only its slice of the head)."""
        if not size or size >= self.vocab_size or self.parallel.attn_tp_size > 1:
            return None
        ids, source = load_draft_vocab(self.config.model_config.model, size, self.vocab_size)
        logger.info("MTP drafts from the %d most frequent tokens (ranked by %s)", size, source)
        return ids

    # ------------------------------------------------------------------ expert placement (xdeepserve §4.5)
    @property
    def moe_layers(self) -> list[int]:
        return self.experts.moe_layers

    @property
    def num_logical_experts(self) -> int:
        return self.experts.num_logical_experts

    def start_kv_connectors(self, metadata: dict[int, KVConnectorMetadata]) -> None:
        """This DP group's remote-KV work (pool stores and fetches, KV pulls); every rank of the group
        starts it at the same step boundary, before the step's forward can overwrite a stored block."""
        meta = metadata.get(self.parallel.dp_rank)
        if meta is None:
            return
        if meta.kv_pulls and self.pd_connector is None:
            raise RuntimeError("KV pull ordered on a TE that is not a decode TE")
        for connector in self.kv_connectors:
            connector.start_load_kv(meta)

    def take_kv_connector_report(self) -> KVConnectorReport | None:
        """What the KV connectors finished since the last call; None: nothing."""
        report = KVConnectorReport(rank=self.parallel.rank, dp_rank=self.parallel.dp_rank)
        for connector in self.kv_connectors:
            connector.get_finished(report)
        return None if report.is_empty else report

    def apply_eplb(self, command: EplbCommand) -> None:
        """One phase of an expert-placement reconfiguration; every rank applies it at the same step boundary."""
        self.experts.apply(command)

    @property
    def background_busy(self) -> bool:
        return (self.experts.busy
                or (self.weight_server is not None and self.weight_server.pending)
                or any(connector.busy for connector in self.kv_connectors))

    @property
    def kv_region(self) -> KVRegion | None:
        return self.pd_connector.region if self.pd_connector is not None else None

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()
        for connector in self.kv_connectors:
            connector.close()  # the P/D one unlinks the shared-memory KV cache
        self.background_wakeup.close()
        if self.weight_server is not None:
            self.weight_server.close()

    def poll_background(self) -> list[tuple[str, str]]:
        """(kind, detail) of background work that finished since the last call (KV connectors aside)."""
        events = [(WorkerEventKind.ROLLED_BACK, detail) for detail in self._rollback_events]
        self._rollback_events.clear()
        events += self.experts.poll()
        if self.weight_server is not None and self.weight_server.take_ready():
            events.append((WorkerEventKind.WEIGHTS_SERVED, self.weight_server.address))
        return events

    def take_expert_load(self) -> list[list[int]] | None:
        return self.experts.take_load()

    # ------------------------------------------------------------------ state updates
    def _add(self, new: NewRequestData) -> None:
        if new.token_ids and (min(new.token_ids) < 0 or max(new.token_ids) >= self.vocab_size):
            bad = next(t for t in new.token_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        params = new.sampling_params
        params.validate()  # decoding checked them; a caller in this process may have changed them since
        generator = None
        if params.seed is not None:
            generator = make_generator(params.seed, self.device)  # on the logits' device, as the sampler needs
        self.requests[new.req_id] = RequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            params=params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            generator=generator,
            prompt_token_ids=list(new.token_ids[: new.num_prompt_tokens]),
            # the outputs a resumed request already has reach its matcher with its first step's masks
            matcher=None if self.grammar is None else self.grammar.matcher_for(params),
            num_matched=None if params.structured_outputs and params.structured_outputs.starts_after else 0,
        )
        if generator is not None and len(new.token_ids) > new.num_prompt_tokens:
            # resumed after preemption: advance the generator past the tokens already sampled
            # so a seeded request stays reproducible
            for _ in range(len(new.token_ids) - new.num_prompt_tokens):
                torch.empty(1, device=self.device).exponential_(generator=generator)

    def _apply(self, sched: SchedulerOutput) -> dict[str, str]:
        """Take the step's request changes; the new requests that could not be taken on, and why."""
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
            self.failed_ids.discard(req_id)
        failed = {}
        for new in sched.new_reqs:
            try:
                self._add(new)
            except Exception as exc:  # noqa: BLE001 - one request's settings fail that request alone
                if is_process_fault(exc):
                    raise
                failed[new.req_id] = describe_error(exc)
                self.failed_ids.add(new.req_id)
                logger.warning("request %s failed: %s", new.req_id, failed[new.req_id])
        for cached in sched.cached_reqs:
            if cached.req_id in self.failed_ids:
                continue
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            # the master may not have seen the drafts the last verification accepted yet: this count leads
            if state.num_computed_tokens < cached.num_computed_tokens:
                failed[cached.req_id] = (f"the master booked {cached.num_computed_tokens} computed tokens, "
                                         f"the worker only {state.num_computed_tokens}")
                self.requests.pop(cached.req_id)
                self.failed_ids.add(cached.req_id)
                logger.error("request %s failed: %s", cached.req_id, failed[cached.req_id])
        return failed

    # ------------------------------------------------------------------ one step
    def run_batch(self, batch: StepBatch, agreed: AgreedStep | None = None) -> ModelRunnerOutput | None:
        """Apply the batch's control, run this rank's DP group's part; the output the driver reports. `agreed`:
        the step as the ranks of self-contained DP groups agreed on it, whose `per_dp` then holds this rank's
        group's part alone (worker/step_agreement.py)."""
        self.start_kv_connectors(batch.kv_connector)
        if batch.eplb is not None:
            self.apply_eplb(batch.eplb)
        if not batch.per_dp:  # control only
            return None
        if agreed is None:
            out = self.execute_rolling_back(batch.per_dp[self.parallel.dp_rank], batch.microbatches)
        else:
            out = self.execute_rolling_back(batch.per_dp[0], agreed.microbatches, agreed)
        if batch.report_load:
            out.expert_load = self.take_expert_load()  # every rank resets; the driver's is reported
        if not self.parallel.is_driver:
            return None
        out.dp_rank = self.parallel.dp_rank if agreed is None else 0  # a group's master holds that group alone
        return out

    def execute_rolling_back(self, sched: SchedulerOutput, microbatches: int = 1,
                             agreed: AgreedStep | None = None) -> ModelRunnerOutput:
        """`execute(sched)`; after a transient error, the state from before it and, once every rank of the TE has
        failed the same step, the same step again on new process groups, on all of them together. `agreed`:
        the forward's number among all ranks (DP groups that number their steps each on their own) and its
        MTP forwards."""
        snapshot = StepSnapshot.take(self.requests, self.failed_ids, sched)
        for attempt in itertools.count(1):
            try:
                return self.execute(sched, microbatches, None if agreed is None else agreed.mtp_forwards)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                snapshot.restore(self.requests, self.failed_ids)
                why = describe_error(exc)
                if attempt == MAX_STEP_ATTEMPTS:
                    raise StepRetriesExhausted(f"step {sched.step_id} failed {attempt} times in a row, "
                                               f"giving up after {attempt - 1} rollback(s): {why}") from exc
                # RollbackAbandoned: the master recovers the ranks
                self.parallel.agree_on_rollback(sched.step_id if agreed is None else agreed.forward_id)
                self.parallel.rebuild_groups()
                self.num_rollbacks += 1
                detail = (f"step {sched.step_id} attempt {attempt} of {MAX_STEP_ATTEMPTS} failed ({why}); "
                          f"rollback {self.num_rollbacks} of this rank")
                logger.warning("%s: rolled back, running it again", detail)
                self._rollback_events.append(detail)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, microbatches: int = 1,
                mtp_forwards: int | None = None) -> ModelRunnerOutput:
        """One attempt at a step (`execute_rolling_back` retries it); `microbatches`: as the whole step runs;
        `mtp_forwards`: the MTP forwards every rank runs this step (default: this step's own)."""
        overlap = {"microbatches": 2} if microbatches == 2 else {}
        t0 = time.perf_counter()
        failed = self._apply(sched)
        # every rank of the DP group skips the same failed requests, so the group stays in lockstep
        num_tokens = {req_id: n for req_id, n in sched.num_scheduled_tokens.items() if req_id not in self.failed_ids}
        if not num_tokens:
            if self.parallel.world_size > 1:  # an idle DP group still joins every MoE collective
                self._idle_forward(sched, overlap, mtp_forwards)
            return ModelRunnerOutput(step_id=sched.step_id, failed=failed)
        seqs = self._lay_out(num_tokens)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        for seq in seqs:
            state = seq.state
            if seq.is_decode:
                input_ids.append(state.token_ids[seq.start])
                input_ids.extend(seq.drafts)
                query_lens.extend([1] * seq.num_rows)
                context_lens.extend(range(seq.start, seq.start + seq.num_rows))
                tables.extend([state.block_ids] * seq.num_rows)
            else:
                input_ids.extend(state.token_ids[seq.start:seq.start + seq.num_rows])
                query_lens.append(seq.num_rows)
                context_lens.append(seq.start)
                tables.append(state.block_ids)
            positions.extend(range(seq.start, seq.start + seq.num_rows))
        attn = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, device=self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        sampling = [seq for seq in seqs if seq.samples]
        # structured outputs: the grammar masks are filled while the forward pass runs
        masks = self.grammar.start(sampling) if self.grammar is not None else None
        try:
            hidden = self.model(ids, pos, attn, self.model_kv_caches, **overlap)
        finally:
            if masks is not None:
                masks.wait()  # the fill walks the matchers through drafts: it ends before anything else
        out = ModelRunnerOutput(step_id=sched.step_id, failed=failed)
        produced = self._produce_tokens(hidden, sampling, out, masks)
        if self.proposer is not None and sched.mtp_catch_up:
            self._propose(hidden, seqs, produced, drafting=sched.num_draft_tokens > 0, microbatches=microbatches)
        missing = 0 if mtp_forwards is None else mtp_forwards - self.mtp_forwards_of(sched)
        if missing > 0:  # other groups draft more: their MTP collectives need this rank too
            self.proposer.idle_forwards(missing, microbatches)
        out.execute_seconds = time.perf_counter() - t0
        return out

    def _lay_out(self, num_tokens: dict[str, int]) -> list[StepSeq]:
        """The step's sequences in batch order (one-token decode rows first, as the attention kernels expect),
        each request's progress booked."""
        seqs = []
        for req_id, n in num_tokens.items():
            state = self.requests[req_id]
            start = state.num_computed_tokens
            known = len(state.token_ids)
            is_decode = start == known - 1
            if not is_decode and start + n > known:
                raise RuntimeError(f"request {req_id}: scheduled tokens [{start}, {start + n}) but only {known} known")
            drafts = state.draft_token_ids[:n - 1] if is_decode else []
            state.draft_token_ids = []
            num_rows = 1 + len(drafts) if is_decode else n
            # a verification books its first token; accepted drafts are added once known
            state.num_computed_tokens = start + (1 if is_decode else n)
            seqs.append(StepSeq(state, start, 0, num_rows, drafts, is_decode, samples=start + num_rows >= known))
        seqs.sort(key=lambda seq: not seq.is_decode)
        row = 0
        for seq in seqs:
            seq.row = row
            row += seq.num_rows
        return seqs

    def _produce_tokens(self, hidden: torch.Tensor, sampling: list[StepSeq], out: ModelRunnerOutput,
                        masks: StepMasks | None = None) -> dict[str, list[int]]:
        """Sample (or verify the drafts of) each sequence that reached its end; the tokens each produced.
        `masks`: the grammar masks of its constrained sequences."""
        if not sampling:
            return {}
        rows = [row for seq in sampling
                for row in (range(seq.row, seq.row + seq.num_rows) if seq.is_decode else [seq.row + seq.num_rows - 1])]
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=self.device)))
        mask_failures = masks.apply(logits) if masks is not None else {}
        sampling_rows = [
            SamplingRow(params=seq.state.params, prompt_token_ids=seq.state.prompt_token_ids,
                        output_token_ids=seq.state.output_token_ids, generator=seq.state.generator,
                        eos_token_ids=self.eos_token_ids)
            for seq in sampling
        ]
        if any(seq.drafts for seq in sampling):
            tokens, logprobs, failures = self._verify(logits, sampling_rows, [seq.drafts for seq in sampling])
        else:
            sampled = self._sample(logits, sampling_rows)
            tokens = [[token] for token in sampled.token_ids]
            logprobs = [None if lp is None else [lp] for lp in sampled.logprobs]
            failures = sampled.failed
        produced = {}
        for i, seq in enumerate(sampling):
            state = seq.state
            if i in failures or state.req_id in mask_failures:
                self._fail_request(state.req_id, failures.get(i) or mask_failures[state.req_id], out)
                continue
            state.token_ids.extend(tokens[i])
            if seq.is_decode:
                state.num_computed_tokens += len(tokens[i]) - 1
            produced[state.req_id] = out.sampled[state.req_id] = tokens[i]
            if seq.drafts:
                out.num_drafts[state.req_id] = len(seq.drafts)
            if logprobs[i] is not None:
                out.logprobs[state.req_id] = logprobs[i]
        return produced

    def _propose(self, hidden: torch.Tensor, seqs: list[StepSeq], produced: dict[str, list[int]],
                 drafting: bool, microbatches: int = 1) -> None:
        """Fill the MTP layer's cache for the positions this step made final and draft the next tokens (each MTP
        forward split as the step's main forward was)."""
        catch_up = []
        for seq in seqs:
            state = seq.state
            if state.req_id in self.failed_ids:
                continue
            count = len(produced[state.req_id]) if seq.is_decode else seq.num_rows
            catch_up.append(CatchUp(
                req_id=state.req_id, block_ids=state.block_ids, start=seq.start,
                hidden_rows=list(range(seq.row, seq.row + count)),
                next_token_ids=state.token_ids[seq.start + 1:seq.start + 1 + count],
                one_token_rows=seq.is_decode, drafts=self.drafts_wanted and state.req_id in produced))
        for req_id, drafts in self.proposer.propose(hidden, catch_up, drafting, microbatches).items():
            self.requests[req_id].draft_token_ids = drafts

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample on the driver; the other ranks of its attention TP group receive the tokens, a failed
        row's as FAILED_TOKEN (so every rank fails the same requests)."""
        if self.parallel.attn_tp_size == 1:
            return self.sampler.sample_isolating(logits, rows)
        tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        sampled = SamplerOutput(token_ids=[], logprobs=[None] * len(rows))
        if self.parallel.is_driver:
            sampled = self.sampler.sample_isolating(logits, rows)
            tokens.copy_(torch.as_tensor([int(t) for t in sampled.token_ids], dtype=torch.int64))
        self.parallel.attn_broadcast_from_driver(tokens)
        sampled.token_ids = tokens.tolist()
        if not self.parallel.is_driver:
            sampled.failed = {i: "sampling failed on the driver rank" for i, t in enumerate(sampled.token_ids)
                              if t == FAILED_TOKEN}
        return sampled

    def _fail_request(self, req_id: str, error: str, out: ModelRunnerOutput) -> None:
        """Stop running a request that failed here; the master finishes it with the error."""
        logger.warning("request %s failed: %s", req_id, error)
        self.requests.pop(req_id, None)
        self.failed_ids.add(req_id)
        out.failed[req_id] = error

    def _verify(self, logits: torch.Tensor, rows: list[SamplingRow],
                drafts: list[list[int]]) -> tuple[list[list[int]], list[list[SampleLogprobs] | None], dict[int, str]]:
        """Accept or reject each sequence's drafts on the driver (the other ranks of its attention TP group
        receive the tokens): per sequence its produced tokens and their logprobs, and the failed sequences."""
        width = 1 + max(len(d) for d in drafts)
        packed = torch.full((len(rows), width), _NO_TOKEN, dtype=torch.int64, device=self.device)
        verified = VerifyOutput(token_ids=[], logprobs=[None] * len(rows))
        if self.parallel.is_driver:
            verified = verify_drafts(self.sampler, logits, [DraftRow(row, d) for row, d in zip(rows, drafts)])
            for i, tokens in enumerate(verified.token_ids):
                packed[i, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64)
        if self.parallel.attn_tp_size > 1:
            self.parallel.attn_broadcast_from_driver(packed)
        tokens = [[t for t in row if t != _NO_TOKEN] for row in packed.tolist()]
        failed = verified.failed
        if not self.parallel.is_driver:
            failed = {i: "sampling failed on the driver rank" for i, t in enumerate(tokens) if t[0] == FAILED_TOKEN}
        return tokens, verified.logprobs, failed

    def _idle_forward(self, sched: SchedulerOutput, overlap: dict, mtp_forwards: int | None = None) -> None:
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.model(empty, empty, AttentionMetadata.empty(self.device), self.model_kv_caches, **overlap)
        forwards = self.mtp_forwards_of(sched) if mtp_forwards is None else mtp_forwards
        if forwards:
            self.proposer.idle_forwards(forwards, overlap.get("microbatches", 1))

    def mtp_forwards_of(self, sched: SchedulerOutput) -> int:
        """The MTP forwards a step runs: its catch-up, and the drafting ones after it when it drafts."""
        if self.proposer is None or not sched.mtp_catch_up:
            return 0
        return self.proposer.num_draft_tokens if sched.num_draft_tokens > 0 else 1


def configure_threads(num_threads: int | None, world_size: int = 1) -> int:
    """Torch threads of one rank: as asked, else MESHSERVE_NUM_THREADS, else this machine's cores shared among
    the ranks."""
    n = num_threads or envs.num_threads() or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(n)
    return n
