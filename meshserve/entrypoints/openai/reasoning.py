"""A reasoning model's output split into its thinking (`reasoning_content`) and its answer (`content`).

DeepSeek-R1 and Qwen3 think between `<think>` and `</think>`:

- `deepseek_r1`: the chat template opens the thinking part itself (the prompt ends in `<think>\\n`), so the
  output starts inside it; a `<think>` the model writes anyway is dropped. Without `</think>` (cut by
  `max_tokens`) the whole output is thinking.
- `qwen3`: thinking is optional (`enable_thinking`); only an output that starts with `<think>` has a
  thinking part, anything else is all answer.

`ReasoningSplitter.feed` takes the text as it streams and returns what is now known to be thinking and
answer; a piece that may be the start of a tag is held back until the next text decides it, so the streamed
pieces join to exactly what `split` gives for the whole text.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_in_thinking: bool  # the template opened the thinking part: the output begins inside it


REASONING_PARSERS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_thinking=True),
    "qwen3": ReasoningFormat("qwen3", starts_in_thinking=False),
}

_UNDECIDED, _THINKING, _ANSWER = "undecided", "thinking", "answer"


def release(text: str, marker: str) -> tuple[str, str]:
    """(what can be passed on, what must wait): the end of `text` that could be the start of `marker` waits
    for the next text to decide it."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size], text[-size:]
    return text, ""


class ReasoningSplitter:
    """One choice's output, split as it streams."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._state = _UNDECIDED
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) newly known after `text`."""
        self._buffer += text
        thinking, answer = "", ""
        if self._state == _UNDECIDED:
            self._decide()
        if self._state == _THINKING:
            end = self._buffer.find(THINK_END)
            if end < 0:
                thinking, self._buffer = release(self._buffer, THINK_END)
                return thinking, ""
            thinking, self._buffer = self._buffer[:end], self._buffer[end + len(THINK_END):]
            self._state = _ANSWER
        if self._state == _ANSWER:
            answer, self._buffer = self._buffer, ""
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete."""
        rest, self._buffer = self._buffer, ""
        if self._state == _THINKING:
            return rest, ""
        if self._state == _UNDECIDED and self.fmt.starts_in_thinking:
            return rest.removeprefix(THINK_START), ""
        return "", rest

    def _decide(self) -> None:
        """Whether the output opens a thinking part, once enough of it is known."""
        if len(self._buffer) < len(THINK_START) and THINK_START.startswith(self._buffer):
            return  # the tag may still be coming
        if self._buffer.startswith(THINK_START):
            self._buffer = self._buffer[len(THINK_START):]
            self._state = _THINKING
        else:
            self._state = _THINKING if self.fmt.starts_in_thinking else _ANSWER


def thinking_follows(prompt: str) -> bool:
    """Whether the output will begin with thinking: the prompt does not end in a closed thinking part (Qwen3's
    template closes an empty one when thinking is off; DeepSeek-R1's opens one)."""
    return prompt.rfind(THINK_END) < prompt.rfind(THINK_START) or THINK_START not in prompt


def split(fmt: ReasoningFormat, text: str) -> tuple[str, str]:
    """(thinking, answer) of a whole output."""
    splitter = ReasoningSplitter(fmt)
    thinking, answer = splitter.feed(text)
    more_thinking, more_answer = splitter.finish()
    return thinking + more_thinking, answer + more_answer
