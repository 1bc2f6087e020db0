"""Two micro-batches per step against one: the same logits on a world of ranks, with mixed and idle DP groups."""
from __future__ import annotations

import pytest
import torch

from meshserve.layers.metadata import AttentionMetadata
from meshserve.models.factory import make_model
from meshserve.models.loader import load_model
from meshserve.models.microbatch import StageTimeline, interleave, split_batch, split_point
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import spawn_local_world
from tests.models.paged_harness import PagedHarness

TOL = 1e-4
WORLD_TIMEOUT_S = 120
# one row per step, per DP group: (sequence id, new tokens); [] is an idle group
SCHEDULE = [
    [[(0, 9), (1, 5), (2, 12)], [(3, 7)]],
    [[(0, 1), (1, 1), (2, 1)], [(3, 1), (4, 6)]],
    [[(0, 1), (1, 1), (2, 1), (5, 4)], []],
    [[(0, 1), (2, 1), (5, 1)], [(3, 1), (4, 1)]],
    [[], [(3, 1)]],
    [[(1, 1), (5, 1), (0, 1)], [(4, 1), (3, 1)]],
]


def _tokens(seq: int, step: int, count: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * seq + step)
    return torch.randint(0, 32000, (count,), generator=g).tolist()


def _world_worker(rank: int, world_size: int, model_dir: str, int8_dispatch: bool) -> None:
    torch.set_num_threads(1)
    ctx = ParallelContext.build(ParallelStrategy.parse("attn=TP1+DP2 moe=TP1+EP2"), max_tokens_per_step=64,
                                int8_dispatch=int8_dispatch)
    model = load_model(model_dir, parallel=ctx)
    model.stage_timeline = StageTimeline()
    one, two = PagedHarness(model), PagedHarness(model)
    for step, row in enumerate(SCHEDULE):
        seqs = [seq for seq, _ in row[ctx.dp_rank]]
        tokens = [_tokens(seq, step, n) for seq, n in row[ctx.dp_rank]]
        model.stage_timeline.clear()
        whole = one.step(seqs, tokens)
        assert not model.stage_timeline.stages  # one micro-batch: no stages
        halves = two.step(seqs, tokens, microbatches=2)
        for a, b in zip(whole, halves):
            assert (a - b).abs().max().item() <= TOL, f"rank {rank} step {step}"
        # two micro-batches, each through every layer: 3 stages per MoE layer, 1 per dense layer and the last
        stages = model.stage_timeline.stages
        assert {index for index, *_ in stages} == {0, 1}
        assert [index for index, *_ in stages[:4]] == [0, 1, 0, 1]  # in turn


# MTP forwards per step, rows per DP group: one-token rows (a verification's layout), an idle group in two steps
MTP_ROWS = [(7, 3), (0, 5), (4, 0)]


def _mtp_world_worker(rank: int, world_size: int, model_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = ParallelContext.build(ParallelStrategy.parse("attn=TP1+DP2 moe=TP1+EP2"), max_tokens_per_step=64)
    model = load_model(model_dir, parallel=ctx)
    model.stage_timeline = StageTimeline()
    table = [3, 1, 7, 0]  # scrambled blocks of 4 tokens
    caches = {mbs: model.kv_cache_layout(num_mtp_layers=1).allocate(8, 4)[-1] for mbs in (1, 2)}
    with torch.inference_mode():
        for step, counts in enumerate(MTP_ROWS):
            n = counts[ctx.dp_rank]
            g = torch.Generator().manual_seed(100 * step + ctx.dp_rank)
            previous = torch.randn(n, model.params.hidden_size, generator=g)
            next_ids = torch.randint(0, 32000, (n,), generator=g)
            positions = torch.arange(n)
            attn = (AttentionMetadata.build([1] * n, list(range(n)), [table] * n, 4) if n
                    else AttentionMetadata.empty(torch.device("cpu")))
            out = {}
            for mbs in (1, 2):
                model.stage_timeline.clear()
                out[mbs] = model.forward_mtp(previous, next_ids, positions, attn, caches[mbs], microbatches=mbs)
                # split: both halves ran their stages in turn (dispatch, combine, finish); whole: none
                assert {index for index, *_ in model.stage_timeline.stages} == ({0, 1} if mbs == 2 else set())
            assert out[1].shape == out[2].shape == (n, model.params.hidden_size)
            if n:
                assert (out[1] - out[2]).abs().max().item() <= TOL, f"rank {rank} step {step}"
    assert torch.allclose(caches[1], caches[2], atol=TOL)  # the halves wrote the MTP cache as one batch does


def test_the_mtp_layer_in_two_microbatches_gives_the_hidden_states_of_one(model_dir):
    """A step that splits splits its MTP forwards too: the second half's rows read the MTP cache entries the first
    half wrote in the same layer; an idle group runs two empty halves, so the collectives pair up."""
    spawn_local_world(_mtp_world_worker, 2, args=(model_dir,), timeout_s=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_model("deepseek_v3", "tiny", tmp_path_factory.mktemp("microbatch") / "model", seed=2))


@pytest.mark.parametrize("int8_dispatch", [False, True])
def test_two_microbatches_give_the_logits_of_one_on_a_dp2_ep2_world(model_dir, int8_dispatch):
    spawn_local_world(_world_worker, 2, args=(model_dir, int8_dispatch), timeout_s=WORLD_TIMEOUT_S)


def test_the_batch_is_cut_at_the_sequence_boundary_nearest_half_its_tokens():
    meta = AttentionMetadata.build([1, 1, 1, 6, 3], [4, 7, 2, 0, 5], [[0, 1]] * 5, block_size=8)
    assert split_point(meta) == 3  # 3 tokens against 9, or 9 against 3: the tie goes to the earlier cut
    (rows_a, a), (rows_b, b) = split_batch(meta)
    assert (rows_a, rows_b) == (slice(0, 3), slice(3, 12))
    assert (a.num_decodes, b.num_decodes) == (3, 0)
    assert a.query_start_loc == [0, 1, 2, 3] and b.query_start_loc == [0, 6, 9]
    assert a.seq_lens == [5, 8, 3] and b.seq_lens == [6, 8]
    assert torch.equal(torch.cat([a.slot_mapping, b.slot_mapping]), meta.slot_mapping)
    assert torch.equal(torch.cat([a.block_tables, b.block_tables]), meta.block_tables)
    decodes = AttentionMetadata.build([1] * 7, [3] * 7, [[0]] * 7, block_size=8)
    assert split_point(decodes) == 3 and split_point(AttentionMetadata.empty()) == 0


def test_interleave_runs_one_stage_of_each_in_turn_and_returns_their_results():
    order = []

    def half(name: str, stages: int):
        for i in range(stages):
            order.append(f"{name}{i}")
            yield f"stage {i}"
        return name.upper()

    timeline = StageTimeline()
    assert interleave([half("a", 3), half("b", 1)], timeline) == ["A", "B"]
    assert order == ["a0", "b0", "a1", "a2"]
    assert [(i, stage) for i, stage, *_ in timeline.stages] == [
        (0, "stage 0"), (1, "stage 0"), (0, "stage 1"), (1, "finish"), (0, "stage 2"), (0, "finish")]
    assert all(end >= start for *_, start, end in timeline.stages)
