"""Transfer engine (DistFlow role): moves KV blocks between engines over shared memory or TCP."""
from meshserve.transfer.engine import (
    BlockRef,
    Completion,
    RegionDescriptor,
    TransferEngine,
    TransferHandle,
    TransferStatus,
)
from meshserve.transfer.probe import LinkProber, ProbeResult
from meshserve.transfer.shm import ShmKVRegion, allocate_shm_kv_cache, attach_shm_kv_cache
from meshserve.transfer.tcp import TransferError

__all__ = [
    "BlockRef",
    "Completion",
    "LinkProber",
    "ProbeResult",
    "RegionDescriptor",
    "ShmKVRegion",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferStatus",
    "allocate_shm_kv_cache",
    "attach_shm_kv_cache",
]
