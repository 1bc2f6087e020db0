"""Disaggregated prefill/decode deployments, as processes (issue 4, "Must show" 1-3).

Every TE runs as `meshserve te` processes behind an in-process job executor. The oracle is the same
model served by one colocated TE: greedy outputs through any P/D layout, any KV transfer backend, a
decode TE too small for its load, or a prefill TE that dies, must equal it. The decode TEs' counters
(`kv_pulled`, `kv_pull_recomputed`) show whether the prompt KV really came over the transfer engine or
was computed again, so no test can pass by recomputing everything on the decode side.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time

import pytest
import zmq

from meshserve.config import RouterConfig
from meshserve.router.deployment import MultiDeployment
from meshserve.router.router import Router
from meshserve.router.routing import REQUEST_ROUTING_POLICY
from meshserve.utils import cluster_auth
from meshserve.wire import codec
from meshserve.wire.client import AddRequest, AdminRequest, EngineOutputs, EngineStats, ReleaseKV, RequestDelta
from meshserve.wire.heartbeat import EngineHeartbeat
from meshserve.wire.kv import KVRegion, KVTransferParams, KVTransferRole
from meshserve.wire.sampling_params import SamplingParams
from tests.router.deployment_processes import generate_all, kill_te, running_deployment, token_ids

pytestmark = pytest.mark.timeout(300)

ARCHS = ("deepseek_v3", "qwen3_moe")
ENGINE = {"num_kv_blocks": 128}
PRODUCER = KVTransferParams(role=KVTransferRole.PRODUCER)  # what a prefill TE is asked
BLOCK_SIZE = 16  # EngineConfig's default
# generous, so a TE starved of CPU on a busy test machine is not dropped (tests of failures set their own)
HEARTBEAT_TIMEOUT_S = 10.0


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 900 + 5 for i in range(n)]


# prompt lengths around block boundaries; then, once they are computed, a prompt sharing two full blocks
# with two of them: the prefill TE hands off blocks its prefix cache shares
MIXED = [prompt(1, 5), prompt(2, 16), prompt(3, 17), prompt(4, 40), prompt(4, 32) + prompt(9, 7), prompt(5, 1),
         prompt(6, 33)]
SHARED = [prompt(4, 32) + prompt(8, 5)]
MIXED_TOKENS = 6
# more requests than the small decode TE of test_a_full_decode_te can hold at once
CROWD = [prompt(10 + i, 20 + i) for i in range(8)]
CROWD_TOKENS = 24
# a transfer that breaks: one request whose prefill TE dies, and long requests decoding beside it
VICTIM, VICTIM_TOKENS = prompt(30, 23), 8
BYSTANDERS, BYSTANDER_TOKENS = [prompt(31, 9), prompt(32, 18)], 160
WORKLOADS = {
    "mixed": (MIXED, MIXED_TOKENS),
    "shared": (SHARED, MIXED_TOKENS),
    "crowd": (CROWD, CROWD_TOKENS),
    "victim": ([VICTIM], VICTIM_TOKENS),
    "bystanders": (BYSTANDERS, BYSTANDER_TOKENS),
}


@pytest.fixture(scope="module")
def models(tiny_model) -> dict[str, str]:
    return {arch: str(tiny_model(arch, seed=0, name=arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def colocated(models) -> dict[str, dict[str, list[list[int]]]]:
    """The oracle: arch -> workload -> greedy token ids from one colocated TE."""
    reference = {}
    for arch in ARCHS:
        with running_deployment(models[arch], "colocated", engine=ENGINE,
                                heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, _):
            reference[arch] = {name: token_ids(asyncio.run(generate_all(jes[0], prompts, max_tokens)))
                               for name, (prompts, max_tokens) in WORKLOADS.items()}
    return reference


def pd_groups(layout: str, backend: str, prefill: dict | None = None, decode: dict | None = None) -> list[dict]:
    """The te_groups of one MpNd group whose TEs move KV over `backend`."""
    num_p, num_d = (int(x) for x in layout.rstrip("d").split("p"))
    engine = {"kv_transfer_backend": backend}
    return [{"group": backend, "role": "prefill", "count": num_p, **(prefill or {}),
             "engine": {**engine, **(prefill or {}).get("engine", {})}},
            {"group": backend, "role": "decode", "count": num_d, **(decode or {}),
             "engine": {**engine, **(decode or {}).get("engine", {})}}]


def deployment(*groups: list[dict]) -> MultiDeployment:
    return MultiDeployment.from_dict({"engine": ENGINE, "te_groups": [g for group in groups for g in group]})


def stats(je: Router, te: str) -> dict:
    reply = asyncio.run(je.admin("stats", {"te": te}, timeout_s=10))
    assert reply.ok, reply.error
    return reply.to_json()


def wait_until_released(je: Router, prefill_tes: list[str], timeout_s: float = 10.0) -> None:
    """Every prefill TE frees its held blocks once the decode TE pulled them (step 8)."""
    deadline = time.monotonic() + timeout_s
    while True:
        holds = {te: stats(je, te)["kv_transfer_holds"] for te in prefill_tes}
        if not any(holds.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still held after every request finished: {holds}"
        time.sleep(0.1)


def assert_pulled_without_recompute(je: Router, decode_tes: list[str], expected_total: int) -> None:
    counters = {te: stats(je, te) for te in decode_tes}
    for te, s in counters.items():
        assert s["kv_pulled"] > 0, f"decode TE {te} pulled nothing: {s}"
        assert s["kv_pull_recomputed"] == 0, f"decode TE {te} recomputed a prompt: {s}"
    assert sum(s["kv_pulled"] for s in counters.values()) == expected_total


def names(procs: dict, role: str) -> list[str]:
    return sorted(name for name in procs if f"-{role}-" in name)


# ---------------------------------------------------------------- must show 1: same outputs as colocated
# each arch covers every preset; shm and tcp both serve 1p1d, the other layouts use shm or dist
# (torch.distributed send/recv, Gloo between these CPU ranks)
PD_CASES = [
    ("deepseek_v3", "1p1d", ("shm", "tcp")),
    ("deepseek_v3", "2p1d", ("shm",)),
    ("deepseek_v3", "1p2d", ("dist",)),
    ("qwen3_moe", "1p1d", ("shm", "tcp")),
    ("qwen3_moe", "2p1d", ("dist",)),
    ("qwen3_moe", "1p2d", ("shm",)),
]


@pytest.mark.parametrize("arch,layout,backends", PD_CASES, ids=[f"{a}-{p}-{'+'.join(b)}" for a, p, b in PD_CASES])
def test_disaggregated_outputs_equal_colocated(models, colocated, arch, layout, backends):
    # one P/D group per backend behind one JE; round-robin alternates between the groups, so each prompt
    # is repeated once per group and every group serves the whole workload
    def per_group(items: list) -> list:
        return [item for item in items for _ in backends]

    with running_deployment(models[arch], deployment(*(pd_groups(layout, b) for b in backends)), engine={},
                            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, procs):
        je = jes[0]
        prefill_tes, decode_tes = names(procs, "prefill"), names(procs, "decode")
        for workload in ("mixed", "shared"):
            prompts, max_tokens = WORKLOADS[workload]
            outputs = asyncio.run(generate_all(je, per_group(prompts), max_tokens, policy="round_robin"))
            assert token_ids(outputs) == per_group(colocated[arch][workload]), workload
            assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        # every request went prefill -> transfer -> decode: the decode TEs pulled every prompt's KV
        assert_pulled_without_recompute(je, decode_tes, expected_total=len(backends) * (len(MIXED) + len(SHARED)))
        prefill_stats = [stats(je, te) for te in prefill_tes]
        assert all(s["prefix_cache_queries"] > 0 for s in prefill_stats)  # M:N: every prefill TE took requests
        # the shared prompt's two cached blocks were handed off (round-robin sends it to a prefill TE that
        # computed them: the 4th and the 8th request of a group go to the same one of two prefill TEs)
        assert sum(s["prefix_cache_hits"] for s in prefill_stats) >= len(backends) * 2 * BLOCK_SIZE
        wait_until_released(je, prefill_tes)


LAYOUT_CASES = [
    # MLA: every prefill TP rank holds the whole latent cache; decode DP rank d pulls from prefill TP rank d
    ("deepseek_v3", "attn=TP2+DP1 moe=TP2+EP1", "attn=TP1+DP2 moe=TP1+EP2"),
    # GQA: each TP rank holds half the KV heads, so a decode rank pulling from the wrong prefill rank
    # would decode from the wrong heads' KV and change the outputs
    ("qwen3_moe", "attn=TP2+DP1 moe=TP2+EP1", "attn=TP2+DP1 moe=TP1+EP2"),
]


@pytest.mark.parametrize("arch,prefill,decode", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_prefill_and_decode_with_different_layouts(models, colocated, arch, prefill, decode):
    """Decode ranks pull from the prefill ranks the cloudmatrix-infer §4.3.3 mapping names."""
    layout = deployment(pd_groups("1p1d", "shm", prefill={"parallel": prefill}, decode={"parallel": decode}))
    with running_deployment(models[arch], layout, engine={},
                            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, procs):
        je = jes[0]
        outputs = asyncio.run(generate_all(je, MIXED, MIXED_TOKENS))
        assert token_ids(outputs) == colocated[arch]["mixed"]
        assert_pulled_without_recompute(je, names(procs, "decode"), expected_total=len(MIXED))
        wait_until_released(je, names(procs, "prefill"))


def test_disaggregated_with_mtp_outputs_equal_colocated(models, colocated):
    """MTP speculative decoding (k = 2) on both TEs (issue 15): the prefill TE fills the MTP layer's cache for
    the prompt and hands off without drafting; the decode TE pulls that cache with the rest and verifies drafts
    from its first step. Greedy tokens equal the colocated TE's without speculation."""
    spec = {"engine": {"speculative": "mtp", "num_speculative_tokens": 2}}
    layout = deployment(pd_groups("1p1d", "shm", prefill=spec, decode=spec))
    with running_deployment(models["deepseek_v3"], layout, engine={},
                            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, procs):
        je = jes[0]
        (prefill_te,), (decode_te,) = names(procs, "prefill"), names(procs, "decode")
        for workload in ("mixed", "shared"):
            prompts, max_tokens = WORKLOADS[workload]
            outputs = asyncio.run(generate_all(je, prompts, max_tokens))
            assert token_ids(outputs) == colocated["deepseek_v3"][workload], workload
            assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        assert_pulled_without_recompute(je, [decode_te], expected_total=len(MIXED) + len(SHARED))
        decode, prefill = stats(je, decode_te), stats(je, prefill_te)
        # every request decoded (max_tokens - 1 tokens on the decode TE) through verifying steps
        assert decode["spec_verify_steps"] >= len(MIXED) + len(SHARED)
        assert decode["spec_tokens"] == decode["spec_verify_steps"] + sum(decode["spec_accepted"])
        assert prefill["spec_verify_steps"] == 0  # the prefill TE only samples the first token
        wait_until_released(je, [prefill_te])


# ---------------------------------------------------------------- must show 2: a full decode TE
def test_a_full_decode_te_makes_prefill_hold_and_loses_nothing(models, colocated):
    # 6 blocks of 16 tokens: about two of the crowd's requests (up to 3 blocks each) fit at a time
    layout = deployment(pd_groups("1p1d", "shm", decode={"engine": {"num_kv_blocks": 6}}))
    with running_deployment(models["deepseek_v3"], layout, engine={},
                            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, procs):
        je = jes[0]
        (prefill_te,), (decode_te,) = names(procs, "prefill"), names(procs, "decode")
        assert stats(je, decode_te)["num_kv_blocks"] == 6

        async def run_and_watch():
            seen = {"holds": 0, "decode_waiting": 0, "both": False}
            work = asyncio.ensure_future(generate_all(je, CROWD, CROWD_TOKENS, timeout_s=120))
            for _ in range(5000):  # bounded: generate_all's own timeout ends the work first
                if work.done():
                    break
                p, d = await asyncio.gather(je.admin("stats", {"te": prefill_te}, timeout_s=10),
                                            je.admin("stats", {"te": decode_te}, timeout_s=10))
                holds, waiting = p.data.stats.kv_transfer_holds, d.data.stats.num_waiting
                seen["holds"] = max(seen["holds"], holds)
                seen["decode_waiting"] = max(seen["decode_waiting"], waiting)
                seen["both"] |= holds > 0 and waiting > 0
                await asyncio.sleep(0.01)
            return await work, seen

        outputs, seen = asyncio.run(run_and_watch())
        # nothing lost, nothing failed: every request completes with the colocated tokens
        assert token_ids(outputs) == colocated["deepseek_v3"]["crowd"]
        assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outputs)
        # backpressure: requests queued on the decode TE while their KV stayed held on the prefill TE
        assert seen["both"] and seen["holds"] >= 2, seen
        decode = stats(je, decode_te)
        assert decode["kv_pulled"] == len(CROWD) and decode["kv_pull_recomputed"] == 0
        wait_until_released(je, [prefill_te])


# ---------------------------------------------------------------- must show 3: a transfer that breaks
def _children(pid: int) -> list[int]:
    """Direct child processes of `pid` (a TE master's worker ranks)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def kill_te_with_ranks(proc) -> None:
    """SIGKILL a TE's master and its worker ranks at once: its KV block servers die with it."""
    ranks = _children(proc.pid)
    kill_te(proc)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_refused(address: tuple[str, int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(tuple(address), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{address} still accepts connections")


def test_a_pull_from_a_dead_prefill_te_is_recomputed_on_the_decode_te(models, colocated):
    """The prefill TE hands a request off and dies before the decode TE pulls: the pull fails
    (connection refused), the decode TE computes the prompt itself, and requests decoding beside it
    are unaffected."""
    layout = deployment(pd_groups("1p1d", "tcp"))
    with running_deployment(models["deepseek_v3"], layout, engine={},
                            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (jes, procs):
        je = jes[0]
        (prefill_te,), (decode_te,) = names(procs, "prefill"), names(procs, "decode")
        held: dict = {}
        victim_handed_off = None

        def hold_the_victim(job):  # the JE's hand-off step, held back for one request
            if job.parent_id == "victim":
                held["job"] = job
                victim_handed_off.set()
            else:
                Router._on_hand_off(je, job)

        je._on_hand_off = hold_the_victim

        async def run():
            nonlocal victim_handed_off
            victim_handed_off = asyncio.Event()
            progress: dict[str, int] = {}  # request -> tokens received (-1: finished)

            async def one(request_id, tokens, max_tokens):
                final = None
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                async for out in je.generate(None, tokens, params, request_id):
                    final = out
                    progress[request_id] = len(out.outputs[0].token_ids)
                progress[request_id] = -1
                return final

            bystanders = [asyncio.ensure_future(one(f"bystander-{i}", p, BYSTANDER_TOKENS))
                          for i, p in enumerate(BYSTANDERS)]
            victim = asyncio.ensure_future(one("victim", VICTIM, VICTIM_TOKENS))
            await asyncio.wait_for(victim_handed_off.wait(), 60)
            for _ in range(3000):  # a second token: the bystanders' pulls are done and they decode
                if all(progress.get(f"bystander-{i}", 0) not in (0, 1) for i in range(len(BYSTANDERS))):
                    break
                await asyncio.sleep(0.01)
            job = held["job"]
            kill_te_with_ranks(procs[prefill_te])
            for region in job.kv_params.regions:
                wait_refused(region.tcp_address)
            running_beside = [progress.get(f"bystander-{i}", 0) > 0 for i in range(len(BYSTANDERS))]
            Router._on_hand_off(je, job)  # now the decode TE gets it: its pull must fail
            results = await asyncio.wait_for(asyncio.gather(victim, *bystanders), 120)
            return results, running_beside

        (victim_out, *bystander_outs), running_beside = asyncio.run(run())
        assert all(running_beside), "the bystanders finished before the broken transfer; make them longer"
        assert token_ids([victim_out]) == colocated["deepseek_v3"]["victim"]
        assert victim_out.outputs[0].finish_reason == "length"
        assert token_ids(bystander_outs) == colocated["deepseek_v3"]["bystanders"]
        decode = stats(je, decode_te)
        assert decode["kv_pull_recomputed"] == 1
        assert decode["kv_pulled"] == len(BYSTANDERS) + 1  # their pulls worked; the victim's was attempted
        assert decode["healthy"]


def test_requests_routed_to_a_dead_prefill_te_are_rerouted(models, colocated):
    """A prefill TE dies and round-robin still sends it requests (the JE has not noticed yet): they are
    routed again (at once if the JE cannot even send to it, else when its heartbeats time out)."""
    with running_deployment(models["deepseek_v3"], "2p1d", engine=ENGINE, heartbeat_timeout_s=1.5) as (jes, procs):
        je = jes[0]
        dead = "pd-prefill-0"
        sent: list[tuple[str, str]] = []  # (engine request id "child@attempt", TE) of every prefill task
        send = je.dispatcher.send

        def record(te, item):
            if isinstance(item, AddRequest) and item.kv_transfer == PRODUCER:
                sent.append((item.req_id, te.name))
            send(te, item)

        je.dispatcher.send = record
        kill_te(procs[dead])
        outputs = asyncio.run(generate_all(je, MIXED, MIXED_TOKENS, policy="round_robin", timeout_s=60))
        assert token_ids(outputs) == colocated["deepseek_v3"]["mixed"]
        assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outputs)
        to_dead = {req_id for req_id, te in sent if te == dead}
        assert to_dead and all(req_id.endswith("@1") for req_id in to_dead), sent
        retried = {req_id for req_id, _ in sent if not req_id.endswith("@1")}
        assert {r.rsplit("@", 1)[0] for r in retried} == {r.rsplit("@", 1)[0] for r in to_dead}
        assert all(te != dead for req_id, te in sent if req_id in retried)
        assert je.registry.get(dead) is None  # dropped


# ---------------------------------------------------------------- the JE's side, against fake TEs
class FakeTE:
    """A TE as the JE sees it: heartbeats out, requests in (no engine behind it)."""

    def __init__(self, ctx: zmq.Context, je: Router, name: str, role: str, group: str, kv_usage: float = 0.0):
        self.inbox = cluster_auth.server(ctx.socket(zmq.PULL))
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.heartbeat = EngineHeartbeat(name=name, role=role, group=group, input_addr=f"tcp://127.0.0.1:{port}",
                                         kv_events_addr="", model="m", max_model_len=4096, block_size=BLOCK_SIZE,
                                         attn_tp=1, attn_dp=1, stats=EngineStats(kv_usage=kv_usage))
        self.to_je = cluster_auth.client(ctx.socket(zmq.PUSH))
        self.to_je.connect(je.register_addr)
        self.outputs = cluster_auth.client(ctx.socket(zmq.PUSH))
        self.outputs.connect(je.output_addr)

    def beat(self, leaving: bool = False) -> None:
        self.heartbeat.leaving = leaving
        self.heartbeat.timestamp = time.time()
        self.to_je.send(codec.encode(self.heartbeat))

    async def next_message(self, kind: type, timeout_s: float = 10.0):
        """The next message of `kind` this TE received (others, such as KV snapshot queries, are skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            while self.inbox.poll(0):
                item = codec.decode(self.inbox.recv())
                if isinstance(item, kind):
                    return item
            await asyncio.sleep(0.01)
        raise AssertionError(f"{self.heartbeat.name} received no {kind.__name__}")

    def received(self) -> list:
        """Requests and KV releases that arrived and were not read yet."""
        items = []
        while self.inbox.poll(0):
            items.append(codec.decode(self.inbox.recv()))
        return [i for i in items if not isinstance(i, AdminRequest)]

    def send(self, delta: RequestDelta) -> None:
        self.outputs.send(codec.encode(EngineOutputs(deltas=[delta], timestamp=time.time())))

    def close(self) -> None:
        for sock in (self.inbox, self.to_je, self.outputs):
            sock.close(0)


@contextlib.contextmanager
def fake_deployment(model: str, spec: list[tuple[str, str, str, float]], **router_settings):
    """A JE with fake TEs (name, role, group, KV usage its heartbeats report); yields (je, {name: FakeTE}).
    `router_settings`: the JE's (RouterConfig; a heartbeat timeout of 30 s unless given)."""
    je = Router(RouterConfig(**{"model": model, "heartbeat_timeout_s": 30.0, **router_settings}))
    ctx = zmq.Context()
    tes = {name: FakeTE(ctx, je, name, role, group, kv_usage) for name, role, group, kv_usage in spec}
    try:
        yield je, tes
    finally:
        for te in tes.values():
            te.close()
        ctx.term()
        je.shutdown()


async def start_and_hand_off(je: Router, tes: dict, prefill: str, decode: str):
    """Register the fake TEs, submit one request (load-aware), let `prefill` hand it off; returns
    (the generate task, the hand-off params, the AddRequest `decode` got)."""
    await je.start()
    for te in tes.values():
        te.beat()
    for _ in range(500):  # routable: a TE whose link handshake the JE has not seen yet takes no job
        if len(je.registry.routable()) == len(tes):
            break
        await asyncio.sleep(0.01)
    assert len(je.registry.routable()) == len(tes)

    async def generate():
        final = None
        async for out in je.generate(None, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0), "r"):
            final = out
        return final

    REQUEST_ROUTING_POLICY.set("load")  # the least loaded prefill TE, then its group's least loaded decode TE
    work = asyncio.ensure_future(generate())
    # steps 1-3: the prefill TE computes the prompt and hands off its first token and where the KV is
    task = await tes[prefill].next_message(AddRequest)
    assert task.kv_transfer == PRODUCER and task.reply_to == je.output_addr
    region = KVRegion(engine=f"{prefill}/rank0", region="kv", layers=[], host_id="host")
    params = KVTransferParams(role=KVTransferRole.CONSUMER, engine=prefill,
                                  engine_addr=tes[prefill].heartbeat.input_addr, dp_rank=0, attn_tp=1, attn_dp=1,
                                  regions=[region], block_ids=[3], num_tokens=3, num_cached_tokens=0)
    tes[prefill].send(RequestDelta(req_id=task.req_id, new_token_ids=[11], num_prompt_tokens=3,
                                       kv_transfer_params=params))
    # step 4: the decode TE gets the job with the hand-off and the first token
    task = await tes[decode].next_message(AddRequest)
    assert task.kv_transfer == params and task.output_token_ids == [11]
    return work, params, task


def test_a_decode_job_whose_decode_te_leaves_moves_within_its_group_and_frees_the_prefill_hold(models):
    # group a: an idle prefill TE and two decode TEs (the second busier); group b: a busy prefill TE and
    # an idle decode TE
    spec = [("pre-a", "prefill", "a", 0.0), ("dec-a0", "decode", "a", 0.0), ("dec-a1", "decode", "a", 0.5),
            ("pre-b", "prefill", "b", 0.9), ("dec-b0", "decode", "b", 0.0)]
    with fake_deployment(models["deepseek_v3"], spec) as (je, tes):
        async def scenario():
            work, _, task = await start_and_hand_off(je, tes, "pre-a", "dec-a0")
            # the decode TE leaves before it answers: the job moves to the other decode TE of its group
            # (never to group b's idle one), which computes the prompt itself; the prefill TE frees its hold
            tes["dec-a0"].beat(leaving=True)
            moved = await tes["dec-a1"].next_message(AddRequest)
            assert moved.kv_transfer.recompute is True and moved.output_token_ids == [11]
            release = await tes["pre-a"].next_message(ReleaseKV)
            assert release.req_ids == [task.req_id]
            tes["dec-a1"].send(RequestDelta(req_id=moved.req_id, new_token_ids=[12, 13], finish_reason="length",
                                                num_prompt_tokens=3))
            return await asyncio.wait_for(work, 10)

        final = asyncio.run(scenario())
        assert final.outputs[0].token_ids == [11, 12, 13] and final.outputs[0].finish_reason == "length"
        assert tes["dec-b0"].received() == []  # KV snapshot queries only, no request


def test_a_decode_te_that_fails_a_handed_off_job_frees_the_prefill_hold(models):
    spec = [("pre", "prefill", "pd", 0.0), ("dec", "decode", "pd", 0.0)]
    with fake_deployment(models["deepseek_v3"], spec) as (je, tes):
        async def scenario():
            work, _, task = await start_and_hand_off(je, tes, "pre", "dec")
            # e.g. refused at admission: the decode TE will never pull, so the prefill TE must not hold on
            tes["dec"].send(RequestDelta(req_id=task.req_id, new_token_ids=[], finish_reason="error",
                                             error="the waiting queue is full", error_type="QueueFullError"))
            release = await tes["pre"].next_message(ReleaseKV)
            assert release.req_ids == [task.req_id]
            return await asyncio.wait_for(work, 10)

        final = asyncio.run(scenario())
        assert final.outputs[0].finish_reason == "error" and final.outputs[0].token_ids == [11]
        assert "queue is full" in final.error
