"""Which prompt prefixes each self-contained DP group caches, as its TE shell sees them (core/te_shell.py).

Each group's master publishes its prefix-cache events (`KVEventPublisher`, on an address of its own); the shell
subscribes to every group and keeps, per group, the chain hashes of the blocks it caches. A block's chain hash
covers its whole prefix and its prefix-cache namespace (`chain_block_hash`), so a prompt's hit in a group is
its leading blocks, hashed in turn, up to the first one the group does not hold: what the group's own KV cache
manager would match. The shell's placement then weighs each group's hit as the lockstep master's DP balancer
does (xdeepserve §4.3), so a request goes where its prefix is.

A group's events are numbered: a missed batch (a gap) or a new master process (numbers start again) makes the
shell forget what it knew of the group and start again from the next batch; until the group caches the
prefixes again, they count as misses (a request may compute a prefix another group holds: the same output,
no reuse).

The shell also speaks for its groups to job executors (one TE, one event stream): it publishes each group's
batches again under its own numbers, and answers a router's snapshot from what it holds here (`snapshot`:
each block's hash and parent, parents first, without its tokens, which routers do not keep).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

from meshserve.wire.client import CachedBlock
from meshserve.wire.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvents, chain_block_hash


class GroupPrefixes:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # group -> the chain hash of each block it caches -> its parent's (None at the root), parents first
        self._held: dict[Hashable, dict[int, int | None]] = {}
        self._last_seq: dict[Hashable, int] = {}

    def apply(self, group: Hashable, batch: KVCacheEvents) -> bool:
        """One batch of `group`'s cache events; False when batches were missed before it (what was known of
        the group is forgotten: only this batch's blocks are known now)."""
        last = self._last_seq.get(group)
        continued = last is None or batch.seq == last + 1
        if not continued:
            self.forget(group)
        self._last_seq[group] = batch.seq
        held = self._held.setdefault(group, {})
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for block_hash in event.block_hashes:
                    held[block_hash] = parent
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    held.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
        return continued

    def forget(self, group: Hashable) -> None:
        """Nothing is known of `group` (its master is new, or a batch was missed)."""
        self._held.pop(group, None)
        self._last_seq.pop(group, None)

    def snapshot(self, groups: Sequence[Hashable]) -> dict[Hashable, list[CachedBlock]]:
        """Every block each of `groups` caches: (hash, parent hash, no tokens), parents first."""
        return {group: [(block_hash, parent, []) for block_hash, parent in self._held.get(group, {}).items()]
                for group in groups}

    def hits(self, token_ids: Sequence[int], cache_salt: str, groups: Sequence[Hashable]) -> list[int]:
        """For each of `groups`: the leading tokens of `token_ids` it caches (whole blocks). At least the last
        token is computed (its logits give the next token), as the groups' schedulers match."""
        held = [self._held.get(group) for group in groups]
        if not any(held):
            return [0] * len(groups)
        bs = self.block_size
        alive = [h is not None and bool(h) for h in held]
        hits = [0] * len(groups)
        parent: int | None = None
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            block_hash = chain_block_hash(parent, token_ids[start:start + bs], cache_salt)
            for i, h in enumerate(held):
                if alive[i]:
                    if block_hash in h:
                        hits[i] += bs
                    else:
                        alive[i] = False
            if not any(alive):
                break
            parent = block_hash
        return hits
