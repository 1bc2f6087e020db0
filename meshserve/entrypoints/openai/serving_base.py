"""What every route family of the API shares: the engine and its served name, the server's options and
metrics, request checks, tokenizing off the event loop, and the mapping of failures to OpenAI error JSON.

`ServingContext` is the one shared state of an app; each route family (serving_completions.py,
serving_chat.py, serving_caches.py, serving_status.py, serving_admin.py) is a `ServingBase` over it.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from meshserve.engine.protocol import EngineClientProtocol
from meshserve.entrypoints.openai.admission import AdmissionGate, AdmissionLimits
from meshserve.entrypoints.openai.cache_namespaces import CacheNamespaces
from meshserve.entrypoints.openai.chat_prompt import ChatTemplateError, encode_chat
from meshserve.entrypoints.openai.errors import bad_request, from_exception, model_not_found
from meshserve.entrypoints.openai.http_guard import PRINCIPAL_SCOPE_KEY, Principal
from meshserve.entrypoints.openai.metrics import ServerMetrics
from meshserve.entrypoints.openai.server_options import (
    PROMPT_CHARS_PER_TOKEN,
    TOKENS_PER_REQUEST_CONTEXTS,
    ServerOptions,
)
from meshserve.entrypoints.openai.structured_request import check_structured_outputs
from meshserve.structured_output.compiler import GrammarCompiler, grammar_compiler_for
from meshserve.wire.client import Tenancy
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)
RequestModel = TypeVar("RequestModel", bound=BaseModel)
T = TypeVar("T")
_MAX_REQUEST_ID_HEADER_LEN = 128
# a body larger than this is parsed on the tokenizer's thread: validating its token ids takes long enough
# to stall every other request (and /health) if done on the event loop
_PARSE_ON_LOOP_MAX_BYTES = 64 * 1024


def principal_of(raw: Request) -> Principal:
    """Who sent the request (the guard sets it; an app served without the guard sees one local client)."""
    return raw.scope.get(PRINCIPAL_SCOPE_KEY) or Principal("client:local")


class ServingContext:
    """One per app: the engine, the served model name, the options and metrics, the tokenizer's thread, the
    requests running and the shutdown signal, shared by every route family."""

    def __init__(self, engine: EngineClientProtocol, model_name: str, metrics: ServerMetrics,
                 max_queue_hint: int | None, options: ServerOptions) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.max_queue_hint = max_queue_hint
        self.options = options
        self.cache_namespaces = CacheNamespaces(options.shared_cache_keys)
        self.created = int(time.time())
        self.active_ids: set[str] = set()
        self.max_prompt_chars = options.max_prompt_chars or engine.max_model_len * PROMPT_CHARS_PER_TOKEN
        self.admission = AdmissionGate(AdmissionLimits(
            max_choices=options.max_choices_per_request,
            max_tokens=options.max_tokens_per_request or engine.max_model_len * TOKENS_PER_REQUEST_CONTEXTS,
            max_waiting=options.max_waiting_choices or max_queue_hint))
        # one thread: a fast tokenizer must not be used from two threads at once ("Already borrowed")
        self.tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        # set when a shutdown's grace period is over: the streams still running end with an error event
        self.stopping = asyncio.Event()
        self.grammar_compiler: GrammarCompiler | None = None  # structured outputs: built on first use

    def begin_shutdown(self, grace_s: float) -> None:
        """The server stopped accepting: running requests get `grace_s`, then what still runs is ended."""
        logger.info("shutting down: %d running request(s) get %g s to finish", len(self.active_ids), grace_s)
        asyncio.get_running_loop().call_later(grace_s, self.stopping.set)

    def error_json(self, exc: BaseException) -> dict[str, Any]:
        """The OpenAI error body for `exc` (a full queue quotes the queue's size when known)."""
        return from_exception(exc, max_queue_hint=self.max_queue_hint).to_dict()

    async def answer(self, work: Awaitable[Response]) -> Response:
        """`work`'s response, or the OpenAI error JSON for whatever it raised."""
        try:
            return await work
        except Exception as exc:
            return from_exception(exc, max_queue_hint=self.max_queue_hint).to_response()


class ServingBase:
    """A route family's handlers over the shared context: parsing and checking requests against the engine's
    model and vocabulary, and tokenizing on the shared thread."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    @property
    def engine(self) -> EngineClientProtocol:
        return self.context.engine

    @property
    def model_name(self) -> str:
        return self.context.model_name

    def _tenancy(self, raw: Request, cache_salt: str | None = None) -> Tenancy:
        """The sender and prefix-cache namespace every engine request of `raw` carries."""
        return self.context.cache_namespaces.tenancy(principal_of(raw).owner, cache_salt)

    async def _parse(self, model: type[RequestModel], body: bytes) -> RequestModel:
        if not body.strip():
            raise bad_request("The request body is empty; expected a JSON object.")
        # token ids (prompts, stop_token_ids) are checked against the model's vocabulary
        context = {"vocab_size": len(self.engine.tokenizer)}
        validate = functools.partial(model.model_validate_json, body, context=context)
        if len(body) <= _PARSE_ON_LOOP_MAX_BYTES:
            return validate()
        return await self._tokenizing(validate)

    async def _structured_outputs(self, req: Any) -> StructuredOutputs | None:
        """The request's output constraint, checked by the grammar engine (on the tokenizer's thread: a large
        grammar takes a while to check); None for free text."""
        found = req.structured_outputs_spec()
        if found is None:
            return None
        spec, param = found
        await self._tokenizing(lambda: check_structured_outputs(spec, param, self._grammar_compiler()))
        return spec

    def _grammar_compiler(self) -> GrammarCompiler:
        """The API's own compiler of the model's grammars (built on the first constrained request, on the
        tokenizer's thread: that takes about a second, which the event loop must not wait for)."""
        if self.context.grammar_compiler is None:
            self.context.grammar_compiler = grammar_compiler_for(self.engine.tokenizer)
        return self.context.grammar_compiler

    def _check_model_and_engine(self, model: str) -> None:
        if model != self.model_name:
            raise model_not_found(model)
        if not self.engine.healthy:
            raise EngineDeadError(self.engine.dead_error or "the engine is not running")

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(await self._tokenizing(self.engine.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    async def _tokenizing(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args)` on the tokenizer thread: a long prompt must not stall every other stream."""
        return await asyncio.get_running_loop().run_in_executor(self.context.tokenizer_thread,
                                                                functools.partial(fn, *args, **kwargs))

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse a text no model context could hold before spending time on tokenizing it."""
        limit = self.context.max_prompt_chars
        if num_chars > limit:
            raise bad_request(f"The {param} is {num_chars} characters; this server tokenizes at most "
                              f"{limit} (the model's context is {self.engine.max_model_len} "
                              "tokens).", param=param, code="context_length_exceeded")

    def _check_message_chars(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> None:
        """Message texts, tool calls and tools together (the template writes all of them)."""
        chars = sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for m in messages for v in m.values())
        self._check_prompt_chars(chars + (len(json.dumps(tools)) if tools else 0), "messages")

    def _checked_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = len(self.engine.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} in the prompt is outside the vocabulary [0, {vocab_size}).",
                              param="prompt")
        return list(token_ids)

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                     tools: list[dict[str, Any]] | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation (and the tools it may call)."""
        try:
            prompt = encode_chat(self.engine.tokenizer, messages, add_generation_prompt, tools, template_kwargs)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from exc
        return prompt.text, prompt.token_ids

    def _max_tokens(self, prompt_len: int, requested: int | None, prompt_name: str) -> int:
        """The completion budget; absent, it is whatever context the prompt leaves."""
        limit = self.engine.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your {prompt_name} "
                    f"is {prompt_len} tokens, which leaves no room for the completion. "
                    f"Please reduce the length of the {prompt_name}.",
                    param=prompt_name, code="context_length_exceeded")
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_name}, {requested} for the "
                f"completion). Please reduce the length of the {prompt_name} or the completion.",
                param="max_tokens", code="context_length_exceeded")
        return requested

    @staticmethod
    def _request_id(raw: Request, prefix: str) -> str:
        given = raw.headers.get("x-request-id")
        if given is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not given or len(given) > _MAX_REQUEST_ID_HEADER_LEN or not given.isprintable():
            raise bad_request(f"X-Request-Id must be 1 to {_MAX_REQUEST_ID_HEADER_LEN} printable characters.")
        return f"{prefix}-{given}"
