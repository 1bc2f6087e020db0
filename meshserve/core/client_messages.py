"""The master's handling of its clients' messages (requests, aborts, KV releases, stats queries, operator
commands, shutdown): a mixin of `EngineCore`, as SGLang's scheduler keeps its request handling in
mixins of its own. Every handler reads the parts built for the ranks of now (`admission`, `kv_connectors`,
`admin_ops`): a recovery builds them again."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from meshserve.core.client_links import ClientLink, GroupLink, RouterLinks
from meshserve.wire.base import Shutdown
from meshserve.wire.client import AbortRequests, AddRequest, AdminRequest, EngineStats, ReleaseKV, StatsQuery
from meshserve.wire.codec import MAX_INBOX_BYTES, RefusedFrame
from meshserve.wire.dp_group import EplbRelay, WorldRestart
from meshserve.wire.receive import drop_frame, recv_message
from meshserve.wire.worker import StepBatch

if TYPE_CHECKING:
    import zmq

    from meshserve.core.admin_ops import AdminOps
    from meshserve.core.admission import Admission
    from meshserve.core.dp_group import GroupPlace
    from meshserve.core.kv_connector import KVConnectors
    from meshserve.core.recovery import RankRecovery
    from meshserve.core.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

_INBOX = "te-inbox"  # the master's socket for client messages, as dropped frames name it


class ClientMessages:
    """Takes what the inbox holds and hands each message to its handler; whatever one holds, the loop goes on."""

    link: ClientLink | RouterLinks | GroupLink
    place: GroupPlace | None
    inbox: zmq.Socket
    admission: Admission
    kv_connectors: KVConnectors
    admin_ops: AdminOps
    recovery: RankRecovery
    dead_error: str | None
    running: bool
    requests_received: int
    workers: WorkerGroup

    def _stats(self) -> EngineStats: ...  # EngineCore's

    def _on_world_restart(self, item: WorldRestart) -> None: ...  # EngineCore's

    def _take_client_messages(self) -> None:
        while self.inbox.poll(0):
            item = recv_message(self.inbox, _INBOX, MAX_INBOX_BYTES, self._answer_refused)
            if item is not None:
                self._on_client(item)

    def _on_client(self, item) -> None:
        """One message from the inbox; whatever it holds, the loop goes on."""
        if self.recovery.defers(item):
            return
        handler = self._CLIENT_HANDLERS.get(type(item))
        if handler is None:
            drop_frame(_INBOX, f"a {type(item).__name__} is not a message for a TE")
            return
        try:
            handler(self, item)
        except Exception as exc:  # noqa: BLE001 - one message must never end the TE
            logger.exception("handling a %s failed", type(item).__name__)
            if isinstance(item, AddRequest):
                self.admission.reject(item, exc)

    def _answer_refused(self, refused: RefusedFrame) -> None:
        """A request whose frame failed its checks (e.g. sampling params out of range) fails alone, answered."""
        logger.warning("refused a request: %s", refused)
        self.link.send(refused.answer, refused.reply_to)

    def _add_request(self, item: AddRequest) -> None:
        self.requests_received += 1
        if self.dead_error is not None:
            self.admission.reject(item, RuntimeError(f"engine is dead: {self.dead_error}"))
            return
        self.admission.add(item)

    def _on_abort(self, item: AbortRequests) -> None:
        self.admission.abort(item.req_ids)

    def _on_release_kv(self, item: ReleaseKV) -> None:
        self.kv_connectors.release(item.req_ids)

    def _on_stats_query(self, item: StatsQuery) -> None:
        self.link.send(self._stats(), item.reply_to)

    def _on_admin(self, item: AdminRequest) -> None:
        reply = self.admin_ops.reply(item)
        if self.place is not None and self.place.index > 0:  # every group applies it; the first one answers
            return
        # a TE's sender that names no address wants none
        if item.reply_to or isinstance(self.link, ClientLink) or (isinstance(self.link, GroupLink)
                                                                  and self.link.has_client):
            self.link.send(reply, item.reply_to)

    def _on_shutdown(self, item: Shutdown) -> None:
        self.running = False

    def _on_world_restart_message(self, item: WorldRestart) -> None:
        self._on_world_restart(item)

    def _on_eplb_relay(self, item: EplbRelay) -> None:
        """A phase of the shell's reconfiguration, for this group's ranks to apply with every other rank."""
        self.workers.send(StepBatch(per_dp=[], eplb=item.command))

    _CLIENT_HANDLERS = {AddRequest: _add_request, AbortRequests: _on_abort, ReleaseKV: _on_release_kv,
                        StatsQuery: _on_stats_query, AdminRequest: _on_admin, Shutdown: _on_shutdown,
                        WorldRestart: _on_world_restart_message, EplbRelay: _on_eplb_relay}
