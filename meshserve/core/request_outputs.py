"""Where each request's outputs go, and sending them.

A TE serving job executors sends a request's outputs straight to the frontend its AddRequest named
(output short-circuiting); a TE started by one client sends everything to it. The deltas
of one turn go out as one EngineOutputs per destination. The master's warm-up request answers nobody.
"""
from __future__ import annotations

import time

from meshserve.core.client_links import ClientLink, RouterLinks
from meshserve.wire.client import EngineOutputs, RequestDelta

WARMUP_ID = "meshserve-warmup"  # the dummy request a TE runs before it registers (answers go nowhere)


class RequestOutputs:
    def __init__(self, link: ClientLink | RouterLinks) -> None:
        self._link = link
        self._reply_of: dict[str, str] = {}  # request id -> where its outputs go (TE serving job executors)

    def route(self, req_id: str, reply_to: str) -> None:
        """Send this request's outputs to `reply_to` (nothing to remember for an empty address)."""
        if reply_to:
            self._reply_of[req_id] = reply_to

    def reply_to(self, req_id: str) -> str:
        """Where this request's outputs go ("": the TE's own client)."""
        return self._reply_of.get(req_id, "")

    def send(self, deltas: list[RequestDelta]) -> None:
        """The deltas, grouped per destination; a request's route is forgotten with its last delta (it finished,
        or a prefill TE handed it to decode)."""
        if not deltas:
            return
        by_client: dict[str, list[RequestDelta]] = {}
        for delta in deltas:
            reply_to = self._reply_of.get(delta.req_id, "")
            if delta.finish_reason is not None or delta.kv_transfer_params is not None:
                self._reply_of.pop(delta.req_id, None)
            by_client.setdefault(reply_to, []).append(delta)
        now = time.time()
        for reply_to, batch in by_client.items():
            batch = [delta for delta in batch if delta.req_id != WARMUP_ID]
            if batch:
                self._link.send(EngineOutputs(deltas=batch, timestamp=now), reply_to)
