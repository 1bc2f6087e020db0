"""Merge order of engine settings: defaults <- deployment file <- flags actually given."""
from __future__ import annotations

import pytest

from meshserve.config import EngineConfig
from meshserve.entrypoints.cli import build_parser
from meshserve.entrypoints.engine_args import engine_config_from_args, resolve_deployment


@pytest.fixture
def deployment_file(tmp_path):
    path = tmp_path / "deployment.yaml"
    path.write_text("engine: {max_num_seqs: 8, int8_dispatch: true, kv_hold_timeout_s: 30.0, block_size: 32}\n")
    return str(path)


def _config(argv: list[str]) -> EngineConfig:
    args = build_parser().parse_args(["serve", "--model", "m", *argv])
    resolve_deployment(args)
    return engine_config_from_args(args, "m")


def _checked(config: EngineConfig) -> tuple:
    return (config.scheduler_config.max_num_seqs, config.parallel_config.int8_dispatch,
            config.kv_transfer_config.kv_hold_timeout_s, config.cache_config.block_size)


def test_the_file_sets_what_no_flag_gives(deployment_file):
    assert _checked(_config(["--deployment", deployment_file])) == (8, True, 30.0, 32)


def test_a_flag_equal_to_its_default_still_overrides_the_file(deployment_file):
    defaults = EngineConfig.from_kwargs("m")
    config = _config(["--deployment", deployment_file, "--max-num-seqs", str(defaults.scheduler_config.max_num_seqs),
                      "--no-int8-dispatch", "--kv-hold-timeout-s", str(defaults.kv_transfer_config.kv_hold_timeout_s),
                      "--block-size", str(defaults.cache_config.block_size)])
    assert _checked(config) == _checked(defaults)


def test_a_flag_lands_in_its_concern_and_leaves_the_others_to_the_file(deployment_file):
    config = _config(["--deployment", deployment_file, "--block-size", "64", "--pool-namespace", "tenant-a"])
    assert (config.cache_config.block_size, config.pool_config.pool_namespace) == (64, "tenant-a")
    assert config.scheduler_config.max_num_seqs == 8  # from the file


def test_help_shows_each_concern_with_its_settings_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    headings = [line for line in out.splitlines() if line and not line[0].isspace()]
    concerns = ["model:", "cache:", "scheduler:", "parallel:", "eplb:", "pool:", "kv_transfer:"]
    assert [h for h in headings if h in concerns] == concerns
    cache_group = out.split("\ncache:\n", 1)[1].split("\nscheduler:\n", 1)[0]
    flat = " ".join(cache_group.split())  # argparse wraps long help
    assert "--block-size BLOCK_SIZE tokens per KV cache block (a power of two) (default: 16)" in flat
    assert "--enable-prefix-caching, --no-enable-prefix-caching reuse the KV blocks of a shared prompt prefix " \
           "(default: on)" in flat
    assert "--moe-comm {fused,sync} hybrid TP-EP collectives" in " ".join(out.split())
