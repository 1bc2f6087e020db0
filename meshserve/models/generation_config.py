"""Light readers of a model directory's JSON files (no torch import: the master and clients use them)."""
from __future__ import annotations

import json
from pathlib import Path


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS ids from generation_config.json (preferred) or config.json, as a list."""
    model_dir = Path(model_dir)
    eos = read_json(model_dir / "generation_config.json").get("eos_token_id")
    if eos is None:
        eos = read_json(model_dir / "config.json").get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def max_position_embeddings(model_dir: str | Path) -> int:
    cfg = read_json(Path(model_dir) / "config.json")
    return int(cfg.get("max_position_embeddings") or 4096)
