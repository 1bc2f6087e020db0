"""How the ranks of self-contained DP groups agree on a step (worker/step_agreement.py): the plan every rank reads
from the gathered rows, and the pause between idle rounds."""
from __future__ import annotations

from meshserve.worker.step_agreement import IDLE_ROUND_MAX_S, IDLE_ROUND_MIN_S, NO_STEP, idle_pause_s, plan_round


def _row(step: int = NO_STEP, tokens: int = 0, stop: int = 0, mtp: int = 0, eplb: int = 0) -> list[int]:
    return [step, tokens, stop, mtp, eplb]


def test_groups_with_a_step_run_it_and_idle_groups_join_with_nothing():
    plan = plan_round([_row(4, 8), _row(), _row(9, 1), _row()], attn_tp=1, microbatches=1, microbatch_min_tokens=16)
    assert plan.runs == [True, False, True, False]
    assert plan.forward and not plan.stop and plan.microbatches == 1


def test_no_forward_when_no_group_has_a_step():
    plan = plan_round([_row(), _row()], attn_tp=1, microbatches=2, microbatch_min_tokens=2)
    assert plan.runs == [False, False] and not plan.forward and plan.microbatches == 1


def test_a_group_runs_only_once_every_one_of_its_tp_ranks_holds_the_step():
    # group 0: both TP ranks hold step 3; group 1: its second rank has not received step 7 yet
    plan = plan_round([_row(3, 5), _row(3, 5), _row(7, 2), _row()], attn_tp=2, microbatches=1,
                      microbatch_min_tokens=16)
    assert plan.runs == [True, False]
    # ... nor when its ranks hold different steps (one is a step ahead)
    plan = plan_round([_row(3, 5), _row(4, 5)], attn_tp=2, microbatches=1, microbatch_min_tokens=16)
    assert plan.runs == [False] and not plan.forward


def test_two_micro_batches_when_the_largest_step_that_runs_is_big_enough():
    rows = [_row(1, 20), _row(2, 3)]
    assert plan_round(rows, attn_tp=1, microbatches=2, microbatch_min_tokens=16).microbatches == 2
    assert plan_round(rows, attn_tp=1, microbatches=2, microbatch_min_tokens=21).microbatches == 1
    assert plan_round(rows, attn_tp=1, microbatches=1, microbatch_min_tokens=2).microbatches == 1
    # a step that cannot run this round does not count: its group's TP ranks are not all there
    rows = [_row(1, 40), _row(), _row(2, 3), _row(2, 3)]
    assert plan_round(rows, attn_tp=2, microbatches=2, microbatch_min_tokens=16).microbatches == 1


def test_a_group_that_ran_last_and_has_no_step_yet_is_late_not_idle():
    rows = [_row(5, 8), _row()]
    assert plan_round(rows, attn_tp=1, microbatches=1, microbatch_min_tokens=16, ran_last=[True, True]).late
    # it was idle before too: no wait for it
    assert not plan_round(rows, attn_tp=1, microbatches=1, microbatch_min_tokens=16, ran_last=[True, False]).late
    # nobody has a step: an idle round, not a late one
    assert not plan_round([_row(), _row()], attn_tp=1, microbatches=1, microbatch_min_tokens=16,
                          ran_last=[True, True]).late


def test_every_rank_runs_as_many_mtp_forwards_as_the_running_group_that_needs_most():
    # group 0 drafts (catch-up + 2 draft forwards), group 1 only catches up, group 2 is idle, group 3's step
    # (which drafts) cannot run yet: it does not count
    rows = [_row(1, 8, mtp=3), _row(2, 8, mtp=1), _row(), _row(4, 8, mtp=3), _row(), _row()]
    assert plan_round(rows[:3], attn_tp=1, microbatches=1, microbatch_min_tokens=16).mtp_forwards == 3
    assert plan_round(rows[1:3], attn_tp=1, microbatches=1, microbatch_min_tokens=16).mtp_forwards == 1
    assert plan_round(rows[2:], attn_tp=2, microbatches=1, microbatch_min_tokens=16).mtp_forwards == 0


def test_an_expert_placement_phase_applies_once_every_rank_has_it():
    rows = [_row(1, 8, eplb=3), _row(eplb=2), _row(eplb=3), _row(eplb=3)]
    assert plan_round(rows, attn_tp=1, microbatches=1, microbatch_min_tokens=16).eplb_phases == 2
    # also in a round without a forward
    idle = plan_round([_row(eplb=1), _row(eplb=1)], attn_tp=1, microbatches=1, microbatch_min_tokens=16)
    assert idle.eplb_phases == 1 and not idle.forward


def test_a_stop_from_any_rank_stops_every_rank():
    plan = plan_round([_row(1, 4), _row(stop=1)], attn_tp=1, microbatches=1, microbatch_min_tokens=16)
    assert plan.stop


def test_the_idle_pause_doubles_up_to_its_cap():
    pauses = [idle_pause_s(n) for n in range(1, 12)]
    assert pauses[0] == IDLE_ROUND_MIN_S
    assert all(b == min(2 * a, IDLE_ROUND_MAX_S) for a, b in zip(pauses, pauses[1:]))
    assert pauses[-1] == IDLE_ROUND_MAX_S
    assert idle_pause_s(10_000) == IDLE_ROUND_MAX_S  # however long the TE idles
