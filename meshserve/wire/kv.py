"""Remote KV: the KV connectors' messages (memory pool fetches and stores, prefill -> decode pulls, link
probes), a disaggregated request's transfer parameters, link states, and the prefix-cache events a
master publishes to routers.

  master -> worker   : KVConnectorMetadata (inside StepBatch: one DP group's loads and stores)
  worker -> master   : KVConnectorReport (what finished in the background)
  master -> routers  : KVCacheEvents (PUB socket at CacheConfig.kv_events_endpoint)
"""
from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterable, Sequence

import msgspec
from msgspec import field

from meshserve.wire.base import Message


class KVTransferRole(enum.StrEnum):
    PRODUCER = "producer"  # a prefill TE: compute the prompt, sample the first token, hold the KV for a decode TE
    CONSUMER = "consumer"  # a decode TE: pull the prompt's KV from the prefill TE, then decode


class KVRegionLayer(Message):
    shape: list[int]
    dtype: str


class KVShmSegment(Message):
    shm_name: str
    shape: list[int]
    dtype: str


class KVRegion(Message):
    """One rank's KV cache as its transfer engine exposes it (`transfer.RegionDescriptor`, typed)."""

    engine: str
    region: str
    layers: list[KVRegionLayer]
    host_id: str
    tcp_address: tuple[str, int] | None = None
    shm: list[KVShmSegment] | None = None  # per layer, when the cache lives in shared memory
    device: str = "cpu"
    device_id: str | None = None  # which GPU holds it (its UUID)


class KVTransferParams(Message):
    """A request's part in disaggregated prefill/decode (xdeepserve §5.1).

    To a prefill TE: `role` PRODUCER only. A prefill TE's hand-off (RequestDelta) describes where the prompt's
    KV blocks wait, with role CONSUMER: the router forwards it to the decode TE as it is (`recompute`: the blocks
    may be gone, compute the prompt instead).
    """

    role: KVTransferRole
    engine: str = ""  # the prefill TE's name (its transfer engines' peer name)
    engine_addr: str = ""  # its input address: ReleaseKV goes there
    dp_rank: int = 0  # the DP group holding the blocks
    attn_tp: int = 1
    attn_dp: int = 1
    regions: list[KVRegion] = field(default_factory=list)  # that DP group's ranks' KV caches, by attention-TP rank
    block_ids: list[int] = field(default_factory=list)  # the prompt's blocks there, in order
    num_tokens: int = 0  # prompt tokens whose KV the blocks hold
    num_cached_tokens: int = 0  # of which the prefill TE found in its prefix cache
    hold_s: float = 0.0  # how long the prefill TE holds the blocks, and until when (wall clock: another host)
    hold_expires_at: float | None = None
    recompute: bool = False


class PoolBlock(Message, array_like=True):
    block_id: int
    key: str  # the block's pool key (meshserve.pool.context_keys; each rank adds its rank_key part)


class PoolFetch(Message):
    """Populate `blocks` of one request from the memory pool (deepserve RTC populate)."""

    req_id: str
    blocks: list[PoolBlock]


class KVPull(Message):
    """Pull one request's prompt blocks from a prefill TE."""

    req_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    # the prefill rank each attention-TP rank of this DP group reads from (meshserve.core.pd_mapping)
    sources: list[KVRegion]


class KVConnectorMetadata(Message):
    """One DP group's remote-KV work of a step boundary: every rank of the group starts it before the step."""

    pool_stores: list[PoolBlock] = field(default_factory=list)  # full blocks to copy to the memory pool
    pool_fetches: list[PoolFetch] = field(default_factory=list)
    kv_pulls: list[KVPull] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.pool_stores or self.pool_fetches or self.kv_pulls)


class PoolFetchDone(Message, array_like=True):
    req_id: str
    num_blocks: int  # the leading ordered blocks this rank wrote (fewer: the pool lost the next one)


class KVPullDone(Message):
    req_id: str
    error: str | None = None  # why the pull failed; None: the blocks are in


class LinkProbe(Message):
    """One link probe of a decode rank (xdeepserve §6.1): a tiny dummy transfer from a prefill rank's transfer
    engine (`peer`, its name there), timed."""

    peer: str
    ok: bool
    rtt_s: float  # the round trip (a failure: how long until it failed)
    error: str | None = None


class KVConnectorReport(Message):
    """What one rank's connectors finished in the background since its last report."""

    rank: int
    dp_rank: int
    pool_fetches: list[PoolFetchDone] = field(default_factory=list)
    kv_pulls: list[KVPullDone] = field(default_factory=list)
    link_probes: list[LinkProbe] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.pool_fetches or self.kv_pulls or self.link_probes)


class LinkState(enum.StrEnum):
    """A decode TE's KV transfer path from one prefill TE (`meshserve.core.link_monitor`)."""

    OK = "ok"
    SATURATED = "saturated"  # probes pass, pulls are slow or wait for blocks: the decode side is busy
    DOWN = "down"  # probes fail: nothing goes through; routing pairs neither TE with the other


class LinkStatus(Message):
    """One decode TE -> prefill TE link as the decode TE sees it (its pulls and its ranks' probes)."""

    decode: str  # the TE reporting it
    prefill: str  # the TE its ranks pull from
    state: LinkState = LinkState.OK
    since: float = 0.0  # when it entered that state (wall clock)
    rtt_s: float = 0.0  # the last probe's round trip (the slowest rank's)
    consecutive_failures: int = 0  # probes failed in a row (the rank with the most)
    probes: int = 0
    probe_failures: int = 0
    pulls: int = 0
    pull_failures: int = 0
    slow_pulls: int = 0  # pulls that took longer than the stall threshold
    last_error: str | None = None



_SEVERITY = {LinkState.OK: 0, LinkState.SATURATED: 1, LinkState.DOWN: 2}

def merge_links(links: Iterable[LinkStatus]) -> list[LinkStatus]:
    """One status per (decode TE, prefill TE) from its DP groups' statuses: the worst state (and its time and
    error), the slowest round trip, the longest run of failures, the counts added up."""
    merged: dict[tuple[str, str], LinkStatus] = {}
    for link in links:
        key = (link.decode, link.prefill)
        have = merged.get(key)
        if have is None:
            merged[key] = LinkStatus(**{f: getattr(link, f) for f in link.__struct_fields__})
            continue
        worse = _SEVERITY[link.state] > _SEVERITY[have.state]
        if worse:
            have.state, have.since = link.state, link.since
        have.last_error = (link.last_error or have.last_error) if worse else (have.last_error or link.last_error)
        have.rtt_s = max(have.rtt_s, link.rtt_s)
        have.consecutive_failures = max(have.consecutive_failures, link.consecutive_failures)
        have.probes += link.probes
        have.probe_failures += link.probe_failures
        have.pulls += link.pulls
        have.pull_failures += link.pull_failures
        have.slow_pulls += link.slow_pulls
    return [merged[key] for key in sorted(merged)]


def down_prefills(links: Iterable[LinkStatus]) -> frozenset[str]:
    """The prefill TEs whose link is down, of one decode TE's statuses."""
    return frozenset(link.prefill for link in links if link.state is LinkState.DOWN)



# ---------------------------------------------------------------- prefix-cache events (master -> routers)
def chain_block_hash(parent_block_hash: int | None, token_ids: Sequence[int], cache_salt: str = "") -> int:
    """Stable 64-bit hash of a block given its parent's hash: equal prefixes give equal hashes
    in every process (unlike Python's randomised `hash`). A chain's first block also hashes the
    prefix-cache namespace (`Tenancy.cache_salt`; its children inherit it through their parent's hash),
    so equal tokens under two salts never share a hash (docs/caching.md#tenant-isolation)."""
    h = hashlib.blake2b(digest_size=8)
    if parent_block_hash is None:
        # the unsalted root keeps its historical encoding; a salt is length-prefixed so no two salts collide
        salt = cache_salt.encode()
        h.update(b"\x02" + len(salt).to_bytes(4, "little") + salt if salt else b"\x00")
    else:
        h.update(b"\x01" + parent_block_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


class KVCacheEvent(msgspec.Struct, tag_field="type", tag=True, forbid_unknown_fields=True):
    """A prefix-cache change of one DP group's KV cache manager; "type" names the kind on the wire."""


class BlockStored(KVCacheEvent):
    """Full blocks that joined the prefix tree, as one chain under `parent_block_hash`."""

    block_hashes: list[int]
    parent_block_hash: int | None  # None: the chain starts at the root
    token_ids: list[int]  # len(block_hashes) * block_size tokens, in order
    block_size: int


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]


class AllBlocksCleared(KVCacheEvent):
    pass


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVCacheEvents(Message):
    """Prefix-cache changes of one TE, published for routers that keep a global prompt tree."""

    seq: int  # increases by one per batch, so a subscriber can detect a gap and resync
    timestamp: float
    events: list[CacheEvent] = field(default_factory=list)
    dp_rank: int = 0  # the DP group whose cache changed (each DP group has its own KV pool)
    engine: str = ""  # the TE's name (EngineConfig.te_name)
