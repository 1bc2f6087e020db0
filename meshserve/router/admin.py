"""Admin queries from the job executor to one TE, matched to their replies: an operator's command
(`Router.admin`: EPLB, context caches, drain, ...) and the JE's own KV snapshot queries, which rebuild its
prompt tree's view of a TE's prefix caches (deepserve §5.2).

An operator names the TE with `te=NAME` (optional when only one is live); deleting a named context cache
goes to the TE that pinned it, and answers "not deleted" when that TE is gone (its pins went with it).
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from meshserve.engine.client_core import PendingReplies, ReplyCallback
from meshserve.router.cache_homes import CacheHomes
from meshserve.router.engine_registry import EngineRecord, EngineRegistry
from meshserve.wire.client import AdminOp, AdminReply, AdminRequest, ContextCacheDeleted, KVSnapshot

Send = Callable[[EngineRecord, AdminRequest], None]


class TEAdmin:
    def __init__(self, registry: EngineRegistry, replies: PendingReplies, send: Send, reply_to: str,
                 cache_homes: CacheHomes) -> None:
        """`replies`: the query ids awaiting a reply (the replies arrive with the TEs' outputs at `reply_to`)."""
        self.registry, self.replies, self.send, self.reply_to = registry, replies, send, reply_to
        self.cache_homes = cache_homes

    async def ask(self, op: str, args: dict | None, timeout_s: float) -> AdminReply:
        """An operator command to one TE: `args["te"]` names it (optional when there is only one)."""
        args = dict(args or {})
        if op == AdminOp.CONTEXT_CACHE_DELETE and "te" not in args:  # the TE that pinned it
            home = self.cache_homes.pop(str(args.get("id")))
            if home is None or self.registry.get(home) is None:  # its TE is gone, and its pins with it
                return AdminReply(query_id=0, data=ContextCacheDeleted(id=str(args.get("id")), deleted=False))
            args["te"] = home
        live = self.registry.live()
        name = args.pop("te", None) or (live[0].name if len(live) == 1 else None)
        record = self.registry.get(name) if name else None
        if record is None:
            return AdminReply(query_id=0, ok=False, error=(
                f"name the TE with te=NAME; live TEs: {', '.join(sorted(r.name for r in live)) or 'none'}"))
        try:
            request = AdminRequest.of(0, op, args, reply_to=self.reply_to)
        except ValueError as exc:
            return AdminReply(query_id=0, ok=False, error=str(exc))
        return await self._request(record, request, timeout_s)

    async def _request(self, record: EngineRecord, request: AdminRequest, timeout_s: float) -> AdminReply:
        fut = asyncio.get_running_loop().create_future()
        request.query_id = query_id = self.replies.open(fut)
        self.send(record, request)
        try:
            return await asyncio.wait_for(fut, timeout=timeout_s)
        except TimeoutError:
            self.replies.forget(query_id)
            return AdminReply(query_id=query_id, ok=False,
                              error=f"TE {record.name} did not answer {request.op} in {timeout_s:.0f} s")

    def request_snapshot(self, record: EngineRecord | None) -> None:
        """Ask a TE for its KV snapshot, for the prompt tree (once the tree exists; one query at a time)."""
        if record is None or self.registry.tree is None or record.snapshot_query is not None:
            return
        query_id = self.replies.open(ReplyCallback(functools.partial(self._on_snapshot, record.name)))
        record.snapshot_query = query_id
        self.send(record, AdminRequest(query_id=query_id, op=AdminOp.KV_SNAPSHOT, reply_to=self.reply_to))

    def _on_snapshot(self, te: str, reply: AdminReply) -> None:
        """A TE's KV snapshot, for the prompt tree (a TE dropped since, or asked again since, is ignored)."""
        record = self.registry.get(te)
        if record is not None and record.snapshot_query == reply.query_id:
            if reply.ok and isinstance(reply.data, KVSnapshot):
                self.registry.load_snapshot(record, reply.data)
            else:
                record.snapshot_query = None
