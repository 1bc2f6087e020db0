"""Chat messages -> prompt text and token ids, with message content kept as plain text.

A chat template writes control tokens (role markers, end of turn) around each
message's content. Tokenizing the rendered text as one string would also turn
special-token text inside the content ("<|system|>" typed by a user) into the
real control token, so a user could pose as the system. Here only the template
writes control tokens: when any content holds special-token text, the template
is rendered with a placeholder per content, its own parts are tokenized with
special tokens and each content with special tokens split into plain text.
Content without special-token text (nearly every request) is tokenized as the
whole rendered string, exactly as the model's tokenizer would.
"""
from __future__ import annotations

import json
import re
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

# per tokenizer: its special-token texts, and a backend copy that splits them
_special_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_plain_backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejects the conversation."""


@dataclass
class ChatPrompt:
    text: str
    token_ids: list[int]


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """The rendered conversation (and the tools it may call) and its token ids; special-token text in any
    content stays text. Tools, earlier tool calls and the template's own variables (`template_kwargs`, e.g.
    Qwen3's `enable_thinking`) are rendered by the template as they are, so special-token text in them is
    refused (ChatTemplateError)."""
    specials = special_token_texts(tokenizer)
    _refuse_special_text([tools, [m.get("tool_calls") for m in messages], template_kwargs], specials)
    extra = {"tools": tools or None, **(template_kwargs or {})}
    text = _render(tokenizer, messages, add_generation_prompt, extra)
    if not any(token in m["content"] for m in messages for token in specials):
        return ChatPrompt(text, list(tokenizer.encode(text, add_special_tokens=False)))
    return _encode_with_plain_content(tokenizer, messages, add_generation_prompt, text, extra)


def _refuse_special_text(parts: Any, specials: tuple[str, ...]) -> None:
    """Tools, tool calls and template variables reach the prompt through the template, not as content: a
    control token written in them would be one (a caller posing as the system)."""
    text = json.dumps(parts, ensure_ascii=False)
    found = next((token for token in specials if token in text), None)
    if found is not None:
        raise ChatTemplateError(f"The tools, tool calls or chat_template_kwargs contain the model's control token "
                                f"{found!r}.")


def special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts the tokenizer turns into special (control) tokens."""
    texts = _special_texts.get(tokenizer)
    if texts is None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        found = {token.content for token in added.values() if getattr(token, "special", False)}
        found.update(getattr(tokenizer, "all_special_tokens", []) or [])
        texts = _special_texts[tokenizer] = tuple(sorted(t for t in found if t))
    return texts


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
            extra: dict[str, Any] | None = None) -> str:
    """`extra`: what else the template reads (the tools, the caller's template variables)."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **(extra or {}))
    except Exception as exc:  # no template, or the template rejects the conversation
        raise ChatTemplateError(f"The messages cannot be rendered with the model's chat template: {exc}") from exc


def _encode_with_plain_content(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                               text: str, extra: dict[str, Any]) -> ChatPrompt:
    """Template parts tokenized with control tokens, contents as plain text, in the template's order."""
    nonce = uuid.uuid4().hex
    marked = [{**m, "content": f"\x00{nonce}:{i}\x00"} for i, m in enumerate(messages)]
    skeleton = _render(tokenizer, marked, add_generation_prompt, extra)
    contents = _contents_as_rendered(messages, skeleton, nonce, text)
    pieces = re.split(f"\x00{nonce}:(\\d+)\x00", skeleton)
    token_ids: list[int] = []
    rendered = []
    # re.split alternates template text and the captured content index
    for position, piece in enumerate(pieces):
        if position % 2 == 0:
            token_ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
            rendered.append(piece)
        else:
            content = contents[int(piece)]
            token_ids += _encode_plain(tokenizer, content)
            rendered.append(content)
    return ChatPrompt("".join(rendered), token_ids)


def _contents_as_rendered(messages: list[dict[str, str]], skeleton: str, nonce: str, text: str) -> list[str]:
    """Each content as the template writes it: verbatim, or stripped when the template trims contents."""
    raw = [m["content"] for m in messages]
    stripped = [c.strip() for c in raw]
    for contents in (raw, stripped):
        if _filled(skeleton, nonce, contents) == text:
            return contents
    return raw  # a template that rewrites contents: keep the user's own text


def _filled(skeleton: str, nonce: str, contents: list[str]) -> str:
    """The skeleton with each content marker replaced by its content."""
    return re.sub(f"\x00{nonce}:(\\d+)\x00", lambda match: contents[int(match.group(1))], skeleton)


def _encode_plain(tokenizer: Any, content: str) -> list[int]:
    """`content`'s token ids with special-token text split into ordinary tokens.

    A private copy of the fast tokenizer's backend does this: the shared one's
    `split_special_tokens` switch is process-wide state, unsafe across threads.
    """
    if not content:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ChatTemplateError("special-token text in chat content needs a fast tokenizer")
    plain = _plain_backends.get(tokenizer)
    if plain is None:
        plain = type(backend).from_str(backend.to_str())
        plain.encode_special_tokens = True
        _plain_backends[tokenizer] = plain
    return list(plain.encode(content, add_special_tokens=False).ids)
