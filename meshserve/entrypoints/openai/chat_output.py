"""One chat choice's output as an assistant message: the reasoning part split off first (`--reasoning-parser`),
then the answer read for tool calls as the request's ToolPlan says (tool_request.py).

`ChoiceOutput.feed` takes the text as it streams and returns the message's new pieces (`MessageDelta`);
`finish` returns what was held back. A whole response is the same two calls on the whole text, so a stream's
pieces always join to the whole response's message.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from meshserve.entrypoints.openai.reasoning import ReasoningFormat, ReasoningSplitter
from meshserve.entrypoints.openai.tool_parsers import ToolCall, ToolCallStream
from meshserve.entrypoints.openai.tool_request import AUTO, NAMED, REQUIRED, ToolPlan


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    # NAMED under streaming: the called function's arguments grow piece by piece (OpenAI's argument deltas)
    arguments: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls or self.arguments)


class ChoiceOutput:
    """One choice's message, built as its text streams."""

    def __init__(self, reasoning: ReasoningFormat | None, tools: ToolPlan | None) -> None:
        self._splitter = ReasoningSplitter(reasoning) if reasoning is not None else None
        self._plan = tools
        self._calls = ToolCallStream(tools.parser) if tools is not None and tools.mode == AUTO else None
        self._answer = ""  # REQUIRED: the JSON array of calls, parsed once complete
        self.named_call: ToolCall | None = None  # NAMED: the one call, its arguments growing
        self.num_calls = 0

    @property
    def made_calls(self) -> bool:
        return self.num_calls > 0 or self.named_call is not None

    def feed(self, text: str) -> MessageDelta:
        thinking, answer = self._splitter.feed(text) if self._splitter is not None else ("", text)
        return self._answer_delta(thinking, answer)

    def finish(self) -> MessageDelta:
        thinking, answer = self._splitter.finish() if self._splitter is not None else ("", "")
        delta = self._answer_delta(thinking, answer)
        if self._calls is not None:
            delta.content += self._calls.finish()
        elif self._plan is not None and self._plan.mode == REQUIRED:
            delta.tool_calls = self._required_calls()
            if not delta.tool_calls:  # cut short before the array closed: what it wrote is not lost
                delta.content = self._answer
        return delta

    def _answer_delta(self, thinking: str, answer: str) -> MessageDelta:
        delta = MessageDelta(reasoning=thinking)
        mode = self._plan.mode if self._plan is not None else None
        if self._calls is not None:
            delta.content, calls = self._calls.feed(answer)
            delta.tool_calls = self._keep(calls)
        elif mode == REQUIRED:
            self._answer += answer
        elif mode == NAMED:
            if self.named_call is None and answer:
                self.named_call = ToolCall(self._plan.function, "")
                delta.tool_calls = [self.named_call]
                self.num_calls = 1
            if self.named_call is not None:
                self.named_call.arguments += answer
                delta.arguments = answer
        else:
            delta.content = answer
        return delta

    def _keep(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls to report: the first only when parallel calls are off."""
        if self._plan is not None and not self._plan.parallel:
            calls = calls[:max(0, 1 - self.num_calls)]
        self.num_calls += len(calls)
        return calls

    def _required_calls(self) -> list[ToolCall]:
        """The JSON array the grammar made the model write, as calls (none when it was cut short)."""
        try:
            written = json.loads(self._answer)
        except ValueError:
            return []
        calls = [ToolCall(call["name"], json.dumps(call["parameters"])) for call in written
                 if isinstance(call, dict) and "name" in call and "parameters" in call]
        return self._keep(calls)
