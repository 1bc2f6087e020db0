"""A rank without a model, for measuring everything around the model (`meshserve bench control-plane`).

Under MESHSERVE_NULL_MODEL_MS (benchmarks only) each rank runs this in place of the `ModelRunner`: it keeps each
request's tokens as the runner would, and a step "produces" a made-up token for every request that reaches the
end of its known tokens, with no collective of the model and a forward that only sleeps the given time (a
model's step time without its CPU use, so the control plane's processes keep the cores). What a step takes
beyond that sleep is the control plane: the master's scheduling, the messages to and from the ranks, the
self-contained groups' agreement round, the outputs to the client.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from meshserve.config import EngineConfig
from meshserve.wire.worker import ModelRunnerOutput, SchedulerOutput, StepBatch

NULL_VOCAB_SIZE = 32_000
_DEFAULT_BLOCKS = 4096


@dataclass
class _Held:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class NullRunner:
    """`ModelRunner`'s interface to the worker loop, without a model."""

    def __init__(self, config: EngineConfig, parallel, forward_s: float = 0.0) -> None:
        self.config, self.parallel, self.forward_s = config, parallel, forward_s
        self.num_blocks = config.cache_config.num_kv_blocks or _DEFAULT_BLOCKS
        self.layout = SimpleNamespace(bytes_per_token=1)
        self.moe_layers, self.num_logical_experts, self.kv_region = [], 0, None
        self.vocab_size = NULL_VOCAB_SIZE
        self.load_info = SimpleNamespace(start=0.0, end=0.0, source="", nbytes=0)
        self.weights_addr = ""
        self.background_busy = False
        self.background_wakeup = None  # no background work to wake the loop for
        self._held: dict[str, _Held] = {}

    def run_batch(self, batch: StepBatch, agreed=None) -> ModelRunnerOutput | None:
        if not batch.per_dp:
            return None
        sched = batch.per_dp[self.parallel.dp_rank if agreed is None else 0]
        out = self.execute_rolling_back(sched)
        if not self.parallel.is_driver:
            return None
        out.dp_rank = self.parallel.dp_rank if agreed is None else 0
        return out

    def execute_rolling_back(self, sched: SchedulerOutput, microbatches: int = 1, agreed=None) -> ModelRunnerOutput:
        if self.forward_s:
            time.sleep(self.forward_s)
        for req_id in sched.finished_req_ids:
            self._held.pop(req_id, None)
        for new in sched.new_reqs:
            self._held[new.req_id] = _Held(list(new.token_ids), new.num_computed_tokens, list(new.block_ids))
        sampled = {}
        for req_id, n in sched.num_scheduled_tokens.items():
            held = self._held[req_id]
            held.num_computed += n
            if held.num_computed >= len(held.tokens):
                token = 100 + len(held.tokens) % 1000  # never an EOS of a real tokenizer's first ids
                held.tokens.append(token)
                sampled[req_id] = [token]
        return ModelRunnerOutput(step_id=sched.step_id, sampled=sampled)

    def mtp_forwards_of(self, sched: SchedulerOutput) -> int:
        return 0

    def apply_eplb(self, command) -> None:
        pass

    def poll_background(self) -> list:
        return []

    def take_kv_connector_report(self) -> None:
        return None

    def start_kv_connectors(self, metadata) -> None:
        pass

    def close(self) -> None:
        pass
