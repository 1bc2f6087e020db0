"""What the OpenAI API server needs from the engine behind it, whichever engine that is.

Two implementations: `AsyncEngineClient` (meshserve/engine/async_client.py, one TE in front of its own
processes) and the job executor's `Router` (meshserve/router/router.py, the TEs of a deployment). The API
server (meshserve/entrypoints/openai/) uses nothing of an engine beyond these members.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from meshserve.engine.outputs import RequestOutput
from meshserve.wire.client import NO_TENANCY, AdminReply, EngineStats, Tenancy
from meshserve.wire.sampling_params import SamplingParams


@runtime_checkable
class EngineClientProtocol(Protocol):
    """An engine as the API server drives it: requests in, outputs out, health, stats and operator commands."""

    model_name: str
    max_model_len: int
    tokenizer: Any  # a transformers fast tokenizer

    async def start(self) -> None:
        """Called once the server's event loop runs, before the first request (a job executor takes TE
        heartbeats on that loop from now on)."""

    def generate(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str, priority: int = 0, context_cache_id: str | None = None,
                 context_cache_ttl_s: float | None = None,
                 tenancy: Tenancy = NO_TENANCY) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; `context_cache_id` names a context cache leading the prompt,
        with `context_cache_ttl_s` the request creates that cache from its prompt. `tenancy` names its sender
        (fair scheduling) and its prefix-cache namespace (cache isolation); every engine request it makes
        (each choice, each leg, each resend) carries it."""

    async def abort(self, request_id: str) -> None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def dead_error(self) -> str | None:
        """Why no request can be served now (None while one can)."""

    def health(self) -> dict[str, Any]:
        """What /health reports beyond ok or not (a job executor: what can be routed, what is missing)."""

    async def get_stats(self) -> EngineStats: ...

    async def admin(self, op: str, args: dict | None = None) -> AdminReply:
        """An operator command (e.g. "eplb.status"); a refused one is a reply with `ok` false."""
