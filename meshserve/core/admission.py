"""Admission: a TE's new requests checked, turned into `Request`s and handed to the DP waiting queue.

A request whose fields this model cannot take is refused alone, with an error delta naming the error's
class (the caller's other requests go on). A request may name a context cache to create or reuse
(deepserve MatchByID), carry its part of a disaggregated prefill -> decode transfer (through the KV
connectors), or come with output tokens from a failed TE, from which it goes on (token recomputation).
"""
from __future__ import annotations

from meshserve.core.kv_connector import KVConnectors
from meshserve.core.rank_health import RecoveryState
from meshserve.core.request import Request
from meshserve.core.request_outputs import RequestOutputs
from meshserve.core.waiting_queue import DPWaitingQueue
from meshserve.wire.client import AddRequest, FinishReason, RequestDelta, error_type_of
from meshserve.wire.errors import InvalidRequestError, QueueFullError, RequestTooLongError
from meshserve.wire.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, SamplingParamsError

MAX_REQUEST_ID_CHARS = 256
MAX_TENANCY_CHARS = 256  # a tenant name or cache salt (the frontend sends hashes of 16 to 64 characters)
MAX_ID_LIST = 1024  # eos and stop token ids of one request


def check_token_ids(token_ids: list[int], vocab_size: int, what: str) -> None:
    """InvalidRequestError unless every id is in the vocabulary [0, vocab_size)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(f"{what} token id {bad} is outside the vocabulary [0, {vocab_size})")


def set_context_cache(request: Request, item: AddRequest) -> None:
    """Explicit context caching (deepserve MatchByID): a ttl makes the request create the named cache."""
    if item.context_cache_ttl_s is not None:
        if not item.context_cache_id:
            raise ValueError("context_cache_ttl_s needs a context_cache_id to pin the prompt under")
        if not item.context_cache_ttl_s > 0:
            raise ValueError(f"context_cache_ttl_s must be positive, got {item.context_cache_ttl_s}")
    request.context_cache_id = item.context_cache_id or None
    request.context_cache_ttl_s = item.context_cache_ttl_s


class Admission:
    """Admits AddRequests into the DP groups of the ranks served now (built again with them)."""

    def __init__(self, vocab_size: int, block_size: int, queue: DPWaitingQueue, kv_connectors: KVConnectors,
                 outputs: RequestOutputs, recovery: RecoveryState) -> None:
        self.vocab_size = vocab_size  # every token id a request names must be below it
        self.block_size = block_size
        self.queue = queue
        self.kv_connectors = kv_connectors
        self.outputs = outputs
        self.recovery = recovery  # counts the requests that go on from another TE's tokens

    def add(self, item: AddRequest) -> None:
        """Admit the request, or refuse it with an error delta."""
        try:
            params = self.check(item)
        except ValueError as exc:  # InvalidRequestError, SamplingParamsError
            self.reject(item, exc)
            return
        self.outputs.route(item.req_id, item.reply_to)
        try:
            self.queue.admit(self._request(item, params))
        except (QueueFullError, RequestTooLongError, ValueError) as exc:
            self.reject(item, exc)

    def check(self, item: AddRequest) -> SamplingParams:
        """The request's sampling settings, once every field is within what this model takes
        (InvalidRequestError or SamplingParamsError otherwise): a bad request is refused here, alone."""
        if not item.req_id or len(item.req_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"a request id must have 1 to {MAX_REQUEST_ID_CHARS} characters")
        if not item.prompt_token_ids:
            raise InvalidRequestError("the prompt has no tokens")
        if len(item.eos_token_ids) > MAX_ID_LIST:
            raise InvalidRequestError(f"more than {MAX_ID_LIST} eos token ids")
        for what, token_ids in (("prompt", item.prompt_token_ids), ("eos", item.eos_token_ids),
                                ("output", item.output_token_ids)):
            check_token_ids(token_ids, self.vocab_size, what)
        if max(len(item.tenancy.tenant), len(item.tenancy.cache_salt)) > MAX_TENANCY_CHARS:
            raise InvalidRequestError(f"a tenant or cache salt must have at most {MAX_TENANCY_CHARS} characters")
        if not INT64_MIN <= item.priority <= INT64_MAX:
            raise InvalidRequestError(f"priority must fit in a signed 64-bit integer, got {item.priority}")
        params = item.sampling_params  # its own checks ran when the frame was decoded
        if len(params.stop_token_ids) > MAX_ID_LIST:
            raise SamplingParamsError(f"more than {MAX_ID_LIST} stop token ids", param="stop_token_ids")
        params.verify(self.vocab_size)
        return params

    def _request(self, item: AddRequest, params: SamplingParams) -> Request:
        """The Request the schedulers run; QueueFullError when its context cache may not pin more blocks."""
        request = Request(req_id=item.req_id, prompt_token_ids=item.prompt_token_ids,
                          sampling_params=params, arrival_time=item.arrival_time, priority=item.priority,
                          eos_token_ids=item.eos_token_ids)
        set_context_cache(request, item)
        request.tenancy = item.tenancy
        if request.context_cache_ttl_s is not None and not self.queue.can_pin(
                request.num_prompt_tokens // self.block_size):
            raise QueueFullError("named context caches already pin the share of the KV cache they may hold; "
                                 "delete some or wait for them to expire")
        if item.kv_transfer is not None:
            # a producer here computes the prompt and the first token only; a consumer pulls the prompt's KV
            # from the prefill TE its params name and decodes from its first token
            self.kv_connectors.accept(request, item.kv_transfer, item.output_token_ids)
        elif item.output_token_ids:  # a request moved here from a failed TE: it goes on from these tokens
            self._resume(request, item.output_token_ids)
        return request

    def _resume(self, request: Request, output_token_ids: list[int]) -> None:
        """Token recomputation: the prompt and the tokens already streamed are computed here, and the request
        goes on from its next token (the client has the others)."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and len(output_token_ids) >= max_tokens:
            raise InvalidRequestError(f"{len(output_token_ids)} output tokens already reach max_tokens {max_tokens}")
        for token in output_token_ids:
            request.append_output_token(int(token))
        self.recovery.migrated += 1

    def reject(self, item: AddRequest, error: Exception) -> None:
        """Refuse one request: its caller gets an error delta naming the error's class."""
        self.outputs.route(item.req_id, item.reply_to)
        self.outputs.send([RequestDelta(req_id=item.req_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
                                        error=str(error), error_type=error_type_of(error),
                                        num_prompt_tokens=len(item.prompt_token_ids))])

    def abort(self, req_ids: list[str]) -> None:
        self.kv_connectors.release(req_ids)  # a prefill TE's held blocks, whichever DP group holds them
        self.queue.abort(req_ids)
