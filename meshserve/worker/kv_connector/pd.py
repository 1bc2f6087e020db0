"""The worker half of the P/D connector: one rank's end of prefill -> decode KV transfer (xdeepserve §5.1
steps 6-8).

The rank's KV cache is a region of its own transfer engine: in shared memory on CPU (a decode rank on
the same host maps it and copies blocks with one memcpy per layer), and always behind the engine's TCP
block server, which also sets up the torch.distributed groups of the "dist" backend (Gloo between CPU
ranks; NCCL between ranks on different GPUs). A decode rank pulls a request's blocks from the prefill
rank the scheduler half chose for it (`meshserve.core.pd_mapping`); pulls run on the transfer engine's
threads while the rank keeps decoding, and their completions are reported to the master (the thread that ends a
pull wakes the rank's loop, which would otherwise see it only at its next step or poll timeout).

Link probing (xdeepserve §6.1): every prefill rank this rank has linked to is probed every few seconds
(`meshserve.transfer.probe.LinkProber`), and at once when a pull from it fails or has been in flight for
`PULL_STALL_S`; the probes go to the master with the pulls' completions, which judges the links from both.
A peer whose probes have failed for `FORGET_AFTER_S` is unlinked (its TE is gone, or was replaced).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from meshserve.transfer import BlockRef, LinkProber, TransferEngine, TransferStatus
from meshserve.wire.kv import KVConnectorMetadata, KVConnectorReport, KVPull, KVPullDone, KVRegion, LinkProbe
from meshserve.worker.kv_connector.base import KVConnectorWorker

logger = logging.getLogger(__name__)

REGION = "kv"
PULL_STALL_S = 2.0  # a pull in flight this long has its link probed at once
FORGET_AFTER_S = 120.0


@dataclass
class _InFlight:
    req_id: str
    peer: str
    started: float  # time.monotonic()
    probed: bool = False  # its link was probed for its stall


class PDConnectorWorker(KVConnectorWorker):
    def __init__(self, name: str, host: str, backend: str, num_layers: int, num_blocks: int, block_size: int,
                 entry_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tp_rank: int) -> None:
        self.backend = None if backend == "auto" else backend
        self.tp_rank = tp_rank  # which of a pull's sources this rank reads
        self.engine = TransferEngine(name, host=host, force_tcp=backend == "tcp")
        if device.type == "cpu":
            self.kv_caches = self.engine.allocate_region(REGION, num_layers, num_blocks, block_size, entry_shape,
                                                         dtype)
        else:  # device memory: peers read it through the TCP block server or a "dist" (NCCL) group
            self.kv_caches = [torch.zeros((num_blocks, block_size, *entry_shape), dtype=dtype, device=device)
                              for _ in range(num_layers)]
            self.engine.register(REGION, self.kv_caches)
        self._linked: dict[str, KVRegion] = {}  # peer -> the region it was linked with
        self._pulls: dict[int, _InFlight] = {}  # by transfer handle id
        self._failed_now: list[KVPullDone] = []  # pulls that could not even start
        # the engine's probe is looked up per probe, so a hook wrapped around it later is called too
        self.prober = LinkProber(lambda peer, timeout: self.engine.probe(peer, timeout), name=f"link-prober-{name}")

    @property
    def region(self) -> KVRegion:
        """This rank's KV cache as peers reach it."""
        return msgspec.convert(self.engine.descriptor(REGION).to_dict(), KVRegion)

    @property
    def busy(self) -> bool:
        return bool(self._pulls or self._failed_now)

    def wake_with(self, wake: Callable[[], None]) -> None:
        self.engine.on_complete = wake  # the transfer thread that ends a pull calls it

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for pull in meta.kv_pulls:
            self._start_pull(pull, pull.sources[self.tp_rank])

    def _start_pull(self, pull: KVPull, source: KVRegion) -> None:
        """Pull the order's source blocks from the prefill rank whose KV cache `source` describes."""
        try:
            peer = source.engine
            if self._linked.get(peer) != source:  # a new peer, or one restarted under the same name
                if peer in self._linked:
                    self._unlink(peer)
                self.engine.link(peer, msgspec.to_builtins(source), backend=self.backend)
                self._linked[peer] = source
                self.prober.watch(peer)
            handle = self.engine.transfer(BlockRef(REGION, tuple(pull.src_block_ids), engine=peer),
                                          BlockRef(REGION, tuple(pull.dst_block_ids)))
        except Exception as exc:  # a bad or unreachable source ends this request's pull only
            self._failed_now.append(KVPullDone(pull.req_id, f"{type(exc).__name__}: {exc}"))
            self.prober.probe_now(source.engine)
            return
        self._pulls[handle.id] = _InFlight(pull.req_id, peer, time.monotonic())

    def _unlink(self, peer: str) -> None:
        self.prober.forget(peer)
        self.engine.unlink(peer)
        del self._linked[peer]

    def get_finished(self, report: KVConnectorReport) -> None:
        done, self._failed_now = self._failed_now, []
        for completion in self.engine.poll():
            pull = self._pulls.pop(completion.handle_id, None)
            if pull is None:
                continue
            error = None if completion.status is TransferStatus.DONE else str(completion.error)
            if error is not None:  # a broken link, or only this pull? A probe tells
                self.prober.probe_now(pull.peer)
            done.append(KVPullDone(pull.req_id, error))
        for pull in done:
            if pull.error is not None:
                logger.warning("KV pull of request %s failed: %s", pull.req_id, pull.error)
        report.kv_pulls += done
        self._probe_stalled()
        report.link_probes += [LinkProbe(peer=r.peer, ok=r.ok, rtt_s=r.rtt_s, error=r.error)
                               for r in self.prober.take()]

    def _probe_stalled(self) -> None:
        """Probe the links of pulls in flight for PULL_STALL_S (once per pull); unlink the peers whose probes
        have failed for FORGET_AFTER_S (their TE is gone: nothing will be pulled from them)."""
        now = time.monotonic()
        for pull in self._pulls.values():
            if not pull.probed and now - pull.started > PULL_STALL_S:
                pull.probed = True
                self.prober.probe_now(pull.peer)
        busy = {pull.peer for pull in self._pulls.values()}
        for peer in [p for p in self._linked if p not in busy and self.prober.failing_for(p, now) > FORGET_AFTER_S]:
            logger.warning("unlinking %s: its link probes have failed for %.0f s", peer, FORGET_AFTER_S)
            self._unlink(peer)

    def close(self) -> None:
        self.prober.close()
        self.engine.close()
