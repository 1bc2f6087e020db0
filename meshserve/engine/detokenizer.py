"""Incremental detokenization: turn a growing list of token ids into text, a token at a time.

Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding such
a prefix yields the replacement character U+FFFD. We use the prefix/read-offset
scheme vLLM uses: decode a small window of recent tokens twice, once without
the new tokens (the "prefix") and once with them, and emit the difference only
once it no longer ends in an incomplete character. The window restarts after
every emission, so the cost per token does not grow with the sequence.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT_CHAR = "\ufffd"
# prompt tokens decoded with the first outputs, so a leading space or a word
# continuation renders the way it will in the full text
_PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    """The model's (fast) tokenizer from a local model directory."""
    # start-up: transformers imports torch (about 2 s); only where a tokenizer is loaded
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {model_dir!r}: {exc}") from exc


def as_decoder(tokenizer: Any) -> Decoder:
    """Accept a transformers tokenizer, a raw `tokenizers.Tokenizer`, or anything with the same decode().

    Both libraries spell it decode(ids, skip_special_tokens=...), so no adapter is needed.
    """
    if callable(getattr(tokenizer, "decode", None)):
        return tokenizer
    raise TypeError(
        f"expected a transformers tokenizer or a tokenizers.Tokenizer, got {type(tokenizer).__name__}"
    )


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._decoder = as_decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        # only the tail of the prompt is ever decoded, so only the tail is kept
        self._token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._token_ids)  # tokens before this are already in .text
        self.text = ""

    @property
    def has_pending(self) -> bool:
        """Whether some appended tokens have not yet produced text (an incomplete character)."""
        return self._read_offset < len(self._token_ids)

    def append(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text they completed (may be empty)."""
        pieces = [self._append_one(token_id) for token_id in new_token_ids]
        new_text = "".join(pieces)
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is pending, replacement characters included."""
        if not self.has_pending:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._token_ids))
        new_text = full_text[len(prefix_text):]
        self._advance()
        self.text += new_text
        return new_text

    def _append_one(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or it ends inside a multi-byte character
        new_text = full_text[len(prefix_text):]
        self._advance()
        return new_text

    def _advance(self) -> None:
        # drop tokens before the window so memory, like time, stays bounded
        del self._token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._decoder.decode(self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens)
