"""The scheduler under speculative decoding, driven by a fake worker that verifies drafts.

The fake worker of test_scheduler.py is extended with drafts: a decode scheduled for 1 + j
tokens writes the KV fingerprints of its last token and j drafts, of which the first few are
right (the oracle's continuation) and the rest wrong, and reports the accepted drafts followed
by the next true token. Rejected drafts leave wrong fingerprints in their slots; the worker's
check of every context slot before computing proves they are never read as context. It also
checks that each step's table holds the slots the MTP layer writes when it drafts k > 1.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest

from meshserve.config import SchedulerConfig
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.scheduler import Scheduler
from meshserve.core.spec_controller import MEASURE, SpeculationController
from meshserve.wire.worker import ModelRunnerOutput, SchedulerOutput
from tests.core.test_scheduler import (
    BS,
    VOCAB,
    FakeWorker,
    _Held,
    check_step,
    collect,
    expected_outputs,
    make_request,
    next_token,
    prompt_of,
)


def make_spec_scheduler(k: int, num_blocks: int = 64, **cfg) -> Scheduler:
    config = SchedulerConfig(**{"max_model_len": 4096, **cfg})
    return Scheduler(config, KVCacheManager(num_blocks, BS, enable_prefix_caching=True), num_speculative_tokens=k)


@dataclass
class DraftingWorker(FakeWorker):
    """`num_right[req_id]`: how many of a step's drafts are right (default: all)."""

    num_right: dict[str, int] = field(default_factory=dict)
    drafts_verified: int = 0
    max_unseen_accepted: int = 0  # overlapped steps: drafts the master may not know were accepted
    scheduled_behind: int = 0  # decodes scheduled while a verification of theirs was in flight

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        for req_id in sched.finished_req_ids:
            del self.held[req_id]
        for new in sched.new_reqs:
            self.held[new.req_id] = _Held(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
        for cached in sched.cached_reqs:
            held = self.held[cached.req_id]
            # overlapped: the master has not seen what the verification in flight accepted
            assert held.num_computed - self.max_unseen_accepted <= cached.num_computed_tokens <= held.num_computed
            held.blocks += cached.new_block_ids
        out = ModelRunnerOutput(step_id=sched.step_id)
        for req_id, n in sched.num_scheduled_tokens.items():
            held = self.held[req_id]
            start = held.num_computed
            decode = start == len(held.tokens) - 1
            drafts = self._drafts(req_id, held.tokens, n - 1) if decode else []
            assert decode or start + n <= len(held.tokens), "scheduled tokens the worker does not know"
            history = held.tokens + drafts if decode else held.tokens[:start + n]
            end = start + (1 + len(drafts) if decode else n)
            self.write_kv(req_id, held, history, start, end)
            if not decode:
                held.num_computed = end
                if end < len(held.tokens):
                    continue
                tokens = [next_token(held.tokens)]
            else:
                tokens = self._accepted(held.tokens, drafts)
                out.num_drafts[req_id] = len(drafts)
                self.drafts_verified += len(drafts)
                held.num_computed = start + len(tokens)
            held.tokens.extend(tokens)
            out.sampled[req_id] = tokens
            self.samples[req_id] += len(tokens)
            if sched.num_draft_tokens > 1:  # the MTP layer writes k - 1 positions past the last accepted one
                last = held.num_computed - 1 + sched.num_draft_tokens - 1
                assert len(held.blocks) * self.block_size > last or last >= 4096, "no slot for the MTP drafts"
        return out

    def _drafts(self, req_id: str, tokens: list[int], j: int) -> list[int]:
        truth = expected_outputs(tokens, j)
        right = min(j, self.num_right.get(req_id, j))
        return truth[:right] + [(t + 1) % VOCAB for t in truth[right:]]

    @staticmethod
    def _accepted(tokens: list[int], drafts: list[int]) -> list[int]:
        truth = expected_outputs(tokens, len(drafts) + 1)
        a = 0
        while a < len(drafts) and drafts[a] == truth[a]:
            a += 1
        return truth[:a + 1]



def run_spec(sched: Scheduler, worker: DraftingWorker, max_steps: int = 3000):
    outputs, finish = {}, {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs, finish
        out = sched.schedule()
        check_step(sched, out)
        collect(sched.update_from_output(out, worker.execute(out)), outputs, finish)
    raise AssertionError("requests did not finish")


def run_spec_overlapped(sched: Scheduler, worker: DraftingWorker, max_steps: int = 3000):
    """As the master runs it: step n + 1 is scheduled (and executed) before step n's output is applied."""
    worker.max_unseen_accepted = sched.num_speculative_tokens
    outputs, finish = {}, {}
    in_flight: deque = deque()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not in_flight:
            return outputs, finish
        behind = {req_id for step, _ in in_flight for req_id in step.num_scheduled_tokens
                   if (req := sched.get_request(req_id)) is not None and req.num_unverified_drafts}
        out = sched.schedule()
        check_step(sched, out)
        worker.scheduled_behind += len(behind & out.num_scheduled_tokens.keys())
        if not out.is_empty:
            in_flight.append((out, worker.execute(out)))
        assert in_flight, "nothing scheduled and nothing in flight"
        if len(in_flight) == 2 or out.is_empty:
            done, result = in_flight.popleft()
            collect(sched.update_from_output(done, result), outputs, finish)
    raise AssertionError("requests did not finish")


RUNNERS = [run_spec, run_spec_overlapped]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_outputs_match_the_oracle_whatever_is_accepted(k, runner):
    sched = make_spec_scheduler(k, max_num_batched_tokens=16, max_num_seqs=4)
    worker = DraftingWorker(num_right={"r0": 0, "r1": 1, "r3": 0})  # r2, r4, r5: every draft right
    reqs = [make_request(f"r{i}", prompt_of(i, 3 + 7 * i), max_tokens=5 + 3 * i) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    outputs, finish = runner(sched, worker)
    for r in reqs:
        assert outputs[r.req_id] == expected_outputs(r.prompt_token_ids, r.sampling_params.max_tokens)
        assert finish[r.req_id].finish_reason == "length"
    assert sched.kv_manager.usage == 0.0  # rejected drafts' slots went back with their requests
    stats = sched.stats()
    assert stats.spec_verify_steps > 0 and stats.spec_tokens == stats.spec_verify_steps + sum(stats.spec_accepted)
    assert sum(stats.spec_drafted) == worker.drafts_verified
    # a request whose drafts are all right advances k + 1 tokens per verifying step
    steps_of_r5 = [s for s in worker.steps if s.num_scheduled_tokens.get("r5", 0) == 1 + k]
    assert len(steps_of_r5) < reqs[5].sampling_params.max_tokens - 1
    if runner is run_spec_overlapped:  # verifications did overlap the next step
        assert worker.scheduled_behind > 0


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_stop_token_in_the_middle_of_the_accepted_drafts_drops_the_rest(runner):
    prompt = prompt_of(3, 9)
    truth = expected_outputs(prompt, 12)
    stop = truth[5]
    assert stop not in truth[:5]
    sched = make_spec_scheduler(3)
    worker = DraftingWorker()
    sched.add_request(make_request("a", prompt, max_tokens=12, eos=[stop]))
    outputs, finish = runner(sched, worker)
    assert outputs["a"] == truth[:6]
    assert finish["a"].finish_reason == "stop" and finish["a"].stop_reason == stop
    assert worker.samples["a"] > 6  # the worker produced tokens past the stop; none was emitted


@pytest.mark.parametrize("runner", RUNNERS)
def test_drafts_never_run_past_max_tokens_or_the_budget(runner):
    sched = make_spec_scheduler(3, max_num_batched_tokens=6, max_num_seqs=4)
    worker = DraftingWorker()
    reqs = [make_request(f"r{i}", prompt_of(i, 2), max_tokens=3 + i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    outputs, _ = runner(sched, worker)
    for r in reqs:
        assert outputs[r.req_id] == expected_outputs(r.prompt_token_ids, r.sampling_params.max_tokens)
        # nothing was verified that could not become an output
        assert worker.samples[r.req_id] == r.sampling_params.max_tokens
    assert all(s.total_num_scheduled_tokens <= 6 for s in worker.steps)


@pytest.mark.parametrize("runner", RUNNERS)
def test_preemption_and_prefix_hits_under_speculation(runner):
    sched = make_spec_scheduler(2, num_blocks=14, max_num_batched_tokens=32)
    worker = DraftingWorker(num_right={"b": 1})
    shared = prompt_of(7, 12)
    reqs = [make_request("a", shared + [1], max_tokens=20), make_request("b", shared + [2], max_tokens=20),
            make_request("c", prompt_of(8, 10), max_tokens=20)]
    for r in reqs:
        sched.add_request(r)
    outputs, _ = runner(sched, worker)
    for r in reqs:
        assert outputs[r.req_id] == expected_outputs(r.prompt_token_ids, 20)
    assert sched.num_preemptions > 0
    again = make_request("a2", shared + [1], max_tokens=4)
    sched.add_request(again)
    outputs, _ = runner(sched, worker)
    assert outputs["a2"] == expected_outputs(again.prompt_token_ids, 4)
    assert sched.stats().prefix_cache_hits >= 12
    assert sched.kv_manager.usage == 0.0


def test_no_drafts_are_verified_while_the_master_says_not_to_speculate():
    sched = make_spec_scheduler(2)
    sched.speculating = False
    worker = DraftingWorker()
    sched.add_request(make_request("a", prompt_of(1, 5), max_tokens=6))
    outputs, _ = run_spec(sched, worker)
    assert outputs["a"] == expected_outputs(prompt_of(1, 5), 6)
    assert worker.drafts_verified == 0 and all(s.num_draft_tokens == 0 for s in worker.steps)


def test_a_worker_reporting_more_tokens_than_drafts_fails_the_request():
    sched = make_spec_scheduler(1)
    sched.add_request(make_request("a", prompt_of(1, 4)))
    step = sched.schedule()
    sched.update_from_output(step, ModelRunnerOutput(step_id=step.step_id, sampled={"a": [5]}))
    step = sched.schedule()
    assert step.num_scheduled_tokens["a"] == 2
    (delta,) = sched.update_from_output(step, ModelRunnerOutput(step_id=step.step_id, sampled={"a": [5, 6, 7]},
                                                                num_drafts={"a": 1}))
    assert delta.finish_reason == "error" and "after 1 drafts" in delta.error


# ---------------------------------------------------------------- when to draft
def test_a_fixed_limit_drafts_up_to_that_batch():
    assert SpeculationController(0).decide(512) == (True, True)
    controller = SpeculationController(8)
    assert controller.decide(8) == (True, True)
    assert controller.decide(9) == (False, False)  # no drafts and no MTP layer where it does not pay


def test_the_measuring_controller_drafts_where_it_pays_and_keeps_checking():
    controller = SpeculationController(MEASURE)
    decisions = {1: [], 64: []}
    drafted_before = {1: False, 64: False}
    for _ in range(200):
        for batch, (with_drafts, without) in {1: (150.0, 100.0), 64: (800.0, 1000.0)}.items():
            drafting, catch_up = controller.decide(batch)
            assert catch_up or not drafting
            decisions[batch].append(drafting)
            # a step verifies drafts only when the step before it drafted; a transition step is slow either way
            verified = drafted_before[batch]
            steady = drafting == verified
            rate = (with_drafts if drafting else without) if steady else 50.0
            controller.observe(batch, drafting, verified, int(rate), 1.0)
            drafted_before[batch] = drafting
    assert sum(decisions[1][-100:]) > 90  # drafts at batch 1 ...
    assert sum(decisions[64][-100:]) < 10  # ... not at batch 64, but still tries now and then
    assert 0 < sum(decisions[64][-100:])
    assert controller.drafting_buckets() == {1: True, 64: False}
