"""The worker half of the P/D connector: one rank's end of prefill -> decode KV transfer (xdeepserve §5.1
steps 6-8).

The rank's KV cache is a region of its own transfer engine: in shared memory on CPU (a decode rank on
the same host maps it and copies blocks with one memcpy per layer), and always behind the engine's TCP
block server, which also sets up the torch.distributed groups of the "dist" backend (Gloo between CPU
ranks; NCCL between ranks on different GPUs). A decode rank pulls a request's blocks from the prefill
rank the scheduler half chose for it (`meshserve.core.pd_mapping`); pulls run on the transfer engine's
threads while the rank keeps decoding, and their completions are reported to the master.
"""
from __future__ import annotations

import logging

import msgspec
import torch

from meshserve.core.messages import KVConnectorMetadata, KVConnectorReport, KVPull, KVPullDone, KVRegion
from meshserve.transfer import BlockRef, TransferEngine, TransferStatus
from meshserve.worker.kv_connector.base import KVConnectorWorker

logger = logging.getLogger(__name__)

REGION = "kv"


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
        self._pulls: dict[int, str] = {}  # transfer handle id -> request id
        self._failed_now: list[KVPullDone] = []  # pulls that could not even start

    @property
    def region(self) -> KVRegion:
        """This rank's KV cache as peers reach it."""
        return msgspec.convert(self.engine.descriptor(REGION).to_dict(), KVRegion)

    @property
    def busy(self) -> bool:
        return bool(self._pulls or self._failed_now)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for pull in meta.kv_pulls:
            self._start_pull(pull, pull.sources[self.tp_rank])

    def _start_pull(self, pull: KVPull, source: KVRegion) -> None:
        """Pull the order's source blocks from the prefill rank whose KV cache `source` describes."""
        try:
            peer = source.engine
            if self._linked.get(peer) != source:  # a new peer, or one restarted under the same name
                if peer in self._linked:
                    self.engine.unlink(peer)
                    del self._linked[peer]
                self.engine.link(peer, msgspec.to_builtins(source), backend=self.backend)
                self._linked[peer] = source
            handle = self.engine.transfer(BlockRef(REGION, tuple(pull.src_block_ids), engine=peer),
                                          BlockRef(REGION, tuple(pull.dst_block_ids)))
        except Exception as exc:  # a bad or unreachable source ends this request's pull only
            self._failed_now.append(KVPullDone(pull.req_id, f"{type(exc).__name__}: {exc}"))
            return
        self._pulls[handle.id] = pull.req_id

    def get_finished(self, report: KVConnectorReport) -> None:
        done, self._failed_now = self._failed_now, []
        for completion in self.engine.poll():
            req_id = self._pulls.pop(completion.handle_id, None)
            if req_id is None:
                continue
            error = None if completion.status is TransferStatus.DONE else str(completion.error)
            done.append(KVPullDone(req_id, error))
        for pull in done:
            if pull.error is not None:
                logger.warning("KV pull of request %s failed: %s", pull.req_id, pull.error)
        report.kv_pulls += done

    def close(self) -> None:
        self.engine.close()
