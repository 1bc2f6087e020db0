"""Decode-length predictor: classifies a request into a bucket of `bucket_tokens` output tokens.

The JE's PD-aware policy (deepserve §5.3) needs the decode length of a request
before it runs; like the paper it predicts a length range, not an exact count,
because sampling makes the exact count noisy and the heatmap cells are coarse.

The model is deliberately small, so it trains on CPU in seconds and adds
nothing noticeable to routing: a hashed bag of prompt unigrams and bigrams
(log counts) plus the prompt length, max_tokens and the bucket max_tokens falls
in, fed to a softmax classifier (linear, or one hidden layer). max_tokens bounds
the output, so buckets above its bucket are masked out in training and prediction.

Bucket k holds outputs of (k * B, (k + 1) * B] tokens (an empty output is bucket 0).
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from meshserve.router.length_examples import DEFAULT_BUCKET_TOKENS, LengthExample, bucket_of

FORMAT = "meshserve-length-predictor"
VERSION = 1
DEFAULT_FEATURE_DIM = 4096
# numbers of the hash below: odd 64-bit constants (splitmix64), and a salt that keeps bigrams off unigram slots
_MIX_A = np.uint64(0xBF58476D1CE4E5B9)
_MIX_B = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_BIGRAM_SALT = np.uint64(0x632BE59BD9B4E019)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fixed hash, the same in every process (unlike Python's `hash`)."""
    with np.errstate(over="ignore"):
        z = values + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX_A
        z = (z ^ (z >> np.uint64(27))) * _MIX_B
        return z ^ (z >> np.uint64(31))


def hashed_ngrams(prompt_token_ids: Sequence[int], feature_dim: int) -> tuple[list[int], list[float]]:
    """Feature slots of the prompt's unigrams and bigrams, with log(1 + count) weights."""
    ids = np.asarray(list(prompt_token_ids), dtype=np.int64).astype(np.uint64)
    if ids.size == 0:
        return [], []
    unigrams = _mix(ids)
    with np.errstate(over="ignore"):
        bigrams = _mix(_mix(ids[:-1]) ^ (ids[1:] + _BIGRAM_SALT))
    slots = (np.concatenate([unigrams, bigrams]) % np.uint64(feature_dim)).astype(np.int64)
    unique, counts = np.unique(slots, return_counts=True)
    return unique.tolist(), np.log1p(counts).astype(np.float32).tolist()


class _Classifier(nn.Module):
    """Bag of hashed n-grams (EmbeddingBag, so the 4096-wide input stays sparse) + dense features -> logits."""

    def __init__(self, feature_dim: int, num_dense: int, num_classes: int, hidden: int):
        super().__init__()
        width = hidden or num_classes
        self.ngrams = nn.EmbeddingBag(feature_dim, width, mode="sum")
        # start near zero: nn's N(0, 1) default gives a prompt's ~100 slots logits of std ~7, pure noise to unlearn
        nn.init.normal_(self.ngrams.weight, std=0.01)
        self.dense = nn.Linear(num_dense, width)
        self.out = nn.Linear(hidden, num_classes) if hidden else None

    def forward(self, slots, offsets, weights, dense):
        x = self.ngrams(slots, offsets, per_sample_weights=weights) + self.dense(dense)
        return self.out(torch.relu(x)) if self.out is not None else x


@dataclass
class _Batch:
    slots: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor
    dense: torch.Tensor
    allowed: torch.Tensor  # [n, classes] bool: buckets the output can reach under max_tokens


class LengthPredictor:
    """A trained decode-length classifier; build one with `train` or `load`."""

    def __init__(self, model: _Classifier, *, bucket_tokens: int, feature_dim: int, num_buckets: int,
                 hidden: int, majority_bucket: int):
        self._model = model.eval()
        self.bucket_tokens = bucket_tokens
        self.feature_dim = feature_dim
        self.num_buckets = num_buckets
        self.hidden = hidden
        self.majority_bucket = majority_bucket

    # ---- training -------------------------------------------------------------------------------------------

    @classmethod
    def train(cls, examples: Sequence[LengthExample], bucket_tokens: int = DEFAULT_BUCKET_TOKENS, epochs: int = 30,
              seed: int = 0, *, feature_dim: int = DEFAULT_FEATURE_DIM, hidden: int = 0, lr: float = 0.05,
              batch_size: int = 64, weight_decay: float = 3e-3) -> LengthPredictor:
        """Fit on `examples`; the same examples and seed always give the same weights.

        hidden=0 is a linear softmax classifier; hidden=H adds one ReLU layer of width H. The weight decay
        is what keeps thousands of hashed n-gram slots from memorising noisy training labels.
        """
        if not examples:
            raise ValueError("no examples to train the length predictor on")
        for name, value in (("bucket_tokens", bucket_tokens), ("epochs", epochs), ("feature_dim", feature_dim),
                            ("batch_size", batch_size)):
            if int(value) < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if hidden < 0:
            raise ValueError(f"hidden must be 0 (linear) or positive, got {hidden}")
        for example in examples:
            _check_example(example)
        num_buckets = 1 + max(max(bucket_of(e.max_tokens, bucket_tokens), bucket_of(e.output_tokens, bucket_tokens))
                              for e in examples)
        targets = [min(bucket_of(e.output_tokens, bucket_tokens), bucket_of(e.max_tokens, bucket_tokens))
                   for e in examples]
        counts = np.bincount(targets, minlength=num_buckets)
        majority = int(np.argmax(counts))  # ties -> the lowest bucket, deterministically

        with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's global RNG
            torch.manual_seed(seed)
            model = _Classifier(feature_dim, _num_dense(num_buckets), num_buckets, hidden)
        predictor = cls(model, bucket_tokens=bucket_tokens, feature_dim=feature_dim, num_buckets=num_buckets,
                        hidden=hidden, majority_bucket=majority)
        with _one_thread():
            predictor._fit(examples, targets, epochs=epochs, seed=seed, lr=lr, batch_size=batch_size,
                           weight_decay=weight_decay)
        return predictor

    def _fit(self, examples, targets, *, epochs, seed, lr, batch_size, weight_decay) -> None:
        model = self._model
        encoded = [self._encode_one(e.prompt_token_ids, e.max_tokens) for e in examples]
        target_tensor = torch.tensor(targets, dtype=torch.long)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
        order = list(range(len(examples)))
        shuffler = random.Random(seed)
        model.train()
        for _ in range(epochs):
            shuffler.shuffle(order)
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                batch = self._collate([encoded[i] for i in rows])
                logits = self._masked_logits(batch)
                loss = nn.functional.cross_entropy(logits, target_tensor[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        model.eval()

    # ---- prediction -----------------------------------------------------------------------------------------

    def predict_bucket(self, prompt_token_ids: Sequence[int], max_tokens: int) -> int:
        """The most likely output-length bucket of a request."""
        return self.predict_buckets([(prompt_token_ids, max_tokens)])[0]

    def predict_buckets(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[int]:
        """`predict_bucket` for many requests in one forward pass."""
        if not requests:
            return []
        for _, max_tokens in requests:
            _check_max_tokens(max_tokens)
        batch = self._collate([self._encode_one(p, m) for p, m in requests])
        with torch.no_grad():
            return self._masked_logits(batch).argmax(dim=-1).tolist()

    def predict_tokens(self, prompt_token_ids: Sequence[int], max_tokens: int) -> int:
        """A decode length to plan with: the predicted bucket's midpoint, never above max_tokens."""
        bucket = self.predict_bucket(prompt_token_ids, max_tokens)
        return min(bucket * self.bucket_tokens + self.bucket_tokens // 2, int(max_tokens))

    def evaluate(self, examples: Sequence[LengthExample]) -> dict:
        """Accuracy on `examples` next to two baselines measured on the same examples.

        Baselines: the training set's majority bucket, and the bucket max_tokens falls in (what a router
        without a predictor would assume). `confusion[true][predicted]` counts requests.
        """
        if not examples:
            raise ValueError("no examples to evaluate the length predictor on")
        for example in examples:
            _check_example(example)
        truth = [bucket_of(e.output_tokens, self.bucket_tokens) for e in examples]
        predicted = self.predict_buckets([(e.prompt_token_ids, e.max_tokens) for e in examples])
        by_max_tokens = [bucket_of(e.max_tokens, self.bucket_tokens) for e in examples]
        size = max(self.num_buckets, max(truth) + 1, max(by_max_tokens) + 1)
        confusion = [[0] * size for _ in range(size)]
        for t, p in zip(truth, predicted):
            confusion[t][p] += 1
        n = len(examples)
        return {
            "n": n,
            "bucket_tokens": self.bucket_tokens,
            "accuracy": _share(truth, predicted),
            "within_one_bucket": sum(abs(t - p) <= 1 for t, p in zip(truth, predicted)) / n,
            "baselines": {
                "majority_bucket": _share(truth, [self.majority_bucket] * n),
                "max_tokens_bucket": _share(truth, by_max_tokens),
            },
            "majority_bucket": self.majority_bucket,
            "confusion": confusion,
        }

    # ---- files ----------------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """One safetensors file: the weights, and what is needed to rebuild the model in its metadata."""
        # start-up: safetensors only when a predictor is saved or loaded
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"format": FORMAT, "version": str(VERSION), "bucket_tokens": str(self.bucket_tokens),
                    "feature_dim": str(self.feature_dim), "num_buckets": str(self.num_buckets),
                    "hidden": str(self.hidden), "majority_bucket": str(self.majority_bucket)}
        tensors = {name: t.detach().contiguous() for name, t in self._model.state_dict().items()}
        save_file(tensors, str(path), metadata=metadata)
        return path

    @classmethod
    def load(cls, path: str | Path) -> LengthPredictor:
        """Read a file written by `save`; anything else raises ValueError saying what is wrong."""
        # start-up: safetensors only when a predictor is saved or loaded
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"length predictor file {str(path)!r} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, json.JSONDecodeError, RuntimeError) as exc:
            raise ValueError(f"{path} is not a safetensors file: {exc}") from None
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a length predictor file (format {metadata.get('format')!r}, "
                             f"expected {FORMAT!r})")
        if metadata.get("version") != str(VERSION):
            raise ValueError(f"{path}: length predictor version {metadata.get('version')!r} is not supported "
                             f"(this meshserve reads version {VERSION})")
        try:
            shape = {key: int(metadata[key]) for key in
                     ("bucket_tokens", "feature_dim", "num_buckets", "hidden", "majority_bucket")}
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{path}: length predictor metadata is incomplete or malformed ({exc})") from None
        if min(shape["bucket_tokens"], shape["feature_dim"], shape["num_buckets"]) < 1 or shape["hidden"] < 0:
            raise ValueError(f"{path}: length predictor metadata out of range: {shape}")
        model = _Classifier(shape["feature_dim"], _num_dense(shape["num_buckets"]), shape["num_buckets"],
                            shape["hidden"])
        try:
            model.load_state_dict(tensors, strict=True)
        except RuntimeError as exc:
            first_line = str(exc).strip().splitlines()[0]
            raise ValueError(f"{path}: weights do not match the metadata ({first_line})") from None
        return cls(model, **shape)

    # ---- features -------------------------------------------------------------------------------------------

    def _encode_one(self, prompt_token_ids: Sequence[int], max_tokens: int):
        slots, weights = hashed_ngrams(prompt_token_ids, self.feature_dim)
        max_bucket = bucket_of(max_tokens, self.bucket_tokens)
        one_hot = [0.0] * self.num_buckets
        one_hot[min(max_bucket, self.num_buckets - 1)] = 1.0
        dense = [math.log1p(len(prompt_token_ids)), math.log1p(int(max_tokens))] + one_hot
        return slots, weights, dense, max_bucket

    def _collate(self, encoded) -> _Batch:
        offsets, slots, weights = [], [], []
        for s, w, _, _ in encoded:
            offsets.append(len(slots))
            slots.extend(s)
            weights.extend(w)
        classes = torch.arange(self.num_buckets)
        max_buckets = torch.tensor([m for _, _, _, m in encoded], dtype=torch.long)
        return _Batch(slots=torch.tensor(slots, dtype=torch.long), offsets=torch.tensor(offsets, dtype=torch.long),
                      weights=torch.tensor(weights, dtype=torch.float32),
                      dense=torch.tensor([d for _, _, d, _ in encoded], dtype=torch.float32),
                      allowed=classes[None, :] <= max_buckets[:, None])

    def _masked_logits(self, batch: _Batch) -> torch.Tensor:
        logits = self._model(batch.slots, batch.offsets, batch.weights, batch.dense)
        return logits.masked_fill(~batch.allowed, float("-inf"))


@contextmanager
def _one_thread():
    """Train on one intra-op thread: the ops are too small to split, and on a busy machine the threads' hand-offs
    made training over ten times slower; one thread also makes the weights independent of the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _num_dense(num_buckets: int) -> int:
    return 2 + num_buckets  # log prompt length, log max_tokens, one-hot bucket of max_tokens


def _share(truth: Sequence[int], predicted: Sequence[int]) -> float:
    return sum(t == p for t, p in zip(truth, predicted)) / len(truth)


def _check_max_tokens(max_tokens: int) -> None:
    if int(max_tokens) < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")


def _check_example(example: LengthExample) -> None:
    _check_max_tokens(example.max_tokens)
    if int(example.output_tokens) < 0:
        raise ValueError(f"output_tokens must be non-negative, got {example.output_tokens}")
