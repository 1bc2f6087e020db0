"""MTP speculative decoding through the engine (issue 15, "Must show" 1-3, and the features it must work with).

The oracle is the same engine without speculation. Three set-ups:

- the factory's tiny deepseek_v3 behind `LLM` (master + worker processes): its one MTP layer is random, so
  nearly every draft is rejected, and greedy tokens and logprobs must still equal the reference under chunked
  prefill, prefix-cache hits, preemption, stop tokens, max_tokens and n > 1; seeded sampling is reproducible;
- oracle drafts: in this process a real Scheduler and KV cache manager drive a real ModelRunner whose MTP
  proposer is patched to propose the true greedy continuation (every draft accepted), or a right draft then a
  wrong one; accepted runs, stops inside them and the block accounting are checked there, and the MTP layer's
  own cache is compared with the one a plain run of the same request leaves;
- a 16-token deepseek_v3 whose MTP layer is edited to guess well (drafts are accepted about half of the
  time): a chi-square test that rejection sampling keeps the target distribution at the engine level, and
  greedy outputs with real accepted runs.
"""
from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from meshserve import LLM, SamplingParams
from meshserve.config import EngineConfig
from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.core.request import Request
from meshserve.core.scheduler import Scheduler
from meshserve.engine.core_client import EngineStartupError
from meshserve.entrypoints.openai.metrics import ServerMetrics
from meshserve.models.generation_config import max_position_embeddings
from meshserve.wire import codec
from meshserve.wire.client import EngineStats
from meshserve.wire.worker import ModelRunnerOutput
from meshserve.worker.model_runner import ModelRunner

LOGPROB_TOL = 1e-4
OUTPUT_LEN = 24
# small steps and a small cache: long prompts are chunked and the batch does not fit, so requests are preempted
ENGINE_ARGS = dict(max_num_batched_tokens=32, block_size=8, max_num_seqs=8, num_kv_blocks=24, num_threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=1234)
K_VALUES = (1, 2, 3)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 31900, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts([5, 70, 17, 33, 9, 50])  # 184 prompt tokens + 6 x 24 outputs: more than 24 blocks of 8
REPEATED = PROMPTS[2:4]  # served twice more after PROMPTS: the second time from the prefix cache


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The in-process runners share two cores with the engines' processes: one thread each avoids thrashing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2}))


def _spec(k: int) -> dict:
    return dict(speculative="mtp", num_speculative_tokens=k) if k else {}


def assert_spec_counters_consistent(stats: EngineStats, k: int) -> None:
    """Every verifying step produced its accepted drafts plus one token; drafts fill positions in order."""
    assert stats.spec_tokens == stats.spec_verify_steps + sum(stats.spec_accepted)
    if not k:
        assert stats.spec_verify_steps == 0 and not any(stats.spec_drafted)
        return
    assert len(stats.spec_drafted) == len(stats.spec_accepted) == k
    assert stats.spec_drafted[0] == stats.spec_verify_steps
    assert all(a <= d for a, d in zip(stats.spec_accepted, stats.spec_drafted))
    assert all(later <= earlier for earlier, later in zip(stats.spec_accepted, stats.spec_accepted[1:]))


# ---------------------------------------------------------------- the engine (LLM) on the factory's model
@dataclass
class Served:
    """What one engine gave for the module's workload (see `_serve`)."""

    main: list = field(default_factory=list)  # CompletionOutput per PROMPTS entry
    main_stats: EngineStats | None = None
    repeated: list = field(default_factory=list)  # REPEATED once more, after `main` and REPEATED
    before_repeat_stats: EngineStats | None = None
    repeated_stats: EngineStats | None = None
    stopped: list = field(default_factory=list)  # with stop tokens / max_tokens cut inside the output
    n2: list = field(default_factory=list)  # the two completions of one n=2 greedy request
    seeded: list = field(default_factory=list)  # the same seeded request twice in one batch, then alone
    seeded_n2: list = field(default_factory=list)
    final_stats: EngineStats | None = None
    stop_params: list[SamplingParams] = field(default_factory=list)  # what `stopped` asked


def _stop_params(reference: list) -> list[SamplingParams]:
    """For the first three reference outputs a stop token that first occurs in the middle of the output; then
    a max_tokens cut (7: not a multiple of k + 1)."""
    params = []
    for i, out in enumerate(reference[:3]):
        tokens = out.token_ids
        j = next(j for j in range(5 + 2 * i, len(tokens)) if tokens[j] not in tokens[:j])
        params.append(msgspec.structs.replace(GREEDY, stop_token_ids=[tokens[j]], max_tokens=OUTPUT_LEN))
    params.append(msgspec.structs.replace(GREEDY, max_tokens=7))
    return params


def _serve(model_dir: str, k: int, stop_params: list[SamplingParams] | None) -> Served:
    served = Served()
    with LLM(model=model_dir, **ENGINE_ARGS, **_spec(k)) as llm:
        served.main = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
        served.main_stats = llm.get_stats()
        llm.generate(REPEATED, GREEDY)  # their blocks are the cache's most recent ones now
        served.before_repeat_stats = llm.get_stats()
        served.repeated = [o.outputs[0] for o in llm.generate(REPEATED, GREEDY)]
        served.repeated_stats = llm.get_stats()
        stop_params = stop_params or _stop_params(served.main)
        served.stopped = [o.outputs[0] for o in llm.generate(PROMPTS[:len(stop_params)], stop_params)]
        served.n2 = llm.generate(PROMPTS[2], msgspec.structs.replace(GREEDY, n=2, max_tokens=12))[0].outputs
        served.seeded = [o.outputs[0] for o in llm.generate([PROMPTS[0], PROMPTS[0]], SEEDED)]
        served.seeded += [llm.generate(PROMPTS[0], SEEDED)[0].outputs[0]]
        served.seeded_n2 = [o.outputs for o in (llm.generate(PROMPTS[4], msgspec.structs.replace(SEEDED, n=2))[0],
                                                llm.generate(PROMPTS[4], msgspec.structs.replace(SEEDED, n=2))[0])]
        served.final_stats = llm.get_stats()
    served.stop_params = stop_params
    return served


@pytest.fixture(scope="module")
def reference(model_dir) -> Served:
    return _serve(model_dir, 0, None)


def assert_same_greedy(outs: list, refs: list) -> None:
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        assert (out.finish_reason, out.stop_reason) == (ref.finish_reason, ref.stop_reason)
        assert len(out.logprobs) == len(ref.logprobs) == len(ref.token_ids)
        for pos, ref_pos in zip(out.logprobs, ref.logprobs):
            assert pos.chosen.token_id == ref_pos.chosen.token_id
            assert pos.chosen.logprob == pytest.approx(ref_pos.chosen.logprob, abs=LOGPROB_TOL)
            assert [t.token_id for t in pos.top] == [t.token_id for t in ref_pos.top]
            for ours, theirs in zip(pos.top, ref_pos.top):
                assert ours.logprob == pytest.approx(theirs.logprob, abs=LOGPROB_TOL)


def test_reference_workload_exercises_every_feature(reference):
    """The workload is what the speculative runs are compared on: it must chunk, preempt, hit and stop."""
    assert max(len(p) for p in PROMPTS) > 2 * ENGINE_ARGS["max_num_batched_tokens"]
    assert reference.main_stats.num_preemptions > 0
    assert reference.repeated_stats.prefix_cache_hits > reference.before_repeat_stats.prefix_cache_hits
    for out, full, params in zip(reference.stopped, reference.main, reference.stop_params):
        if params.stop_token_ids:
            cut = full.token_ids.index(params.stop_token_ids[0])
            assert out.finish_reason == "stop" and out.stop_reason == params.stop_token_ids[0]
            assert 5 <= cut < OUTPUT_LEN - 1 and out.token_ids == full.token_ids[:len(out.token_ids)]
            assert len(out.token_ids) in (cut, cut + 1)
        else:
            assert out.finish_reason == "length" and out.token_ids == full.token_ids[:params.max_tokens]


@pytest.mark.parametrize("k", K_VALUES)
def test_greedy_outputs_with_mtp_equal_the_outputs_without(model_dir, reference, k):
    served = _serve(model_dir, k, reference.stop_params)
    assert_same_greedy(served.main, reference.main)
    assert_same_greedy(served.repeated, reference.main[2:4])
    assert_same_greedy(served.stopped, reference.stopped)
    assert_same_greedy(list(served.n2), list(reference.n2))
    assert served.n2[0].token_ids == served.n2[1].token_ids
    # the drafts really ran (and, the MTP layer being random, were mostly rejected)
    stats = served.final_stats
    assert stats.spec_verify_steps > 0 and stats.spec_drafted[0] > 0
    assert_spec_counters_consistent(stats, k)
    # preemption and prefix-cache hits happened with speculation too, and idle engines hold no block
    assert served.main_stats.num_preemptions > 0
    assert served.repeated_stats.prefix_cache_hits > served.before_repeat_stats.prefix_cache_hits
    for s in (served.main_stats, served.repeated_stats, stats):
        assert s.kv_usage == 0 and s.num_running == 0 and s.num_waiting == 0
    # seeds are honoured: the same seeded request gives the same tokens beside its twin and alone
    assert served.seeded[0].token_ids == served.seeded[1].token_ids == served.seeded[2].token_ids
    first, second = served.seeded_n2
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert first[0].token_ids != first[1].token_ids  # n > 1 children draw with different seeds


def test_mtp_on_a_model_without_mtp_layers_fails_at_start_up(tiny_model):
    model = tiny_model("qwen3", overrides={"num_hidden_layers": 1})
    with pytest.raises(EngineStartupError, match="MTP") as err:
        LLM(model=str(model), num_kv_blocks=16, num_threads=1, speculative="mtp", num_speculative_tokens=2)
    assert "speculative" in str(err.value)


def test_prometheus_shows_the_speculative_counters():
    stats = EngineStats(spec_drafted=[40, 30], spec_accepted=[30, 12], spec_verify_steps=40, spec_tokens=82)
    assert_spec_counters_consistent(stats, 2)
    metrics = ServerMetrics()
    metrics.update_engine_stats(stats)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render()[0].decode())
               for s in family.samples}
    assert samples[("meshserve_spec_decode_verify_steps_total", ())] == 40
    assert samples[("meshserve_spec_decode_tokens_total", ())] == 82
    assert samples[("meshserve_spec_decode_tokens_per_step", ())] == pytest.approx(82 / 40)
    for position, (drafted, accepted) in enumerate(zip(stats.spec_drafted, stats.spec_accepted)):
        label = (("position", str(position)),)
        assert samples[("meshserve_spec_decode_draft_tokens_total", label)] == drafted
        assert samples[("meshserve_spec_decode_accepted_tokens_total", label)] == accepted
        assert samples[("meshserve_spec_decode_acceptance_rate", label)] == pytest.approx(accepted / drafted)
    # without speculation: zeros and no position at all
    metrics.update_engine_stats(EngineStats())
    text = metrics.render()[0].decode()
    assert "meshserve_spec_decode_tokens_per_step 0.0" in text and 'position="0"' not in text


# ---------------------------------------------------------------- oracle drafts, in this process
@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None


class InProcessEngine:
    """The master's step loop in this process: a real Scheduler and KV cache manager over a real ModelRunner
    (one step at a time, as the master schedules under speculative decoding)."""

    def __init__(self, model_dir: str, k: int = 0, **engine_args) -> None:
        config = EngineConfig.from_kwargs(model_dir, **{**ENGINE_ARGS, **engine_args, **_spec(k)})
        self.runner = ModelRunner(config)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache_config.block_size)
        max_model_len = config.scheduler_config.max_model_len or max_position_embeddings(model_dir)
        scheduler_config = msgspec.structs.replace(config.scheduler_config, max_model_len=max_model_len)
        self.scheduler = Scheduler(scheduler_config, self.kv, num_speculative_tokens=k)
        self.steps: list[ModelRunnerOutput] = []

    def generate(self, requests: dict[str, tuple[list[int], SamplingParams]],
                 eos: dict[str, list[int]] | None = None) -> dict[str, Result]:
        for req_id, (prompt, params) in requests.items():
            self.scheduler.add_request(Request(req_id, prompt, params, eos_token_ids=(eos or {}).get(req_id)))
        results = {req_id: Result() for req_id in requests}
        while self.scheduler.has_unfinished_requests():
            sched = self.scheduler.schedule()
            assert not sched.is_empty, "the scheduler stalled with unfinished requests"
            out = self.runner.execute(codec.decode(codec.encode(sched)))  # as it crosses to a worker process
            self.steps.append(out)
            for delta in self.scheduler.update_from_output(sched, out):
                result = results[delta.req_id]
                result.token_ids += delta.new_token_ids
                result.logprobs += [lp.logprob for lp in delta.new_logprobs or []]
                if delta.finish_reason is not None:
                    result.finish_reason, result.stop_reason = delta.finish_reason, delta.stop_reason
        return results

    def use_oracle_drafts(self, continuation: dict[str, list[int]], num_right: int | None = None) -> None:
        """Drafts are the true greedy continuation (`continuation`: each request's reference output), the first
        `num_right` of them right and the rest wrong (None: all right). The MTP layer still runs: its cache
        and its forwards stay as in serving, only its guesses are replaced."""
        runner = self.runner
        propose = runner.proposer.propose
        vocab = runner.vocab_size

        def oracle(hidden, seqs, drafting_step=True, microbatches=1):
            drafts = propose(hidden, seqs, drafting_step, microbatches)
            for req_id, guessed in drafts.items():
                produced = len(runner.requests[req_id].output_token_ids)
                truth = continuation[req_id][produced:produced + len(guessed)]
                right = len(truth) if num_right is None else min(num_right, len(truth))
                wrong = [(t + 1) % vocab for t in truth[right:]]
                drafts[req_id] = truth[:right] + wrong + guessed[len(truth):]
            return drafts

        runner.proposer.propose = oracle

    def assert_no_block_held(self) -> None:
        """Idle: every block is free or merely cached (evictable), none referenced."""
        assert not self.scheduler.has_unfinished_requests()
        assert self.kv.usage == 0
        assert all(self.kv.ref_count(b) == 0 for b in range(self.kv.num_blocks))
        assert self.kv.num_free_blocks + self.kv.num_evictable_blocks == self.kv.num_blocks

    def verify_steps(self, req_id: str) -> list[tuple[int, list[int]]]:
        """(drafts verified, tokens produced) of each step of `req_id` that verified drafts."""
        return [(out.num_drafts[req_id], out.sampled[req_id]) for out in self.steps if req_id in out.num_drafts]


ORACLE_LEN = 20
ORACLE_PARAMS = SamplingParams(temperature=0.0, max_tokens=ORACLE_LEN, ignore_eos=True, logprobs=0)
ORACLE_PROMPTS = dict(zip("abcd", _prompts([5, 40, 13, 21], seed=1)))


@pytest.fixture(scope="module")
def oracle_reference(model_dir) -> dict[str, Result]:
    """Greedy outputs without speculation, long enough to supply every draft of the oracle runs."""
    params = msgspec.structs.replace(ORACLE_PARAMS, max_tokens=ORACLE_LEN + 4)
    engine = InProcessEngine(model_dir)
    return engine.generate({r: (p, params) for r, p in ORACLE_PROMPTS.items()})


def _oracle_run(model_dir, reference, k, num_right=None, requests=None, eos=None, **engine_args):
    engine = InProcessEngine(model_dir, k, **engine_args)
    engine.use_oracle_drafts({r: out.token_ids for r, out in reference.items()}, num_right)
    requests = requests or {r: (p, ORACLE_PARAMS) for r, p in ORACLE_PROMPTS.items()}
    return engine, engine.generate(requests, eos)


def assert_same_as_reference(results: dict[str, Result], reference: dict[str, Result], length: int = ORACLE_LEN):
    for req_id, result in results.items():
        assert result.token_ids == reference[req_id].token_ids[:length], req_id
        assert result.logprobs == pytest.approx(reference[req_id].logprobs[:length], abs=LOGPROB_TOL)


@pytest.mark.parametrize("k", K_VALUES)
def test_all_drafts_accepted_gives_k_plus_one_tokens_per_step(model_dir, oracle_reference, k):
    engine, results = _oracle_run(model_dir, oracle_reference, k)
    assert_same_as_reference(results, oracle_reference)
    assert all(r.finish_reason == "length" for r in results.values())
    stats = engine.scheduler.stats()
    assert_spec_counters_consistent(stats, k)
    assert stats.spec_accepted == stats.spec_drafted and stats.spec_accepted[0] > 0
    for req_id in results:
        steps = engine.verify_steps(req_id)
        assert steps and all(len(tokens) == drafts + 1 for drafts, tokens in steps)
        # k drafts each step, fewer only where max_tokens leaves less room (the request's last step)
        assert all(drafts == k for drafts, _ in steps[:-1])
    engine.assert_no_block_held()


def test_a_right_then_a_wrong_draft_gives_two_tokens_per_step(model_dir, oracle_reference):
    engine, results = _oracle_run(model_dir, oracle_reference, 2, num_right=1)
    assert_same_as_reference(results, oracle_reference)
    stats = engine.scheduler.stats()
    assert_spec_counters_consistent(stats, 2)
    assert stats.spec_accepted[0] == stats.spec_drafted[0] > 0 and stats.spec_accepted[1] == 0
    assert stats.spec_tokens == 2 * stats.spec_verify_steps
    for req_id in results:
        assert all(len(tokens) == 2 for _, tokens in engine.verify_steps(req_id))
    engine.assert_no_block_held()


def _inside_a_step(steps: list[tuple[int, list[int]]], index: int) -> bool:
    """Whether output token `index` (0: the prefill's) came from a verifying step with tokens after it."""
    produced = 1
    for _, tokens in steps:
        if produced <= index < produced + len(tokens) - 1:
            return True
        produced += len(tokens)
    return False


def test_stop_token_eos_and_max_tokens_inside_an_accepted_run(model_dir, oracle_reference):
    """The worker produces k + 1 tokens per step; the master keeps those up to the one that ends the request
    (a stop token, an EOS) and drops the rest. max_tokens is known ahead: the last step verifies only the
    drafts that fit."""
    k = 3
    ref = {r: out.token_ids for r, out in oracle_reference.items()}
    # first occurrences that are not the last token of a step of k + 1 (steps produce tokens 1-4, 5-8, ...)
    cut = {r: next(j for j in range(2, ORACLE_LEN) if j % (k + 1) != 0 and ref[r][j] not in ref[r][:j])
           for r in "abc"}
    requests = {"a": (ORACLE_PROMPTS["a"], msgspec.structs.replace(ORACLE_PARAMS, stop_token_ids=[ref["a"][cut["a"]]])),
                "b": (ORACLE_PROMPTS["b"], msgspec.structs.replace(ORACLE_PARAMS, ignore_eos=False)),
                "c": (ORACLE_PROMPTS["c"], msgspec.structs.replace(ORACLE_PARAMS, max_tokens=cut["c"] + 1))}
    engine, results = _oracle_run(model_dir, oracle_reference, k, requests=requests,
                                  eos={"b": [ref["b"][cut["b"]]]})
    for req_id, reason in (("a", "stop"), ("b", "stop"), ("c", "length")):
        result = results[req_id]
        assert result.token_ids == ref[req_id][:cut[req_id] + 1], req_id
        assert result.finish_reason == reason
    for req_id in "ab":
        assert _inside_a_step(engine.verify_steps(req_id), cut[req_id]), req_id
    steps_c = engine.verify_steps("c")
    assert 1 + sum(len(tokens) for _, tokens in steps_c) == cut["c"] + 1 and steps_c[-1][0] < k
    assert results["a"].stop_reason == ref["a"][cut["a"]] and results["b"].stop_reason == ref["b"][cut["b"]]
    engine.assert_no_block_held()


def test_no_block_leaks_after_rejections_and_preemptions_and_the_prefix_cache_stays_right(model_dir,
                                                                                       oracle_reference):
    """Many requests whose drafts are half rejected, in a cache too small for them (preemption): idle, no block
    stays referenced; the same prompts again hit the prefix cache and give the same tokens."""
    requests = {f"{i}{r}": (ORACLE_PROMPTS[r], ORACLE_PARAMS) for i in range(3) for r in ORACLE_PROMPTS}
    again = {f"again{req_id}": request for req_id, request in requests.items()}
    engine = InProcessEngine(model_dir, 2, num_kv_blocks=16)
    # request ids end with their prompt's letter
    engine.use_oracle_drafts({req_id: oracle_reference[req_id[-1]].token_ids for req_id in requests | again},
                             num_right=1)
    first = engine.generate(requests)
    engine.assert_no_block_held()
    stats = engine.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.spec_drafted[1] > stats.spec_accepted[1] == 0
    hits = stats.prefix_cache_hits
    second = engine.generate(again)
    engine.assert_no_block_held()
    assert engine.scheduler.stats().prefix_cache_hits > hits
    for req_id, result in first.items():
        expected = oracle_reference[req_id[-1]].token_ids[:ORACLE_LEN]
        assert result.token_ids == second[f"again{req_id}"].token_ids == expected, req_id
    # and from scratch: the cache, emptied of its cached blocks, is whole
    engine.kv.reset_prefix_cache()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_max_model_len_inside_an_accepted_run(model_dir, oracle_reference):
    """A sequence that reaches the model's length limit: its drafts (and the MTP layer's extra slots) stop there."""
    k = 3
    prompt = ORACLE_PROMPTS["b"]
    limit = len(prompt) + 7
    params = msgspec.structs.replace(ORACLE_PARAMS, max_tokens=None)
    engine, results = _oracle_run(model_dir, oracle_reference, k, requests={"b": (prompt, params)},
                                  max_model_len=limit)
    assert results["b"].token_ids == oracle_reference["b"].token_ids[:7]
    assert results["b"].finish_reason == "length"
    assert engine.scheduler.stats().spec_accepted[0] > 0
    engine.assert_no_block_held()


def mtp_cache_rows(engine: InProcessEngine, req_id: str) -> torch.Tensor:
    """The MTP layer's cache entries of a request's positions that have a next token (the worker still holds
    the request: the step that would tell it to forget a finished one never ran)."""
    state = engine.runner.requests[req_id]
    cache = engine.runner.kv_caches[engine.runner.num_model_layers]
    size = engine.runner.block_size
    return torch.stack([cache[state.block_ids[p // size], p % size] for p in range(len(state.token_ids) - 1)])


def assert_same_rows(rows: torch.Tensor, expected: torch.Tensor) -> None:
    wrong = [p for p in range(len(expected)) if not torch.allclose(rows[p], expected[p], atol=LOGPROB_TOL)]
    assert not wrong, f"the MTP cache differs at positions {wrong} of {len(expected)}"


def test_steps_without_drafts_leave_no_hole_in_the_mtp_cache(model_dir):
    """The master turns drafting off for some steps (speculative_max_batch, or its measuring mode's exploring
    steps); the positions those steps make final still need their MTP cache entries, or later drafts attend to
    zeros or to stale draft entries there (outputs stay right; acceptance drops)."""
    prompt = ORACLE_PROMPTS["b"]  # 40 tokens: two prefill chunks

    def run(draft_every_step: bool) -> tuple[list[int], torch.Tensor]:
        engine = InProcessEngine(model_dir, 2)
        schedule = engine.scheduler.schedule
        steps = iter(range(10**6))

        def every_third_step_without_drafts():
            engine.scheduler.speculating = draft_every_step or next(steps) % 3 != 1
            return schedule()

        engine.scheduler.schedule = every_third_step_without_drafts
        result = engine.generate({"b": (prompt, ORACLE_PARAMS)})["b"]
        return result.token_ids, mtp_cache_rows(engine, "b")

    always_tokens, always_rows = run(True)
    switching_tokens, switching_rows = run(False)
    assert switching_tokens == always_tokens
    assert_same_rows(switching_rows, always_rows)


def test_a_prefix_cache_hit_leaves_no_stale_mtp_entry(model_dir):
    """The MTP entry of a position is computed from the token after it. A prefix-cache hit ending at a block
    boundary reuses the entry of the block's last position, computed with the token that followed it in the
    request that cached it: a request that goes on differently needs it recomputed."""
    shared = _prompts([16], seed=5)[0]  # two full blocks
    params = msgspec.structs.replace(ORACLE_PARAMS, max_tokens=4)
    engine = InProcessEngine(model_dir, 2)
    engine.generate({"first": (shared + [111, 222, 333], params)})
    engine.generate({"second": (shared + [444, 555, 666], params)})
    # under speculation the last hit block is computed again (its last MTP entry belongs to the next token)
    assert engine.scheduler.stats().prefix_cache_hits == len(shared) - 8
    alone = InProcessEngine(model_dir, 2)
    alone.generate({"second": (shared + [444, 555, 666], params)})
    assert_same_rows(mtp_cache_rows(engine, "second"), mtp_cache_rows(alone, "second"))


# ---------------------------------------------------------------- rejection sampling keeps the distribution
# A tiny deepseek_v3 cut to 16 tokens, its layers' outputs scaled down so that the next token depends mostly on
# the current one (attention still matters), and its MTP layer made to read only the embedding of the token it is
# given, through the main model's own norm and head: its draft is then close to the main model's likely next
# token, and drafts are accepted about half of the time at temperature 1.
SMALL_VOCAB = 16
NUM_SAMPLES = 2000
DIST_PROMPT = [0, 2, 12, 0, 15, 10, 7]
# chi-square critical value at significance 0.001, by degrees of freedom (the test is deterministic: seeded)
CHI2_CRITICAL_0001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
                      10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def make_drafting_model(src: Path, dst: Path, vocab: int = SMALL_VOCAB, layer_scale: float = 0.3) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    hidden, mtp = config["hidden_size"], f"model.layers.{config['num_hidden_layers']}."
    tensors = load_file(dst / "model.safetensors")
    for name, tensor in tensors.items():
        if tensor.shape[0] == config["vocab_size"]:  # embeddings and heads: the first `vocab` tokens
            tensors[name] = tensor[:vocab].clone()
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensor * layer_scale
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "enorm.weight"] = torch.ones(hidden)
    # eh_proj reads [enorm(embedding of the next token), hnorm(previous hidden)]: keep the first half only
    tensors[mtp + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    return dst


def chi_square_two_samples(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """The two-sample chi-square statistic over the categories of a and b, and its degrees of freedom;
    categories with fewer than `min_count` samples in both together are pooled into one."""
    n_a, n_b = sum(a.values()), sum(b.values())
    rare = [c for c in a.keys() | b.keys() if a[c] + b[c] < min_count]
    a, b = Counter(a), Counter(b)
    for c in rare:
        a["rare"] += a.pop(c, 0)
        b["rare"] += b.pop(c, 0)
    cells = [c for c in a.keys() | b.keys() if a[c] + b[c] > 0]
    k_a, k_b = math.sqrt(n_b / n_a), math.sqrt(n_a / n_b)
    statistic = sum((k_a * a[c] - k_b * b[c]) ** 2 / (a[c] + b[c]) for c in cells)
    return statistic, len(cells) - 1


@dataclass
class DraftingRun:
    samples: list[list[int]]  # the NUM_SAMPLES seeded samples of DIST_PROMPT
    sample_stats: EngineStats
    greedy: list  # CompletionOutput per GREEDY_SMALL prompt, then per stop request
    stop_params: list[SamplingParams]
    stats: EngineStats


GREEDY_SMALL = [DIST_PROMPT, [3, 5, 9], [11, 4], [6, 6, 1, 13, 2, 8, 0, 5, 14, 9], [7]]
GREEDY_SMALL_PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _run_drafting_model(model: str, k: int, stop_params: list[SamplingParams] | None) -> DraftingRun:
    # steps of a few hundred requests each: one step of all of them can outlast the hang timeout on a busy host
    args = dict(max_num_batched_tokens=2048, max_num_seqs=NUM_SAMPLES,
                max_waiting=NUM_SAMPLES, num_kv_blocks=NUM_SAMPLES + 64, block_size=16, num_threads=1)
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(NUM_SAMPLES)]
    with LLM(model=model, **args, **_spec(k)) as llm:
        samples = [o.outputs[0].token_ids for o in llm.generate([DIST_PROMPT] * NUM_SAMPLES, params)]
        sample_stats = llm.get_stats()
        greedy = [o.outputs[0] for o in llm.generate(GREEDY_SMALL, GREEDY_SMALL_PARAMS)]
        # a stop token that first occurs after a few tokens, where accepted runs are under way
        stop_params = stop_params or [
            msgspec.structs.replace(GREEDY_SMALL_PARAMS, stop_token_ids=[out.token_ids[j]])
            for out in greedy for j in [next((j for j in range(2, 12) if out.token_ids[j] not in out.token_ids[:j]),
                                             None)] if j is not None]
        greedy += [o.outputs[0] for o in llm.generate(GREEDY_SMALL[:len(stop_params)], stop_params)]
        return DraftingRun(samples, sample_stats, greedy, stop_params, llm.get_stats())


@pytest.fixture(scope="module")
def drafting_runs(tiny_model, tmp_path_factory) -> tuple[DraftingRun, DraftingRun]:
    """The edited 16-token model without and with MTP (k = 2)."""
    src = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 1})
    model = str(make_drafting_model(src, tmp_path_factory.mktemp("drafting") / "model"))
    plain = _run_drafting_model(model, 0, None)
    return plain, _run_drafting_model(model, 2, plain.stop_params)


def test_rejection_sampling_keeps_the_distribution_of_the_first_speculative_position(drafting_runs):
    plain, speculative = drafting_runs
    stats = speculative.sample_stats
    # max_tokens 3: the step after the prefill verifies one draft (room for one more token after it)
    assert stats.spec_verify_steps == NUM_SAMPLES
    assert stats.spec_accepted[0] > NUM_SAMPLES // 4, stats  # drafts were really accepted, and often
    assert stats.spec_accepted[0] < stats.spec_drafted[0]  # ... and really rejected
    # the prefill's token: the same seeded draw
    assert [t[0] for t in plain.samples] == [t[0] for t in speculative.samples]
    for position in (1, 2):  # the verified position, and the token after it (the bonus token when accepted)
        statistic, dof = chi_square_two_samples(Counter(t[position] for t in plain.samples),
                                                Counter(t[position] for t in speculative.samples))
        assert dof >= 3  # a spread distribution, or the test says little
        assert statistic < CHI2_CRITICAL_0001[dof], (position, statistic, dof)


def test_greedy_outputs_with_accepted_drafts_equal_the_outputs_without(drafting_runs):
    """Through the engine with drafts the MTP layer itself made, most of them accepted."""
    plain, speculative = drafting_runs
    assert len(plain.stop_params) >= 3
    assert_same_greedy(speculative.greedy, plain.greedy)
    for out, params in zip(plain.greedy[len(GREEDY_SMALL):], plain.stop_params):
        assert out.finish_reason == "stop" and out.stop_reason == params.stop_token_ids[0]
    accepted = [a - b for a, b in zip(speculative.stats.spec_accepted, speculative.sample_stats.spec_accepted)]
    drafted = [a - b for a, b in zip(speculative.stats.spec_drafted, speculative.sample_stats.spec_drafted)]
    # most first drafts accepted, and some whole runs of two
    assert accepted[0] > drafted[0] // 2 and accepted[1] > 0, (accepted, drafted)
    assert_spec_counters_consistent(speculative.stats, 2)
