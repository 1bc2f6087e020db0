"""MLA at attention TP1 with o_proj shared over two ranks (`oproj=TP2`, xDeepServe Fig. 10) against one rank.

A world of two ranks loads the `tiny` DeepSeek-V3 (two layers and its MTP layer) as
`attn=TP1+DP2 oproj=TP2 moe=TP1+EP2` and runs prefill/decode steps through the paged cache, one DP group
idle in some steps, in one batch and in two micro-batches; each rank also loads the single-rank model and
checks its DP group's logits against it. The same for the MTP layer; with INT8 (W8A8) weights the o_proj
shard keeps the single-rank INT8 values and the logits stay as close to the float model's as one rank's do.
"""
from __future__ import annotations

import pytest
import torch

from meshserve.layers.metadata import AttentionMetadata
from meshserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from meshserve.models.factory import make_model, preset_config
from meshserve.models.loader import load_model
from meshserve.models.qwen3_moe import Qwen3MoeForCausalLM
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import spawn_local_world
from tests.models.paged_harness import PagedHarness

TOL = 1e-4
INT8_RELATIVE_TOL = 0.25  # of the float model's logits, as tests/models/test_w8a8.py allows one rank (max 0.12 here)
WORLD_TIMEOUT_S = 240
STRATEGY = "attn=TP1+DP2 oproj=TP2 moe=TP1+EP2"
# one row per step, per DP group: (sequence id, new tokens); [] is an idle group
SCHEDULE = [
    [[(0, 9), (1, 5)], [(3, 7)]],
    [[(0, 1), (1, 1)], [(3, 1), (4, 6)]],
    [[(0, 1), (1, 1), (5, 4)], []],
    [[], [(3, 1), (4, 1)]],
    [[(0, 1), (5, 1), (1, 3)], [(4, 1), (3, 1)]],
]
MTP_TOKENS = [(6, 0), (3, 5)]  # per MTP forward, per DP group: the tokens of one prefilled sequence


def _tokens(seq: int, step: int, count: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * seq + step)
    return torch.randint(0, 32000, (count,), generator=g).tolist()


def _group_logits(model, dp_group: int, microbatches: int = 1) -> list[torch.Tensor | None]:
    harness = PagedHarness(model)
    out = []
    for step, row in enumerate(SCHEDULE):
        seqs = [seq for seq, _ in row[dp_group]]
        logits = harness.step(seqs, [_tokens(seq, step, n) for seq, n in row[dp_group]], microbatches=microbatches)
        out.append(torch.cat(logits) if logits else None)
    return out


@torch.inference_mode()
def _mtp_logits(model, dp_group: int) -> list[torch.Tensor]:
    out = []
    for call, counts in enumerate(MTP_TOKENS):
        count = counts[dp_group]
        cache = model.kv_cache_layout(num_mtp_layers=1).allocate(4, 4)[-1]
        g = torch.Generator().manual_seed(10 * call + dp_group)
        hidden = torch.randn(count, model.params.hidden_size, generator=g)
        ids = torch.randint(0, 32000, (count,), generator=g)
        meta = AttentionMetadata.build([count], [0], [[0, 1]], block_size=4) if count else AttentionMetadata.empty()
        out.append(model.compute_mtp_logits(model.forward_mtp(hidden, ids, torch.arange(count), meta, cache)))
    return out


def _assert_close(got: list, want: list, label: str, tol: float = TOL, relative: bool = False) -> None:
    for step, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), f"{label} step {step}"
        if b is None or b.numel() == 0:
            continue
        assert a.shape == b.shape, f"{label} step {step}"
        diff = ((a - b).norm() / b.norm()).item() if relative else (a - b).abs().max().item()
        assert diff <= tol, f"{label} step {step}: {diff}"


def _world_worker(rank: int, world_size: int, model_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = ParallelContext.build(ParallelStrategy.parse(STRATEGY), max_tokens_per_step=64)
    assert (ctx.oproj_ranks, ctx.oproj_rank, ctx.oproj_size) == ([0, 1], rank, 2)
    model, single = load_model(model_dir, parallel=ctx), load_model(model_dir)
    # every rank holds all heads but half of o_proj's input columns: its heads-shard
    for ours, whole in zip([*model.layers, *(m.block for m in model.mtp)],
                           [*single.layers, *(m.block for m in single.mtp)]):
        attn, full = ours.self_attn, whole.self_attn
        assert attn.num_heads == full.num_heads and attn.o_proj.weight.shape[1] * 2 == full.o_proj.weight.shape[1]
        assert torch.equal(attn.o_proj.weight, full.o_proj.weight.chunk(2, dim=1)[rank])
        assert torch.equal(attn.q_b_proj.weight, full.q_b_proj.weight)
    reference = _group_logits(single, ctx.dp_rank)
    _assert_close(_group_logits(model, ctx.dp_rank), reference, f"rank {rank}")
    _assert_close(_group_logits(model, ctx.dp_rank, microbatches=2), reference, f"rank {rank} two micro-batches")
    _assert_close(_mtp_logits(model, ctx.dp_rank), _mtp_logits(single, ctx.dp_rank), f"rank {rank} MTP")
    # INT8: the o_proj shard keeps its rows' INT8 grid, and runs through the same INT8 linear
    model8, single8 = load_model(model_dir, parallel=ctx, quantization="int8"), load_model(model_dir,
                                                                                           quantization="int8")
    ours, whole = model8.layers[0].self_attn.o_proj.weight, single8.layers[0].self_attn.o_proj.weight
    assert ours.dtype == torch.int8
    torch.testing.assert_close(ours.float() * ours.int8_scale.unsqueeze(1),
                               (whole.float() * whole.int8_scale.unsqueeze(1)).chunk(2, dim=1)[rank],
                               rtol=1e-6, atol=0)
    _assert_close(_group_logits(model8, ctx.dp_rank), reference, f"rank {rank} INT8", tol=INT8_RELATIVE_TOL,
                  relative=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_model("deepseek_v3", "tiny", tmp_path_factory.mktemp("oproj") / "model", seed=4,
                          overrides={"num_hidden_layers": 2}))


def test_shared_oproj_gives_the_single_rank_logits_on_a_dp2_world(model_dir):
    spawn_local_world(_world_worker, 2, args=(model_dir,), timeout_s=WORLD_TIMEOUT_S)


def test_a_head_count_that_does_not_split_over_the_oproj_group_is_refused():
    config = preset_config("deepseek_v3", "tiny", {"num_hidden_layers": 1, "num_attention_heads": 4,
                                                    "num_key_value_heads": 4, "num_nextn_predict_layers": 0})
    ctx = ParallelContext(ParallelStrategy.parse("attn=TP1+DP8 oproj=TP8 moe=TP1+EP8"), rank=3)
    with pytest.raises(ValueError, match="oproj=TP8: num_attention_heads of 4 does not split evenly"):
        DeepseekV3ForCausalLM(config, parallel=ctx)


def test_a_model_without_mla_refuses_a_shared_oproj():
    config = preset_config("qwen3_moe", "tiny", {"num_hidden_layers": 1})
    ctx = ParallelContext(ParallelStrategy.parse("attn=TP1+DP2 oproj=TP2 moe=TP1+EP2"), rank=1)
    with pytest.raises(ValueError, match="oproj=TP2 shares the output projection of MLA attention .* qwen3_moe has "
                                         "no MLA"):
        Qwen3MoeForCausalLM(config, parallel=ctx)
