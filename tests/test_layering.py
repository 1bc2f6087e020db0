"""The layering rules hold: the import-linter contracts in pyproject.toml, and a live master without torch.

`lint-imports` reads the real import graph (function-local and TYPE_CHECKING imports included); `make test`
runs it too, this test makes plain `pytest` enforce it. The runtime check starts a real engine through the
real launch path and looks inside its master process: no torch library is mapped, no torch module loaded.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import psutil

from meshserve import LLM, SamplingParams
from meshserve.utils import processes
from tests.utils import process_probe

ROOT = Path(__file__).resolve().parent.parent
MASTER_ENTRY = processes.PROCESS_ENTRY_POINTS["master"]
TORCH_LIBRARIES = ("libtorch", "torch/_C")


def test_the_import_contracts_are_kept():
    done = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 broken" in done.stdout


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["name"]: c for c in config["contracts"]}


def _forbids(source: str, forbidden: str) -> bool:
    return any(c["type"] == "forbidden" and source in c["source_modules"] and forbidden in c["forbidden_modules"]
               and not c.get("allow_indirect_imports") for c in _contracts().values())


def test_the_contracts_say_what_the_house_rules_say():
    layers = [c for c in _contracts().values() if c["type"] == "layers"]
    assert len(layers) == 1 and layers[0]["exhaustive"] and not layers[0].get("ignore_imports")
    assert layers[0]["layers"][:2] == ["entrypoints", "bench"] and layers[0]["layers"][-1].startswith("utils")
    assert _forbids("meshserve.core", "torch")
    assert _forbids("meshserve.core", "meshserve.worker")
    assert _forbids("meshserve.models", "meshserve.pool")
    for below in ("meshserve.router", "meshserve.core", "meshserve.worker", "meshserve.utils"):
        assert _forbids(below, "meshserve.entrypoints") and _forbids(below, "meshserve.bench")


def _child_running(parent: psutil.Process, entry: str) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for child in parent.children():
            if entry in child.cmdline():
                return child
        time.sleep(0.1)
    raise AssertionError(f"no child process runs {entry}")


def _first_rank(master: psutil.Process) -> psutil.Process:
    """The master's rank 0 (forked by its forkserver, one level further down)."""
    deadline = time.monotonic() + 30
    while not (ranks := processes.rank_processes(master.pid)):
        assert time.monotonic() < deadline, "the master runs no worker rank"
        time.sleep(0.1)
    return psutil.Process(ranks[min(ranks)])


def _torch_mappings(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return sorted({line.split()[-1] for line in maps.splitlines() if any(lib in line for lib in TORCH_LIBRARIES)})


def _modules_of(pid: int, out: Path) -> list[str]:
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not out.exists():
        assert time.monotonic() < deadline, "the master did not write its modules"
        time.sleep(0.05)
    return json.loads(out.read_text())


def test_a_serving_master_has_no_torch_loaded(tiny_model, tmp_path, monkeypatch):
    """After start-up and a served request, the master maps no torch library and holds no torch module,
    while its worker (the same probe finds it there) has both."""
    out = tmp_path / "master-modules.json"
    monkeypatch.setenv(process_probe.OUT_ENV, str(out))
    # the probe runs the entry point as meshserve.utils.processes does, so the master starts exactly as in use
    monkeypatch.setattr(processes, "RUNNER_MODULE", process_probe.__name__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    model = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    with LLM(model=str(model), kv_cache_memory_gb=0.05) as llm:
        [output] = llm.generate(["the master schedules"], SamplingParams(temperature=0.0, max_tokens=4))
        assert len(output.outputs[0].token_ids) == 4
        master = _child_running(psutil.Process(), MASTER_ENTRY)
        worker = _first_rank(master)
        master_libraries, worker_libraries = _torch_mappings(master.pid), _torch_mappings(worker.pid)
        modules = _modules_of(master.pid, out)
    assert worker_libraries, "the maps check found no torch library even in the worker"
    assert master_libraries == []
    assert "meshserve.core.master" in modules and "zmq" in modules  # the master's own modules were read
    assert [name for name in modules if name == "torch" or name.startswith("torch.")] == []
