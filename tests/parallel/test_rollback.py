"""Iteration rollback across ranks (xdeepserve §6.2): which errors are transient, the ranks' agreement through a
store, and new process groups after a real gloo collective timed out on a real 2-rank world."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from meshserve.layers.moe import fused_experts
from meshserve.moe.runtime import MoERuntime
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.rollback import RollbackAbandoned, RollbackAgreement, is_transient
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import spawn_local_world

# what torch 2.13's gloo raises (plain RuntimeErrors from its TCP transport)
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:37570. This is typically caused by a remote worker crashing.")
GLOO_RESET = "[third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:4242: Connection reset by peer"
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                "3000ms for recv operation to complete")
WAIT_S = 2.0


# ---------------------------------------------------------------- which errors are transient
@pytest.mark.parametrize("exc", [
    RuntimeError(GLOO_CLOSED), RuntimeError(GLOO_RESET), RuntimeError(GLOO_TIMEOUT),
    dist.DistNetworkError("Connection reset by peer"), dist.DistBackendError("NCCL communicator was aborted"),
])
def test_broken_links_and_collective_timeouts_are_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("not transient"), RuntimeError("the pool client timed out"),  # not gloo's
    ValueError(GLOO_CLOSED), dist.DistStoreError("wait timeout after 5000ms"), KeyError("req-1"),
])
def test_other_errors_are_not(exc):
    assert not is_transient(exc)


# ---------------------------------------------------------------- agreement through the store
def _agree_all(store: dist.Store, steps: dict[int, int], world_size: int, rounds: int = 1) -> dict[int, object]:
    """Each rank of `steps` (rank -> the step it failed) agrees `rounds` times in a thread of its own; what each
    ended with (None: agreed every time, else the exception)."""
    results: dict[int, object] = {}

    def rank_main(rank: int) -> None:
        agreement = RollbackAgreement(store, rank, world_size, WAIT_S)
        try:
            for _ in range(rounds):
                agreement.agree(steps[rank])
            results[rank] = None
        except RollbackAbandoned as exc:
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * WAIT_S)
    return results


def test_ranks_that_failed_the_same_step_agree_round_after_round():
    store = dist.HashStore()
    assert _agree_all(store, {0: 7, 1: 7, 2: 7}, world_size=3, rounds=3) == {0: None, 1: None, 2: None}
    assert not store.check(["meshserve/rollback/1/0"])  # a rank clears its word of two rounds before


def test_ranks_that_failed_different_steps_give_up():
    """One rank finished step 7 and failed step 8: the rollback would run different steps, so none runs."""
    results = _agree_all(dist.HashStore(), {0: 7, 1: 8}, world_size=2)
    for exc in results.values():
        assert isinstance(exc, RollbackAbandoned)
        assert "different steps (rank 0 step 7, rank 1 step 8)" in str(exc)


def test_a_rank_that_never_comes_makes_the_others_give_up():
    results = _agree_all(dist.HashStore(), {0: 3, 2: 3}, world_size=3)  # rank 1 is dead
    for exc in results.values():
        assert isinstance(exc, RollbackAbandoned) and "rank(s) [1] did not join" in str(exc)


def test_one_rank_has_nothing_to_agree_on_or_rebuild():
    ctx = ParallelContext.single()
    ctx.agree_on_rollback(step_id=4)
    ctx.rebuild_groups()
    assert ctx.attn_tp_group is None and ctx.moe_groups is None


# ---------------------------------------------------------------- a real 2-rank world
NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 4, 16, 8, 2
COLLECTIVE_TIMEOUT_S = 2.0


def _step(runtime: MoERuntime, experts, w13, w2, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)  # the same tokens on every rank (attention TP needs that)
    hidden = torch.randn(5, HIDDEN, generator=gen)
    ids = torch.rand(5, NUM_EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K]
    weights = torch.softmax(torch.randn(5, TOP_K, generator=gen), dim=-1)
    out = runtime(hidden, ids, weights, experts)
    torch.testing.assert_close(out, fused_experts(hidden, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


def _roll_back_after_a_timeout(rank: int, world_size: int, text: str) -> None:
    ctx = ParallelContext.build(ParallelStrategy.parse(text), max_tokens_per_step=8,
                                collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    runtime = MoERuntime(ctx, NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)
    experts = runtime.make_weights(INTERMEDIATE)
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2
    for expert in range(NUM_EXPERTS):
        for proj, tensor in (("gate_proj", w13[expert, :INTERMEDIATE]), ("up_proj", w13[expert, INTERMEDIATE:]),
                             ("down_proj", w2[expert])):
            experts.load_expert(expert, proj, tensor)
    _step(runtime, experts, w13, w2, seed=1)
    old_groups = (ctx.attn_tp_group, ctx.moe_groups)
    # step 2: rank 1 fails before its collectives; rank 0 waits in them until the timeout fails it too
    if rank == 0:
        with pytest.raises(RuntimeError) as info:
            _step(runtime, experts, w13, w2, seed=2)
        assert is_transient(info.value), info.value
    ctx.agree_on_rollback(step_id=2)
    ctx.rebuild_groups()
    assert (ctx.attn_tp_group, ctx.moe_groups) != old_groups
    comm = runtime.ep_dispatcher or runtime.hybrid
    assert getattr(comm, "group", None) is ctx.moe_groups.inter_node or getattr(comm, "groups", None) is ctx.moe_groups
    _step(runtime, experts, w13, w2, seed=2)  # the step again, on the new groups
    with pytest.raises(RollbackAbandoned, match="different steps"):
        ctx.agree_on_rollback(step_id=3 + rank)  # rank 1 finished step 3 and failed step 4


def _each_layout(rank: int, world_size: int) -> None:
    for text in ("attn=TP1+DP2 moe=TP1+EP2", "attn=TP2+DP1 moe=TP2+EP1"):  # EP dispatcher; hybrid + attention TP
        _roll_back_after_a_timeout(rank, world_size, text)


def test_a_timed_out_collective_is_rolled_back_on_new_groups():
    spawn_local_world(_each_layout, 2, timeout_s=120)
