"""Incremental detokenization equals a full decode, never shows half a character, and stays O(1) per token."""
from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from meshserve.engine.detokenizer import IncrementalDetokenizer, load_tokenizer
from tests.engine.byte_level_bpe import END_OF_TEXT, byte_level_bpe, encode

TEXTS = [
    "Hello world, plain ASCII.",
    "Grüße aus München, déjà vu — ça va?",
    "日本語と中文が混ざったテキスト。",
    "Emoji 😀🎉 skin tone 👍🏽 and a ZWJ family 👨‍👩‍👧 done",
    "🦀🦀🦀 unseen emoji are split into single bytes",
]


def _hf_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), eos_token=END_OF_TEXT)


def _stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.append([token_id]) for token_id in ids]


@pytest.mark.parametrize("tokenizer_factory", [byte_level_bpe, _hf_tokenizer], ids=["tokenizers", "transformers"])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer_factory, text):
    tokenizer = tokenizer_factory()
    ids = encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=encode("Say: "))
    pieces = _stream(detokenizer, ids)
    assert "".join(pieces) == detokenizer.text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_split_characters_are_withheld_until_complete():
    ids = encode("😀")
    assert len(ids) > 1  # the test tokenizer splits this emoji across tokens
    detokenizer = IncrementalDetokenizer(byte_level_bpe(), prompt_token_ids=encode("a "))
    assert _stream(detokenizer, ids[:-1]) == [""] * (len(ids) - 1)
    assert detokenizer.has_pending
    assert detokenizer.append(ids[-1:]) == "😀"
    assert not detokenizer.has_pending


def test_appending_several_tokens_at_once():
    text = TEXTS[3]
    ids = encode(text)
    detokenizer = IncrementalDetokenizer(byte_level_bpe(), prompt_token_ids=[])
    pieces = [detokenizer.append(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(pieces) == text


def test_flush_emits_an_unfinished_character_like_a_full_decode():
    tokenizer = byte_level_bpe()
    ids = encode("ok 😀")[:-1]  # ends in the middle of the emoji
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    streamed = "".join(_stream(detokenizer, ids))
    assert streamed.startswith("ok") and "\ufffd" not in streamed
    flushed = detokenizer.flush()
    assert "\ufffd" in flushed
    assert detokenizer.text == tokenizer.decode(ids)
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(skip):
    tokenizer = _hf_tokenizer()
    ids = encode("one ") + [tokenizer.eos_token_id] + encode(" two")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=encode("x"), skip_special_tokens=skip)
    assert "".join(_stream(detokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert (END_OF_TEXT in detokenizer.text) is not skip


class _RecordingDecoder:
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_does_not_grow_with_sequence_length():
    recorder = _RecordingDecoder(byte_level_bpe())
    long_prompt = encode(" ".join(TEXTS) * 5)
    ids = encode(" ".join(TEXTS)) * 10  # several hundred tokens
    detokenizer = IncrementalDetokenizer(recorder, prompt_token_ids=long_prompt)
    _stream(detokenizer, ids)
    assert detokenizer.text == byte_level_bpe().decode(ids)
    assert len(ids) > 300 and max(recorder.window_sizes) <= 10


def test_load_tokenizer_reads_a_local_model_dir(tmp_path):
    _hf_tokenizer().save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    ids = encode(TEXTS[1])
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    assert "".join(_stream(detokenizer, ids)) == TEXTS[1]


def test_load_tokenizer_reports_a_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "no-such-model"))


def test_rejects_objects_that_cannot_decode():
    with pytest.raises(TypeError, match="tokenizer"):
        IncrementalDetokenizer(object(), prompt_token_ids=[])
