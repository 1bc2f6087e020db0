"""Disaggregated prefill/decode: the scheduler half of the P/D connector (xdeepserve §5.1).

Producer (prefill TE): once a request's first token is sampled, its prompt blocks are held (the prefix
cache indexes them too) and described in `KVTransferParams` (step 3); they are freed when the decode TE
says it has them (ReleaseKV, step 8), when the job is aborted, or when the hold expires.

Consumer (decode TE): a request arrives with those params and its first token. Once blocks are free (a pull
waits rather than preempting: backpressure on the prefill TE) they are allocated and each rank of the DP
group pulls its part from the prefill rank `meshserve.core.pd_mapping` assigns it (step 6). When every rank
reported, the request decodes from the pulled KV, or computes its prompt here if a pull failed; either way
the prefill TE is told to free its blocks. A request whose hold is about to expire is computed here rather
than pulled: blocks read after the expiry may already hold another request's KV.

Link probing (xdeepserve §6.1): the ranks probe the prefill ranks they pull from and report the probes; with
what it sees of the pulls (how long they were in flight or waited for blocks, which failed) the consumer's
`LinkMonitor` tells each prefill TE's link ok, saturated or down, and `fill_stats` reports it
(`EngineStats.links`, which the heartbeat carries to the job executors).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from meshserve.config import KVTransferConfig
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.kv_connector.base import FinishedLoad, KVConnectorScheduler
from meshserve.core.link_monitor import LinkMonitor
from meshserve.core.pd_mapping import source_prefill_tp_rank
from meshserve.core.request import Request, RequestStatus
from meshserve.wire.client import EngineStats
from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport, KVPull, KVRegion, KVTransferParams, KVTransferRole

logger = logging.getLogger(__name__)

# a decode TE does not start a pull this close to the prefill TE's hold expiry: a pull finishes well
# within it (the TCP backend's I/O timeout is 10 s), and blocks read after the expiry may be reused
PULL_MARGIN_S = 10.0


@dataclass(frozen=True)
class PDEndpoint:
    """Where one DP group of this TE is reached for KV transfer."""

    engine: str  # the TE's name (its ranks' transfer-engine peer names start with it)
    engine_addr: str  # its input address (ReleaseKV comes there)
    dp_rank: int
    attn_tp: int
    attn_dp: int
    regions: list[KVRegion]  # the DP group's ranks' KV caches, by attention-TP rank


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float  # the connector's clock


@dataclass
class _Pull:
    """A pull in flight: the DP group's ranks that reported, the first error."""

    req: Request
    source: KVTransferParams
    ordered_at: float  # the link monitor's clock
    ranks: set[int] = field(default_factory=set)
    error: str | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hold_expiring(params: KVTransferParams, now: float | None = None) -> bool:
    """Whether the prefill TE's hold on a consumer request's blocks ends before a pull started now would."""
    if params.hold_expires_at is None:
        return False
    margin = min(PULL_MARGIN_S, 0.2 * (params.hold_s or PULL_MARGIN_S))
    return (time.time() if now is None else now) > params.hold_expires_at - margin


def accept_kv_transfer(config: KVTransferConfig, block_size: int, request: Request, params: KVTransferParams,
                       output_token_ids: list[int]) -> None:
    """Admit a disaggregated request (ValueError when this TE cannot take it): a producer computes the prompt
    and the first token only; a consumer takes the prefill TE's hand-off and its first token."""
    if config.kv_transfer != params.role.value:
        raise ValueError(f"this TE (kv_transfer {config.kv_transfer}) cannot take {params.role.value} requests")
    request.kv_transfer = params
    if params.role is KVTransferRole.PRODUCER:
        return
    missing = [name for name in ("engine", "engine_addr", "regions", "block_ids", "num_tokens")
               if not getattr(params, name)]
    if missing:
        raise ValueError(f"kv_transfer is missing {', '.join(missing)}")
    if not output_token_ids or params.num_tokens != request.num_prompt_tokens:
        raise ValueError("a decode request needs the prompt whose KV is transferred and its first token")
    if not 1 <= params.attn_tp <= len(params.regions):
        raise ValueError(f"kv_transfer names {len(params.regions)} regions for attention TP {params.attn_tp}")
    if len(params.block_ids) != _cdiv(params.num_tokens, block_size):
        raise ValueError(f"{len(params.block_ids)} KV blocks for {params.num_tokens} tokens: the prefill TE's "
                         f"block size is not this TE's ({block_size})")
    for token in output_token_ids:
        request.append_output_token(int(token))
    # "recompute": the blocks may be gone (a decode TE failed after pulling them): compute them here
    request.kv_transfer = None if params.recompute else params


class PDConnector(KVConnectorScheduler):
    may_preempt = False  # a pull waits for free blocks (backpressure on the prefill TE), nothing is dropped

    def __init__(self, config: KVTransferConfig, kv_manager: KVCacheManager, endpoint: PDEndpoint,
                 send_release: Callable[[str, list[str]], None], clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        """`clock` times holds and pulls here; `wall_clock` stamps a hand-off's expiry, which the decode TE reads
        on another host (a simulation hands both its virtual clock)."""
        self.config = config
        self.clock, self.wall_clock = clock, wall_clock
        self.kv_manager = kv_manager
        self.block_size = kv_manager.block_size
        self.endpoint = endpoint
        self.send_release = send_release  # (prefill TE's input address, req_ids): ReleaseKV there
        self.holds: dict[str, _Hold] = {}  # producer: blocks of handed-off requests until pulled
        self._pulls: dict[str, _Pull] = {}  # consumer: pulls ordered, by request
        self._pull_queue: list[KVPull] = []
        self.num_pulled = 0
        self.num_recomputed = 0  # ... of which the pull failed (or could not start in time): computed here
        # link probing: the links from the prefill TEs pulled from, each rank's transfer peers' TE, and the
        # requests waiting for blocks to pull into (since when, from which prefill TE)
        self.links = LinkMonitor(endpoint.engine, clock=clock)
        self._peer_te: dict[str, str] = {}
        self._waiting: dict[str, tuple[str, float]] = {}

    # ------------------------------------------------------------ producer (prefill TE)
    def request_finished(self, req: Request) -> KVTransferParams | None:
        """A request handed off (TRANSFERRED): hold its prompt blocks, free the rest, describe them."""
        self._waiting.pop(req.req_id, None)  # a consumer request that left while it waited for blocks
        if req.status is not RequestStatus.TRANSFERRED:
            return None
        timeout = self.config.kv_hold_timeout_s
        num_blocks = _cdiv(req.num_prompt_tokens, self.block_size)
        held, extra = req.block_ids[:num_blocks], req.block_ids[num_blocks:]
        self.kv_manager.free(extra)
        self.holds[req.req_id] = _Hold(held, self.clock() + timeout)
        ep = self.endpoint
        # the decode TE must pull before the hold expires (wall clock: it is compared on another host)
        return KVTransferParams(role=KVTransferRole.CONSUMER, engine=ep.engine, engine_addr=ep.engine_addr,
                                dp_rank=ep.dp_rank, attn_tp=ep.attn_tp, attn_dp=ep.attn_dp, regions=ep.regions,
                                block_ids=held, num_tokens=req.num_prompt_tokens,
                                num_cached_tokens=req.num_cached_tokens, hold_s=timeout,
                                hold_expires_at=self.wall_clock() + timeout)

    def release(self, req_id: str) -> bool:
        self._waiting.pop(req_id, None)  # a consumer request aborted while it waited for blocks
        hold = self.holds.pop(req_id, None)
        if hold is None:
            return False
        self.kv_manager.free(hold.block_ids)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Free holds no decode TE pulled within the timeout (it died, or the job was dropped)."""
        now = self.clock() if now is None else now
        expired = [req_id for req_id, hold in self.holds.items() if hold.deadline <= now]
        for req_id in expired:
            self.release(req_id)
            logger.warning("request %s: no decode TE pulled its KV blocks in %.0f s; freed", req_id,
                           self.config.kv_hold_timeout_s)
        return expired

    # ------------------------------------------------------------ consumer (decode TE)
    def get_num_new_matched_tokens(self, req: Request, num_local_tokens: int) -> int:
        source = req.kv_transfer
        if source is None or source.role is not KVTransferRole.CONSUMER:
            return 0
        if hold_expiring(source, self.wall_clock()):
            # it waited for blocks (backpressure) until the prefill TE is about to free its KV: a pull
            # could read blocks already reused by another request, so the prompt is computed here
            logger.warning("request %s: the prefill TE's hold on its KV expires; computing the prompt here",
                           req.req_id)
            self._done_with(req, source, recomputed=True)
            return 0
        num_external = source.num_tokens - num_local_tokens
        if num_external <= 0:  # the local prefix cache holds every prompt block: nothing to pull
            self._done_with(req, source, recomputed=False)
        elif req.req_id not in self._waiting:  # until its blocks are allocated (backpressure when that takes)
            self._waiting[req.req_id] = (source.engine, self.links.clock())
            self.links.note(source.engine)
        return max(0, num_external)

    def update_state_after_alloc(self, req: Request, num_local_tokens: int, num_external_tokens: int) -> None:
        source = req.kv_transfer
        first = num_local_tokens // self.block_size
        ep = self.endpoint
        # cloudmatrix-infer §4.3.3: decode TP rank t of this group reads from one fixed prefill rank
        sources = [source.regions[source_prefill_tp_rank(source.attn_tp, ep.attn_tp, ep.attn_dp, ep.dp_rank, t)]
                   for t in range(ep.attn_tp)]
        self._pull_queue.append(KVPull(req_id=req.req_id, src_block_ids=source.block_ids[first:],
                                       dst_block_ids=req.block_ids[first:len(source.block_ids)], sources=sources))
        self._pulls[req.req_id] = _Pull(req, source, self.links.clock())
        self._waiting.pop(req.req_id, None)
        for region in sources:  # the ranks' probes name the prefill ranks' transfer engines
            self._peer_te[region.engine] = source.engine

    def build_connector_meta(self, meta: KVConnectorMetadata) -> None:
        meta.kv_pulls += self._pull_queue
        self._pull_queue = []

    def update_connector_output(self, report: KVConnectorReport) -> list[FinishedLoad]:
        for probe in report.link_probes:
            prefill = self._peer_te.get(probe.peer)
            if prefill is not None:
                self.links.on_probe(prefill, f"{report.rank}<{probe.peer}", probe.ok, probe.rtt_s, probe.error)
        finished = []
        for done in report.kv_pulls:
            pull = self._pulls.get(done.req_id)
            if pull is None:
                continue
            pull.ranks.add(report.rank)
            pull.error = pull.error or done.error
            if len(pull.ranks) < self.endpoint.attn_tp:
                continue
            del self._pulls[done.req_id]
            finished.append(self._pulled(pull))
        return finished

    def _pulled(self, pull: _Pull) -> FinishedLoad:
        """Every rank has pulled (or failed to pull) the request's blocks. A failed pull is recovered by
        computing the prompt here, in the blocks already allocated."""
        req = pull.req
        self.links.on_pull(pull.source.engine, self.links.clock() - pull.ordered_at, pull.error)
        if req.status is not RequestStatus.WAITING_FOR_REMOTE_KV:  # aborted: the blocks only had to be written
            self.send_release(pull.source.engine_addr, [req.req_id])
            return FinishedLoad(req, 0)
        if pull.error is not None:
            logger.warning("request %s: KV pull failed (%s); computing its prompt here", req.req_id, pull.error)
        self._done_with(req, pull.source, recomputed=pull.error is not None)
        return FinishedLoad(req, 0 if pull.error is not None else req.num_external_tokens,
                            num_cached_tokens=pull.source.num_cached_tokens)

    def _done_with(self, req: Request, source: KVTransferParams, recomputed: bool) -> None:
        """The hand-off is used up: count it, and have the prefill TE free its blocks (step 8; after a failure
        too: nobody will read them). From here on a plain request (a preemption recomputes it)."""
        self.num_pulled += 1
        self.num_recomputed += int(recomputed)
        self._waiting.pop(req.req_id, None)
        req.kv_transfer = None
        self.send_release(source.engine_addr, [req.req_id])

    def fill_stats(self, stats: EngineStats) -> None:
        stats.kv_transfer_holds += len(self.holds)
        stats.kv_pulled += self.num_pulled
        stats.kv_pull_recomputed += self.num_recomputed
        stats.links += self.links.statuses(self._stalled())

    def _stalled(self) -> dict[str, float]:
        """Per prefill TE, how long its oldest pull has been in flight or waiting for blocks."""
        now = self.links.clock()
        stalled: dict[str, float] = {}
        waits = [(prefill, since) for prefill, since in self._waiting.values()]
        waits += [(pull.source.engine, pull.ordered_at) for pull in self._pulls.values()]
        for prefill, since in waits:
            stalled[prefill] = max(stalled.get(prefill, 0.0), now - since)
        return stalled
