"""Scheduler driven by a fake worker.

The fake worker keeps each request's tokens the way a real one does (it
fills placeholders from its own samples) and a fake KV cache: every slot holds
a fingerprint of the token history up to that position. Before computing it
checks that every context slot still holds the right fingerprint, so a wrong
block table, a bad prefix hit or a block reused while still referenced fails
the test. Its "model" samples a token that is a function of the whole history,
so the oracle for any request is to run that function from the prompt.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import pytest

from meshserve.config import SchedulerConfig
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.request import Request, RequestStatus
from meshserve.core.scheduler import Scheduler
from meshserve.wire.client import AddRequest, RequestDelta
from meshserve.wire.errors import QueueFullError, RequestTooLongError
from meshserve.wire.sampling_params import SamplingParams
from meshserve.wire.worker import ModelRunnerOutput, SampleLogprobs, SchedulerOutput

BS = 4
VOCAB = 997
_MOD = (1 << 61) - 1


def fingerprints(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % _MOD
        out.append(h)
    return out


def next_token(history: list[int]) -> int:
    return (fingerprints(history)[-1] >> 11) % VOCAB


def expected_outputs(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


@dataclass
class _Held:
    tokens: list[int]
    blocks: list[int]
    num_computed: int


@dataclass
class FakeWorker:
    block_size: int = BS
    kv: dict[int, int] = field(default_factory=dict)
    held: dict[str, _Held] = field(default_factory=dict)
    new_reqs_seen: list = field(default_factory=list)  # (step_id, NewRequestData)
    samples: Counter = field(default_factory=Counter)  # tokens sampled per request
    steps: list[SchedulerOutput] = field(default_factory=list)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        for req_id in sched.finished_req_ids:
            assert req_id in self.held, f"told to drop {req_id}, which it does not hold"
            del self.held[req_id]
        for new in sched.new_reqs:
            assert new.req_id not in self.held, f"{new.req_id} sent as new while held"
            self.held[new.req_id] = _Held(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            self.new_reqs_seen.append((sched.step_id, new))
        for cached in sched.cached_reqs:
            held = self.held[cached.req_id]
            assert cached.num_computed_tokens == held.num_computed
            held.blocks += cached.new_block_ids
        assert set(sched.num_scheduled_tokens) == {r.req_id for r in sched.new_reqs + sched.cached_reqs}

        sampled = {}
        for req_id, n in sched.num_scheduled_tokens.items():
            held = self.held[req_id]
            start, end = held.num_computed, held.num_computed + n
            assert n > 0 and end <= len(held.tokens), "scheduled tokens the worker does not know"
            self.write_kv(req_id, held, held.tokens, start, end)
            held.num_computed = end
            if end == len(held.tokens):
                token = next_token(held.tokens)
                held.tokens.append(token)
                sampled[req_id] = [token]
                self.samples[req_id] += 1
        return ModelRunnerOutput(step_id=sched.step_id, sampled=sampled)

    def write_kv(self, req_id: str, held: _Held, history: list[int], start: int, end: int) -> None:
        """Check the KV fingerprints of positions [0, start) (the context) and write those of [start, end)."""
        assert len(held.blocks) * self.block_size >= end, "block table too short"
        fps = fingerprints(history[:end])
        for pos in range(end):
            slot = held.blocks[pos // self.block_size] * self.block_size + pos % self.block_size
            if pos < start:
                assert self.kv.get(slot) == fps[pos], f"{req_id}: KV at position {pos} is wrong"
            else:
                self.kv[slot] = fps[pos]


def make_request(req_id: str, prompt: list[int], max_tokens: int | None = 8, priority: int = 0,
                 arrival_time: float = 0.0, eos: list[int] | None = None, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(req_id, prompt, sp, arrival_time=arrival_time, priority=priority, eos_token_ids=eos)


def make_scheduler(num_blocks: int = 64, prefix_caching: bool = True, connectors=(), **cfg) -> Scheduler:
    config = SchedulerConfig(**{"max_model_len": 4096, **cfg})
    return Scheduler(config, KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching), connectors)


def prompt_of(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % VOCAB for i in range(n)]


@dataclass
class Run:
    outputs: dict[str, list[int]]
    finish: dict[str, RequestDelta]
    steps: list[SchedulerOutput]


def collect(deltas: list[RequestDelta], outputs: dict, finish: dict) -> None:
    for d in deltas:
        assert d.req_id not in finish, f"{d.req_id} got output after it finished"
        outputs.setdefault(d.req_id, []).extend(d.new_token_ids)
        if d.finish_reason is not None:
            finish[d.req_id] = d


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
    assert sched.num_running <= cfg.max_num_seqs


def run_sync(sched: Scheduler, ex: FakeWorker, max_steps: int = 2000) -> Run:
    outputs, finish = {}, {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return Run(outputs, finish, ex.steps)
        out = sched.schedule()
        check_step(sched, out)
        assert not out.is_empty, "nothing scheduled while requests are unfinished"
        collect(sched.update_from_output(out, ex.execute(out)), outputs, finish)
    raise AssertionError("requests did not finish")


def run_overlapped(sched: Scheduler, ex: FakeWorker, max_steps: int = 2000) -> Run:
    """Schedule step n+1 before step n's output is applied (one step in flight)."""
    outputs, finish = {}, {}
    in_flight: deque = deque()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not in_flight:
            return Run(outputs, finish, ex.steps)
        out = sched.schedule()
        check_step(sched, out)
        if not out.is_empty:
            in_flight.append((out, ex.execute(out)))
        elif not in_flight:
            raise AssertionError("nothing scheduled and nothing in flight")
        if len(in_flight) == 2 or (out.is_empty and in_flight):
            done, result = in_flight.popleft()
            collect(sched.update_from_output(done, result), outputs, finish)
    raise AssertionError("requests did not finish")


def assert_all_match_oracle(requests: list[Request], run: Run) -> None:
    for req in requests:
        n = req.sampling_params.max_tokens
        assert run.outputs[req.req_id] == expected_outputs(req.prompt_token_ids, n), req.req_id
        assert run.finish[req.req_id].finish_reason == "length"


# ---------------------------------------------------------------- batching
@pytest.mark.parametrize("runner", [run_sync, run_overlapped])
def test_mixed_workload_respects_budget_and_matches_oracle(runner):
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=12, max_num_seqs=3)
    ex = FakeWorker()
    reqs = [make_request(f"r{i}", prompt_of(i, 3 + 5 * i), max_tokens=4 + i) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    run = runner(sched, ex)
    assert_all_match_oracle(reqs, run)
    assert max(s.total_num_scheduled_tokens for s in run.steps) == 12  # the budget is used, not exceeded
    assert max(len(s.num_scheduled_tokens) for s in run.steps) == 3
    assert sched.kv_manager.usage == 0.0 and sched.num_running == sched.num_waiting == 0
    # every token sampled by the worker became an output: none scheduled beyond max_tokens
    assert all(ex.samples[r.req_id] == r.sampling_params.max_tokens for r in reqs)


def test_chunked_prefill_splits_a_long_prompt_then_decodes():
    sched = make_scheduler(max_num_batched_tokens=16)
    ex = FakeWorker()
    req = make_request("long", prompt_of(1, 50), max_tokens=3)
    sched.add_request(req)
    run = run_sync(sched, ex)
    assert [s.num_scheduled_tokens["long"] for s in run.steps] == [16, 16, 16, 2, 1, 1]
    assert [s.new_reqs[0].req_id for s in run.steps if s.new_reqs] == ["long"]  # sent once
    assert [c.num_computed_tokens for s in run.steps[1:] for c in s.cached_reqs] == [16, 32, 48, 50, 51]
    assert run.outputs["long"] == expected_outputs(req.prompt_token_ids, 3)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    ex = FakeWorker()
    sched.add_request(make_request("a", prompt_of(1, 6), max_tokens=2))
    sched.add_request(make_request("b", prompt_of(2, 6), max_tokens=2))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 6}  # b's 6 tokens do not fit the 4 left
    sched.update_from_output(first, ex.execute(first))
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 6}
    with pytest.raises(RequestTooLongError, match="max_num_batched_tokens"):
        sched.add_request(make_request("c", prompt_of(3, 11)))


def test_decode_and_prefill_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=8)
    ex = FakeWorker()
    sched.add_request(make_request("a", prompt_of(1, 5), max_tokens=6))
    first = sched.schedule()
    sched.update_from_output(first, ex.execute(first))
    sched.add_request(make_request("b", prompt_of(2, 20), max_tokens=2))
    step = sched.schedule()
    assert step.num_scheduled_tokens == {"a": 1, "b": 7}  # decode first, then the chunk the budget leaves
    assert [c.req_id for c in step.cached_reqs] == ["a"] and [n.req_id for n in step.new_reqs] == ["b"]


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    ex = FakeWorker()
    reqs = [make_request(f"r{i}", prompt_of(i, 4), max_tokens=3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    first = sched.schedule()
    assert list(first.num_scheduled_tokens) == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 3
    sched.update_from_output(first, ex.execute(first))
    run = run_sync(sched, ex)
    assert max(len(s.num_scheduled_tokens) for s in run.steps) == 2
    assert_all_match_oracle(reqs[2:], run)


def test_priority_order_then_fcfs():
    sched = make_scheduler(max_num_seqs=1)
    ex = FakeWorker()
    spec = [("low-a", 5), ("high-a", 0), ("mid", 2), ("high-b", 0), ("low-b", 5)]
    for i, (name, prio) in enumerate(spec):
        sched.add_request(make_request(name, prompt_of(i, 3), max_tokens=2, priority=prio, arrival_time=1.0))
    run = run_sync(sched, ex)
    first_scheduled = [n.req_id for _, n in ex.new_reqs_seen]
    assert first_scheduled == ["high-a", "high-b", "mid", "low-a", "low-b"]
    assert set(run.finish) == {name for name, _ in spec}


def test_fcfs_follows_arrival_time():
    sched = make_scheduler(max_num_seqs=1)
    ex = FakeWorker()
    sched.add_request(make_request("late", prompt_of(1, 3), max_tokens=1, arrival_time=20.0))
    sched.add_request(make_request("early", prompt_of(2, 3), max_tokens=1, arrival_time=10.0))
    run_sync(sched, ex)
    assert [n.req_id for _, n in ex.new_reqs_seen] == ["early", "late"]


# ---------------------------------------------------------------- preemption
@pytest.mark.parametrize("runner", [run_sync, run_overlapped])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_when_blocks_run_out_and_resume(runner, prefix_caching):
    # 3 requests that each grow to 5 blocks, in a pool of 10
    sched = make_scheduler(num_blocks=10, prefix_caching=prefix_caching, max_num_batched_tokens=32)
    ex = FakeWorker()
    reqs = [make_request(f"r{i}", prompt_of(i, 6), max_tokens=14, arrival_time=float(i)) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run = runner(sched, ex)
    assert_all_match_oracle(reqs, run)
    assert sched.stats().num_preemptions > 0

    sent = Counter(n.req_id for _, n in ex.new_reqs_seen)
    resumed = [n for _, n in ex.new_reqs_seen if sent[n.req_id] > 1 and len(n.token_ids) > 6]
    assert resumed, "a request was resumed after decoding"
    for new in resumed:  # recomputed from prompt + the outputs so far
        req = next(r for r in reqs if r.req_id == new.req_id)
        full = req.prompt_token_ids + expected_outputs(req.prompt_token_ids, 14)
        assert new.token_ids == full[: len(new.token_ids)]
        assert new.num_prompt_tokens == 6
    # the latest arrival is the one preempted first
    first_victim = next(n.req_id for _, n in ex.new_reqs_seen if sent[n.req_id] > 1)
    assert first_victim == "r2"
    assert sched.kv_manager.usage == 0.0


def test_a_high_priority_arrival_preempts_a_low_priority_request():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    ex = FakeWorker()
    low = make_request("low", prompt_of(1, 15), max_tokens=4, priority=5)
    sched.add_request(low)
    step = sched.schedule()
    sched.update_from_output(step, ex.execute(step))
    high = make_request("high", prompt_of(2, 11), max_tokens=2, priority=0, arrival_time=9.0)
    sched.add_request(high)
    step = sched.schedule()
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert step.num_scheduled_tokens == {"high": 11}
    assert step.finished_req_ids == ["low"]
    (first_delta,) = sched.update_from_output(step, ex.execute(step))
    run = run_sync(sched, ex)
    assert first_delta.new_token_ids + run.outputs["high"] == expected_outputs(high.prompt_token_ids, 2)
    # low resumes from its prompt and first output, and hits its own cached blocks
    resumed = [n for _, n in ex.new_reqs_seen if n.req_id == "low"][1]
    assert resumed.token_ids == low.prompt_token_ids + low.output_token_ids[:1]
    assert resumed.num_computed_tokens == 12
    assert low.output_token_ids == expected_outputs(low.prompt_token_ids, 4)


def test_a_stale_step_does_not_touch_a_resumed_request():
    # three steps in flight: L chunks (1), is preempted by H (2), resumes (3); then step 1 returns
    sched = make_scheduler(num_blocks=13, max_num_batched_tokens=32)
    ex = FakeWorker()
    low = make_request("low", prompt_of(1, 40), max_tokens=2, priority=5)
    sched.add_request(low)
    step1 = sched.schedule()
    out1 = ex.execute(step1)
    assert step1.num_scheduled_tokens == {"low": 32}
    high = make_request("high", prompt_of(2, 16), max_tokens=3, priority=0)
    sched.add_request(high)
    step2 = sched.schedule()
    out2 = ex.execute(step2)
    assert step2.num_scheduled_tokens == {"high": 16} and low.status is RequestStatus.PREEMPTED
    step3 = sched.schedule()
    out3 = ex.execute(step3)
    assert step3.num_scheduled_tokens == {"high": 1, "low": 31}
    sched.update_from_output(step1, out1)
    # low's new blocks are still being computed by step 3: they must not be offered as a prefix
    assert sched.kv_manager.match_by_prefix(low.prompt_token_ids, record=False) == []
    sched.update_from_output(step2, out2)
    sched.update_from_output(step3, out3)
    run = run_overlapped(sched, ex)
    assert low.output_token_ids == expected_outputs(low.prompt_token_ids, 2)
    assert high.output_token_ids == expected_outputs(high.prompt_token_ids, 3)
    assert run.finish["low"].finish_reason == "length"


def test_an_equal_priority_arrival_waits_instead_of_preempting():
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    ex = FakeWorker()
    first = make_request("first", prompt_of(1, 15), max_tokens=4, arrival_time=1.0)
    sched.add_request(first)
    step = sched.schedule()
    sched.update_from_output(step, ex.execute(step))
    sched.add_request(make_request("second", prompt_of(2, 8), max_tokens=2, arrival_time=2.0))
    step = sched.schedule()
    assert step.num_scheduled_tokens == {"first": 1}
    assert first.status is RequestStatus.RUNNING and sched.num_waiting == 1
    assert sched.stats().num_preemptions == 0


# ---------------------------------------------------------------- prefix cache
def test_prefix_hit_skips_the_cached_blocks():
    sched = make_scheduler()
    ex = FakeWorker()
    prompt = prompt_of(7, 14)  # 3 full blocks + 2 tokens
    sched.add_request(make_request("a", prompt, max_tokens=3))
    run_a = run_sync(sched, ex)
    sched.add_request(make_request("b", prompt, max_tokens=3))
    step = sched.schedule()
    (new,) = step.new_reqs
    assert new.num_computed_tokens == 12 and step.num_scheduled_tokens == {"b": 2}
    delta = sched.update_from_output(step, ex.execute(step))[0]
    assert delta.num_cached_tokens == 12 and delta.num_prompt_tokens == 14
    run_b = run_sync(sched, ex)
    assert run_a.outputs["a"] == delta.new_token_ids + run_b.outputs["b"]
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (28, 12)


def test_a_full_prefix_hit_still_computes_the_last_token():
    sched = make_scheduler()
    ex = FakeWorker()
    prompt = prompt_of(3, 12)  # exactly 3 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_sync(sched, ex)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    step = sched.schedule()
    assert step.new_reqs[0].num_computed_tokens == 8 and step.num_scheduled_tokens == {"b": 4}
    assert sched.update_from_output(step, ex.execute(step))[0].new_token_ids == expected_outputs(prompt, 1)


def test_generated_blocks_are_cached_for_a_follow_up_turn():
    sched = make_scheduler()
    ex = FakeWorker()
    prompt = prompt_of(5, 6)
    req = make_request("turn1", prompt, max_tokens=10)
    sched.add_request(req)
    run_sync(sched, ex)
    follow_up = req.all_token_ids + [1, 2, 3]  # 19 tokens: the first 16 were computed by turn 1
    sched.add_request(make_request("turn2", follow_up, max_tokens=2))
    step = sched.schedule()
    assert step.new_reqs[0].num_computed_tokens == 12  # the block holding the last output was never computed
    sched.update_from_output(step, ex.execute(step))
    run_sync(sched, ex)


# ---------------------------------------------------------------- abort, finish, errors
def test_abort_frees_blocks_and_tells_the_worker():
    sched = make_scheduler(num_blocks=16)
    ex = FakeWorker()
    sched.add_request(make_request("a", prompt_of(1, 9), max_tokens=8))
    sched.add_request(make_request("b", prompt_of(2, 9), max_tokens=8))
    step = sched.schedule()
    sched.update_from_output(step, ex.execute(step))
    used = sched.kv_manager.usage
    sched.add_request(make_request("queued", prompt_of(3, 5)))
    deltas = sched.abort_requests(["a", "queued", "unknown"])
    assert [(d.req_id, d.finish_reason) for d in deltas] == [("a", "abort"), ("queued", "abort")]
    assert sched.kv_manager.usage == pytest.approx(used / 2)
    assert sched.num_running == 1 and sched.num_waiting == 0
    step = sched.schedule()
    assert step.finished_req_ids == ["a"] and list(step.num_scheduled_tokens) == ["b"]
    ex.execute(step)
    sched.abort_requests(["b"])
    assert sched.kv_manager.usage == 0.0 and not sched.has_unfinished_requests()


def test_finished_req_ids_lists_each_dropped_request_once():
    sched = make_scheduler()
    ex = FakeWorker()
    sched.add_request(make_request("short", prompt_of(1, 4), max_tokens=1))
    sched.add_request(make_request("long", prompt_of(2, 4), max_tokens=4))
    step = sched.schedule()
    deltas = sched.update_from_output(step, ex.execute(step))
    assert [d.finish_reason for d in deltas] == ["length", None]
    drops = []
    for _ in range(3):
        step = sched.schedule()
        drops.append(step.finished_req_ids)
        sched.update_from_output(step, ex.execute(step))
    assert drops == [["short"], [], []]
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("next", prompt_of(3, 4), max_tokens=1))
    assert sched.schedule().finished_req_ids == ["long"]  # held back until a step reaches the worker


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_overlapped_steps_schedule_the_placeholder(max_tokens):
    sched = make_scheduler()
    ex = FakeWorker()
    req = make_request("a", prompt_of(1, 6), max_tokens=max_tokens)
    sched.add_request(req)
    first = sched.schedule()
    out1 = ex.execute(first)
    assert req.num_output_placeholders == 1 and req.num_computed_tokens == 6
    second = sched.schedule()  # before step 1's output is known
    if max_tokens == 1:
        assert second.is_empty  # its only token is already being produced
    else:
        assert second.num_scheduled_tokens == {"a": 1}
        assert second.cached_reqs[0].num_computed_tokens == 6  # the placeholder is the input
        assert req.num_output_placeholders == 2
    out2 = ex.execute(second) if not second.is_empty else None
    d1 = sched.update_from_output(first, out1)
    assert d1[0].new_token_ids == expected_outputs(req.prompt_token_ids, 1)
    assert req.num_output_placeholders == (0 if max_tokens == 1 else 1)
    if out2 is not None:
        sched.update_from_output(second, out2)
    run_overlapped(sched, ex)
    assert req.output_token_ids == expected_outputs(req.prompt_token_ids, max_tokens)
    assert ex.samples["a"] == max_tokens and req.finish_reason == "length"  # never scheduled past max_tokens


def test_overlapped_output_after_a_stop_is_ignored():
    prompt = prompt_of(4, 5)
    oracle = expected_outputs(prompt, 10)
    k = next(i for i in range(2, 10) if oracle[i] not in oracle[:i])
    sched = make_scheduler()
    ex = FakeWorker()
    sched.add_request(make_request("a", prompt, max_tokens=10, eos=[oracle[k]]))
    sched.add_request(make_request("b", prompt_of(9, 5), max_tokens=10))
    run = run_overlapped(sched, ex)
    assert run.outputs["a"] == oracle[: k + 1]
    assert run.finish["a"].finish_reason == "stop" and run.finish["a"].stop_reason == oracle[k]
    assert ex.samples["a"] == k + 2  # the step in flight when it stopped sampled one more, unused
    assert run.outputs["b"] == expected_outputs(prompt_of(9, 5), 10)
    assert sum(s.finished_req_ids.count("a") for s in run.steps) == 1


def test_stop_conditions():
    prompt = prompt_of(2, 5)
    oracle = expected_outputs(prompt, 12)
    k = next(i for i in range(1, 12) if oracle[i] not in oracle[:i])
    eos = oracle[k]
    cases = {
        "eos": (dict(eos=[eos]), k + 1, "stop", eos),
        "ignore_eos": (dict(eos=[eos], ignore_eos=True), 12, "length", None),
        "min_tokens": (dict(eos=[eos], min_tokens=k + 2), 12, "length", None),
        "stop_token": (dict(stop_token_ids=[eos]), k + 1, "stop", eos),
    }
    sched = make_scheduler()
    ex = FakeWorker()
    for name, (kw, _, _, _) in cases.items():
        sched.add_request(make_request(name, prompt, max_tokens=12, **kw))
    run = run_sync(sched, ex)
    for name, (_, n, reason, stop_reason) in cases.items():
        assert run.outputs[name] == oracle[:n], name
        assert (run.finish[name].finish_reason, run.finish[name].stop_reason) == (reason, stop_reason), name


def test_max_model_len_ends_a_request_without_max_tokens():
    sched = make_scheduler(max_model_len=20)
    ex = FakeWorker()
    req = make_request("a", prompt_of(1, 14), max_tokens=None)
    sched.add_request(req)
    run = run_overlapped(sched, ex)
    assert run.outputs["a"] == expected_outputs(req.prompt_token_ids, 6)
    assert run.finish["a"].finish_reason == "length" and ex.samples["a"] == 6


def test_logprobs_are_passed_through():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt_of(1, 4), max_tokens=2, logprobs=1))
    step = sched.schedule()
    entry = SampleLogprobs(-0.5, [(7, -0.5), (8, -1.5)])
    out = ModelRunnerOutput(step_id=step.step_id, sampled={"a": [7]}, logprobs={"a": [entry]})
    (delta,) = sched.update_from_output(step, out)
    assert delta.new_token_ids == [7] and delta.new_logprobs == [entry]


def test_a_missing_sample_fails_the_request():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt_of(1, 4)))
    step = sched.schedule()
    (delta,) = sched.update_from_output(step, ModelRunnerOutput(step_id=step.step_id))
    assert delta.finish_reason == "error" and "no token" in delta.error
    assert sched.kv_manager.usage == 0.0


def test_fail_all_finishes_everything_with_error():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", prompt_of(1, 4)))
    sched.add_request(make_request("b", prompt_of(2, 4)))
    sched.schedule()
    deltas = sched.fail_all("worker died")
    assert {d.req_id for d in deltas} == {"a", "b"}
    assert all(d.finish_reason == "error" and d.error == "worker died" for d in deltas)
    assert not sched.has_unfinished_requests() and sched.kv_manager.usage == 0.0


def test_stats():
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    sched.add_request(make_request("a", prompt_of(1, 8)))
    sched.add_request(make_request("b", prompt_of(2, 8)))
    sched.schedule()
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks) == (1, 1, 10)
    assert stats.kv_usage == pytest.approx(0.2)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (8, 0, 0)


def test_queue_full_and_request_too_long():
    sched = make_scheduler(num_blocks=4, max_waiting=2, max_model_len=32)
    sched.add_request(make_request("a", prompt_of(1, 4)))
    sched.add_request(make_request("b", prompt_of(2, 4)))
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("c", prompt_of(3, 4)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", prompt_of(1, 4)))

    sched = make_scheduler(num_blocks=4, max_model_len=32)
    with pytest.raises(RequestTooLongError, match=r"30 tokens plus max_tokens 5 .* 32"):
        sched.add_request(make_request("ctx", prompt_of(1, 30), max_tokens=5))
    with pytest.raises(RequestTooLongError, match="32"):
        sched.add_request(make_request("ctx2", prompt_of(1, 32), max_tokens=None))
    with pytest.raises(RequestTooLongError, match=r"5 KV blocks .* only 4 blocks"):
        sched.add_request(make_request("kv", prompt_of(1, 12), max_tokens=6))
    assert issubclass(RequestTooLongError, ValueError)
    sched.add_request(make_request("fits", prompt_of(1, 12), max_tokens=5))  # 16 tokens need KV: 4 blocks
    run = run_sync(sched, FakeWorker())
    assert len(run.outputs["fits"]) == 5


def test_request_state_and_validation():
    msg = AddRequest("m", [5, 6, 7], SamplingParams(max_tokens=4), arrival_time=3.5, priority=2,
                     eos_token_ids=[9])
    req = Request.from_message(msg)
    assert (req.req_id, req.priority, req.arrival_time, req.eos_token_ids) == ("m", 2, 3.5, [9])
    assert req.sampling_params.max_tokens == 4 and req.status is RequestStatus.WAITING
    req.append_output_token(11)
    assert req.all_token_ids == [5, 6, 7, 11] and req.num_tokens == 4 and req.output_token_ids == [11]
    assert req.finish_reason is None and not req.is_finished
    reasons = {
        RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
        RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error",
    }
    for status, reason in reasons.items():
        req.status = status
        assert req.is_finished and req.finish_reason == reason
    with pytest.raises(ValueError, match="at least one token"):
        Request("x", [])
    with pytest.raises(ValueError, match="non-negative"):
        Request("x", [1, -2])
    with pytest.raises(ValueError, match="req_id"):
        Request("", [1])

    sched = make_scheduler()
    used = make_request("used", prompt_of(1, 4), max_tokens=1)
    sched.add_request(used)
    run_sync(sched, FakeWorker())
    with pytest.raises(ValueError, match="already been scheduled"):
        sched.add_request(used)
