"""POST /v1/completions: one or several prompts (text or token ids), optionally after a context cache."""
from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import Response

from meshserve.entrypoints.openai.generation import EnginePrompt
from meshserve.entrypoints.openai.protocol import CompletionRequest
from meshserve.entrypoints.openai.renderers import CompletionRenderer
from meshserve.entrypoints.openai.responses import generate_response
from meshserve.entrypoints.openai.serving_base import ServingBase, ServingContext, principal_of
from meshserve.entrypoints.openai.serving_caches import ContextCacheServing
from meshserve.wire.client import Tenancy
from meshserve.wire.sampling_params import StructuredOutputs


class CompletionServing(ServingBase):
    def __init__(self, context: ServingContext, caches: ContextCacheServing) -> None:
        super().__init__(context)
        self.caches = caches

    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await self._parse(CompletionRequest, await raw.body())
        self._check_model_and_engine(req.model)
        # before anything is tokenized or built: a small body may ask for a huge fan-out (admission.py)
        self.context.admission.check_choices(len(req.prompt), req.n)
        structured = await self._structured_outputs(req)
        cache = self.caches.for_request(req.context_cache_id, "prompt", "/v1/completions", principal_of(raw))
        prefix = cache.token_ids if cache is not None else []
        self._check_prompt_chars(sum(len(p) for p in req.prompt if isinstance(p, str)), "prompt")
        prompts = []
        for prompt in req.prompt:
            prompts.append(await self._engine_prompt(req, prompt, prefix, after_cache=cache is not None,
                                                     tenancy=self._tenancy(raw, req.cache_salt),
                                                     structured=structured))
            await asyncio.sleep(0)  # token-id prompts are checked on the loop: let other requests run between them
        self.context.admission.check_tokens([len(p.token_ids) for p in prompts],
                                            [p.params.max_tokens for p in prompts], req.n)
        request_id = self._request_id(raw, "cmpl")
        renderer = CompletionRenderer(request_id, self.model_name, req.n, req.logprobs, req.include_usage_in_stream,
                                      await self._echo_texts(req))
        return await generate_response(self.context, raw, request_id, prompts, req.priority, bool(req.stream),
                                       renderer, arrival)

    async def _engine_prompt(self, req: CompletionRequest, prompt: str | list[int], prefix: list[int],
                             after_cache: bool, tenancy: Tenancy,
                             structured: StructuredOutputs | None) -> EnginePrompt:
        if isinstance(prompt, str):
            # after a cached prefix the text continues it: no second set of special tokens
            text, own_ids = prompt, await self._encode(prompt, add_special_tokens=not after_cache)
        else:
            text, own_ids = None, prompt
        token_ids = prefix + own_ids
        max_tokens = self._max_tokens(len(token_ids), req.max_tokens, "prompt")
        if text is None:  # after the length check: checking the ids costs at most one context's worth of work
            self._checked_token_ids(own_ids)
        return EnginePrompt(text, token_ids, req.to_sampling_params(max_tokens, req.logprobs, structured),
                            context_cache_id=req.context_cache_id, tenancy=tenancy)

    async def _echo_texts(self, req: CompletionRequest) -> list[str] | None:
        """The request's own prompts as text for `echo` (not the cached prefix); None without echo."""
        if not req.echo:
            return None
        return [p if isinstance(p, str) else await self._tokenizing(self.engine.tokenizer.decode, p)
                for p in req.prompt]
