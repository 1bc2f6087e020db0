"""Engine settings, shared by the CLI, the offline `LLM` and every engine process."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshserve.parallel.strategy import ParallelStrategy, StrategyError, parse_strategy


DEFAULT_ENGINE_PORT = 29600  # where a master with remote ranks listens for them (`meshserve worker`)


class ConfigError(ValueError):
    """An engine setting is invalid; the CLI prints it as one line."""


def read_deployment_yaml(path: str) -> Any:
    """A deployment file's YAML; ConfigError names the file when it cannot be read or parsed."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read deployment file {path!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"deployment file {path!r} is not valid YAML: {exc}") from None


@dataclass(frozen=True)
class EngineConfig:
    model: str  # HF-format model directory
    served_model_name: str | None = None
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (the checkpoint's)
    device: str = "cpu"
    # paged KV cache
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0  # budget the KV pool is sized from
    num_kv_blocks: int | None = None  # exact pool size; overrides the budget (tests, tuning)
    enable_prefix_caching: bool = True
    # scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # chunked-prefill token budget per step
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_waiting: int = 1024  # queued requests beyond this are refused (HTTP 503)
    async_scheduling: bool = True  # prepare step n+1 while step n runs
    kv_events_endpoint: str | None = None  # ZMQ PUB address for prefix-cache events (e.g. tcp://127.0.0.1:5557)
    # executors: one per rank of the parallel strategy (MixServe grammar, see meshserve/parallel/strategy.py)
    parallel: str = "attn=TP1+DP1 moe=TP1+EP1"
    moe_comm: str = "fused"  # hybrid TP-EP collectives: fused (MixServe Alg. 1-2, overlapped) | sync
    int8_dispatch: bool = False  # INT8 EP dispatch (per-token scale); combine stays full precision
    # expert load balancing (xdeepserve §4.5)
    eplb_redundant_experts: int = 0  # redundant expert slots per EP rank (replicas of hot experts)
    eplb_slice_s: float = 10.0  # expert-load recording slice
    eplb_interval_s: float | None = None  # rebalance automatically this often from the recorded load
    eplb_placement: str | None = None  # placement JSON applied before serving (may move primary experts too)
    # context caching in the memory pool (`meshserve pool controller` address, e.g. tcp://127.0.0.1:7600)
    pool_controller: str | None = None
    pool_namespace: str = "default"  # tenant of this TE's KV blocks: blocks are shared within a namespace only
    pool_load_weights: bool = True  # with a pool: load weights from its model cache when the model is there
    pool_store_decode_blocks: bool = False  # also store blocks of generated tokens (multi-turn reuse)
    # fetch-vs-recompute cost model: the pool's round trip and bandwidth (`meshserve bench cache` measures them)
    pool_fetch_latency_ms: float = 2.0
    pool_fetch_gbps: float = 2.0
    dist_backend: str | None = None  # torch.distributed backend; default gloo on CPU, nccl on CUDA
    num_threads: int | None = None  # torch threads per executor; default: the cores divided among the ranks
    # ranks on other hosts: the master starts ranks 0..local_ranks-1 itself; each other rank is started on
    # its host with `meshserve worker --engine tcp://MASTER_ADDR:ENGINE_PORT --rank R`
    local_ranks: int | None = None  # default: all of them (every rank on this host)
    master_addr: str = "127.0.0.1"  # this host's address as the other hosts reach it (MASTER_ADDR)
    engine_port: int = DEFAULT_ENGINE_PORT  # with remote ranks: where they connect to the master
    master_port: int | None = None  # torch.distributed rendezvous port on this host (MASTER_PORT); default: a free one
    # disaggregated prefill/decode: a prefill TE's ranks expose their KV caches ("producer"), a decode TE's
    # ranks pull from them ("consumer"); `meshserve te --role` sets it
    kv_transfer: str = "none"  # none | producer | consumer
    # auto (shared memory on one host, else TCP) | shm | tcp
    # | dist (torch.distributed send/recv: Gloo between CPU ranks, NCCL between ranks on different GPUs)
    kv_transfer_backend: str = "auto"
    kv_hold_timeout_s: float = 300.0  # a prefill TE frees held KV blocks no decode TE pulled in this time
    te_name: str = "te"  # this TE's name in a deployment (transfer peers and routing tables use it)
    seed: int = 0
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory_gb <= 0 and self.num_kv_blocks is None:
            raise ConfigError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ConfigError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.moe_comm not in ("fused", "sync"):
            raise ConfigError(f"moe_comm must be 'fused' or 'sync', got {self.moe_comm!r}")
        if self.eplb_redundant_experts < 0:
            raise ConfigError(f"eplb_redundant_experts must be >= 0, got {self.eplb_redundant_experts}")
        if self.eplb_slice_s <= 0 or (self.eplb_interval_s is not None and self.eplb_interval_s <= 0):
            raise ConfigError("eplb_slice_s and eplb_interval_s must be positive")
        if self.pool_fetch_latency_ms < 0 or self.pool_fetch_gbps <= 0:
            raise ConfigError("pool_fetch_latency_ms must be >= 0 and pool_fetch_gbps positive")
        if self.kv_transfer not in ("none", "producer", "consumer"):
            raise ConfigError(f"kv_transfer must be none, producer or consumer, got {self.kv_transfer!r}")
        if self.kv_transfer_backend not in ("auto", "shm", "tcp", "dist"):
            raise ConfigError(f"kv_transfer_backend must be auto, shm, tcp or dist, got {self.kv_transfer_backend!r}")
        if self.kv_hold_timeout_s <= 0:
            raise ConfigError(f"kv_hold_timeout_s must be positive, got {self.kv_hold_timeout_s}")
        if self.dist_backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"dist_backend must be gloo or nccl, got {self.dist_backend!r}")
        world = self.world_size  # parses `parallel`, raising ConfigError on a bad strategy
        if self.local_ranks is not None and not 1 <= self.local_ranks <= world:
            raise ConfigError(f"local_ranks must be between 1 and the world size {world} (rank 0 runs beside the "
                              f"master), got {self.local_ranks}")
        for name in ("engine_port", "master_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ConfigError(f"{name} must be a TCP port (1-65535), got {port}")

    @property
    def strategy(self) -> ParallelStrategy:
        try:
            return parse_strategy(self.parallel)
        except StrategyError as exc:
            raise ConfigError(f"bad parallel strategy {self.parallel!r}: {exc}") from None

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def num_local_ranks(self) -> int:
        """Ranks the master starts on its own host; the rest join with `meshserve worker`."""
        return self.world_size if self.local_ranks is None else self.local_ranks

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        return cls(**data)


# ---------------------------------------------------------------- deployment files

# keys `meshserve plan --out` writes for information only
_DEPLOYMENT_INFO_KEYS = {"world_size", "attention", "moe", "estimate", "topology"}
_DEPLOYMENT_ENGINE_KEYS = {"parallel", "moe_comm", "int8_dispatch"}


@dataclass(frozen=True)
class Deployment:
    """A deployment file: the model, its parallel strategy and engine settings for one TE.

    ```yaml
    model: models/ds-small            # optional: default is the built-in default model
    parallel: "attn=TP1+DP2 moe=TP1+EP2"
    moe_comm: fused                   # fused | sync
    int8_dispatch: false
    engine: {max_num_seqs: 32}        # any EngineConfig field
    ```
    """

    model: str | None
    engine: dict[str, Any]

    @classmethod
    def load(cls, path: str) -> "Deployment":
        return cls.from_dict(read_deployment_yaml(path), path)

    @classmethod
    def from_dict(cls, data: Any, source: str = "deployment") -> "Deployment":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level")
        unknown = sorted(set(data) - _DEPLOYMENT_INFO_KEYS - _DEPLOYMENT_ENGINE_KEYS - {"model", "engine"})
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}")
        engine = data.get("engine") or {}
        if not isinstance(engine, dict):
            raise ConfigError(f"{source}: 'engine' must be a mapping of engine settings")
        names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        bad = sorted(set(engine) - names)
        if bad:
            raise ConfigError(f"{source}: unknown engine setting(s) {', '.join(bad)}")
        merged = dict(engine)
        for key in _DEPLOYMENT_ENGINE_KEYS:
            if key in data:
                if key in engine and engine[key] != data[key]:
                    raise ConfigError(f"{source}: {key} is given twice with different values")
                merged[key] = data[key]
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise ConfigError(f"{source}: 'model' must be a path")
        try:  # validate now: a bad strategy is reported against the file
            EngineConfig(model=model or "", **merged)
        except (TypeError, ConfigError) as exc:
            raise ConfigError(f"{source}: {exc}") from None
        return cls(model=model, engine=merged)
