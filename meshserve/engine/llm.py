"""Offline batch inference: `LLM(model=DIR, **engine_args).generate(prompts, params)`."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from meshserve.config import EngineConfig
from meshserve.core import messages as msg
from meshserve.engine.core_client import EngineCoreClient
from meshserve.engine.detokenizer import load_tokenizer
from meshserve.core.errors import ADMISSION_ERRORS, EngineDeadError
from meshserve.engine.output_processor import OutputProcessor
from meshserve.models.generation_config import eos_token_ids
from meshserve.engine.outputs import RequestOutput
from meshserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """Runs a TE (master + executor processes) for the life of this object."""

    def __init__(self, model: str | None = None, *, log_level: int = logging.WARNING, **engine_args) -> None:
        if model is None:
            from meshserve.models.factory import ensure_default_model

            model = str(ensure_default_model())
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.tokenizer = load_tokenizer(model)
        self.eos_token_ids = eos_token_ids(model)
        self.processor = OutputProcessor(self.tokenizer)
        self.engine = EngineCoreClient(self.config, log_level=log_level)
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.engine.ready.max_model_len

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: int | Sequence[int] = 0, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        if len(params_list) != len(prompts) or len(priorities) != len(prompts):
            raise ValueError("sampling_params and priority must be one value or one per prompt")

        order: list[str] = []
        now = time.time()
        for prompt, params, prio in zip(prompts, params_list, priorities):
            request_id = f"offline-{next(self._ids)}"
            if isinstance(prompt, str):
                text, token_ids = prompt, self.tokenizer.encode(prompt)
            else:
                text, token_ids = None, [int(t) for t in prompt]
            order.append(request_id)
            self.engine.submit(self.processor.add_request(request_id, text, token_ids, params, now),
                               token_ids, now, prio, self.eos_token_ids)
        results = self._collect(set(order), use_tqdm)
        return [results[r] for r in order]

    def _collect(self, pending: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(pending), desc="requests", unit="req")
        results: dict[str, RequestOutput] = {}
        try:
            while pending:
                item = self.engine.recv(1000)
                if item is None:
                    if not self.engine.alive:
                        self.processor.fail_all("engine process died")
                        raise EngineDeadError("engine process died")
                    continue
                if isinstance(item, msg.EngineError):
                    self.processor.fail_all(item.message)
                    raise EngineDeadError(item.message)
                if not isinstance(item, msg.EngineOutputs):
                    continue
                for delta in item.deltas:
                    if delta.error_type in ADMISSION_ERRORS:
                        # refused at admission: drop the whole batch so nothing keeps running unseen
                        for request_id in pending:
                            to_abort = self.processor.abort(request_id)
                            if to_abort:
                                self.engine.send(msg.AbortRequests(req_ids=to_abort))
                        raise ADMISSION_ERRORS[delta.error_type](delta.error)
                    out, to_abort = self.processor.process(delta, time.time())
                    if to_abort:
                        self.engine.send(msg.AbortRequests(req_ids=to_abort))
                    if out is not None and out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return results

    def get_stats(self, timeout_s: float = 10.0) -> msg.EngineStats:
        """The engine's counters (running/waiting, KV usage, prefix-cache hits, preemptions)."""
        self.engine.send(msg.StatsQuery())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            item = self.engine.recv(200)
            if isinstance(item, msg.EngineStats):
                return item
            if isinstance(item, msg.EngineError):
                raise EngineDeadError(item.message)
        raise TimeoutError(f"engine did not answer a stats query in {timeout_s:.0f}s")

    def admin(self, op: str, args: dict | None = None, timeout_s: float = 30.0) -> dict:
        """An operator command to the engine (e.g. "eplb.status", "eplb.load", "eplb.rebalance"): its data.

        Raises RuntimeError with the engine's reason when the command is refused.
        """
        query_id = next(self._ids)
        self.engine.send(msg.AdminRequest(query_id=query_id, op=op, args=args or {}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            item = self.engine.recv(200)
            if isinstance(item, msg.AdminReply) and item.query_id == query_id:
                if not item.ok:
                    raise RuntimeError(item.error)
                return item.data
            if isinstance(item, msg.EngineError):
                raise EngineDeadError(item.message)
        raise TimeoutError(f"engine did not answer {op} in {timeout_s:.0f}s")

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
