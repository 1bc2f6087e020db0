"""The quantizer's front door, for `meshserve quantize` and the benchmarks.

  quantize(model_dir, out_dir, method="smoothquant-gptq", calibration=corpus.train, calibration_samples=64)

`calibration` is whatever text the caller has: a 1-D token stream (windows of `seq_len` tokens are cut at
offsets drawn from `seed`), token windows [sequences, seq_len] (used as given), or texts (tokenized with the
model's tokenizer, joined, then cut like a stream). This package reads no corpus itself: the caller passes
e.g. the training split of `meshserve.train.corpus`.
"""
from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from meshserve.quant.pipeline import METHODS
from meshserve.quant.pipeline import quantize as _quantize

DEFAULT_SAMPLES = 64
DEFAULT_SEQ_LEN = 256


def windows(stream: torch.Tensor, samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """[samples, seq_len] windows of a 1-D token stream at seeded offsets (the whole stream as one sequence
    when it is not longer than seq_len)."""
    if samples < 1 or seq_len < 2:
        raise ValueError(f"need samples >= 1 and seq_len >= 2, got {samples} and {seq_len}")
    stream = stream.reshape(-1).long()
    if stream.numel() < 2:
        raise ValueError("the calibration text has fewer than 2 tokens")
    if stream.numel() <= seq_len:
        return stream[None]
    starts = torch.randint(0, stream.numel() - seq_len + 1, (samples,),
                           generator=torch.Generator().manual_seed(seed))
    return stream[starts.unsqueeze(1) + torch.arange(seq_len).unsqueeze(0)]


def tokenize(model_dir: str | Path, texts: Sequence[str]) -> torch.Tensor:
    """The texts tokenized with the model's tokenizer.json, joined into one stream."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json to tokenize the calibration text with")
    tokenizer = Tokenizer.from_file(str(path))
    ids = [i for encoding in tokenizer.encode_batch(list(texts)) for i in encoding.ids]
    return torch.tensor(ids, dtype=torch.long)


def calibration_tokens(model_dir: str | Path, calibration, samples: int = DEFAULT_SAMPLES,
                       seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0) -> torch.Tensor:
    """Token windows [sequences, seq_len] from any of the forms `quantize` takes (see the module doc)."""
    if isinstance(calibration, str):
        calibration = [calibration]
    if isinstance(calibration, torch.Tensor):
        if calibration.dim() == 2:
            return calibration.long()
        if calibration.dim() != 1:
            raise ValueError(f"calibration tokens must be a stream or [sequences, seq_len], got "
                             f"{list(calibration.shape)}")
        return windows(calibration, samples, seq_len, seed)
    texts = list(calibration)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("calibration must be token ids or texts")
    return windows(tokenize(model_dir, texts), samples, seq_len, seed)


def _clear(out_dir: Path) -> None:
    """Remove a previous checkpoint at out_dir (only a model directory: it has a config.json)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / "config.json").is_file()):
        raise FileExistsError(f"{out_dir} exists and is not a model directory: not overwriting it")
    shutil.rmtree(out_dir)


def quantize(model_dir: str | Path, out_dir: str | Path, method: str = "smoothquant-gptq", calibration=None, *,
             calibration_samples: int | None = None, seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0,
             overwrite: bool = False, progress: bool = True, **options) -> dict:
    """Quantize `model_dir` into a W8A8 compressed-tensors checkpoint at `out_dir` and return the report.
    `calibration` (needed by every method but rtn): see the module doc; `calibration_samples` windows of
    `seq_len` tokens (default 64). `overwrite`: replace a previous checkpoint at `out_dir`. `options`: see
    `pipeline.Options` (e.g. min_expert_tokens)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    tokens = None
    if method != "rtn":
        if calibration is None:
            raise ValueError(f"method {method} needs calibration text or token ids (e.g. the training split "
                             "of the corpus)")
        tokens = calibration_tokens(model_dir, calibration, calibration_samples or DEFAULT_SAMPLES, seq_len,
                                    seed)
    if overwrite:
        _clear(Path(out_dir))
    return _quantize(model_dir, out_dir, method, tokens, progress=progress, **options)
