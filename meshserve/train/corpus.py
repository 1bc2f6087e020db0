"""The training corpus: this interpreter's standard-library .py sources (code, comments, docstrings).

The files are those the house tokenizer was trained from (`tokenizer_assets.stdlib_corpus_files`),
so every machine of the project has the corpus, less `pydoc_data/topics.py` (generated: the reference
manual's text as one 750 kB dict literal, which would be half of the held-out part). The split is by
file and stable: a file is held out when a hash of its path relative to the standard-library root
falls in the lowest `HELDOUT_PERCENT` of 100 buckets. Each file is tokenized with the house tokenizer
(BOS first, EOS appended) and the files of a split are concatenated, in path order, into one stream.

Training batches are windows of that stream at offsets drawn from a seeded generator; evaluation
windows and benchmark prompts come from the held-out stream only.
"""
from __future__ import annotations

import functools
import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from meshserve.models import tokenizer_assets as tok

HELDOUT_PERCENT = 5
EXCLUDED_FILES = frozenset({"pydoc_data/topics.py"})


def corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    """Whether the file at `relative_path` (posix, relative to the standard-library root) is held out."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % 100 < HELDOUT_PERCENT


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # int64 token stream of the training files
    heldout: torch.Tensor  # int64 token stream of the held-out files
    train_files: int
    heldout_files: int

    def summary(self) -> dict:
        return {"source": f"Python {sysconfig.get_python_version()} standard library (.py files)",
                "train_files": self.train_files, "heldout_files": self.heldout_files,
                "train_tokens": int(self.train.numel()), "heldout_tokens": int(self.heldout.numel()),
                "heldout_rule": f"sha256(relative path) % 100 < {HELDOUT_PERCENT}",
                "excluded_files": sorted(EXCLUDED_FILES)}


def _token_stream(paths: list[Path]) -> torch.Tensor:
    tokenizer = tok.load_tokenizer()
    eos = tok.special_token_ids()[tok.EOS_TOKEN]
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in paths]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):  # the post-processor puts BOS first
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@functools.lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """The tokenized corpus (a few seconds; cached for the process)."""
    root = corpus_root()
    files = {path.relative_to(root).as_posix(): path for path in tok.stdlib_corpus_files()}
    names = [name for name in files if name not in EXCLUDED_FILES]
    heldout = [files[name] for name in names if is_heldout(name)]
    train = [files[name] for name in names if not is_heldout(name)]
    return Corpus(train=_token_stream(train), heldout=_token_stream(heldout),
                  train_files=len(train), heldout_files=len(heldout))


def _windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return stream[starts.unsqueeze(1) + torch.arange(length).unsqueeze(0)]


def train_batches(corpus: Corpus, batch_size: int, seq_len: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch_size, seq_len] batches of training windows; the same seed gives the same batches."""
    generator = torch.Generator().manual_seed(seed)
    high = corpus.train.numel() - seq_len + 1
    while True:
        yield _windows(corpus.train, torch.randint(0, high, (batch_size,), generator=generator), seq_len)


def heldout_batches(corpus: Corpus, num_sequences: int, seq_len: int, batch_size: int) -> list[torch.Tensor]:
    """The evaluation set: `num_sequences` windows spread evenly over the held-out stream, in batches."""
    starts = torch.linspace(0, corpus.heldout.numel() - seq_len, num_sequences).long()
    windows = _windows(corpus.heldout, starts, seq_len)
    return list(windows.split(batch_size))


def heldout_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` token ids from the held-out files (never seen in training), each inside one
    file (no BOS/EOS in it), at offsets drawn from `seed`: the same arguments give the same prompts."""
    if n < 0 or length < 1:
        raise ValueError(f"need n >= 0 and length >= 1, got n={n}, length={length}")
    stream = load_corpus().heldout
    boundaries = {tok.special_token_ids()[tok.BOS_TOKEN], tok.special_token_ids()[tok.EOS_TOKEN]}
    is_boundary = torch.isin(stream, torch.tensor(sorted(boundaries)))
    generator = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = []
    high = stream.numel() - length + 1
    if high < 1:
        raise ValueError(f"prompt length {length} exceeds the held-out stream ({stream.numel()} tokens)")
    for _ in range(1000 * max(n, 1)):
        if len(prompts) == n:
            break
        start = int(torch.randint(0, high, (1,), generator=generator))
        if not bool(is_boundary[start:start + length].any()):
            prompts.append(stream[start:start + length].tolist())
    if len(prompts) < n:
        raise ValueError(f"could not find {n} held-out prompts of {length} tokens inside single files")
    return prompts
