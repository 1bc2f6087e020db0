"""POST /v1/completions: one or several prompts (text or token ids), optionally after a context cache."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from meshserve.entrypoints.openai.generation import EnginePrompt
from meshserve.entrypoints.openai.protocol import CompletionRequest
from meshserve.entrypoints.openai.renderers import CompletionRenderer
from meshserve.entrypoints.openai.responses import generate_response
from meshserve.entrypoints.openai.serving_base import ServingBase, ServingContext, principal_of
from meshserve.entrypoints.openai.serving_caches import ContextCacheServing


class CompletionServing(ServingBase):
    def __init__(self, context: ServingContext, caches: ContextCacheServing) -> None:
        super().__init__(context)
        self.caches = caches

    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = self._parse(CompletionRequest, await raw.body())
        self._check_model_and_engine(req.model)
        cache = self.caches.for_request(req.context_cache_id, "prompt", "/v1/completions", principal_of(raw))
        prefix = cache.token_ids if cache is not None else []
        prompts, own_texts = [], []
        self._check_prompt_chars(sum(len(p) for p in req.prompt if isinstance(p, str)), "prompt")
        for prompt in req.prompt:
            if isinstance(prompt, str):
                # after a cached prefix the text continues it: no second set of special tokens
                text, token_ids = prompt, await self._encode(prompt, add_special_tokens=cache is None)
            else:
                text, token_ids = None, self._checked_token_ids(prompt)
            own_texts.append(text if text is not None else await self._tokenizing(self.engine.tokenizer.decode,
                                                                                   token_ids))
            token_ids = prefix + token_ids
            max_tokens = self._max_tokens(len(token_ids), req.max_tokens, "prompt")
            prompts.append(EnginePrompt(text, token_ids, req.to_sampling_params(max_tokens, req.logprobs),
                                        context_cache_id=req.context_cache_id,
                                        tenancy=self._tenancy(raw, req.cache_salt)))
        echo_texts = own_texts if req.echo else None  # the request's own prompt, not the cached prefix
        request_id = self._request_id(raw, "cmpl")
        renderer = CompletionRenderer(request_id, self.model_name, req.n, req.logprobs, req.include_usage_in_stream,
                                      echo_texts)
        return await generate_response(self.context, raw, request_id, prompts, req.priority, bool(req.stream),
                                       renderer, arrival)
