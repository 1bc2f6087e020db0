"""Merge order of engine settings: defaults <- deployment file <- flags actually given."""
from __future__ import annotations

import pytest

from meshserve.entrypoints.cli import build_parser, engine_config_from_args, resolve_deployment
from meshserve.config import EngineConfig


@pytest.fixture
def deployment_file(tmp_path):
    path = tmp_path / "deployment.yaml"
    path.write_text("engine: {max_num_seqs: 8, int8_dispatch: true, kv_hold_timeout_s: 30.0}\n")
    return str(path)


def _config(argv: list[str]) -> EngineConfig:
    args = build_parser().parse_args(["serve", "--model", "m", *argv])
    resolve_deployment(args)
    return engine_config_from_args(args, "m")


def test_the_file_sets_what_no_flag_gives(deployment_file):
    config = _config(["--deployment", deployment_file])
    assert (config.max_num_seqs, config.int8_dispatch, config.kv_hold_timeout_s) == (8, True, 30.0)


def test_a_flag_equal_to_its_default_still_overrides_the_file(deployment_file):
    defaults = EngineConfig(model="m")
    config = _config(["--deployment", deployment_file, "--max-num-seqs", str(defaults.max_num_seqs),
                      "--no-int8-dispatch", "--kv-hold-timeout-s", str(defaults.kv_hold_timeout_s)])
    assert (config.max_num_seqs, config.int8_dispatch, config.kv_hold_timeout_s) == (
        defaults.max_num_seqs, False, defaults.kv_hold_timeout_s)
