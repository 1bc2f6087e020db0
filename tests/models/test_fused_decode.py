"""The fused native decode layers (models/fused_decode.py) against the per-op path on the same weights and cache:
the same logits at every decode step, the same cache entries and expert-load counts, in float32 and INT8 W8A8;
mixed batches, the switch and the torch path stay per-op."""
from __future__ import annotations

import random

import pytest
import torch

from meshserve.config import EngineConfig
from meshserve.layers import cpu_kernels
from meshserve.layers.metadata import AttentionMetadata

BLOCK = 4
PROMPT_LENS = (5, 13, 22)
STEPS = 4


@pytest.fixture(scope="module", params=["float32", "int8"])
def runner(request, tiny_model):
    from meshserve.worker.model_runner import ModelRunner

    # 32 experts: the router packs for the native kernel too; the tiny model's 208-row q/kv projection does not
    # (a shape the fused op runs through torch's linear)
    model = tiny_model(overrides={"n_routed_experts": 32}, name="fused-decode")
    quantization = {"quantization": "int8"} if request.param == "int8" else {}
    config = EngineConfig.from_kwargs(str(model), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64,
                                      enable_prefix_caching=False, max_num_seqs=8, **quantization)
    built = ModelRunner(config)
    if not cpu_kernels.enabled():
        pytest.fail("the native CPU kernels did not build")
    yield built
    built.close()


def _prefilled(runner) -> tuple[list[list[int]], list[int]]:
    """Three prompts prefilled into scattered blocks; their block tables and the next tokens."""
    blocks = list(range(1, 64))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * 10:(i + 1) * 10] for i in range(len(PROMPT_LENS))]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (n,), generator=gen) for n in PROMPT_LENS]
    attn = AttentionMetadata.build(list(PROMPT_LENS), [0] * len(PROMPT_LENS), tables, BLOCK)
    positions = torch.cat([torch.arange(n) for n in PROMPT_LENS])
    with torch.inference_mode():
        runner.model(torch.cat(prompts), positions, attn, runner.model_kv_caches)
    return tables, [int(p[-1]) for p in prompts]


def _decode(runner, tables, tokens) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """STEPS greedy decode steps of every sequence: per step the logits; the caches after them."""
    steps = []
    with torch.inference_mode():
        for step in range(STEPS):
            lens = [n + step for n in PROMPT_LENS]
            attn = AttentionMetadata.build([1] * len(lens), lens, tables, BLOCK)
            hidden = runner.model(torch.tensor(tokens), torch.tensor(lens), attn, runner.model_kv_caches)
            logits = runner.model.compute_logits(hidden)
            steps.append(logits)
            tokens = logits.argmax(dim=-1).tolist()
    return steps, [cache.clone() for cache in runner.model_kv_caches]


def test_fused_steps_match_the_per_op_path(runner, monkeypatch):
    model = runner.model
    tables, tokens = _prefilled(runner)
    snapshot = [cache.clone() for cache in runner.model_kv_caches]
    runner.take_expert_load()
    fused_before = model.fused_decode.steps
    fused, fused_caches = _decode(runner, tables, tokens)
    fused_load = runner.take_expert_load()
    assert model.fused_decode.steps == fused_before + STEPS  # every decode step ran fused

    for cache, saved in zip(runner.model_kv_caches, snapshot):
        cache.copy_(saved)
    monkeypatch.setenv("MESHSERVE_FUSED_DECODE", "0")
    per_op, per_op_caches = _decode(runner, tables, tokens)
    per_op_load = runner.take_expert_load()
    assert model.fused_decode.steps == fused_before + STEPS  # the switch sends every step through the ops

    for step, (a, b) in enumerate(zip(fused, per_op)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"decode step {step}")
        assert torch.equal(a.argmax(dim=-1), b.argmax(dim=-1))
    for a, b in zip(fused_caches, per_op_caches):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if fused_load is not None:
        assert fused_load == per_op_load and sum(map(sum, fused_load)) > 0


def test_mixed_batches_and_the_torch_path_run_per_op(runner):
    model = runner.model
    tables, tokens = _prefilled(runner)
    before = model.fused_decode.steps
    with torch.inference_mode():
        # one decode row and one two-token prefill continuation: not all rows are decodes
        attn = AttentionMetadata.build([1, 2], [PROMPT_LENS[0], PROMPT_LENS[1]], tables[:2], BLOCK)
        model(torch.tensor([tokens[0], 7, 8]), torch.tensor([PROMPT_LENS[0], PROMPT_LENS[1], PROMPT_LENS[1] + 1]),
              attn, runner.model_kv_caches)
        with cpu_kernels.disabled():
            attn = AttentionMetadata.build([1], [PROMPT_LENS[2]], tables[2:], BLOCK)
            model(torch.tensor(tokens[2:]), torch.tensor([PROMPT_LENS[2]]), attn, runner.model_kv_caches)
    assert model.fused_decode.steps == before


@pytest.fixture(scope="module")
def bf16_runner(tiny_model):
    from meshserve.worker.model_runner import ModelRunner

    model = tiny_model(overrides={"n_routed_experts": 32}, name="fused-decode")
    config = EngineConfig.from_kwargs(str(model), dtype="bfloat16", device="cpu", block_size=BLOCK, num_kv_blocks=64,
                                      enable_prefix_caching=False, max_num_seqs=8)
    built = ModelRunner(config)
    yield built
    built.close()


def test_a_bfloat16_model_decodes_fused_within_bfloat16_rounding_of_the_per_op_path(bf16_runner, monkeypatch):
    """A bfloat16 model's fused steps keep the rows in float32 between its bfloat16 linears (each input rounded to
    bfloat16, as the per-op path's own layers round it) over the bfloat16 cache: the first decode step's logits and
    cache entries agree with the per-op path's to bfloat16 rounding. (Later steps are not compared: on a random
    MoE model one rounding difference can flip a near-tied expert choice.)"""
    model = bf16_runner.model
    tables, tokens = _prefilled(bf16_runner)
    snapshot = [cache.clone() for cache in bf16_runner.model_kv_caches]
    lens = list(PROMPT_LENS)
    attn = AttentionMetadata.build([1] * len(lens), lens, tables, BLOCK)
    before = model.fused_decode.steps

    def step() -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(torch.tensor(tokens), torch.tensor(lens), attn, bf16_runner.model_kv_caches)
            return model.compute_logits(hidden).float()

    fused = step()
    fused_caches = [cache.clone() for cache in bf16_runner.model_kv_caches]
    # the experts' native bfloat16 packs (AVX512-BF16) are what the fused MLP half needs; elsewhere it runs per op
    runs_fused = model.layers[1].mlp.experts._bf16_native is not None
    assert runs_fused == cpu_kernels.bf16_packable(model.layers[1].mlp.experts.w13[0])
    assert model.fused_decode.steps == before + runs_fused
    for cache, saved in zip(bf16_runner.model_kv_caches, snapshot):
        cache.copy_(saved)
    monkeypatch.setenv("MESHSERVE_FUSED_DECODE", "0")
    per_op = step()
    assert model.fused_decode.steps == before + runs_fused
    assert torch.nn.functional.cosine_similarity(fused, per_op, dim=-1).min() > 0.999
    assert ((fused - per_op).norm() / per_op.norm()).item() < 0.03
    for a, b in zip(fused_caches, bf16_runner.model_kv_caches):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-6 * b.float().abs().max().item())
