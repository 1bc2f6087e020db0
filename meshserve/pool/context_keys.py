"""Pool keys of KV blocks (context caching, cloudmatrix-infer §4.4.2).

A block's key chains the previous block's key with the block's token ids, the model's
identity (a content hash of its weights and the KV layout: compute dtype, KV cache dtype,
weight quantization, MTP) and two namespaces: the pool's (`--pool-namespace`) and the
request's prefix-cache salt (its tenant's namespace and `cache_salt`). Equal prefixes
share blocks while different models, versions, number formats or tenants never do. Each rank
stores its own part of a block under the key plus its attention-TP coordinates
(`rank_key`), so layouts with different TP never read each other's bytes.

Torch-free: the master computes keys; the workers store and fetch the bytes.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from meshserve.utils.checkpoint_files import content_version

_TOKEN = struct.Struct("<I")


def model_identity(model_dir: str, kv_layout: str) -> str:
    """The model's content version (`checkpoint_files.content_version`: the same for every copy of
    the weights, and for a directory that loads them from the pool) and the KV layout (`kv_layout_name`)."""
    return f"{content_version(model_dir)}-{kv_layout}"


def kv_layout_name(dtype: str, kv_cache_dtype: str = "auto", quantization: str | None = None,
                   mtp: bool = False) -> str:
    """What besides the weights decides a block's bytes: the model's compute dtype, the KV cache dtype
    where it is not the model's ("+kv-int8": quantized rows), the weight quantization ("+w-int8": W8A8
    activations change every layer's KV, so its blocks never serve a float engine, nor the reverse), and
    "+mtp" where blocks also hold the MTP layer's KV. A float engine's layout keeps its plain name
    ("float32", "float32+mtp")."""
    name = dtype
    if quantization:
        name += f"+w-{quantization}"
    if kv_cache_dtype != "auto":
        name += f"+kv-{kv_cache_dtype}"
    return name + ("+mtp" if mtp else "")


def key_root(model_id: str, namespace: str, cache_salt: str = "") -> str:
    """What the first block's key chains from: the pool namespace, the model and the request's prefix-cache
    namespace (`Tenancy.cache_salt`: tenants' equal prompts get different keys; docs/caching.md#tenant-isolation).
    An unsalted key keeps its historical form, so pools filled before salting still serve single-tenant engines."""
    root = f"{namespace}\0{model_id}"
    return f"{root}\0salt:{cache_salt}" if cache_salt else root


def block_keys(token_ids: Sequence[int], block_size: int, model_id: str, namespace: str,
               num_blocks: int | None = None, cache_salt: str = "") -> list[str]:
    """Keys of the first `num_blocks` full blocks of `token_ids` (default: every full block)."""
    return chain_block_keys(key_root(model_id, namespace, cache_salt), token_ids, block_size, 0, num_blocks)


def chain_block_keys(parent: str, token_ids: Sequence[int], block_size: int, first_block: int,
                     num_blocks: int | None = None) -> list[str]:
    """Keys of the full blocks of `token_ids` from `first_block` on, chained from `parent` (the key of
    block first_block - 1, or `key_root` for block 0): extends a sequence's keys as it grows."""
    full = len(token_ids) // block_size
    last = full if num_blocks is None else min(first_block + num_blocks, full)
    keys: list[str] = []
    parent = parent.encode()
    for b in range(first_block, last):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(_TOKEN.pack(t) for t in token_ids[b * block_size:(b + 1) * block_size]))
        key = digest.hexdigest()
        keys.append(key)
        parent = key.encode()
    return keys


def rank_key(key: str, attn_tp_rank: int, attn_tp_size: int) -> str:
    """The pool key of one rank's part of a block."""
    return f"kv/{key}/tp{attn_tp_rank}of{attn_tp_size}"
