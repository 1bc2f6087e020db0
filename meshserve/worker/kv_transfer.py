"""One rank's end of prefill -> decode KV transfer (xdeepserve §5.1 steps 6-8).

The rank's KV cache is a region of its own transfer engine: in shared memory on CPU (a decode rank on
the same host maps it and copies blocks with one memcpy per layer), and always behind the engine's TCP
block server, which also sets up the torch.distributed groups of the "dist" backend (Gloo between CPU
ranks; NCCL between ranks on different GPUs). A decode rank pulls a request's
blocks from the prefill rank the master chose for it (`meshserve.core.pd_mapping`); pulls run on
the transfer engine's threads while the rank keeps decoding, and their completions are reported to
the master as executor events.
"""
from __future__ import annotations

import logging

import torch

from meshserve.core.messages import PULL_FAILED, PULLED
from meshserve.transfer import BlockRef, TransferEngine, TransferStatus

logger = logging.getLogger(__name__)

REGION = "kv"


class RankKVTransfer:
    def __init__(self, name: str, host: str, backend: str, num_layers: int, num_blocks: int, block_size: int,
                 entry_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.backend = None if backend == "auto" else backend
        self.engine = TransferEngine(name, host=host, force_tcp=backend == "tcp")
        if device.type == "cpu":
            self.kv_caches = self.engine.allocate_region(REGION, num_layers, num_blocks, block_size, entry_shape,
                                                         dtype)
        else:  # device memory: peers read it through the TCP block server or a "dist" (NCCL) group
            self.kv_caches = [torch.zeros((num_blocks, block_size, *entry_shape), dtype=dtype, device=device)
                              for _ in range(num_layers)]
            self.engine.register(REGION, self.kv_caches)
        self._linked: dict[str, dict] = {}  # peer -> the descriptor it was linked with
        self._pulls: dict[int, str] = {}  # transfer handle id -> request id
        self._failed_now: list[tuple[str, str]] = []  # pulls that could not even start

    @property
    def descriptor(self) -> dict:
        return self.engine.descriptor(REGION).to_dict()

    @property
    def busy(self) -> bool:
        return bool(self._pulls or self._failed_now)

    def start_pull(self, order: dict, source: dict) -> None:
        """Pull `order`'s source blocks from the prefill rank described by `source` (a region descriptor)."""
        req_id = order["req_id"]
        try:
            peer = source["engine"]
            if self._linked.get(peer) != source:  # a new peer, or one restarted under the same name
                if peer in self._linked:
                    self.engine.unlink(peer)
                    del self._linked[peer]
                self.engine.link(peer, source, backend=self.backend)
                self._linked[peer] = source
            handle = self.engine.transfer(BlockRef(REGION, order["src_block_ids"], engine=peer),
                                          BlockRef(REGION, order["dst_block_ids"]))
        except Exception as exc:  # a bad or unreachable source ends this request's pull only
            self._failed_now.append((req_id, f"{type(exc).__name__}: {exc}"))
            return
        self._pulls[handle.id] = req_id

    def poll(self) -> list[tuple[str, str]]:
        """(kind, detail) per finished pull: ("kv_pulled", req_id) or ("kv_pull_failed", "req_id\\terror")."""
        events = [(PULL_FAILED, f"{req_id}\t{error}") for req_id, error in self._failed_now]
        self._failed_now = []
        for completion in self.engine.poll():
            req_id = self._pulls.pop(completion.handle_id, None)
            if req_id is None:
                continue
            if completion.status is TransferStatus.DONE:
                events.append((PULLED, req_id))
            else:
                events.append((PULL_FAILED, f"{req_id}\t{completion.error}"))
        for kind, detail in events:
            if kind == PULL_FAILED:
                logger.warning("KV pull failed: %s", detail.replace("\t", ": "))
        return events

    def close(self) -> None:
        self.engine.close()
