"""A tiny byte-level BPE tokenizer (GPT-2 style) trained in-process, for text tests without network."""
from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"

_CORPUS = [
    "Hello world, this is a small corpus for a byte level tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "Stop strings end a completion early; streaming must not leak them.",
    "Grüße aus München! Ça va très bien, merci. Déjà vu.",
    "日本語のテキストも少し入れておきます。中文也可以。",
    "Emoji: 😀 🎉 👍🏽 and a family 👨‍👩‍👧 appear sometimes.",
]


@functools.lru_cache(maxsize=1)
def byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tokenizer


def encode(text: str) -> list[int]:
    return byte_level_bpe().encode(text).ids
