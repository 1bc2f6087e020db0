"""The draft vocabulary of speculative decoding: the tokens a draft head scores (FR-Spec, frequency-ranked).

A draft costs one read of the MTP head, a vocabulary-sized matrix; scoring only the most frequent tokens cuts
that read while missing few of the tokens the main model goes on to pick (a draft outside the subset is merely
rejected: outputs never change). `draft_vocab.json` in a model directory ranks the ids by their frequency in
the text the model was trained on (`meshserve train` writes it); without it the tokenizer's id order stands in
(byte-level BPE numbers its merges in the order of their frequency when the tokenizer was trained).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

DRAFT_VOCAB_FILE = "draft_vocab.json"


def write_draft_vocab(model_dir: str | Path, token_counts: Sequence[int], source: str) -> Path:
    """Rank token ids by `token_counts` (index = id), most frequent first; ties keep id order."""
    ranked = sorted(range(len(token_counts)), key=lambda token: (-token_counts[token], token))
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    path.write_text(json.dumps({"source": source, "token_ids": ranked}) + "\n")
    return path


def load_draft_vocab(model_dir: str | Path, size: int, vocab_size: int) -> tuple[list[int], str]:
    """The `size` most frequent token ids, and where the ranking came from."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"speculative_draft_vocab must be in [1, {vocab_size}] (the vocabulary), got {size}")
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return list(range(size)), "the tokenizer's id order"
    try:
        ranked = json.loads(path.read_text())["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a draft vocabulary ({type(exc).__name__}: {exc})") from None
    if not isinstance(ranked, list) or len(set(ranked)) != len(ranked) or len(ranked) < size \
            or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ranked[:size]):
        raise ValueError(f"{path}: token_ids must rank at least {size} distinct ids in [0, {vocab_size})")
    return ranked[:size], str(path.name)
