"""The master's expert-load slices and the four-phase reconfiguration sequence (no processes)."""
from __future__ import annotations

import pytest

from meshserve.core.eplb_controller import EplbControl, EplbController, EplbError
from meshserve.moe.balance import balancedness
from meshserve.moe.live_moves import check_every_expert_served
from meshserve.moe.placement import ExpertPlacement, PlacementShape
from meshserve.wire.eplb import EplbCommand, EplbPhase
from meshserve.wire.worker import WorkerEventKind

SHAPE = PlacementShape(num_logical=8, num_ranks=2, redundant_per_rank=1)
LAYERS = [1, 2]


def controller(**kwargs) -> EplbController:
    return EplbController(SHAPE, LAYERS, world_size=2, slice_s=10.0, **kwargs)


def hot_placement() -> dict:
    """Slots 0-4 are rank 0's (experts 0-3 + one redundant), 5-9 rank 1's (experts 4-7 + one redundant)."""
    placement = ExpertPlacement.default(SHAPE, LAYERS)
    for layer in LAYERS:
        placement.layers[layer][4] = 5  # expert 5 (on rank 1) gets a replica on rank 0
        placement.layers[layer][9] = 0  # expert 0 (on rank 0) gets a replica on rank 1
    return placement.to_dict()


def test_load_reports_sum_into_time_slices():
    ctl = controller()
    assert ctl.step_control(now=100.0) == EplbControl(report_load=True)
    assert ctl.step_control(now=100.5) == EplbControl()  # at most one report per report_every_s
    ctl.on_counts([[1] * 8, [2] * 8])
    ctl.on_counts([[1] * 8, [0] * 8])  # a second DP group's driver
    start = ctl._current_start
    ctl.tick(start + 10.5)
    ctl.on_counts([[0, 5, 0, 0, 0, 0, 0, 0], [0] * 8])
    record = ctl.record()
    assert record.num_slices == 2
    assert record.counts[0] == [[2] * 8, [2] * 8]
    assert record.counts[1][0][1] == 5
    assert record.slice_start_times[1] == pytest.approx(start + 10.0)
    assert ctl.record(include_current=False).num_slices == 1


def test_reconfiguration_runs_four_phases_after_every_rank_acks():
    ctl = controller()
    ctl.rebalance(hot_placement())
    first = ctl.step_control(now=0.0)
    assert first.eplb.phase == EplbPhase.PREFETCH
    assert ExpertPlacement.from_dict(first.eplb.placement.to_dict()).replicas(1)[0] == [0, 9]
    assert ctl.idle_control() == EplbControl()  # nothing more until every rank has prefetched
    ctl.on_event(0, WorkerEventKind.EPLB_PREFETCHED, "")
    assert ctl.idle_control() == EplbControl()
    ctl.on_event(1, WorkerEventKind.EPLB_PREFETCHED, "")
    assert ctl.idle_control() == EplbControl(EplbCommand(EplbPhase.DISABLE_AND_LOAD))
    ctl.on_event(1, WorkerEventKind.EPLB_LOADED, "")
    ctl.on_event(0, WorkerEventKind.EPLB_LOADED, "")
    assert ctl.has_pending_control
    assert ctl.idle_control() == EplbControl(EplbCommand(EplbPhase.ENABLE))
    assert not ctl.busy and ctl.num_reconfigurations == 1
    assert ctl.status().placement.replicas["1"][0] == [0, 9]


def test_a_failed_phase_stops_the_sequence_and_is_reported():
    ctl = controller()
    ctl.rebalance(hot_placement())
    ctl.idle_control()
    ctl.on_event(1, WorkerEventKind.EPLB_FAILED, "OSError: disk")
    assert ctl.idle_control() == EplbControl(EplbCommand(EplbPhase.ABORT))  # every rank drops it at one boundary
    assert not ctl.busy and ctl.idle_control() == EplbControl()
    assert "rank 1" in ctl.status().last_error and ctl.num_reconfigurations == 0


def _other_shape() -> dict:
    return ExpertPlacement.default(PlacementShape(8, 2, 2), LAYERS).to_dict()


def _one_layer() -> dict:
    placement = hot_placement()
    del placement["layers"]["2"]
    return placement


@pytest.mark.parametrize("make, message", [
    (_other_shape, "placement is for"), (_one_layer, "covers layers"),
    (lambda: {"format": "nope"}, "bad placement"),
])
def test_bad_placements_are_refused(make, message):
    ctl = controller()
    placement = make()
    with pytest.raises(EplbError, match=message):
        ctl.rebalance(placement)
    assert not ctl.busy


def test_rebalance_needs_redundant_slots_and_refuses_while_busy():
    no_spare = EplbController(PlacementShape(8, 2, 0), LAYERS, world_size=2, slice_s=10.0)
    with pytest.raises(EplbError, match="no redundant expert slots"):
        no_spare.rebalance(None)
    ctl = controller()
    with pytest.raises(EplbError, match="no expert load recorded"):
        ctl.rebalance(None)
    ctl.rebalance(hot_placement())
    with pytest.raises(EplbError, match="already running"):
        ctl.rebalance(hot_placement())


def test_dense_models_have_nothing_to_record():
    ctl = EplbController(None, [], world_size=1, slice_s=10.0)
    assert not ctl.enabled and ctl.step_control(now=0.0) == EplbControl()
    with pytest.raises(EplbError):
        ctl.record()


def test_automatic_rebalance_plans_from_the_recent_slices():
    ctl = controller(interval_s=20.0, live_mode="redundant")
    start = ctl._current_start
    hot = [[100, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 90]]
    ctl.on_counts(hot)
    ctl.tick(start + 10.5)  # one slice closed, not yet time to rebalance
    assert not ctl.busy
    ctl.on_counts(hot)
    ctl.tick(start + 20.5)
    assert ctl.busy
    control = ctl.idle_control()
    planned = ExpertPlacement.from_dict(control.eplb.placement.to_dict())
    assert len(planned.replicas(1)[0]) == 2 and len(planned.replicas(2)[7]) == 2  # the hot experts
    assert ctl.status().rounds >= 1


def _acked_round(ctl: EplbController) -> list[EplbPhase]:
    """Drive one round through its phases with both ranks acking; the commands sent."""
    sent = [ctl.idle_control().eplb.phase]
    for kind in (WorkerEventKind.EPLB_PREFETCHED, WorkerEventKind.EPLB_LOADED):
        for rank in (0, 1):
            ctl.on_event(rank, kind, "")
        sent.append(ctl.idle_control().eplb.phase)
    return sent


def test_primaries_move_in_rounds_each_keeping_every_expert_a_copy():
    ctl = controller()
    target = ExpertPlacement.default(SHAPE, LAYERS)
    for layer in LAYERS:  # the two ranks trade experts 0 and 4 (primaries), expert 0 also replicated
        target.layers[layer][0], target.layers[layer][5], target.layers[layer][9] = 4, 0, 0
    ctl.rebalance(target.to_dict())
    rounds = ctl.status().rounds
    assert rounds > 1 and ctl.status().round == 1
    before = ctl.placement
    for number in range(1, rounds + 1):
        assert ctl.status().round == number
        assert _acked_round(ctl) == [EplbPhase.PREFETCH, EplbPhase.DISABLE_AND_LOAD, EplbPhase.ENABLE]
        for layer in LAYERS:
            check_every_expert_served(before.layers[layer], ctl.placement.layers[layer])
        before = ctl.placement
    assert not ctl.busy and ctl.num_reconfigurations == 1
    assert ctl.placement.layers == target.layers and ctl.status().rounds == 0


def test_a_round_failed_while_loading_leaves_the_rounds_done_and_its_slots_empty():
    ctl = controller()
    target = ExpertPlacement.default(SHAPE, LAYERS)
    for layer in LAYERS:
        target.layers[layer][0], target.layers[layer][5] = 4, 0
    ctl.rebalance(target.to_dict())
    _acked_round(ctl)  # round 1 done
    done = ctl.placement
    ctl.idle_control()  # round 2's prefetch
    ctl.on_event(0, WorkerEventKind.EPLB_PREFETCHED, "")
    ctl.on_event(1, WorkerEventKind.EPLB_PREFETCHED, "")
    ctl.idle_control()  # its load
    ctl.on_event(1, WorkerEventKind.EPLB_FAILED, "OSError: disk")
    assert ctl.idle_control() == EplbControl(EplbCommand(EplbPhase.ABORT))
    for layer in LAYERS:  # the slots round 2 was writing are empty, every expert still has a slot
        changed = [slot for slot, (a, b) in enumerate(zip(done.layers[layer], ctl.placement.layers[layer])) if a != b]
        assert changed and all(ctl.placement.layers[layer][slot] == -1 for slot in changed)
    assert not ctl.busy and "rank 1" in ctl.status().last_error


def test_a_planned_rebalance_keeps_primaries_only_in_redundant_mode_and_full_balances_better():
    load = [[100, 90, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 80, 90]]  # two hot experts on one rank in each layer
    plans = {}
    for mode in ("full", "redundant"):
        ctl = controller(live_mode=mode)
        ctl.on_counts(load)
        plans[mode] = ctl.rebalance(None)
    redundant, full = plans["redundant"], plans["full"]
    assert redundant.layers[1][:4] == [0, 1, 2, 3] and redundant.layers[1][5:9] == [4, 5, 6, 7]
    default = ExpertPlacement.default(SHAPE, LAYERS)
    for position, layer in enumerate(LAYERS):
        counts = [load[position]]
        assert balancedness(full.layers[layer], counts, 2) > balancedness(redundant.layers[layer], counts, 2)
        # renumbered to the slots in use: at least half the slots keep their expert
        assert sum(a == b for a, b in zip(full.layers[layer], default.layers[layer])) >= 5


def test_an_automatic_rebalance_every_slice_plans_from_the_slice_just_closed():
    # the window is the last slices closed: the one under way has only begun when the rebalance is due
    ctl = controller(interval_s=10.0, live_mode="redundant")
    start = ctl._current_start
    ctl.on_counts([[100, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 90]])
    ctl.tick(start + 10.5)
    assert ctl.busy
    planned = ExpertPlacement.from_dict(ctl.idle_control().eplb.placement.to_dict())
    assert len(planned.replicas(1)[0]) == 2 and len(planned.replicas(2)[7]) == 2


def test_a_placement_that_balances_the_load_stays_until_the_load_moves():
    ctl = controller(interval_s=10.0, rebalance_below=0.95)
    start = ctl._current_start
    ctl.on_counts([[10] * 8, [10] * 8])  # the default placement balances an even load: 1.0
    ctl.tick(start + 10.5)
    assert not ctl.busy and ctl.num_reconfigurations == 0
    ctl.on_counts([[100, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 90]])  # the next slice is skewed
    ctl.tick(start + 20.5)
    assert ctl.busy
