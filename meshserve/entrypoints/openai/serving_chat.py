"""POST /v1/chat/completions: a conversation rendered by the model's chat template, optionally continuing
the conversation of a context cache."""
from __future__ import annotations

import time

import msgspec
from fastapi import Request
from fastapi.responses import Response

from meshserve.entrypoints.openai.errors import bad_request
from meshserve.entrypoints.openai.generation import EnginePrompt
from meshserve.entrypoints.openai.protocol import ChatCompletionRequest
from meshserve.entrypoints.openai.reasoning import REASONING_PARSERS, THINK_END, thinking_follows
from meshserve.entrypoints.openai.renderers import ChatRenderer
from meshserve.entrypoints.openai.responses import generate_response
from meshserve.entrypoints.openai.serving_base import ServingBase, ServingContext, principal_of
from meshserve.entrypoints.openai.serving_caches import ContextCacheServing
from meshserve.entrypoints.openai.tool_parsers import tool_call_format_of_template
from meshserve.entrypoints.openai.tool_request import NONE, ToolPlan, plan_tools


class ChatServing(ServingBase):
    def __init__(self, context: ServingContext, caches: ContextCacheServing) -> None:
        super().__init__(context)
        self.caches = caches
        options = context.options
        self.reasoning = REASONING_PARSERS[options.reasoning_parser] if options.reasoning_parser else None
        # the model's own tool-call format, from its chat template, unless the operator names one
        self.tool_call_parser = options.tool_call_parser or tool_call_format_of_template(
            getattr(self.engine.tokenizer, "chat_template", None))
        self._think_end: list[int] | None = None  # the token ids of "</think>"

    async def _think_end_ids(self) -> list[int]:
        if self._think_end is None:
            self._think_end = await self._encode(THINK_END, add_special_tokens=False)
        return self._think_end

    async def _tool_plan(self, req: ChatCompletionRequest, constrained: bool) -> ToolPlan | None:
        """What the request's tools make the server do; each tool's schema is checked on the tokenizer's thread
        (a large one takes a while)."""
        return await self._tokenizing(plan_tools, req.tools, req.tool_choice, req.parallel_tool_calls,
                                      self.tool_call_parser, constrained, self._grammar_compiler)

    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await self._parse(ChatCompletionRequest, await raw.body())
        self._check_model_and_engine(req.model)
        self.context.admission.check_choices(1, req.n)  # before the template is rendered (admission.py)
        structured = await self._structured_outputs(req)
        tools = await self._tool_plan(req, structured is not None)
        template_tools = tools.tools if tools is not None else None
        if tools is not None and tools.constraint is not None:  # required or named: the grammar writes the calls
            structured = tools.constraint
        cache = self.caches.for_request(req.context_cache_id, "messages", "/v1/chat/completions", principal_of(raw))
        cached_messages = cache.messages if cache is not None else []
        messages = [m.for_template() for m in req.messages]
        self._check_message_chars(messages, template_tools)
        # the cached conversation first, rendered together with the new messages
        # the template writes the control tokens (BOS, role markers); message contents stay plain text
        text, token_ids = await self._tokenizing(self._render_chat, cached_messages + messages, True, template_tools,
                                                 req.chat_template_kwargs)
        if not token_ids:
            raise bad_request("The messages render to an empty prompt.", param="messages")
        if structured is not None and self.reasoning is not None and thinking_follows(text):
            # the answer, not the thinking, is what the constraint shapes
            structured = msgspec.structs.replace(structured, starts_after=await self._think_end_ids())
        max_tokens = self._max_tokens(len(token_ids), req.requested_max_tokens, "messages")
        self.context.admission.check_tokens([len(token_ids)], [max_tokens], req.n)
        prompt = EnginePrompt(text, token_ids, req.to_sampling_params(max_tokens, req.num_logprobs, structured),
                              context_cache_id=req.context_cache_id, tenancy=self._tenancy(raw, req.cache_salt))
        request_id = self._request_id(raw, "chatcmpl")
        read_calls = tools if tools is not None and tools.mode != NONE else None
        renderer = ChatRenderer(request_id, self.model_name, req.n, req.num_logprobs, req.include_usage_in_stream,
                                reasoning=self.reasoning, tools=read_calls)
        return await generate_response(self.context, raw, request_id, [prompt], req.priority, bool(req.stream),
                                       renderer, arrival)
