"""Checkpoint files without torch: which safetensors files a model directory has, their headers,
and a content version of the model (the master and the pool tools use it without importing torch)."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MARKER_FILE = "pool_model.json"  # written by model_cache.fetch_model_files: which pooled model a directory stands for
VERSION_SAMPLE_BYTES = 4096  # leading bytes of each tensor that enter the version hash


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files in load order; every listed shard must exist."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path} is not a safetensors index (needs a 'weight_map'): {e}") from None
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index_path} lists shard(s) missing from {str(model_dir)!r}: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{str(model_dir)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_safetensors_header(path: Path) -> tuple[bytes, dict, int]:
    """(raw header bytes, parsed header, offset where the data starts)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(length)
    return raw, json.loads(raw), 8 + length


def model_version(model_dir: str | Path) -> str:
    """Content hash of config.json, the safetensors index and headers: 16 hex digits."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    if (model_dir / INDEX_FILE).is_file():
        digest.update((model_dir / INDEX_FILE).read_bytes())
    for path in safetensors_files(model_dir):
        raw, header, data_start = read_safetensors_header(path)
        digest.update(path.name.encode() + b"\0" + raw)
        with open(path, "rb") as f:  # a sample of every tensor: retrained weights keep the headers, not the data
            for name in sorted(k for k in header if k != "__metadata__"):
                begin, end = header[name]["data_offsets"]
                f.seek(data_start + begin)
                digest.update(f.read(min(VERSION_SAMPLE_BYTES, end - begin)))
    return digest.hexdigest()[:16]


def content_version(model_dir: str | Path) -> str:
    """`model_version` of the weights a directory holds, or, for a directory made by
    `model_cache.fetch_model_files` (no weights), of the pooled model it stands for."""
    model_dir = Path(model_dir)
    marker = model_dir / MARKER_FILE
    if marker.is_file() and not any(model_dir.glob("*.safetensors")):
        return json.loads(marker.read_text())["version"]
    return model_version(model_dir)
