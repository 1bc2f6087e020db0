"""POST /v1/chat/completions: a conversation rendered by the model's chat template, optionally continuing
the conversation of a context cache."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from meshserve.entrypoints.openai.errors import bad_request
from meshserve.entrypoints.openai.generation import EnginePrompt
from meshserve.entrypoints.openai.protocol import ChatCompletionRequest
from meshserve.entrypoints.openai.renderers import ChatRenderer
from meshserve.entrypoints.openai.responses import generate_response
from meshserve.entrypoints.openai.serving_base import ServingBase, ServingContext, principal_of
from meshserve.entrypoints.openai.serving_caches import ContextCacheServing


class ChatServing(ServingBase):
    def __init__(self, context: ServingContext, caches: ContextCacheServing) -> None:
        super().__init__(context)
        self.caches = caches

    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await self._parse(ChatCompletionRequest, await raw.body())
        self._check_model_and_engine(req.model)
        self.context.admission.check_choices(1, req.n)  # before the template is rendered (admission.py)
        cache = self.caches.for_request(req.context_cache_id, "messages", "/v1/chat/completions", principal_of(raw))
        cached_messages = cache.messages if cache is not None else []
        messages = [m.for_template() for m in req.messages]
        self._check_message_chars(messages)
        # the cached conversation first, rendered together with the new messages
        # the template writes the control tokens (BOS, role markers); message contents stay plain text
        text, token_ids = await self._tokenizing(self._render_chat, cached_messages + messages)
        if not token_ids:
            raise bad_request("The messages render to an empty prompt.", param="messages")
        max_tokens = self._max_tokens(len(token_ids), req.requested_max_tokens, "messages")
        self.context.admission.check_tokens([len(token_ids)], [max_tokens], req.n)
        prompt = EnginePrompt(text, token_ids, req.to_sampling_params(max_tokens, req.num_logprobs),
                              context_cache_id=req.context_cache_id, tenancy=self._tenancy(raw, req.cache_salt))
        request_id = self._request_id(raw, "chatcmpl")
        renderer = ChatRenderer(request_id, self.model_name, req.n, req.num_logprobs, req.include_usage_in_stream)
        return await generate_response(self.context, raw, request_id, [prompt], req.priority, bool(req.stream),
                                       renderer, arrival)
