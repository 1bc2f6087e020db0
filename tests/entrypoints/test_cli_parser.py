"""The command line is built without torch: every process `meshserve` starts that does not run a model (a pool
server, a job executor, the cluster manager) is spared its import; a benchmark's flags load with its command."""
from __future__ import annotations

import subprocess
import sys

import pytest

from meshserve.bench.commands import BENCH_COMMANDS
from meshserve.entrypoints.cli import build_parser

BUILD_ONLY = """
import sys
from meshserve.entrypoints.cli import build_parser
build_parser().parse_args(["pool", "server", "--controller", "tcp://127.0.0.1:1", "--bind", "tcp://127.0.0.1:2",
                           "--dram-gb", "1"])
sys.exit(sorted(m for m in ("torch", "transformers", "fastapi") if m in sys.modules) or None)
"""


def test_building_the_command_line_imports_no_torch():
    run = subprocess.run([sys.executable, "-c", BUILD_ONLY], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("name", [name for name, _, _ in BENCH_COMMANDS])
def test_every_benchmark_gets_its_flags_and_entry_point_when_parsed(name, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["bench", name, "--help"])
    assert stop.value.code == 0
    assert f"usage: meshserve bench {name}" in capsys.readouterr().out
    args = parser.parse_args(["bench", name, *_required_flags(name)])
    assert callable(args.func) and args.bench_command == name


def test_a_benchmark_flag_it_does_not_take_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["bench", "transfer", "--json", "t.json", "--no-such-flag"])
    assert stop.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


def _required_flags(name: str) -> list[str]:
    workload = ["--requests", "1", "--input-len", "2:2", "--output-len", "2:2", "--json", "x.json"]
    return {"offline": ["--preset", "tiny", *workload],
            "serve": ["--url", "http://127.0.0.1:1", "--rate", "1", *workload],
            "parallel": ["--preset", "tiny", "--world", "2", *workload],
            "decode-step": ["--preset", "tiny", "--json", "x.json"],
            "moe-comm": ["--json", "x.json"], "eplb": ["--json", "x.json"], "cache": ["--json", "x.json"],
            "transfer": ["--json", "x.json"], "pd": ["--json", "x.json"],
            "routing": ["--json", "x.json"], "microbatch": ["--json", "x.json"]}.get(name, [])
