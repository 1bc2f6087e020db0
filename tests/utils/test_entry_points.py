"""Every process entry point and every `meshserve` subcommand handler imports: a moved file fails here."""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap

import pytest

from meshserve.entrypoints.cli import build_parser
from meshserve.utils.processes import PROCESS_ENTRY_POINTS, entry_point


@pytest.mark.parametrize("name", sorted(PROCESS_ENTRY_POINTS))
def test_every_process_entry_point_imports(name):
    function = entry_point(PROCESS_ENTRY_POINTS[name])
    assert callable(function)
    # launch passes JSON keyword arguments: the function must take them by name
    assert all(p.kind is not inspect.Parameter.POSITIONAL_ONLY for p in inspect.signature(function).parameters.values())


def test_the_runner_refuses_what_the_table_does_not_name():
    command = [sys.executable, "-m", "meshserve.utils.processes", "os:system", json.dumps({"command": "true"})]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "not a meshserve entry point: 'os:system'" in done.stderr


def _subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(command words, parser) for every leaf subcommand, nested ones (`bench offline`) included."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        yield prefix, parser
    for action in actions:
        for word, sub in action.choices.items():
            yield from _subcommands(sub, (*prefix, word))


def _local_imports(function) -> list[tuple[str, str | None]]:
    """(module, name) for each import inside `function`'s body (handlers import their command lazily)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
    return found


SUBCOMMANDS = sorted(_subcommands(build_parser()), key=lambda item: item[0])


def test_the_cli_has_its_subcommands():
    words = {words[0] for words, _ in SUBCOMMANDS}
    assert {"serve", "te", "worker", "make-model", "plan", "pool", "bench"} <= words


@pytest.mark.parametrize("words,parser", SUBCOMMANDS, ids=[" ".join(words) for words, _ in SUBCOMMANDS])
def test_every_cli_subcommand_handler_imports(words, parser):
    handler = parser.get_default("func")
    assert callable(handler), f"`meshserve {' '.join(words)}` has no handler"
    for module, name in _local_imports(inspect.unwrap(handler)):
        imported = importlib.import_module(module)
        if name is not None and name != "*":
            assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), f"{module}.{name}"


EXIT_PROBE = """
import atexit, sys, threading, time
from meshserve.utils.processes import exit_without_teardown
atexit.register(lambda: print("exit handler ran", flush=True))
late = threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished")))
late.start()
from concurrent.futures import ThreadPoolExecutor
ThreadPoolExecutor(1).submit(print, end="")  # its idle worker is woken at exit, not waited on forever
print("buffered, not yet flushed", end="")
exit_without_teardown({code!r})
print("never printed")
"""


@pytest.mark.parametrize("code, returncode", [(None, 0), (3, 3), ("meshserve: error: bad", 1)])
def test_an_exit_without_teardown_keeps_what_a_normal_exit_does(code, returncode):
    """Threads joined, exit handlers run, streams flushed and the exit code kept; only the module teardown
    (a second once torch is imported) is skipped."""
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE.format(code=code)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == returncode, done.stderr
    assert done.stdout.splitlines() == ["buffered, not yet flushedthread finished", "exit handler ran"]
    assert ("meshserve: error: bad" in done.stderr) == isinstance(code, str)
