"""The house tokenizer: a byte-level BPE with a chat template, committed under `assets/`.

Every generated checkpoint ships the same `tokenizer.json`, so models never depend on
re-training. `train_tokenizer` is kept for provenance: it rebuilds the file from the
running interpreter's standard library (.py sources: code plus English docstrings and
comments). The committed file was trained on CPython 3.11's standard library.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TOKENIZER_FILE = ASSETS_DIR / "tokenizer.json"
CHAT_TEMPLATE_FILE = ASSETS_DIR / "chat_template.json"

VOCAB_SIZE = 32000
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_OF_TURN_TOKEN = "<|end_of_turn|>"
# Order fixes the ids: the trainer gives special tokens the first ids (0..6).
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_OF_TURN_TOKEN)
ROLE_TOKENS = (SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_OF_TURN_TOKEN)

# Llama-3 style split: contractions, letter runs, up-to-3-digit numbers, punctuation runs,
# newlines and indentation kept apart so code tokenizes well.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Standard-library parts that are test data, vendored code or unusual encodings.
_SKIPPED_STDLIB_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "encodings"})


def special_token_ids() -> dict[str, int]:
    """Token string -> id for the special tokens (fixed by `SPECIAL_TOKENS` order)."""
    return {token: i for i, token in enumerate(SPECIAL_TOKENS)}


def stdlib_corpus_files() -> list[Path]:
    """The training corpus: this interpreter's standard-library .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path for path in root.rglob("*.py")
        if not _SKIPPED_STDLIB_DIRS.intersection(path.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _iter_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


@contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    # The Rust trainer reads this variable at each call; one thread keeps training reproducible.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def build_untrained_tokenizer():
    """The tokenizer pipeline (split, byte-level, BOS post-processor) with an empty BPE model."""
    # start-up: tokenizers only when a tokenizer is built
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    bos_id = special_token_ids()[BOS_TOKEN]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def train_tokenizer(out_path: str | Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train the byte-level BPE on the standard-library corpus and write `tokenizer.json` to `out_path`."""
    # start-up: tokenizers only when a tokenizer is built
    from tokenizers import pre_tokenizers, trainers

    tokenizer = build_untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = stdlib_corpus_files()
    with _single_threaded_tokenizers():
        tokenizer.train_from_iterator(_iter_texts(files), trainer=trainer, length=len(files))
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained vocab has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    for token, token_id in special_token_ids().items():
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token} got id {tokenizer.token_to_id(token)}, wanted {token_id}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_path), pretty=False)
    return out_path


def load_tokenizer():
    """The committed tokenizer as a `tokenizers.Tokenizer`."""
    # start-up: tokenizers only when a tokenizer is built
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER_FILE))


def chat_template() -> str:
    """The jinja chat template (HF `apply_chat_template` compatible)."""
    return json.loads(CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"))["chat_template"]


def special_tokens_map() -> dict:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
    }


def tokenizer_config(model_max_length: int) -> dict:
    """The `tokenizer_config.json` HF's AutoTokenizer reads next to `tokenizer.json`."""
    added_tokens_decoder = {
        str(token_id): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for token, token_id in special_token_ids().items()
    }
    return {
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template(),
    }


def write_tokenizer_files(out_dir: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out_dir = Path(out_dir)
    shutil.copyfile(TOKENIZER_FILE, out_dir / "tokenizer.json")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(model_max_length))
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map())


def follow_chat_template(model_dir: str | Path) -> None:
    """A model written earlier takes the house chat template as it is now (one written before the template
    learnt tools would otherwise never render them); the weights and the tokenizer are untouched."""
    config_path = Path(model_dir) / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if config.get("chat_template") != chat_template():
        config["chat_template"] = chat_template()
        staging = config_path.with_suffix(".json.tmp")
        _write_json(staging, config)
        staging.replace(config_path)  # atomic: a process reading it sees the old file or the new one
        logger.info("updated the chat template of %s", model_dir)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
