"""The rank template (`meshserve rank-template`, MESHSERVE_RANK_TEMPLATE): a master's forkserver forked from it
serves the same ranks as one of the master's own; a master killed with -9 still takes its forkserver and
ranks with it, and the template collects them; a template that cannot be reached is passed over; the
template ends with the process that started it. The test session runs its engines on such a template
(tests/conftest.py), so every other engine test exercises it too."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from meshserve import LLM, SamplingParams
from meshserve.utils.processes import FORKSERVER_TITLE, PROCESS_ENTRY_POINTS, launch, process_tree, rank_processes

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [101] * 20]
TEMPLATE_ENTRY = PROCESS_ENTRY_POINTS["rank-template"]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2}))


def _forkservers(master_pid: int) -> list[psutil.Process]:
    """The forkserver(s) serving `master_pid`'s ranks: the parents of its ranks."""
    return list({psutil.Process(pid).parent() for pid in rank_processes(master_pid).values()})


def _generate(model_dir: str) -> tuple[list[list[int]], str, str]:
    """Greedy tokens of PROMPTS on two ranks, their forkserver's `ps` line and that of the forkserver's parent."""
    with LLM(model=model_dir, kv_cache_memory_gb=0.05, parallel="attn=TP1+DP2 moe=TP1+EP2") as llm:
        (server,) = _forkservers(llm.engine.proc.pid)
        server_line, parent_line = " ".join(server.cmdline()), " ".join(server.parent().cmdline())
        tokens = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    return tokens, server_line, parent_line


def test_ranks_from_a_templates_forkserver_generate_what_the_masters_own_do(model_dir, monkeypatch):
    assert os.environ.get("MESHSERVE_RANK_TEMPLATE"), "the session's engines run on a rank template"
    templated, server_line, parent_line = _generate(model_dir)
    assert FORKSERVER_TITLE in server_line.split() and TEMPLATE_ENTRY in parent_line

    monkeypatch.delenv("MESHSERVE_RANK_TEMPLATE")
    own, server_line, parent_line = _generate(model_dir)
    assert FORKSERVER_TITLE not in server_line.split() and PROCESS_ENTRY_POINTS["master"] in parent_line
    assert templated == own


def test_a_killed_masters_templated_forkserver_and_ranks_end_and_are_collected(model_dir):
    llm = LLM(model=model_dir, kv_cache_memory_gb=0.05, parallel="attn=TP1+DP2 moe=TP1+EP2")
    try:
        master = llm.engine.proc.pid
        (forkserver,) = _forkservers(master)
        template = forkserver.parent()
        below = process_tree(master)
        assert forkserver in below and len(rank_processes(master)) == 2
        os.kill(master, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (left := [p.pid for p in below if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]):
            assert time.monotonic() < deadline, f"still running 30 s after their master was killed: {left}"
            time.sleep(0.1)
        # the template reaps what it forked and what it adopted: no zombie is left below it
        while (zombies := [p.pid for p in below if p.is_running() and p.ppid() == template.pid]):
            assert time.monotonic() < deadline, f"not collected by the template: {zombies}"
            time.sleep(0.1)
        assert template.is_running() and template.status() != psutil.STATUS_ZOMBIE
    finally:
        llm.shutdown()


def test_a_template_that_cannot_be_reached_is_passed_over(model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("MESHSERVE_RANK_TEMPLATE", str(tmp_path / "no-template-here"))
    with LLM(model=model_dir, kv_cache_memory_gb=0.05) as llm:
        (forkserver,) = _forkservers(llm.engine.proc.pid)
        assert forkserver.ppid() == llm.engine.proc.pid  # the master's own
        assert len(llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_the_template_ends_with_the_process_that_started_it(tmp_path):
    socket_path = tmp_path / "socket"
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from meshserve.utils.processes import launch
        print(launch("rank-template", socket_path={str(socket_path)!r}).pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        template = psutil.Process(int(starter.stdout.readline()))
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            assert time.monotonic() < deadline, "the template never listened"
            time.sleep(0.05)
        starter.kill()
        starter.wait(10)
        template.wait(30)  # raises psutil.TimeoutExpired if it outlives its parent
        assert not socket_path.exists()
    finally:
        starter.kill()
        starter.wait(10)


def test_a_template_whose_launcher_is_already_gone_ends(tmp_path):
    """A launcher that died before the template asked for its parent (the template would then read init's
    pid and wait forever) is noticed: the template watches the pid it was given."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    template = launch("rank-template", socket_path=str(tmp_path / "socket"), parent_pid=gone.pid)
    try:
        assert template.wait(60) == 0
    finally:
        template.kill()
        template.wait(10)
