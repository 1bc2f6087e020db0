"""Model caching in the memory pool: a model's weights as pool values under a versioned model id.

Layout, all in the reserved namespace `models`:
  `ID@VERSION/manifest`      msgpack: tensor names, safetensors dtypes, shapes, byte sizes, chunk
                             counts, and the model's small files (config.json, tokenizer files, ...)
  `ID@VERSION/TENSOR/I`      chunk I of a tensor's raw bytes (tensors above `chunk_bytes` are split)
  `catalog`                  msgpack: every cached model's id, version, bytes and last use (the LRU record)

VERSION is a content hash of config.json, the safetensors index, every safetensors header (names,
dtypes, shapes, offsets) and the first 4 KiB of every tensor, so a changed model (new config or
retrained weights) is a new version and keys of two versions never mix; copies of one model on
different hosts get the same version. The manifest is written last: its presence means every chunk was stored.

Eviction is per model: `evict_model` deletes all of one model's values, and `put_model` with a
`max_bytes` budget first evicts whole least-recently-used models. The LRU record is one small
`catalog` value rather than access times in each manifest, because listing and choosing a victim
need every model at once and the pool cannot list keys. Readers and writers update it by
read-modify-write; two racing updates can lose one `last_used` stamp, which only makes the LRU
order slightly stale. If the catalog is lost (its server died), the models stay loadable (their
manifest keys are derived from id and version) but are no longer listed or evicted as a whole.

Loading (`iter_pool_tensors`; `load_model(..., read_weights=pool_weights(client, model_dir))`):
for a tensor a rank keeps only a piece of, the chunks covering the piece are read whole and the
piece is cut from them (a piece along dim 0 is a contiguous byte range, so only its chunks are
fetched; along other dims the whole tensor is fetched). Any tensor with a missing chunk (server
down, evicted) is read from disk instead; the load never fails while the disk copy exists.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import msgpack
import torch
from safetensors import safe_open

from meshserve.layers.tensor_parallel import Shard
from meshserve.models.loader import WeightsReader, iter_safetensors
from meshserve.pool.sdk import PoolClient
from meshserve.utils.checkpoint_files import (  # noqa: F401 (model_version is part of this module's API)
    INDEX_FILE,
    MARKER_FILE,
    model_version,
    read_safetensors_header,
    safetensors_files,
)

logger = logging.getLogger(__name__)

NAMESPACE = "models"
CATALOG_KEY = "catalog"
DEFAULT_CHUNK_BYTES = 64 << 20
BATCH_BYTES = 64 << 20  # bytes per put/get call: bounds memory and keeps each call well inside a timeout
MAX_FILE_BYTES = 64 << 20  # small files stored in the manifest; anything bigger is left out
_MANIFEST_FORMAT = 1

_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class ModelCacheError(RuntimeError):
    pass


@dataclass
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype code ("F32", "BF16", ...)
    shape: list[int]
    nbytes: int
    chunks: int


@dataclass
class Manifest:
    model_id: str
    version: str
    chunk_bytes: int
    tensors: list[TensorInfo]
    files: dict[str, bytes]  # file name -> contents (config.json, tokenizer files, ...)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def encode(self) -> bytes:
        return msgpack.packb({"format": _MANIFEST_FORMAT, "model_id": self.model_id, "version": self.version,
                              "chunk_bytes": self.chunk_bytes, "files": self.files,
                              "tensors": [[t.name, t.dtype, t.shape, t.nbytes, t.chunks] for t in self.tensors]},
                             use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        raw = msgpack.unpackb(data, raw=False)
        if raw.get("format") != _MANIFEST_FORMAT:
            raise ModelCacheError(f"unknown model manifest format {raw.get('format')!r}")
        return cls(raw["model_id"], raw["version"], raw["chunk_bytes"],
                   [TensorInfo(*t) for t in raw["tensors"]], dict(raw["files"]))


@dataclass
class CatalogEntry:
    model_id: str
    version: str
    bytes: int
    values: int  # chunks + the manifest
    stored_at: float
    last_used: float

    @property
    def ref(self) -> str:
        return model_ref(self.model_id, self.version)


# ---------------------------------------------------------------- keys and versions
def model_ref(model_id: str, version: str) -> str:
    return f"{model_id}@{version}"


def manifest_key(model_id: str, version: str) -> str:
    return f"{model_ref(model_id, version)}/manifest"


def chunk_key(model_id: str, version: str, tensor: str, index: int) -> str:
    return f"{model_ref(model_id, version)}/{tensor}/{index}"


def value_keys(manifest: Manifest) -> list[str]:
    """Every pool key of a model: its chunks, then its manifest."""
    keys = [chunk_key(manifest.model_id, manifest.version, t.name, i)
            for t in manifest.tensors for i in range(t.chunks)]
    return keys + [manifest_key(manifest.model_id, manifest.version)]


def default_model_id(model_dir: str | Path) -> str:
    return Path(model_dir).resolve().name


def _tensor_layout(model_dir: Path) -> list[tuple[Path, int, str, dict]]:
    """(file, data start, name, header entry) per tensor, in the order the disk loader reads them."""
    layout = []
    for path in safetensors_files(model_dir):
        _, header, data_start = read_safetensors_header(path)
        for name in sorted(k for k in header if k != "__metadata__"):
            layout.append((path, data_start, name, header[name]))
    return layout


def _small_files(model_dir: Path) -> dict[str, bytes]:
    files = {}
    for path in sorted(model_dir.iterdir()):
        if (path.is_file() and not path.name.endswith(".safetensors") and path.name not in (INDEX_FILE, MARKER_FILE)
                and path.stat().st_size <= MAX_FILE_BYTES):
            files[path.name] = path.read_bytes()
    return files


# ---------------------------------------------------------------- catalog (the LRU record)
def read_catalog(pool: PoolClient) -> dict[str, CatalogEntry]:
    value = pool.get(NAMESPACE, [CATALOG_KEY]).get(CATALOG_KEY)
    if value is None:
        return {}
    return {ref: CatalogEntry(**fields) for ref, fields in msgpack.unpackb(bytes(value), raw=False).items()}


def write_catalog(pool: PoolClient, catalog: dict[str, CatalogEntry]) -> bool:
    data = msgpack.packb({ref: asdict(e) for ref, e in catalog.items()}, use_bin_type=True)
    return pool.put(NAMESPACE, {CATALOG_KEY: data}).get(CATALOG_KEY, False)


def list_models(pool: PoolClient) -> list[CatalogEntry]:
    """Cached models, most recently used first."""
    return sorted(read_catalog(pool).values(), key=lambda e: e.last_used, reverse=True)


def touch_model(pool: PoolClient, model_id: str, version: str) -> None:
    """Stamp a model as just used (the LRU order of whole-model eviction)."""
    catalog = read_catalog(pool)
    entry = catalog.get(model_ref(model_id, version))
    if entry is not None:
        entry.last_used = time.time()
        write_catalog(pool, catalog)


def resolve_version(pool: PoolClient, model_id: str, version: str | None = None) -> str | None:
    """`version` itself, or the most recently stored version of `model_id` in the catalog."""
    if version is not None:
        return version
    versions = [e for e in read_catalog(pool).values() if e.model_id == model_id]
    return max(versions, key=lambda e: e.stored_at).version if versions else None


def fetch_manifest(pool: PoolClient, model_id: str, version: str) -> Manifest | None:
    value = pool.get(NAMESPACE, [manifest_key(model_id, version)]).get(manifest_key(model_id, version))
    return None if value is None else Manifest.decode(bytes(value))


# ---------------------------------------------------------------- storing and evicting
def _manifest(model_dir: Path, layout: list, model_id: str, version: str, chunk_bytes: int) -> Manifest:
    """What the pool will hold of a checkpoint: each tensor's dtype, shape, size and chunk count, and its small
    files."""
    tensors = []
    for _, _, name, entry in layout:
        nbytes = entry["data_offsets"][1] - entry["data_offsets"][0]
        tensors.append(TensorInfo(name, entry["dtype"], list(entry["shape"]), nbytes, -(-nbytes // chunk_bytes)))
    return Manifest(model_id, version, chunk_bytes, tensors, _small_files(model_dir))


def _chunks(layout: list, tensors: list[TensorInfo], model_id: str, version: str, chunk_bytes: int
            ) -> Iterator[tuple[str, memoryview]]:
    """Each tensor's chunks in file order, read from its shard, with their pool keys."""
    for (path, data_start, name, entry), info in zip(layout, tensors):
        begin = data_start + entry["data_offsets"][0]
        with open(path, "rb") as f:
            for i in range(info.chunks):
                size = min(chunk_bytes, info.nbytes - i * chunk_bytes)
                data = bytearray(size)
                f.seek(begin + i * chunk_bytes)
                if f.readinto(data) != size:
                    raise ModelCacheError(f"{path} is shorter than its header says ({name})")
                yield chunk_key(model_id, version, name, i), memoryview(data)


def put_model(pool: PoolClient, model_dir: str | Path, model_id: str | None = None,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_bytes: int | None = None,
              progress: Callable[[str], None] | None = None) -> CatalogEntry:
    """Store every tensor of `model_dir` in the pool; returns the catalog entry.

    A model already in the pool (same id and version, manifest present) is only stamped as used.
    With `max_bytes`, whole least-recently-used models are evicted first so that the models
    namespace stays within it. Raises ModelCacheError when the pool refuses values (nothing of
    this version is left behind) or the model alone exceeds `max_bytes`.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    say = progress or (lambda line: None)
    model_dir = Path(model_dir)
    model_id = model_id or default_model_id(model_dir)
    version = model_version(model_dir)
    layout = _tensor_layout(model_dir)
    manifest = _manifest(model_dir, layout, model_id, version, chunk_bytes)
    tensors = manifest.tensors
    ref = model_ref(model_id, version)

    catalog = read_catalog(pool)
    if ref in catalog and pool.exists(NAMESPACE, [manifest_key(model_id, version)])[0]:
        catalog[ref].last_used = time.time()
        write_catalog(pool, catalog)
        say(f"{ref}: already in the pool ({_mib(manifest.total_bytes)})")
        return catalog[ref]
    if max_bytes is not None:
        _make_room(pool, catalog, manifest.total_bytes, max_bytes, keep=ref, say=say)

    total, done = manifest.total_bytes, 0
    say(f"{ref}: storing {len(tensors)} tensors, {_mib(total)} in chunks of up to {_mib(chunk_bytes)}")
    batch: dict[str, memoryview] = {}

    def flush() -> None:
        nonlocal done
        refused = [k for k, ok in pool.put(NAMESPACE, batch).items() if not ok]
        if refused:
            evict_values(pool, manifest)
            raise ModelCacheError(f"the pool refused {len(refused)} value(s) of {ref} (out of space or over the "
                                  f"namespace quota, or a server is down); nothing of it was kept")
        done += sum(v.nbytes for v in batch.values())
        say(f"{ref}: {_mib(done)} / {_mib(total)} ({100 * done // max(1, total)}%)")
        batch.clear()

    for key, data in _chunks(layout, tensors, model_id, version, chunk_bytes):
        if batch and sum(v.nbytes for v in batch.values()) + data.nbytes > BATCH_BYTES:
            flush()
        batch[key] = data
    if batch:
        flush()
    # The manifest goes last: a reader that finds it knows every chunk was stored.
    key = manifest_key(model_id, version)
    if not pool.put(NAMESPACE, {key: manifest.encode()}).get(key):
        evict_values(pool, manifest)
        raise ModelCacheError(f"the pool refused the manifest of {ref}; nothing of it was kept")
    now = time.time()
    entry = CatalogEntry(model_id, version, total, sum(t.chunks for t in tensors) + 1, now, now)
    catalog = read_catalog(pool)  # re-read: another writer may have changed it meanwhile
    catalog[ref] = entry
    if not write_catalog(pool, catalog):
        logger.warning("model cache: the catalog was not written; %s is stored but not listed", ref)
    say(f"{ref}: stored")
    return entry


def _make_room(pool: PoolClient, catalog: dict[str, CatalogEntry], needed: int, max_bytes: int,
               keep: str, say: Callable[[str], None]) -> None:
    if needed > max_bytes:
        raise ModelCacheError(f"the model needs {_mib(needed)}, more than the models budget of {_mib(max_bytes)}")
    others = sorted((e for ref, e in catalog.items() if ref != keep), key=lambda e: e.last_used)
    used = sum(e.bytes for e in others)
    for victim in others:
        if used + needed <= max_bytes:
            break
        say(f"evicting {victim.ref} ({_mib(victim.bytes)}, least recently used) to stay within {_mib(max_bytes)}")
        evict_model(pool, victim.model_id, victim.version)
        used -= victim.bytes


def evict_values(pool: PoolClient, manifest: Manifest) -> int:
    """Delete every value of one model version; returns how many the pool had."""
    keys = value_keys(manifest)
    deleted = 0
    for start in range(0, len(keys), 1024):
        deleted += sum(pool.delete(NAMESPACE, keys[start:start + 1024]))
    return deleted


def evict_model(pool: PoolClient, model_id: str, version: str | None = None) -> list[CatalogEntry]:
    """Delete one model version (or, without `version`, every version of `model_id`) as a whole."""
    catalog = read_catalog(pool)
    refs = [ref for ref, e in catalog.items() if e.model_id == model_id and version in (None, e.version)]
    if version is not None and model_ref(model_id, version) not in refs:
        refs.append(model_ref(model_id, version))  # not listed, yet its values may be there
    evicted = []
    for ref in refs:
        entry = catalog.pop(ref, None)
        found_version = entry.version if entry else version
        manifest = fetch_manifest(pool, model_id, found_version)
        if manifest is not None:
            evict_values(pool, manifest)
        elif entry is not None:
            logger.warning("model cache: the manifest of %s is gone; its chunks are left to the pool's LRU", ref)
        if entry is not None or manifest is not None:
            evicted.append(entry or CatalogEntry(model_id, found_version, manifest.total_bytes, 0, 0.0, 0.0))
    if evicted:
        write_catalog(pool, catalog)
    return evicted


def prefetch_model(pool: PoolClient, model_id: str, version: str | None = None) -> int:
    """Read every value of a model once, so the pool servers hold it in DRAM; returns the bytes found.

    The pool has no touch message, so prefetching moves the bytes to the caller and drops them.
    """
    version = resolve_version(pool, model_id, version)
    manifest = fetch_manifest(pool, model_id, version) if version else None
    if manifest is None:
        return 0
    found = 0
    for keys in _key_batches(manifest, [(t, 0, t.nbytes) for t in manifest.tensors]):
        found += sum(v.nbytes for v in pool.get(NAMESPACE, keys).values())
    touch_model(pool, model_id, version)
    return found


def fetch_model_files(pool: PoolClient, model_id: str, out_dir: str | Path, version: str | None = None) -> Path:
    """Write a pooled model's small files (config.json, tokenizer, ...) and a marker into `out_dir`.

    `load_model(out_dir, read_weights=pool_weights(pool, out_dir))` then loads the weights from the pool alone
    (without a disk copy to fall back on, a missing tensor fails the load).
    """
    version = resolve_version(pool, model_id, version)
    manifest = fetch_manifest(pool, model_id, version) if version else None
    if manifest is None:
        raise ModelCacheError(f"model {model_id!r} is not in the pool")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in manifest.files.items():
        (out_dir / Path(name).name).write_bytes(data)
    (out_dir / MARKER_FILE).write_text(json.dumps({"model_id": model_id, "version": version}) + "\n")
    return out_dir


# ---------------------------------------------------------------- loading
def pooled_model_of(model_dir: str | Path, model_id: str | None = None) -> tuple[str, str | None]:
    """(model id, version) a directory loads from the pool: its own content hash when it holds the
    safetensors files, else what fetch_model_files's marker names."""
    model_dir = Path(model_dir)
    marker = model_dir / MARKER_FILE
    try:
        return model_id or default_model_id(model_dir), model_version(model_dir)
    except FileNotFoundError:
        if not marker.is_file():
            raise
    named = json.loads(marker.read_text())
    return model_id or named["model_id"], named["version"]


def pool_weights(pool: PoolClient, model_dir: str | Path, model_id: str | None = None) -> WeightsReader:
    """A `load_model(read_weights=...)` source reading `model_dir`'s tensors from the pool's model cache."""
    return lambda wanted, shard_of: iter_pool_tensors(pool, model_dir, model_id, wanted, shard_of)


def iter_pool_tensors(pool: PoolClient, model_dir: str | Path, model_id: str | None = None,
                      name_filter: Callable[[str], bool] | None = None,
                      shard_of: Callable[[str], Shard | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_safetensors` with the pool as the source: (name, tensor or this rank's piece of it).

    Tensors missing from the pool (or the whole model, when its manifest is missing) come from
    disk. Chunks are fetched in batches, the next batch in flight while the current one is used.
    """
    model_id, version = pooled_model_of(model_dir, model_id)
    manifest = fetch_manifest(pool, model_id, version)
    if manifest is None:
        if (Path(model_dir) / MARKER_FILE).is_file() and not any(Path(model_dir).glob("*.safetensors")):
            raise ModelCacheError(f"model {model_ref(model_id, version)} is missing from the pool and "
                                  f"{model_dir} has no weights on disk")
        logger.info("model cache: %s is not in the pool; loading from disk", model_ref(model_id, version))
        yield from iter_safetensors(model_dir, name_filter, shard_of)
        return
    touch_model(pool, model_id, version)
    wanted = []
    for info in manifest.tensors:
        if name_filter is not None and not name_filter(info.name):
            continue
        shard = shard_of(info.name) if shard_of is not None else None
        begin, end = _byte_range(info, shard)
        wanted.append((info, shard, begin, end))
    batches = _tensor_batches(wanted)
    fallback = _DiskFallback(Path(model_dir))
    pending = pool.get_async(NAMESPACE, _chunk_keys(manifest, batches[0])) if batches else None
    try:
        for i, batch in enumerate(batches):
            values = pending.result()
            if i + 1 < len(batches):
                pending = pool.get_async(NAMESPACE, _chunk_keys(manifest, batches[i + 1]))
            for info, shard, begin, end in batch:
                tensor = _assemble(manifest, info, shard, begin, end, values)
                yield info.name, (tensor if tensor is not None else fallback.read(info.name, shard))
    finally:
        fallback.close()
    if fallback.count:
        logger.warning("model cache: %d of %d tensors of %s came from disk (pool misses)",
                       fallback.count, len(wanted), model_ref(model_id, version))


def _byte_range(info: TensorInfo, shard: Shard | None) -> tuple[int, int]:
    """The bytes of a tensor to fetch: a dim-0 piece is contiguous, any other piece needs the whole."""
    if shard is None or shard.dim != 0 or not info.shape:
        return 0, info.nbytes
    start, length = shard.bounds(info.shape[0], info.name)
    row = info.nbytes // info.shape[0]
    return start * row, (start + length) * row


def _chunks_of(manifest: Manifest, info: TensorInfo, begin: int, end: int) -> range:
    if end <= begin:
        return range(0)
    return range(begin // manifest.chunk_bytes, (end - 1) // manifest.chunk_bytes + 1)


def _tensor_batches(wanted: list) -> list[list]:
    batches, current, size = [], [], 0
    for item in wanted:
        needed = item[3] - item[2]
        if current and size + needed > BATCH_BYTES:
            batches.append(current)
            current, size = [], 0
        current.append(item)
        size += needed
    return batches + ([current] if current else [])


def _chunk_keys(manifest: Manifest, batch: list) -> list[str]:
    return [chunk_key(manifest.model_id, manifest.version, info.name, c)
            for info, _, begin, end in batch for c in _chunks_of(manifest, info, begin, end)]


def _key_batches(manifest: Manifest, ranges: list) -> Iterator[list[str]]:
    batch = [(info, None, begin, end) for info, begin, end in ranges]
    for group in _tensor_batches(batch):
        yield _chunk_keys(manifest, group)


def _assemble(manifest: Manifest, info: TensorInfo, shard: Shard | None, begin: int, end: int,
              values: dict) -> torch.Tensor | None:
    """The tensor (or its piece) from fetched chunks; None when a chunk is missing."""
    data = bytearray(end - begin)
    view = memoryview(data)
    for c in _chunks_of(manifest, info, begin, end):
        chunk = values.get(chunk_key(manifest.model_id, manifest.version, info.name, c))
        chunk_start = c * manifest.chunk_bytes
        expected = min(manifest.chunk_bytes, info.nbytes - chunk_start)
        if chunk is None or chunk.nbytes != expected:
            return None
        lo, hi = max(begin, chunk_start), min(end, chunk_start + expected)
        view[lo - begin:hi - begin] = memoryview(chunk).cast("B")[lo - chunk_start:hi - chunk_start]
    dtype = _TORCH_DTYPES.get(info.dtype)
    if dtype is None:
        return None  # a dtype torch cannot hold here: the disk loader decides what to do with it
    shape = list(info.shape)
    if (begin, end) != (0, info.nbytes):  # a dim-0 piece
        shape[0] = (end - begin) // (info.nbytes // info.shape[0])
    tensor = torch.frombuffer(data, dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
    if shard is not None and shard.dim != 0:
        tensor = shard.take(tensor, info.name).contiguous()
    return tensor


class _DiskFallback:
    """Reads single tensors from the safetensors files, opening each file once."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.count = 0
        self._stack = ExitStack()
        self._where: dict[str, Path] | None = None
        self._open: dict[Path, object] = {}

    def read(self, name: str, shard: Shard | None) -> torch.Tensor:
        self.count += 1
        if self._where is None:
            try:
                self._where = {n: path for path, _, n, _ in _tensor_layout(self.model_dir)}
            except FileNotFoundError:
                self._where = {}
        path = self._where.get(name)
        if path is None:
            raise ModelCacheError(f"tensor {name!r} is missing from the pool and {self.model_dir} has no copy of it")
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        f = self._open[path]
        return f.get_tensor(name) if shard is None else shard.read(f.get_slice(name), name)

    def close(self) -> None:
        self._stack.close()


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"
