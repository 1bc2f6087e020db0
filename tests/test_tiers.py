"""The test tiers of tests/conftest.py: every test module has one, every exception names a module or test that
exists, every collected test carries exactly one tier, and a `unit` test that starts a process fails."""
from __future__ import annotations

import ast
import multiprocessing
import os
import subprocess

import pytest

from tests.conftest import (
    FIXTURE_TIERS,
    FOLDER_TIERS,
    PROCESS_ATTEMPTS,
    TESTS_DIR,
    TIER_EXCEPTIONS,
    TIERS,
    ProcessInUnitTestError,
    tier_of,
)


def test_every_test_module_has_a_tier():
    modules = sorted(TESTS_DIR.rglob("test_*.py"))
    assert len(modules) > 100
    assert [path for path in modules if tier_of(path, "any_test") is None] == []


def test_every_exception_names_a_module_or_test_that_exists():
    assert set(FOLDER_TIERS.values()) | set(FIXTURE_TIERS.values()) | set(TIER_EXCEPTIONS.values()) <= set(TIERS)
    for key in TIER_EXCEPTIONS:
        module, _, test = key.partition("::")
        path = TESTS_DIR / module
        assert path.is_file(), key
        if test:
            tests = {node.name for node in ast.parse(path.read_text()).body
                     if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
            assert test in tests, key


def test_folders_exceptions_and_fixtures_decide_the_tier():
    assert tier_of(TESTS_DIR / "core/test_scheduler.py", "test_x") == "unit"
    assert tier_of(TESTS_DIR / "core/test_scheduler.py", "test_x", ("tmp_path", "tiny_model")) == "model"
    assert tier_of(TESTS_DIR / "engine/test_recovery.py", "test_x", ("tiny_model",)) == "engine"  # never lower
    assert tier_of(TESTS_DIR / "engine/test_sampler.py", "test_greedy_is_argmax") == "unit"
    assert tier_of(TESTS_DIR / "engine/test_sampler.py", "test_temperature_sampling_matches_softmax") == "model"
    assert tier_of(TESTS_DIR / "bench/test_report.py", "test_x") == "unit"
    assert tier_of(TESTS_DIR / "bench/test_spec_bench.py", "test_x", ("tiny_model",)) == "bench"
    assert tier_of(TESTS_DIR / "nowhere/test_x.py", "test_x") is None


def test_every_collected_test_has_exactly_one_tier(request):
    for item in request.session.items:
        assert [name for name in TIERS if item.get_closest_marker(name)] == [
            tier_of(item.path, item.originalname, tuple(item.fixturenames))], item.nodeid


def test_a_unit_test_that_starts_a_process_fails(request):
    assert request.node.get_closest_marker("unit")
    starts = {"subprocess": lambda: subprocess.run(["true"], check=False),
              "multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
              "os.system": lambda: os.system("true")}
    for start in starts.values():
        with pytest.raises(ProcessInUnitTestError, match="may not start a process"):
            start()
    attempts = request.node.stash[PROCESS_ATTEMPTS]
    assert attempts == list(starts)
    attempts.clear()  # the attempts, even caught, would fail this test after its call
