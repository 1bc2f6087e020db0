"""Subcommands whose flags live in a heavy module (one that imports torch): the module is imported when that
subcommand is parsed or its help is shown, so that `meshserve pool server`, `meshserve serve` and the other
commands start without it."""
from __future__ import annotations

import argparse
import importlib


class LazyArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser (the class of a subparsers action) whose `flags_from="module:add_function[:main_function]"`
    adds its flags, and `func=main_function` when given, on first use."""

    def __init__(self, *args, flags_from: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._flags_from = flags_from

    def _populate(self) -> None:
        if self._flags_from is None:
            return
        module_name, add_name, *main_name = self._flags_from.split(":")
        self._flags_from = None
        module = importlib.import_module(module_name)
        getattr(module, add_name)(self)
        if main_name:
            self.set_defaults(func=getattr(module, main_name[0]))

    def parse_known_args(self, args=None, namespace=None):
        self._populate()
        return super().parse_known_args(args, namespace)

    def get_default(self, dest: str):
        self._populate()
        return super().get_default(dest)

    def format_help(self) -> str:
        self._populate()
        return super().format_help()

    def format_usage(self) -> str:
        self._populate()
        return super().format_usage()
