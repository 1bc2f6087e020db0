"""The job executor's settings (RouterConfig): checked when built, and the command line's router flags generated
from its fields, each keeping its name and meaning (`serve --routing` over the deployment file's routing,
`cluster up --hold-s` defaulting to 120 s), and none of them taken for an engine setting."""
from __future__ import annotations

import argparse

import pytest

from meshserve.config import ConfigError, RouterConfig
from meshserve.config.arguments import add_struct_arguments, given_engine_settings, given_settings
from meshserve.config.base import settings_of
from meshserve.entrypoints.cli import build_parser
from meshserve.entrypoints.serve import router_config


def test_the_defaults_are_the_job_executors_own():
    config = RouterConfig(model="m")
    assert (config.routing, config.register_port, config.hold_s, config.manager_addrs) == ("round_robin", 0, 0.0, ())
    assert (config.heartbeat_timeout_s, config.max_attempts, config.migrate_deadline_s) == (5.0, 3, 60.0)


@pytest.mark.parametrize("bad", [{"routing": "random"}, {"hold_s": -1.0}, {"register_port": 70000},
                                 {"heartbeat_timeout_s": 0.0}, {"max_attempts": 0}, {"report_interval_s": 0.0}])
def test_a_bad_setting_is_one_line_naming_it(bad):
    (name, value), = bad.items()
    with pytest.raises(ConfigError, match=f"^{name} must be .*, got {value!r}$"):
        RouterConfig(model="m", **bad)


def test_serve_routes_by_the_deployment_file_unless_the_flag_is_given():
    parse = build_parser().parse_args
    assert router_config(parse(["serve"]), "m", None, "combined").routing == "combined"
    args = parse(["serve", "--routing", "round_robin", "--register-port", "5555"])  # round_robin: the default
    config = router_config(args, "m", "x", "combined")
    assert (config.routing, config.register_port, config.served_model_name) == ("round_robin", 5555, "x")


def test_router_flags_are_not_engine_settings():
    args = build_parser().parse_args(["serve", "--routing", "load", "--max-num-seqs", "3"])
    assert given_engine_settings(args) == {"max_num_seqs": 3}
    assert given_settings(args, RouterConfig) == {"routing": "load"}


def test_router_flags_take_their_choices_from_the_field():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_struct_arguments(parser, RouterConfig, "job executor", names=("routing", "register_port"))
    assert parser.parse_args(["--routing", "pd_aware"]).routing == "pd_aware"
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--routing", "random"])


def test_serve_help_shows_the_router_flags_with_their_descriptions(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "--routing {round_robin,load,locality,pd_aware,combined}" in text
    for name in ("routing", "register_port"):
        setting = next(s for s in settings_of(RouterConfig) if s.name == name)
        assert " ".join(setting.description.split()) in text


def test_cluster_up_holds_requests_for_120_s_unless_told(capsys):
    parse = build_parser().parse_args
    args = parse(["cluster", "up", "colocated"])
    assert args.hold_s == 120.0 and given_settings(args, RouterConfig) == {}
    assert given_settings(parse(["cluster", "up", "colocated", "--hold-s", "0"]), RouterConfig) == {"hold_s": 0.0}
    with pytest.raises(SystemExit):
        parse(["cluster", "up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--hold-s HOLD_S how long a JE holds a request no TE can take yet" in text and "(default: 120.0)" in text
