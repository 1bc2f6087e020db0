"""The HTTP server's settings: one flag per setting generated from the struct, the keys from their own flags or
the environment, declarative checks with one-line errors, and the server's flags kept apart from the engine's."""
from __future__ import annotations

import pytest

from meshserve.config import ConfigError
from meshserve.config.arguments import given_engine_settings
from meshserve.entrypoints.cli import build_parser
from meshserve.entrypoints.openai.server_options import (
    ADMIN_KEY_ENV,
    ServerOptions,
    server_options,
    server_options_from_args,
)


def test_the_flags_given_make_the_options_and_stay_out_of_the_engine_settings():
    args = build_parser().parse_args(["serve", "--max-body-bytes", "5", "--shutdown-grace-s", "2.5",
                                      "--allow-unauthenticated", "--api-key", "k1", "--api-key", "k2",
                                      "--block-size", "16"])
    options = server_options_from_args(args, {ADMIN_KEY_ENV: "admin-secret"})
    assert (options.max_body_bytes, options.shutdown_grace_s, options.allow_unauthenticated) == (5, 2.5, True)
    assert options.api_keys == ("k1", "k2") and options.admin_key == "admin-secret"
    assert options.max_connections == ServerOptions().max_connections  # not given: the default
    assert given_engine_settings(args) == {"block_size": 16}


def test_every_setting_but_the_keys_has_a_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for name in ServerOptions().public_kwargs():
        assert f"--{name.replace('_', '-')}" in text
    assert "--api-key" in text and "--admin-key" in text


@pytest.mark.parametrize(("setting", "value"), [("max_body_bytes", 0), ("header_timeout_s", -1.0),
                                                ("max_prompt_chars", 0), ("max_context_cache_ttl", 1e9)])
def test_bad_settings_are_one_line_errors_naming_them(setting, value):
    with pytest.raises(ConfigError, match=f"^{setting} must be ") as raised:
        server_options({}, **{setting: value})
    assert "\n" not in str(raised.value)


def test_an_empty_key_is_refused_without_printing_the_keys():
    with pytest.raises(ConfigError, match="must not be empty") as raised:
        server_options({}, api_keys=("sk-real-key", ""))
    assert "sk-real-key" not in str(raised.value)
