"""`meshserve bench step-profile`: one-line argument errors, py-spy's collapsed stacks read and put into the
first matching part, and a --quick run on the tiny model: both processes' tables cover every sample, the
worker's samples land in the fused decode layers, and the flame graph is drawn (timings are never compared)."""
from __future__ import annotations

import json

import pytest

from meshserve.bench.step_profile import MASTER_PARTS, OTHER, WORKER_PARTS, breakdown, categorize, parse_collapsed
from meshserve.entrypoints.cli import main

COLLAPSED = """\
<module> (meshserve/utils/processes.py:140);_serve (meshserve/worker/worker.py:277);Poller.poll \
(zmq/sugar/poll.py:106) 7
<module> (meshserve/utils/processes.py:140);_serve (meshserve/worker/worker.py:291);ModelRunner.execute \
(meshserve/worker/model_runner.py:330);_attention_half (meshserve/models/fused_decode.py:90) 20
<module> (meshserve/utils/processes.py:140);_serve (meshserve/worker/worker.py:291);ModelRunner.execute \
(meshserve/worker/model_runner.py:339);ModelRunner._sample (meshserve/worker/model_runner.py:470);\
Sampler.sample_isolating (meshserve/worker/sampler.py:120) 3
<module> (meshserve/utils/processes.py:140);something_else (x.py:1) 2
not a stack line
"""


@pytest.mark.parametrize(("flags", "message"), [(["--seconds", "0"], "--seconds must be positive"),
                                                (["--prompt-len", "-1"], "--prompt-len must be positive"),
                                                (["--preset", "huge"], "--preset must be tiny or small"),
                                                (["--model", "/no/such/dir"], "is not a model directory")])
def test_bad_arguments_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "step-profile", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_stacks_go_to_the_first_part_that_names_one_of_their_functions():
    stacks = parse_collapsed(COLLAPSED)
    assert sum(stacks.values()) == 32 and len(stacks) == 4
    assert ("<module> (processes.py:140)", "something_else (x.py:1)") in stacks  # directories dropped
    counts = categorize(stacks, WORKER_PARTS)
    assert counts["waiting for the master"] == 7
    assert counts["decoder layers: attention (fused op)"] == 20
    assert counts["sampling"] == 3  # "Sampler." matches every Sampler method, before "other step work"
    assert counts[OTHER] == 2 and sum(counts.values()) == 32
    rows = breakdown(counts, step_ms=4.0)
    assert sum(row["ms_per_step"] for row in rows) == pytest.approx(4.0)
    assert next(row for row in rows if row["part"] == "sampling")["share"] == pytest.approx(3 / 32)


@pytest.mark.timeout(600)
def test_a_quick_run_on_the_tiny_model(tiny_model, tmp_path, capsys):
    path = tmp_path / "step-profile.json"
    model = tiny_model(overrides={"n_routed_experts": 32}, name="fused-decode")
    assert main(["bench", "step-profile", "--quick", "--model", str(model), "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    assert result["step_ms"] > 0
    for process, parts in (("worker", WORKER_PARTS), ("master", MASTER_PARTS)):
        rows = result[process]
        assert [row["part"] for row in rows] == [name for name, _ in parts] + [OTHER]
        assert sum(row["share"] for row in rows) == pytest.approx(1.0)
        assert sum(row["samples"] for row in rows) == sum(n for _, n in result["stacks"][process]) > 0
    cpu = result["cpu_ms_per_step"]
    assert list(cpu) == ["worker", "master", "client"] and all(ms > 0 for ms in cpu.values())
    assert cpu["worker"] > cpu["master"]  # the worker computes the step; the master only schedules it
    fused = {row["part"]: row["samples"] for row in result["worker"]}
    assert fused["decoder layers: attention (fused op)"] > 0 and fused["decoder layers: MLP / MoE (fused op)"] > 0
    out = capsys.readouterr().out
    assert "| worker | ms per step | share |" in out and "batch-1 decode step" in out and "CPU per step: " in out
