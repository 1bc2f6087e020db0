"""Tool calls in a model's own words, as OpenAI's `tool_calls`.

Each model family writes its calls in a format of its own (`--tool-call-parser`):

- `deepseek_v3` (DeepSeek-V3, -R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``,
  a newline, the arguments in a json code fence, ``<｜tool▁call▁end｜>`` per call, ``<｜tool▁calls▁end｜>``;
  V3.1's shorter ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`` is read too.
- `kimi_k2` (Kimi-K2): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX``
  ``<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>`` per call, ``<|tool_calls_section_end|>``; the
  call's id is the model's own ``functions.NAME:INDEX``.
- `hermes` (Qwen3 and other Hermes-style templates): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  per call.

Text before the first call is the message's content. `ToolCallStream.feed` takes the text as it streams and
returns the content known so far and every call completed since; a piece that may be the start of a marker is
held back, so the streamed pieces give exactly what `parse` gives for the whole text. A call that never
completes (the output was cut) is returned as content, so nothing the model wrote is lost.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from meshserve.entrypoints.openai.reasoning import release


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str  # where the calls begin: everything before it is content
    call: re.Pattern  # one complete call


def _deepseek_call(match: re.Match) -> ToolCall:
    name = match.group("name") or match.group("short_name")
    arguments = match.group("args") if match.group("args") is not None else match.group("short_args")
    return ToolCall(name.strip(), arguments.strip())


def _kimi_call(match: re.Match) -> ToolCall:
    call_id = match.group("id").strip()
    return ToolCall(call_id.split(":")[0].split(".", 1)[-1], match.group("args").strip(), id=call_id)


def _hermes_call(match: re.Match) -> ToolCall:
    body = json.loads(match.group("body"))
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise ValueError("a hermes tool call is a JSON object with a name")
    arguments = body.get("arguments", body.get("parameters", {}))
    return ToolCall(body["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


TOOL_CALL_FORMATS = {
    "deepseek_v3": (ToolCallFormat("deepseek_v3", "<｜tool▁calls▁begin｜>", re.compile(
        r"<｜tool▁call▁begin｜>\s*(?:function<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*?)\n```"
        r"|(?P<short_name>[^<]+?)<｜tool▁sep｜>(?P<short_args>.*?))\s*<｜tool▁call▁end｜>", re.DOTALL)),
        _deepseek_call),
    "kimi_k2": (ToolCallFormat("kimi_k2", "<|tool_calls_section_begin|>", re.compile(
        r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>",
        re.DOTALL)), _kimi_call),
    "hermes": (ToolCallFormat("hermes", "<tool_call>", re.compile(
        r"<tool_call>\s*(?P<body>.*?)\s*</tool_call>", re.DOTALL)), _hermes_call),
}


def tool_call_format_of_template(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs (the model's default), or None."""
    for name, (fmt, _) in TOOL_CALL_FORMATS.items():
        if template and fmt.start in template:
            return name
    return None


class ToolCallStream:
    """One choice's output, its tool calls read as it streams."""

    def __init__(self, parser: str) -> None:
        self.fmt, self._read_call = TOOL_CALL_FORMATS[parser]
        self._buffer = ""
        self._in_calls = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, completed calls) newly known after `text`."""
        self._buffer += text
        content = ""
        if not self._in_calls:
            start = self._buffer.find(self.fmt.start)
            if start < 0:
                content, self._buffer = release(self._buffer, self.fmt.start)
                return content, []
            content, self._buffer = self._buffer[:start], self._buffer[start:]
            self._in_calls = True
        calls = []
        while (match := self.fmt.call.search(self._buffer)) is not None:
            try:
                calls.append(self._read_call(match))
            except ValueError:  # a malformed call stays in the text
                return content, calls
            self._buffer = self._buffer[match.end():]
        return content, calls

    def finish(self) -> str:
        """What is left once the output is complete: marker text between calls is dropped; an unfinished call
        is content."""
        rest, self._buffer = self._buffer, ""
        if not self._in_calls:
            return rest
        return "" if not re.sub(r"<[|｜][^>]*[|｜]>|</?tool_call>", "", rest).strip() else rest


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output."""
    stream = ToolCallStream(parser)
    content, calls = stream.feed(text)
    return content + stream.finish(), calls
