"""Forking a rank's weights from a running TE (`meshserve.worker.weight_fork`) against a checkpoint load.

The oracle is the disk load of the same layout: a forked model holds the same tensors bit for bit (also
INT8 W8A8, whose conversion runs after loading) and computes the same logits; a whole forked TE of two
ranks generates the same tokens while its source keeps generating. A source that serves another model or
layout is refused by name, a dead one fails the load at once.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.models.loader import load_model
from meshserve.parallel.context import ParallelContext
from meshserve.worker.weight_fork import WeightForkError, WeightServer, fork_identity, fork_model, weight_slots
from tests.models.paged_harness import prefill_logits

PROMPT = [5, 17, 300, 42, 7, 99, 1024, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE_ARGS = dict(max_num_batched_tokens=64, block_size=8, max_num_seqs=4, num_kv_blocks=64)
LAYOUT = "attn=TP1+DP2 moe=TP1+EP2"


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})


def _serve(model_dir, quantization=None) -> tuple[torch.nn.Module, WeightServer]:
    model = load_model(model_dir, quantization=quantization)
    identity = fork_identity(model_dir, torch.float32, quantization, ParallelContext.single())
    return model, WeightServer(model, identity)


def _assert_same_state(want: torch.nn.Module, got: torch.nn.Module) -> None:
    want_state = {slot.name: slot.get() for slot in weight_slots(want)}
    got_state = {slot.name: slot.get() for slot in weight_slots(got)}
    assert want_state.keys() == got_state.keys()
    for name, tensor in want_state.items():
        other = got_state[name]
        assert (other.dtype, other.shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(other, tensor), name


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_fork_equals_checkpoint_load(model_dir, quantization):
    source, server = _serve(model_dir, quantization)
    try:
        forked, nbytes = fork_model(server.address, model_dir, torch.float32, quantization=quantization)
    finally:
        server.close()
    disk = load_model(model_dir, quantization=quantization)
    assert nbytes == server.nbytes > 0
    _assert_same_state(disk, forked)
    _assert_same_state(disk, source)  # serving left the source's weights as they were
    assert torch.equal(prefill_logits(forked, PROMPT), prefill_logits(disk, PROMPT))
    # the fork's tensors are its own: writing them leaves the source alone
    slot = next(s for s in weight_slots(forked) if s.kind == "param" and s.get().is_floating_point())
    before = next(s for s in weight_slots(source) if s.name == slot.name).get().clone()
    slot.get().add_(1.0)
    assert torch.equal(next(s for s in weight_slots(source) if s.name == slot.name).get(), before)


def test_source_keeps_serving_during_forks(model_dir):
    source, server = _serve(model_dir)
    want = prefill_logits(source, PROMPT)
    forked, errors = [], []

    def fork():
        try:
            forked.append(fork_model(server.address, model_dir, torch.float32)[0])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=fork) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        steps = [prefill_logits(source, PROMPT) for _ in range(3)]  # the source runs while the forks read
        for t in threads:
            t.join(timeout=60)
    finally:
        server.close()
    assert not errors and len(forked) == 2
    assert all(torch.equal(step, want) for step in steps)
    assert all(torch.equal(prefill_logits(model, PROMPT), want) for model in forked)


def test_another_model_is_refused(model_dir, tiny_model):
    other = tiny_model("deepseek_v3", seed=1, overrides={"num_hidden_layers": 2})
    _, server = _serve(other)
    try:
        with pytest.raises(WeightForkError, match="its version is"):
            fork_model(server.address, model_dir, torch.float32)
        with pytest.raises(WeightForkError, match="its dtype is 'float32', this rank's is 'bfloat16'"):
            fork_model(server.address, other, torch.bfloat16)
        with pytest.raises(WeightForkError, match="its quantization is 'none', this rank's is 'int8'"):
            fork_model(server.address, other, torch.float32, quantization="int8")
    finally:
        server.close()


def test_dead_source_fails_the_load(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(WeightForkError, match=f"cannot fork weights from tcp://127.0.0.1:{port}"):
        fork_model(f"tcp://127.0.0.1:{port}", model_dir, torch.float32, timeout_s=5.0)
    with pytest.raises(WeightForkError, match="not an address"):
        fork_model("nowhere", model_dir, torch.float32)


def _weight_servers(capfd, world_size: int, timeout_s: float = 60.0) -> list[str]:
    """The ranks' weight-server addresses from their log lines (each rank writes its snapshot in the background,
    so the lines may come after the engine is ready)."""
    text, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text += capfd.readouterr().err
        found = dict(re.findall(r"worker\[(\d+)\] INFO weight server at (tcp://\S+):", text))
        if len(found) == world_size:
            return [found[str(rank)] for rank in range(world_size)]
        time.sleep(0.1)
    raise AssertionError(f"{world_size} weight servers not announced within {timeout_s:.0f} s")


def test_two_rank_te_forks_while_its_source_generates(model_dir, capfd):
    prompts = [PROMPT, PROMPT[::-1], [11, 12, 13]]
    with LLM(model=str(model_dir), **ENGINE_ARGS, parallel=LAYOUT) as llm:
        want = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    capfd.readouterr()
    with LLM(model=str(model_dir), **ENGINE_ARGS, parallel=LAYOUT, serve_weights=True,
             log_level=logging.INFO) as source:
        addrs = _weight_servers(capfd, 2)
        during: list = []
        generating = threading.Thread(target=lambda: during.extend(source.generate(prompts, GREEDY)))
        generating.start()
        try:
            with LLM(model=str(model_dir), **ENGINE_ARGS, parallel=LAYOUT, fork_from=",".join(addrs)) as target:
                got = [out.outputs[0].token_ids for out in target.generate(prompts, GREEDY)]
        finally:
            generating.join(timeout=120)
        with pytest.raises(Exception, match=r"its layout is 'attn=TP1\+DP2 moe=TP1\+EP2', this rank's is"):
            LLM(model=str(model_dir), **ENGINE_ARGS, fork_from=addrs[1])
    assert got == want
    assert [out.outputs[0].token_ids for out in during] == want
