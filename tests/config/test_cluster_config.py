"""The cluster manager's settings: `meshserve cluster up`'s flags generated from ClusterConfig under their
names of old, the struct carried to a detached manager as a dict, and one-line errors for bad values."""
from __future__ import annotations

import pytest

from meshserve.config import ClusterConfig, ConfigError
from meshserve.config.arguments import given_engine_settings, given_settings
from meshserve.entrypoints.cli import build_parser, main


def test_cluster_up_flags_make_the_config_and_stay_out_of_the_engine_settings():
    args = build_parser().parse_args(["cluster", "up", "colocated", "--name", "blue", "--backend", "ray",
                                      "--ray-address", "10.0.0.1:6379", "--host", "0.0.0.0", "--port", "9000",
                                      "--hold-s", "5", "--block-size", "16"])
    config = ClusterConfig(**given_settings(args, ClusterConfig))
    assert config == ClusterConfig(name="blue", backend="ray", ray_address="10.0.0.1:6379", host="0.0.0.0",
                                   port=9000, hold_s=5.0)
    assert given_engine_settings(args) == {"block_size": 16}
    assert args.name == "blue"  # the state directory's default still follows --name


def test_defaults_without_flags():
    args = build_parser().parse_args(["cluster", "up", "colocated"])
    assert ClusterConfig(**given_settings(args, ClusterConfig)) == ClusterConfig()
    assert (args.backend, args.host, args.port, args.hold_s) == ("local", "127.0.0.1", 8000, 120.0)


def test_the_config_travels_as_a_dict():
    config = ClusterConfig(port=9100, hold_s=0.0, autoscale=False, preload=False, heartbeat_timeout_s=3.0)
    assert ClusterConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="port"):
        ClusterConfig.from_dict({"port": 0})
    with pytest.raises(ConfigError, match="unknown field"):
        ClusterConfig.from_dict({"base_port": 8000})


@pytest.mark.parametrize(("setting", "value"), [("port", 70000), ("hold_s", -1.0), ("backend", "k8s"),
                                                ("heartbeat_timeout_s", 0.0), ("name", "")])
def test_bad_settings_are_one_line_errors_naming_them(setting, value):
    with pytest.raises(ConfigError, match=f"^{setting} must be "):
        ClusterConfig(**{setting: value})


def test_cluster_up_refuses_a_bad_setting_before_anything_starts(tmp_path, capsys):
    assert main(["cluster", "up", "colocated", "--port", "0", "--state-dir", str(tmp_path / "state")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshserve: error: port must be ") and len(err.splitlines()) == 1
    assert not (tmp_path / "state").exists()
