"""Engine settings, shared by the CLI, the offline `LLM` and every engine process: one struct per concern
(model, cache, scheduler, parallel, EPLB, pool, KV transfer, speculative decoding) composed into `EngineConfig`;
the job executor's settings in `RouterConfig`, and the cluster manager's in `ClusterConfig`."""
from meshserve.config.base import ConfigError, ConfigStruct, Setting, settings_of
from meshserve.config.cache import CacheConfig
from meshserve.config.cluster import ClusterConfig
from meshserve.config.deployment import Deployment, read_deployment_yaml
from meshserve.config.engine import CONCERN_OF, CONCERNS, EngineConfig, engine_settings
from meshserve.config.eplb import EplbConfig
from meshserve.config.kv_transfer import KVTransferConfig
from meshserve.config.model import ModelConfig
from meshserve.config.parallel import DEFAULT_ENGINE_PORT, ParallelConfig
from meshserve.config.pool import PoolConfig
from meshserve.config.router import RouterConfig
from meshserve.config.scheduler import SchedulerConfig
from meshserve.config.speculative import SpeculativeConfig

__all__ = [
    "CONCERNS", "CONCERN_OF", "DEFAULT_ENGINE_PORT", "CacheConfig", "ClusterConfig", "ConfigError", "ConfigStruct",
    "Deployment", "EngineConfig", "EplbConfig", "KVTransferConfig", "ModelConfig", "ParallelConfig", "PoolConfig",
    "RouterConfig",
    "SchedulerConfig", "Setting", "SpeculativeConfig", "engine_settings", "read_deployment_yaml", "settings_of",
]
