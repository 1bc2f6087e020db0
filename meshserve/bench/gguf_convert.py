"""`python -m meshserve.bench.gguf_convert LLAMA_CPP_DIR MODEL_DIR [converter flags]`: llama.cpp's
convert_hf_to_gguf.py on a meshserve model.

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text and refuses a hash it
has not listed. The house tokenizer splits with Llama 3's regex (models/assets/tokenizer.json), so a hash the
converter does not know is named "llama-bpe", the name llama.cpp gives that regex (the benchmark feeds token
ids, never text, so the name cannot change what it measures). Run with llama.cpp's gguf-py on PYTHONPATH.
"""
from __future__ import annotations

import runpy
import sys

HOUSE_PRE_TOKENIZER = "llama-bpe"


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m meshserve.bench.gguf_convert LLAMA_CPP_DIR MODEL_DIR [converter flags]")
    llama_dir, rest = argv[0], argv[1:]
    sys.path.insert(0, llama_dir)
    try:
        from conversion.base import TextModel  # llama.cpp's converter package (2026 layout)
    except ImportError as exc:
        raise SystemExit(f"{llama_dir}: no converter package this script knows ({exc})") from exc
    listed = TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return listed(self, tokenizer)
        except NotImplementedError:
            return HOUSE_PRE_TOKENIZER

    TextModel.get_vocab_base_pre = pre_tokenizer
    script = f"{llama_dir}/convert_hf_to_gguf.py"
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
