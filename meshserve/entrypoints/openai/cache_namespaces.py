"""Which prefix-cache namespace a request's blocks live in: one per API key (or client address) unless the
operator shares one among trusted keys (docs/caching.md#tenant-isolation).

Equal prompts of two namespaces hash differently everywhere a prefix is looked up (the TEs' prefix caches,
the memory pool's keys, the router's prompt tree), so one tenant's `cached_tokens`, time to first token and
routing never depend on what another tenant sent. The salt the engines see is a hash of the namespace and
the request's own `cache_salt` (vLLM's field of the same name): a tenant can split its own namespace further,
never reach into another's.
"""
from __future__ import annotations

import hashlib

from meshserve.config import ConfigError
from meshserve.wire.client import Tenancy

SHARE_ALL = "*"  # every key and client shares one namespace (a deployment whose keys all trust each other)
_SALT_HEX_CHARS = 32  # 128 bits: no two namespaces meet by chance


def key_fingerprint(key: str) -> str:
    """What names an API key in `--shared-cache-keys`: the first 16 hex digits of its SHA-256 (the authenticator
    names the key's principal "key:" + this), so the flag never shows a key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def parse_shared_cache_keys(spec: str) -> tuple[frozenset[str], ...]:
    """The key groups of `--shared-cache-keys`: groups separated by ";", each a comma-separated list of key
    fingerprints (`key_fingerprint`); "*" alone shares one namespace among every key. ConfigError when a
    fingerprint is malformed or in two groups."""
    if spec.strip() in ("", SHARE_ALL):
        return ()
    groups = tuple(frozenset(fp.strip().lower() for fp in group.split(",") if fp.strip())
                   for group in spec.split(";") if group.strip())
    seen: set[str] = set()
    for group in groups:
        for fingerprint in group:
            if len(fingerprint) != 16 or any(c not in "0123456789abcdef" for c in fingerprint):
                raise ConfigError(f"shared_cache_keys: {fingerprint!r} is not a key fingerprint (16 hex digits)")
            if fingerprint in seen:
                raise ConfigError(f"shared_cache_keys: key {fingerprint} is in two groups")
            seen.add(fingerprint)
    return groups


class CacheNamespaces:
    """Maps a request's principal (its owner name, `http_guard.Principal.owner`) and `cache_salt` to the
    `Tenancy` its engine requests carry."""

    def __init__(self, shared_cache_keys: str = "") -> None:
        self.share_all = shared_cache_keys.strip() == SHARE_ALL
        self._group_of: dict[str, str] = {}  # a shared key's owner -> its group's namespace
        for group in parse_shared_cache_keys(shared_cache_keys):
            name = "group:" + ",".join(sorted(group))
            for fingerprint in group:
                self._group_of["key:" + fingerprint] = name

    def namespace(self, owner: str) -> str:
        """The principal's own namespace, or the shared one the operator put it in."""
        if self.share_all:
            return "shared"
        return self._group_of.get(owner, owner)

    def tenancy(self, owner: str, cache_salt: str | None = None) -> Tenancy:
        """The tenant (the principal's owner name: a key's fingerprint or a client address, never a key) and
        the salt of its namespace and the request's own `cache_salt`."""
        material = f"{self.namespace(owner)}\0{cache_salt or ''}".encode()
        return Tenancy(tenant=owner,
                       cache_salt=hashlib.sha256(material).hexdigest()[:_SALT_HEX_CHARS])

