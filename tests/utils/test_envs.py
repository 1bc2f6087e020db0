"""The environment variables meshserve reads are listed in one module and in the serving guide, and read only
there."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from meshserve.utils import envs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshserve"
ENVS_MODULE = PACKAGE / "utils" / "envs.py"


def test_the_serving_guide_lists_every_variable_as_envs_does():
    guide = (ROOT / "docs" / "serving.md").read_text()
    assert envs.markdown_table() in guide
    for var in envs.ENV_VARS:
        assert f"`{var.name}`" in guide


def _environment_reads(tree: ast.AST) -> list[tuple[int, ast.expr | None]]:
    """(line, key expression) of every read of the environment: os.environ.get / [..] / in, os.getenv."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func)
            if target in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                reads.append((node.lineno, node.args[0] if node.args else None))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and ast.unparse(node.value) in ("os.environ", "environ"):
            reads.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) in ("os.environ", "environ")
                                                   for c in node.comparators):
            reads.append((node.lineno, node.left))
    return reads


def test_no_module_but_envs_reads_a_meshserve_variable():
    """Outside envs.py a read must name its variable literally, and never a MESHSERVE_* one."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == ENVS_MODULE:
            continue
        for line, key in _environment_reads(ast.parse(path.read_text(), str(path))):
            literal = isinstance(key, ast.Constant) and isinstance(key.value, str)
            if not literal or key.value.startswith("MESHSERVE_") or key.value in {v.name for v in envs.ENV_VARS}:
                offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert offenders == []


def test_the_read_check_sees_the_ways_code_reads_the_environment():
    tree = ast.parse("import os\nos.environ.get('MESHSERVE_X')\nos.getenv(NAME)\nos.environ['RANK']\n"
                     "'A' in os.environ\nos.environ['PATH'] = 'x'\n")
    keys = [ast.unparse(key) for _, key in _environment_reads(tree)]
    assert sorted(keys) == sorted(["'MESHSERVE_X'", "NAME", "'RANK'", "'A'"])  # the assignment is no read


@pytest.mark.parametrize("value, keys", [("", ()), ("a", ("a",)), (" a , b,,", ("a", "b"))])
def test_api_keys_split_on_commas(value, keys):
    assert envs.api_keys({"MESHSERVE_API_KEY": value}) == keys


def test_accessors_read_the_environment_when_called(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path))
    assert envs.cache_dir() == tmp_path
    monkeypatch.setenv("RANK", "3")
    assert envs.rank() == 3
    monkeypatch.setenv("RANK", "three")
    assert envs.rank() is None
    monkeypatch.setenv("MESHSERVE_CPU_KERNELS", "0")
    assert not envs.cpu_kernels_enabled()


def test_threads_per_rank_come_from_the_flag_then_the_variable_then_the_cores(monkeypatch):
    import torch

    from meshserve.worker.model_runner import configure_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("MESHSERVE_NUM_THREADS", raising=False)
        assert envs.num_threads() is None
        assert configure_threads(None, world_size=1) == max(1, os.cpu_count() or 1)
        monkeypatch.setenv("MESHSERVE_NUM_THREADS", "1")
        assert configure_threads(None, world_size=1) == 1 == torch.get_num_threads()
        assert configure_threads(3, world_size=1) == 3  # the flag wins
        for bad in ("0", "two", "-1"):
            monkeypatch.setenv("MESHSERVE_NUM_THREADS", bad)
            with pytest.raises(ValueError, match="MESHSERVE_NUM_THREADS must be a positive integer"):
                envs.num_threads()
    finally:
        torch.set_num_threads(before)


def test_the_null_model_time_reads_milliseconds(monkeypatch):
    monkeypatch.delenv("MESHSERVE_NULL_MODEL_MS", raising=False)
    assert envs.null_model_s() is None  # the model runs
    monkeypatch.setenv("MESHSERVE_NULL_MODEL_MS", "20")
    assert envs.null_model_s() == pytest.approx(0.02)
    monkeypatch.setenv("MESHSERVE_NULL_MODEL_MS", "0")
    assert envs.null_model_s() == 0.0  # null ranks whose forwards take no time
    for bad in ("-1", "soon"):
        monkeypatch.setenv("MESHSERVE_NULL_MODEL_MS", bad)
        with pytest.raises(ValueError, match="MESHSERVE_NULL_MODEL_MS must be a number of milliseconds"):
            envs.null_model_s()
