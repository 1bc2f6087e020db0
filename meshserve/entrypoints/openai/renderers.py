"""Engine outputs -> OpenAI response bodies and stream chunks, for completions and for chat.

Choice indices follow OpenAI: with several prompts, prompt p's i-th sample is
choice `p * n + i`. A stream sends one choice per chunk; each choice's last
chunk carries its finish_reason.
"""
from __future__ import annotations

import time
from typing import Any

from meshserve.engine.outputs import CompletionOutput
from meshserve.entrypoints.openai.chat_output import ChoiceOutput, MessageDelta
from meshserve.entrypoints.openai.protocol import chat_logprobs, completion_logprobs
from meshserve.entrypoints.openai.reasoning import ReasoningFormat
from meshserve.entrypoints.openai.tool_request import ToolPlan

ChoiceKey = tuple[int, int]  # (prompt index, sample index within the prompt)


class Renderer:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, n: int, num_logprobs: int | None, include_usage: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.n = n
        self.num_logprobs = num_logprobs
        self.include_usage = include_usage
        self._finish_sent: set[int] = set()

    def choice_index(self, prompt_index: int, choice: CompletionOutput) -> int:
        return prompt_index * self.n + choice.index

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    # ---------------------------------------------------------------- streaming
    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def delta_chunk(self, prompt_index: int, choice: CompletionOutput) -> dict[str, Any] | None:
        """The chunk for what is new in `choice`, or None when nothing is."""
        index = self.choice_index(prompt_index, choice)
        finish = choice.finish_reason if index not in self._finish_sent else None
        has_logprobs = self.num_logprobs is not None and bool(choice.logprobs_delta)
        if not (choice.text_delta or has_logprobs or finish or self._has_pending_prefix(index)):
            return None
        if finish:
            self._finish_sent.add(index)
        return self._chunk(self._delta_choice(index, choice, finish))

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            chunk["usage"] = None  # OpenAI sends usage only in the final chunk
        return chunk

    def _has_pending_prefix(self, index: int) -> bool:
        return False

    def _delta_choice(self, index: int, choice: CompletionOutput, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    # ---------------------------------------------------------------- whole response
    def response(self, choices: dict[ChoiceKey, CompletionOutput], usage: dict[str, Any]) -> dict[str, Any]:
        rendered = sorted((self._full_choice(self.choice_index(p, c), c) for (p, _), c in choices.items()),
                          key=lambda c: c["index"])
        return {**self._envelope(self.object_name, rendered), "usage": usage}

    def _full_choice(self, index: int, choice: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, request_id: str, model: str, n: int, num_logprobs: int | None, include_usage: bool,
                 echo_texts: list[str] | None = None) -> None:
        super().__init__(request_id, model, n, num_logprobs, include_usage)
        self._echo_texts = echo_texts  # per prompt, when echo is on
        self._echo_sent: set[int] = set()
        self._text_offsets: dict[int, int] = {}

    def _echo_prefix(self, index: int) -> str:
        return self._echo_texts[index // self.n] if self._echo_texts is not None else ""

    def _has_pending_prefix(self, index: int) -> bool:
        return bool(self._echo_prefix(index)) and index not in self._echo_sent

    def _delta_choice(self, index: int, choice: CompletionOutput, finish: str | None) -> dict[str, Any]:
        text = choice.text_delta
        if index not in self._echo_sent:
            self._echo_sent.add(index)
            text = self._echo_prefix(index) + text
        logprobs = None
        if self.num_logprobs is not None:
            offset = self._text_offsets.get(index, 0)
            logprobs = completion_logprobs(choice.logprobs_delta or [], self.num_logprobs, offset)
            self._text_offsets[index] = offset + sum(len(p.chosen.decoded) for p in choice.logprobs_delta or [])
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _full_choice(self, index: int, choice: CompletionOutput) -> dict[str, Any]:
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = completion_logprobs(choice.logprobs or [], self.num_logprobs)
        return {"index": index, "text": self._echo_prefix(index) + choice.text, "logprobs": logprobs,
                "finish_reason": choice.finish_reason}


class ChatRenderer(Renderer):
    """Chat responses; with a reasoning parser or tools, each choice's text goes through a ChoiceOutput
    (chat_output.py): `reasoning_content`, `content` and `tool_calls`, streamed as OpenAI's deltas."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, n: int, num_logprobs: int | None, include_usage: bool,
                 reasoning: ReasoningFormat | None = None, tools: ToolPlan | None = None) -> None:
        super().__init__(request_id, model, n, num_logprobs, include_usage)
        self.reasoning = reasoning
        self.tools = tools
        self._outputs: dict[int, ChoiceOutput] = {}  # per streamed choice

    def _choice_output(self) -> ChoiceOutput:
        return ChoiceOutput(self.reasoning, self.tools)

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(self.n)]

    def _delta_choice(self, index: int, choice: CompletionOutput, finish: str | None) -> dict[str, Any]:
        output = self._outputs.setdefault(index, self._choice_output())
        delta = output.feed(choice.text_delta)
        if finish:  # what the parsers held back comes with the last chunk
            rest = output.finish()
            delta = MessageDelta(delta.reasoning + rest.reasoning, delta.content + rest.content,
                                 delta.tool_calls + rest.tool_calls, delta.arguments + rest.arguments)
        calls_before = output.num_calls - len(delta.tool_calls)
        logprobs = None
        if self.num_logprobs is not None and choice.logprobs_delta:
            logprobs = chat_logprobs(choice.logprobs_delta, self.num_logprobs)
        return {"index": index, "delta": _stream_delta(delta, calls_before), "logprobs": logprobs,
                "finish_reason": _finish_reason(finish, output)}

    def _full_choice(self, index: int, choice: CompletionOutput) -> dict[str, Any]:
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = chat_logprobs(choice.logprobs or [], self.num_logprobs)
        output = self._choice_output()
        first, rest = output.feed(choice.text), output.finish()
        calls = first.tool_calls + rest.tool_calls
        message: dict[str, Any] = {"role": "assistant", "content": first.content + rest.content}
        if self.reasoning is not None:
            message["reasoning_content"] = (first.reasoning + rest.reasoning) or None
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
            message["content"] = message["content"] or None
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": _finish_reason(choice.finish_reason, output)}


def _stream_delta(delta: MessageDelta, calls_before: int) -> dict[str, Any]:
    """OpenAI's chunk delta: new text, each new call whole, and a named call's arguments piece by piece."""
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    calls = [call.to_openai(calls_before + i) for i, call in enumerate(delta.tool_calls)]
    if delta.arguments and not delta.tool_calls:  # the named call, already opened: its arguments grow
        calls = [{"index": 0, "function": {"arguments": delta.arguments}}]
    if calls:
        out["tool_calls"] = calls
    return out


def _finish_reason(finish: str | None, output: ChoiceOutput) -> str | None:
    """OpenAI reports a message that ends in tool calls as finished for `tool_calls`."""
    return "tool_calls" if finish == "stop" and output.made_calls else finish
