"""Settings as command-line flags: one `--flag` per setting, generated from a settings struct.

Every command that takes engine flags (`serve`, `te`, the benchmarks) declares them here, from the field's
annotation: its type, `Literal` choices, `--x/--no-x` for a bool, and its description as the help text,
grouped by concern. Each flag remembers that it was given, so the merge order defaults <- deployment file
<- flags holds even for a flag equal to its default. Other processes' settings structs (the router's, the
cluster manager's, the HTTP server's) become flags the same way (`add_struct_arguments`).
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from meshserve.config.base import ConfigStruct, Setting, settings_of
from meshserve.config.engine import CONCERN_OF, engine_settings

GIVEN_ENGINE_FLAGS = "_given_engine_flags"  # the namespace attribute naming the engine flags on the command line
NOT_FLAGS = frozenset({"model"})  # every command names its model its own way


def _note_given(namespace: argparse.Namespace, dest: str) -> None:
    given = getattr(namespace, GIVEN_ENGINE_FLAGS, set())
    given.add(dest)
    setattr(namespace, GIVEN_ENGINE_FLAGS, given)


class _StoreGiven(argparse.Action):
    """Store the value and remember the flag was given: a flag equal to its default still overrides a file."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        _note_given(namespace, self.dest)


class _BooleanGiven(argparse.BooleanOptionalAction):
    def __init__(self, *args, help: str | None = None, **kwargs) -> None:
        super().__init__(*args, help=help, **kwargs)
        self.help = help  # the text as given: some Python versions append the default themselves

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


def add_engine_arguments(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """One `--flag` per engine setting (or per setting in `names`), in one argument group per concern."""
    wanted = None if names is None else set(names)
    for concern, settings in engine_settings().items():
        chosen = [s for s in settings if s.name not in NOT_FLAGS and (wanted is None or s.name in wanted)]
        if chosen:
            group = parser.add_argument_group(concern)
            for setting in chosen:
                _add_flag(group, setting)


def add_struct_arguments(parser: argparse.ArgumentParser, cls: type[ConfigStruct], title: str,
                         names: Iterable[str] | None = None, skip: Iterable[str] = (),
                         defaults: Mapping[str, Any] | None = None) -> None:
    """One `--flag` per plain setting of `cls` (or per setting in `names`, less those in `skip`), in one
    argument group; `given_settings(args, cls)` then reads back the ones given. `defaults`: this command's
    own defaults for some settings (the flag's value and its help when it is not given)."""
    wanted, skipped, defaults = (None if names is None else set(names)), set(skip), dict(defaults or {})
    group = parser.add_argument_group(title)
    for setting in settings_of(cls):
        if setting.name not in skipped and (wanted is None or setting.name in wanted):
            if setting.name in defaults:
                setting = dataclasses.replace(setting, default=defaults[setting.name])
            _add_flag(group, setting)


def given_settings(args: argparse.Namespace, cls: type[ConfigStruct]) -> dict[str, Any]:
    """The settings of `cls` whose flag was given on the command line (whatever its value)."""
    names = {s.name for s in settings_of(cls)}
    return {name: getattr(args, name) for name in sorted(getattr(args, GIVEN_ENGINE_FLAGS, set()) & names)}


def _add_flag(group: argparse._ArgumentGroup, setting: Setting) -> None:
    flag = "--" + setting.name.replace("_", "-")
    help_text = setting.description + _default_text(setting)
    if setting.kind is bool:
        group.add_argument(flag, dest=setting.name, action=_BooleanGiven, default=setting.default, help=help_text)
    else:
        group.add_argument(flag, dest=setting.name, action=_StoreGiven, type=setting.kind, choices=setting.choices,
                           default=setting.default, help=help_text)


def _default_text(setting: Setting) -> str:
    if setting.default is None:
        return ""  # the description says what happens unset
    value = ("on" if setting.default else "off") if setting.kind is bool else setting.default
    return f" (default: {value})"


def given_engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings whose flag was given on the command line (whatever its value); the given flags of
    other settings structs on the same command (the HTTP server's, the cluster manager's) are not engine's."""
    given = getattr(args, GIVEN_ENGINE_FLAGS, set()) & set(CONCERN_OF)
    return {name: getattr(args, name) for name in sorted(given)}
