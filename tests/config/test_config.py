"""Engine settings: one struct per concern, validated declaratively, composed, merged and shown as flags."""
from __future__ import annotations

import re
import subprocess
import sys

import msgspec
import pytest

from meshserve.config import (
    CONCERN_OF,
    CONCERNS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    EplbConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    PoolConfig,
    SchedulerConfig,
    engine_settings,
    settings_of,
)
from meshserve.config.arguments import add_engine_arguments, given_engine_settings
from meshserve.entrypoints.cli import build_parser
from meshserve.entrypoints.engine_args import engine_config_from_args, resolve_deployment
from meshserve.wire import codec
from meshserve.wire.codec import MessageError
from meshserve.wire.worker import WorkerHandshake


# ---------------------------------------------------------------- validation, per concern
@pytest.mark.parametrize("concern, settings, message", [
    (ModelConfig, {"model": "m", "dtype": "float64"}, "dtype must be one of float32, bfloat16, float16, auto, "
                                                      "got 'float64'"),
    (ModelConfig, {"model": 7}, "model must be a string, got 7"),
    (CacheConfig, {"block_size": 24}, "block_size must be a power of two, got 24"),
    (CacheConfig, {"block_size": 0}, "block_size must be an integer >= 1, got 0"),
    (CacheConfig, {"kv_cache_memory_gb": 0}, "kv_cache_memory_gb must be positive"),
    (CacheConfig, {"num_kv_blocks": 0}, "num_kv_blocks must be an integer >= 1 (or unset), got 0"),
    (CacheConfig, {"enable_prefix_caching": "yes"}, "enable_prefix_caching must be true or false, got 'yes'"),
    (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
    (SchedulerConfig, {"max_num_batched_tokens": -5}, "max_num_batched_tokens must be an integer >= 1"),
    (SchedulerConfig, {"max_num_seqs": 2.5}, "max_num_seqs must be an integer >= 1, got 2.5"),
    (ParallelConfig, {"moe_comm": "async"}, "moe_comm must be one of fused, sync, got 'async'"),
    (ParallelConfig, {"parallel": "attn=TP3"}, "bad parallel strategy 'attn=TP3'"),
    (ParallelConfig, {"local_ranks": 2}, "local_ranks must be between 1 and the world size 1"),
    (ParallelConfig, {"local_ranks": 0}, "local_ranks must be an integer >= 1 (or unset), got 0"),
    (ParallelConfig, {"engine_port": 65536}, "engine_port must be an integer >= 1 and <= 65535, got 65536"),
    (ParallelConfig, {"dist_backend": "mpi"}, "dist_backend must be one of gloo, nccl (or unset), got 'mpi'"),
    (ParallelConfig, {"microbatches": 3}, "microbatches must be an integer >= 1 and <= 2, got 3"),
    (ParallelConfig, {"microbatches": 2, "parallel": "attn=TP2+DP1 moe=TP1+EP2"},
     "microbatches 2 overlaps the expert-parallel dispatch and combine: it needs attn=TP1+DPn moe=TP1+EPn"),
    (ParallelConfig, {"microbatches": 2}, "microbatches 2 overlaps the expert-parallel dispatch and combine"),
    (ParallelConfig, {"microbatch_min_tokens": 1}, "microbatch_min_tokens must be an integer >= 2, got 1"),
    (ParallelConfig, {"gc_collect_every_steps": -1}, "gc_collect_every_steps must be an integer >= 0, got -1"),
    (ParallelConfig, {"pin_cores": "yes"}, "pin_cores must be true or false, got 'yes'"),
    (EplbConfig, {"eplb_redundant_experts": -1}, "eplb_redundant_experts must be an integer >= 0, got -1"),
    (EplbConfig, {"eplb_interval_s": 0}, "eplb_interval_s must be a number > 0 (or unset), got 0"),
    (PoolConfig, {"pool_fetch_gbps": 0}, "pool_fetch_gbps must be a number > 0, got 0"),
    (PoolConfig, {"pool_fetch_latency_ms": -1.0}, "pool_fetch_latency_ms must be a number >= 0, got -1.0"),
    (KVTransferConfig, {"kv_transfer": "both"}, "kv_transfer must be one of none, producer, consumer, got 'both'"),
    (KVTransferConfig, {"kv_hold_timeout_s": 0}, "kv_hold_timeout_s must be a number > 0, got 0"),
])
def test_a_bad_setting_is_one_line_naming_the_field(concern, settings, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as refused:
        concern(**settings)
    assert "\n" not in str(refused.value)
    flat = {"model": "m", **settings}
    with pytest.raises(ConfigError, match="^" + re.escape(message)):  # the same through the flat names
        EngineConfig.from_kwargs(flat.pop("model"), **flat)


def test_two_microbatches_need_two_sequences_per_step():
    with pytest.raises(ConfigError, match="^microbatches 2 splits a step's sequences in two: it needs max_num_seqs "
                                          ">= 2, got 1$"):
        EngineConfig.from_kwargs("m", parallel="attn=TP1+DP2 moe=TP1+EP2", microbatches=2, max_num_seqs=1)
    config = EngineConfig.from_kwargs("m", parallel="attn=TP1+DP2 moe=TP1+EP2", microbatches=2)
    assert config.parallel_config.microbatches == 2


def test_budget_may_be_zero_when_the_block_count_is_given():
    assert CacheConfig(kv_cache_memory_gb=0, num_kv_blocks=8).num_kv_blocks == 8


def test_every_setting_has_help_text_and_a_known_concern():
    for settings in engine_settings().values():
        for setting in settings:
            assert setting.description, setting.name
    assert set(CONCERN_OF) == {s.name for group in engine_settings().values() for s in group}


def test_settings_are_frozen():
    config = EngineConfig.from_kwargs("m")
    with pytest.raises(AttributeError):
        config.cache_config.block_size = 32


# ---------------------------------------------------------------- composition
def test_from_kwargs_routes_every_flat_name_to_its_concern():
    config = EngineConfig.from_kwargs("m", served_model_name="x", block_size=32, max_num_seqs=8,
                                      parallel="attn=TP1+DP2 moe=TP1+EP2", eplb_slice_s=5.0, pool_namespace="t",
                                      kv_transfer="producer", te_name="te-a")
    assert config.model_config == ModelConfig(model="m", served_model_name="x")
    assert config.cache_config == CacheConfig(block_size=32)
    assert config.scheduler_config == SchedulerConfig(max_num_seqs=8)
    assert config.parallel_config.world_size == 2
    assert (config.eplb_config.eplb_slice_s, config.pool_config.pool_namespace) == (5.0, "t")
    assert (config.kv_transfer_config.kv_transfer, config.te_name) == ("producer", "te-a")
    for name, attr in CONCERN_OF.items():
        holder = config if attr is None else getattr(config, attr)
        assert isinstance(holder, (EngineConfig, *CONCERNS.values())) and hasattr(holder, name)


def test_unknown_names_are_refused():
    with pytest.raises(ConfigError, match="unknown engine argument\\(s\\): warp_speed"):
        EngineConfig.from_kwargs("m", warp_speed=9)
    with pytest.raises(ConfigError, match="unknown field `warp_speed`"):
        EngineConfig.from_dict({"model_config": {"model": "m"}, "cache_config": {"warp_speed": 9}})


def test_replace_changes_settings_by_flat_name_and_validates():
    config = EngineConfig.from_kwargs("m", block_size=32)
    changed = config.replace(kv_transfer="consumer", max_num_seqs=4)
    assert changed.kv_transfer_config.kv_transfer == "consumer" and changed.scheduler_config.max_num_seqs == 4
    assert changed.cache_config == config.cache_config and config.kv_transfer_config.kv_transfer == "none"
    with pytest.raises(ConfigError, match="block_size"):
        config.replace(block_size=3)


def test_to_dict_is_nested_and_round_trips():
    config = EngineConfig.from_kwargs("m", block_size=64, max_model_len=512, local_ranks=1, engine_port=1234,
                                      parallel="attn=TP2+DP1 moe=TP1+EP2", eplb_placement="p.json",
                                      pool_controller="tcp://127.0.0.1:7600", kv_transfer_backend="tcp")
    data = config.to_dict()
    assert set(data) == {*CONCERNS, "te_name"} and data["cache_config"]["block_size"] == 64
    assert EngineConfig.from_dict(data) == config
    assert EngineConfig.from_dict(msgspec.json.decode(msgspec.json.encode(data))) == config  # as a process argument


def test_from_dict_validates_every_concern():
    data = EngineConfig.from_kwargs("m").to_dict()
    data["scheduler_config"]["max_num_seqs"] = 0
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig.from_dict(data)


def test_the_handshake_carries_a_typed_config():
    config = EngineConfig.from_kwargs("m", parallel="attn=TP1+DP2 moe=TP1+EP2", local_ranks=1)
    sent = WorkerHandshake(rank=1, config=config, work_addr="tcp://h:1", result_addr="tcp://h:2")
    received = codec.decode(codec.encode(sent))
    assert isinstance(received.config, EngineConfig) and received.config == config


def test_a_handshake_with_a_bad_config_is_refused_on_decode():
    data = msgspec.msgpack.encode(["WorkerHandshake", {"rank": 1, "config": {
        "model_config": {"model": "m"}, "cache_config": {"block_size": 3}}}])
    with pytest.raises(MessageError):
        codec.decode(data)


def test_the_config_package_imports_no_torch():
    code = "import sys, meshserve.config, meshserve.config.arguments; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ---------------------------------------------------------------- merge order and flags
@pytest.fixture
def deployment_file(tmp_path):
    path = tmp_path / "deployment.yaml"
    path.write_text('parallel: "attn=TP1+DP2 moe=TP1+EP2"\n'
                    "engine: {max_num_seqs: 8, block_size: 32, enable_prefix_caching: false, "
                    "pool_namespace: tenant}\n")
    return str(path)


def _merged(command: list[str]) -> EngineConfig:
    args = build_parser().parse_args([*command, "--model", "m"])
    resolve_deployment(args)
    return engine_config_from_args(args, "m")


@pytest.mark.parametrize("command", [["serve"], ["te"]])
def test_merge_order_is_defaults_then_file_then_flags_given(deployment_file, command):
    defaults = EngineConfig.from_kwargs("m")
    assert _merged(command) == defaults
    from_file = _merged([*command, "--deployment", deployment_file])
    assert (from_file.scheduler_config.max_num_seqs, from_file.cache_config.block_size) == (8, 32)
    assert from_file.parallel_config.world_size == 2 and from_file.pool_config.pool_namespace == "tenant"
    assert from_file.cache_config.enable_prefix_caching is False
    assert from_file.eplb_config == defaults.eplb_config  # what the file leaves out keeps its default
    flags = _merged([*command, "--deployment", deployment_file, "--max-num-seqs", "64", "--block-size", "16",
                     "--enable-prefix-caching", "--pool-namespace", "default", "--max-waiting", "7"])
    # every flag given wins, even where it equals the default the file overrode
    assert flags.scheduler_config == SchedulerConfig(max_num_seqs=64, max_waiting=7)
    assert flags.cache_config == defaults.cache_config and flags.pool_config == defaults.pool_config
    assert flags.parallel_config.world_size == 2  # no flag: the file's


def test_only_flags_given_count_as_given():
    args = build_parser().parse_args(["serve", "--block-size", "16", "--no-async-scheduling"])
    assert given_engine_settings(args) == {"block_size": 16, "async_scheduling": False}
    assert given_engine_settings(build_parser().parse_args(["serve"])) == {}


def test_flags_take_their_type_and_choices_from_the_annotation():
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-cache-memory-gb", "0.5", "--num-kv-blocks", "9", "--kv-transfer", "consumer"])
    assert (args.kv_cache_memory_gb, args.num_kv_blocks, args.kv_transfer) == (0.5, 9, "consumer")
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--moe-comm", "async"])
    with pytest.raises(argparse.ArgumentError, match="invalid int value"):
        parser.parse_args(["--max-num-seqs", "many"])


def test_help_shows_every_setting_with_its_description(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for concern, settings in engine_settings().items():
        assert f" {concern}: " in text
        for setting in settings:
            if setting.name != "model":  # each command has its own --model
                assert f"--{setting.name.replace('_', '-')}" in text
                assert " ".join(setting.description.split()) in text, setting.name


def test_bench_flags_come_from_the_same_declaration():
    from meshserve.bench.cli import BENCH_ENGINE_SETTINGS

    args = build_parser().parse_args(["bench", "offline", "--preset", "tiny", "--requests", "1", "--input-len", "2",
                                      "--output-len", "2", "--json", "o.json", "--max-num-seqs", "64",
                                      "--moe-comm", "sync"])
    assert given_engine_settings(args) == {"max_num_seqs": 64, "moe_comm": "sync"}
    assert set(BENCH_ENGINE_SETTINGS) <= set(CONCERN_OF)
    assert all(settings_of(cls) for cls in CONCERNS.values())
