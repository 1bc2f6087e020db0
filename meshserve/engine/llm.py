"""Offline batch inference: `LLM(model=DIR, **engine_args).generate(prompts, params)`."""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tqdm import tqdm

from meshserve.config import EngineConfig
from meshserve.engine.client_core import ClientCore
from meshserve.engine.core_client import EngineCoreClient
from meshserve.engine.detokenizer import load_tokenizer
from meshserve.engine.outputs import RequestOutput
from meshserve.models.factory import ensure_default_model
from meshserve.models.generation_config import eos_token_ids
from meshserve.wire.client import AdminRequest, EngineError, EngineStats, StatsQuery
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """Runs a TE (master + worker processes) for the life of this object."""

    def __init__(self, model: str | None = None, *, log_level: int = logging.WARNING, **engine_args) -> None:
        if model is None:
            model = str(ensure_default_model())
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        # the tokenizer (transformers and torch to import, about 2 s) loads while the engine's processes start
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer") as loader:
            tokenizer = loader.submit(load_tokenizer, model)
            self.engine = EngineCoreClient(self.config, log_level=log_level)
            try:
                self.tokenizer = tokenizer.result()
            except BaseException:
                self.engine.shutdown()
                raise
        self.eos_token_ids = eos_token_ids(model)
        self.core = ClientCore(self.tokenizer, self.engine.abort)
        self.processor = self.core.processor
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.engine.ready.max_model_len

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
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
        outbox: deque = deque()  # every request's outputs (and errors), in arrival order
        now = time.time()
        for prompt, params, prio in zip(prompts, params_list, priorities):
            request_id = f"offline-{next(self._ids)}"
            if isinstance(prompt, str):
                text, token_ids = prompt, self.tokenizer.encode(prompt)
            else:
                text, token_ids = None, [int(t) for t in prompt]
            order.append(request_id)
            children = self.core.register(request_id, text, token_ids, params, now, outbox.append)
            self.engine.submit(children, token_ids, now, prio, self.eos_token_ids)
        results = self._collect(set(order), outbox, use_tqdm)
        return [results[r] for r in order]

    def _collect(self, pending: set[str], outbox: deque, use_tqdm: bool) -> dict[str, RequestOutput]:
        bar = None
        if use_tqdm:
            bar = tqdm(total=len(pending), desc="requests", unit="req")
        results: dict[str, RequestOutput] = {}
        try:
            while pending:
                self._receive(1000)
                while outbox:
                    out = outbox.popleft()
                    if isinstance(out, Exception):
                        raise out  # e.g. refused at admission: the batch's other requests are aborted below
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        self.core.release(out.request_id, finished=True)
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            for request_id in pending:  # nothing keeps running unseen
                self.core.release(request_id, finished=False)
            if bar is not None:
                bar.close()
        return results

    def _receive(self, timeout_ms: int) -> None:
        """Take the engine's next message into the client core; raises EngineDeadError once the engine is gone."""
        item = self.engine.recv(timeout_ms)
        if item is None:
            if not self.engine.alive:
                self.core.engine_died("engine process died")
                raise EngineDeadError("engine process died")
            return
        self.core.on_message(item)
        if isinstance(item, EngineError):
            raise EngineDeadError(item.message)

    def get_stats(self, timeout_s: float = 10.0) -> EngineStats:
        """The engine's counters (running/waiting, KV usage, prefix-cache hits, preemptions)."""
        reply: Future = Future()
        self.core.replies.wait_for_stats(reply)
        self.engine.send(StatsQuery())
        return self._await_reply(reply, timeout_s, "a stats query")

    def admin(self, op: str, args: dict | None = None, timeout_s: float = 30.0) -> dict:
        """An operator command to the engine (e.g. "eplb.status", "eplb.load", "eplb.rebalance"): its data.

        Raises RuntimeError with the engine's reason when the command is refused.
        """
        reply: Future = Future()
        query_id = self.core.replies.open(reply)
        self.engine.send(AdminRequest.of(query_id, op, args))
        try:
            answer = self._await_reply(reply, timeout_s, op)
        finally:
            self.core.replies.forget(query_id)
        if not answer.ok:
            raise RuntimeError(answer.error)
        return answer.to_json()

    def _await_reply(self, reply: Future, timeout_s: float, what: str):
        """The reply once it came (raises EngineDeadError if the engine reports its death first)."""
        deadline = time.monotonic() + timeout_s
        while not reply.done() and time.monotonic() < deadline:
            item = self.engine.recv(200)
            if item is not None:
                self.core.on_message(item)
        if not reply.done():
            raise TimeoutError(f"engine did not answer {what} in {timeout_s:.0f}s")
        return reply.result()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
