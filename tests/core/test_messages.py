"""Every message that crosses a process round-trips through its codec, and none carries an untyped payload.

The engine's messages (`meshserve.wire`) and the memory pool's (`meshserve.pool.messages`) are
found by walking their base classes, so a new message type fails here until it has a sample below, built
with a realistic value in every field (no field left at its default, so a field the codec dropped shows).
"""
from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest

from meshserve.config import EngineConfig
from meshserve.pool import messages as pool_msg
from meshserve.utils.faults import Fault, FaultKind
from meshserve.wire import codec
from meshserve.wire.base import Message, Shutdown
from meshserve.wire.client import (
    AbortRequests,
    AddRequest,
    AdminData,
    AdminOp,
    AdminReply,
    AdminRequest,
    ContextCacheDeleted,
    ContextCacheInfo,
    ContextCacheListing,
    EngineError,
    EngineOutputs,
    EngineReady,
    EngineStats,
    EplbStatus,
    ErrorType,
    ExpertLoad,
    FinishReason,
    KVSnapshot,
    ReleaseKV,
    RequestDelta,
    StatsQuery,
    StatsResult,
    Tenancy,
    error_type_of,
)
from meshserve.wire.cluster import (
    ClusterQuery,
    ClusterStatus,
    GroupDemand,
    GroupStatus,
    JEStatus,
    JobExecutorReport,
    TEStatus,
    WarmAssign,
    WarmReady,
)
from meshserve.wire.codec import _MESSAGE_TYPES, RefusedFrame
from meshserve.wire.dp_group import EplbRelay, GroupExpertLoad, HandOver, WorldRestart
from meshserve.wire.eplb import EplbCommand, EplbPhase, PlacementData
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole, StartupTimeline
from meshserve.wire.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvents,
    KVConnectorMetadata,
    KVConnectorReport,
    KVPull,
    KVPullDone,
    KVRegion,
    KVRegionLayer,
    KVShmSegment,
    KVTransferParams,
    KVTransferRole,
    LinkProbe,
    LinkState,
    LinkStatus,
    PoolBlock,
    PoolFetch,
    PoolFetchDone,
)
from meshserve.wire.sampling_params import SamplingParams, StructuredOutputs
from meshserve.wire.worker import (
    CachedRequestData,
    InjectFault,
    ModelRunnerOutput,
    NewRequestData,
    SampleLogprobs,
    SchedulerOutput,
    StepBatch,
    WorkerEvent,
    WorkerEventKind,
    WorkerFailure,
    WorkerHandshake,
    WorkerPing,
    WorkerPong,
    WorkerReady,
)

PACKAGE = Path(__file__).resolve().parents[2] / "meshserve"

PARAMS = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234, presence_penalty=0.5,
                        frequency_penalty=-0.5, repetition_penalty=1.1, stop=["\n\n"], stop_token_ids=[2, 7],
                        max_tokens=64, min_tokens=4, ignore_eos=True, logprobs=3, include_stop_str_in_output=True,
                        skip_special_tokens=False, logit_bias={5: -2.5},
                        structured_outputs=StructuredOutputs(json='{"type": "object"}', lenient=True,
                                                             starts_after=[7, 8]))
PLACEMENT = PlacementData(format="meshserve-expert-placement/1", num_logical=4, num_ranks=2,
                              redundant_per_rank=1, layers={"1": [0, 1, 3, 2, 3, 0]}, slots_per_rank=3,
                              replicas={"1": [[0, 5], [1], [3], [2, 4]]})
LAYER = KVRegionLayer(shape=[64, 2, 16, 128], dtype="bfloat16")
REGION = KVRegion(engine="prefill-0", region="kv", layers=[LAYER], host_id="host-a",
                      tcp_address=("10.0.0.5", 40123), shm=[KVShmSegment("kv-0", [64, 2, 16, 128], "bfloat16")],
                      device="cuda", device_id="GPU-1234")
LINK = LinkStatus(decode="pd-decode-0", prefill="pd-prefill-1", state=LinkState.DOWN, since=1.7e9,
                      rtt_s=0.004, consecutive_failures=2, probes=40, probe_failures=2, pulls=9, pull_failures=1,
                      slow_pulls=3, last_error="TransferError: connection refused")
FAULT = Fault(kind=FaultKind.LINK_BREAK, rank=1, after_steps=3, times=2, duration_s=5.0, delay_s=0.5,
              peer="prefill-0")
PROBE = LinkProbe(peer="pd-prefill-1/rank0", ok=False, rtt_s=2.0, error="TransferError: timed out")
STATS = EngineStats(num_running=3, num_waiting=2, kv_usage=0.25, num_kv_blocks=512, prefix_cache_queries=100,
                        prefix_cache_hits=40, num_preemptions=1, pool_hit_tokens=32, waiting_tokens=900,
                        running_tokens=700, kv_transfer_holds=1, kv_pulled=2, kv_pull_recomputed=1,
                        dropped_frames={"te-inbox": 2}, links=[LINK], num_rollbacks=1, num_recoveries=2,
                        num_migrated=5, world_size=3, recovering="worker 3 died", last_failure="worker 3 died",
                        last_failure_silent_s=0.5, healthy=False, error="worker 1 died",
                        spec_drafted=[10, 8], spec_accepted=[7, 4], spec_verify_steps=10, spec_tokens=21,
                        microbatched_steps=4, gc_marked_steps=4, requests_received=12)
TRANSFER = KVTransferParams(role=KVTransferRole.CONSUMER, engine="prefill-0", engine_addr="tcp://10.0.0.5:5555",
                                dp_rank=1, attn_tp=2, attn_dp=2, regions=[REGION], block_ids=[4, 9],
                                num_tokens=32, num_cached_tokens=16, hold_s=30.0, hold_expires_at=1.7e9,
                                recompute=True)
POOL_BLOCK = PoolBlock(block_id=12, key="m/ns/ab12")
LOGPROBS = SampleLogprobs(logprob=-0.1, top=[(11, -0.1), (13, -2.3)])
DELTA = RequestDelta(req_id="cmpl-1-0", new_token_ids=[11, 12], finish_reason=FinishReason.LENGTH,
                         stop_reason=2, new_logprobs=[LOGPROBS, SampleLogprobs(-0.4, [])], num_prompt_tokens=9,
                         num_cached_tokens=8, error="the waiting queue is full", error_type=ErrorType.QUEUE_FULL,
                         kv_transfer_params=TRANSFER)
STORED = BlockStored(block_hashes=[2**64 - 1, 17], parent_block_hash=99, token_ids=list(range(8)), block_size=4)

TIMELINE = StartupTimeline(process_start=1.7e9, entry=1.7e9 + 0.01, imports_done=1.7e9 + 0.02,
                               rank_start=1.7e9 + 0.05, load_start=1.7e9 + 0.1, load_end=1.7e9 + 1.1, ready=1.7e9 + 1.3,
                               load_source="page-cache", load_bytes=1 << 30, prewarmed=True)
DEMAND = GroupDemand(group="pd/prefill", held=2, held_oldest_s=1.5, arrivals=7, ttft_s=[0.3, 2.5], tpot_s=[0.05])
TE_STATUS = TEStatus(name="pd-decode-2", group="pd", role="decode", state="draining", pid=123, host="10.0.0.4",
                         source="prewarmed+fork", restarts=1, num_running=3, num_waiting=1, kv_usage=0.5,
                         uptime_s=33.0)
GROUP_STATUS = GroupStatus(group="pd", role="decode", current=2, target=1, min_count=1, max_count=4,
                               reason="idle")
JE_STATUS = JEStatus(name="je-0", http_addr="http://10.0.0.9:8000", pid=99, state="ready")

SAMPLES: dict[type, object] = {
    # ---- master -> worker
    NewRequestData: NewRequestData(req_id="r1", token_ids=[5, 6, 7], sampling_params=PARAMS, block_ids=[3],
                                           num_computed_tokens=2, num_prompt_tokens=3),
    CachedRequestData: CachedRequestData(req_id="r2", new_block_ids=[8], num_computed_tokens=17),
    SchedulerOutput: SchedulerOutput(
        step_id=9, new_reqs=[NewRequestData("r1", [5, 6, 7], PARAMS, [3], 0, 3)],
        cached_reqs=[CachedRequestData("r2", [8], 17)], num_scheduled_tokens={"r1": 3, "r2": 1},
        finished_req_ids=["r0"], num_draft_tokens=2,
        mtp_catch_up=True),
    KVRegionLayer: LAYER,
    KVShmSegment: KVShmSegment(shm_name="kv-1", shape=[64, 2, 16, 128], dtype="float16"),
    KVRegion: REGION,
    KVTransferParams: TRANSFER,
    PoolBlock: POOL_BLOCK,
    PoolFetch: PoolFetch(req_id="r1", blocks=[POOL_BLOCK]),
    KVPull: KVPull(req_id="r3", src_block_ids=[4, 9], dst_block_ids=[1, 2], sources=[REGION]),
    KVConnectorMetadata: KVConnectorMetadata(
        pool_stores=[POOL_BLOCK], pool_fetches=[PoolFetch("r1", [POOL_BLOCK])],
        kv_pulls=[KVPull("r3", [4], [1], [REGION])]),
    StepBatch: StepBatch(
        per_dp=[SchedulerOutput(step_id=9, num_draft_tokens=2)],
        eplb=EplbCommand(EplbPhase.PREFETCH, PLACEMENT), report_load=True,
        kv_connector={1: KVConnectorMetadata(pool_stores=[POOL_BLOCK])}, microbatches=2, collect_garbage=True),
    # ---- worker -> master
    SampleLogprobs: LOGPROBS,
    ModelRunnerOutput: ModelRunnerOutput(step_id=9, dp_rank=1, expert_load=[[3, 0, 5, 1]],
                                                 sampled={"r1": [42, 7]}, num_drafts={"r1": 2},
                                                 logprobs={"r1": [SampleLogprobs(-0.2, [(42, -0.2)]),
                                                                  SampleLogprobs(-0.5, [])]},
                                                 failed={"r2": "ValueError: stop token 99 is outside the vocabulary"},
                                                 execute_seconds=0.012),
    WorkerReady: WorkerReady(rank=1, rank_start=1.7e9 - 2, num_kv_blocks=512, kv_bytes_per_token=4096, kv_region=REGION,
                                     moe_layers=[1, 2], num_logical_experts=8, vocab_size=32000, load_start=1.7e9,
                                     load_end=1.7e9 + 1, load_source="fork", load_bytes=1 << 30,
                                     weights_addr="tcp://10.0.0.1:7100"),
    WorkerEvent: WorkerEvent(rank=1, kind=WorkerEventKind.EPLB_FAILED, detail="OSError: disk"),
    WorkerFailure: WorkerFailure(rank=2, message="CUDA out of memory"),
    WorkerHandshake: WorkerHandshake(rank=3, config=EngineConfig.from_kwargs("/models/tiny", block_size=32),
                                             work_addr="tcp://10.0.0.1:6001", result_addr="tcp://10.0.0.1:6002",
                                             dist_init_method="tcp://10.0.0.1:29500", error="rank 3 is being recovered",
                                             retry=True, redirect="tcp://10.0.0.1:41234"),
    PoolFetchDone: PoolFetchDone(req_id="r1", num_blocks=3),
    KVPullDone: KVPullDone(req_id="r3", error="ConnectionResetError"),
    KVConnectorReport: KVConnectorReport(rank=1, dp_rank=1, pool_fetches=[PoolFetchDone("r1", 3)],
                                                 kv_pulls=[KVPullDone("r3")], link_probes=[PROBE]),
    LinkProbe: PROBE,
    LinkStatus: LINK,
    # ---- client <-> master
    AddRequest: AddRequest(req_id="cmpl-1-0", prompt_token_ids=[1, 2, 3], sampling_params=PARAMS,
                                   arrival_time=1.7e9, priority=-2, eos_token_ids=[2], reply_to="tcp://10.0.0.9:7000",
                                   kv_transfer=TRANSFER, output_token_ids=[44], context_cache_id="ctxc-1",
                                   context_cache_ttl_s=60.0,
                                   tenancy=Tenancy(tenant="key:0123456789abcdef", cache_salt="9f" * 16)),
    AbortRequests: AbortRequests(req_ids=["cmpl-1-0", "cmpl-1-1"]),
    ReleaseKV: ReleaseKV(req_ids=["cmpl-2-0"]),
    RequestDelta: DELTA,
    EngineOutputs: EngineOutputs(deltas=[DELTA], timestamp=1.7e9),
    StatsQuery: StatsQuery(reply_to="tcp://10.0.0.9:7000"),
    EngineStats: STATS,
    EngineReady: EngineReady(num_kv_blocks=512, block_size=16, kv_bytes_per_token=4096, max_model_len=4096,
                                     vocab_size=32000),
    EngineError: EngineError(message="worker 0 died", fatal=False, engine="decode-1"),
    KVCacheEvents: KVCacheEvents(seq=5, timestamp=1.7e9, dp_rank=1, engine="colocated-0", events=[
        STORED, BlockRemoved(block_hashes=[17]), AllBlocksCleared()]),
    AdminRequest: AdminRequest(query_id=4, op=AdminOp.EPLB_REBALANCE, placement=PLACEMENT,
                                       cache_id="ctxc-1", fault=FAULT, reply_to="tcp://10.0.0.9:7000"),
    WorkerPing: WorkerPing(seq=7),
    WorkerPong: WorkerPong(rank=1, seq=7),
    InjectFault: InjectFault(fault=FAULT),
    WorldRestart: WorldRestart(generation=3, dist_init="tcp://127.0.0.1:29700", reason="rank 5 died",
                               lost_ranks=[5], index=2,
                               config=EngineConfig.from_kwargs("/models/tiny", parallel="attn=TP1+DP3 moe=TP1+EP3"),
                               retire=True),
    HandOver: HandOver(requests=[AddRequest(req_id="cmpl-3-0", prompt_token_ids=[4, 5], sampling_params=PARAMS,
                                            arrival_time=1.7e9, output_token_ids=[9, 8])]),
    GroupExpertLoad: GroupExpertLoad(counts=[[3, 0, 5], [1, 1, 6]]),
    EplbRelay: EplbRelay(command=EplbCommand(EplbPhase.ENABLE)),
    AdminReply: AdminReply(query_id=4, ok=False, data=ContextCacheDeleted(id="ctxc-1", deleted=True),
                                   error="partly failed"),
    Shutdown: Shutdown(),
    EngineHeartbeat: EngineHeartbeat(name="decode-1", role=EngineRole.DECODE, group="pd-a",
                                             input_addr="tcp://10.0.0.2:5555", kv_events_addr="tcp://10.0.0.2:5556",
                                             model="tiny-moe", max_model_len=4096, block_size=16, attn_tp=2,
                                             attn_dp=2, stats=STATS, kv_event_seq=5, timestamp=1.7e9, leaving=True,
                                             draining=True, pid=4242, startup=TIMELINE,
                                             weights_addrs=["tcp://10.0.0.2:7100", "tcp://10.0.0.2:7101"]),
    # ---- cluster manager
    StartupTimeline: TIMELINE,
    GroupDemand: DEMAND,
    JobExecutorReport: JobExecutorReport(name="je-0", http_addr="http://10.0.0.9:8000",
                                                 register_addr="tcp://10.0.0.9:7700", pid=99, te_names=["decode-1"],
                                                 groups=[DEMAND], timestamp=1.7e9),
    WarmReady: WarmReady(name="warm-3", pid=77, assign_addr="tcp://10.0.0.3:7300", num_workers=2,
                                 host="10.0.0.3"),
    WarmAssign: WarmAssign(config=EngineConfig.from_kwargs("/models/tiny", te_name="main-colocated-4"),
                                   role=EngineRole.PREFILL, group="pd", listen="tcp://10.0.0.3:0",
                                   register=["tcp://10.0.0.9:7700"], assigned_at=1.7e9),
    ClusterQuery: ClusterQuery(op="scale", pool="pd/decode", target=3),
    TEStatus: TE_STATUS,
    GroupStatus: GROUP_STATUS,
    JEStatus: JE_STATUS,
    ClusterStatus: ClusterStatus(name="prod", backend="ray", manager_pid=5, tes=[TE_STATUS],
                                         groups=[GROUP_STATUS], jes=[JE_STATUS], warm=2,
                                         events=["12:00:01 drain TE pd-decode-2: idle"], ok=False,
                                         error="no pool 'x/y'"),
    # ---- memory pool
    pool_msg.Put: pool_msg.Put(req_id=1, namespace="kv", keys=["a", "b"]),
    pool_msg.PutReply: pool_msg.PutReply(req_id=1, stored=[True, False], error="server full"),
    pool_msg.Get: pool_msg.Get(req_id=2, namespace="kv", keys=["a"]),
    pool_msg.GetReply: pool_msg.GetReply(req_id=2, found=[True], error="tier read failed"),
    pool_msg.Exists: pool_msg.Exists(req_id=3, namespace="kv", keys=["a", "c"]),
    pool_msg.ExistsReply: pool_msg.ExistsReply(req_id=3, found=[True, False]),
    pool_msg.Delete: pool_msg.Delete(req_id=4, namespace="kv", keys=["a"]),
    pool_msg.DeleteReply: pool_msg.DeleteReply(req_id=4, deleted=[True]),
    pool_msg.ServerStatsQuery: pool_msg.ServerStatsQuery(req_id=5),
    pool_msg.ServerStats: pool_msg.ServerStats(req_id=5, server_id="s0", dram_bytes=1 << 30, ssd_bytes=1 << 32,
                                               num_keys=12, namespaces={"kv": 4096}, hits=9, misses=3),
    pool_msg.Register: pool_msg.Register(server_id="s0", address="tcp://10.0.0.3:7100", dram_capacity=1 << 30,
                                         ssd_capacity=1 << 34),
    pool_msg.RegisterReply: pool_msg.RegisterReply(accepted=False, quotas={"kv": 1 << 30}, num_servers=3,
                                                   error="duplicate server id"),
    pool_msg.Heartbeat: pool_msg.Heartbeat(server_id="s0", namespaces={"kv": 4096}),
    pool_msg.ViewQuery: pool_msg.ViewQuery(req_id=6),
    pool_msg.View: pool_msg.View(req_id=6, version=3, servers={"s0": "tcp://10.0.0.3:7100"}, virtual_nodes=128,
                                 quotas={"kv": 1 << 30}),
    pool_msg.CreateNamespace: pool_msg.CreateNamespace(req_id=7, namespace="kv", quota_bytes=1 << 30, force=True),
    pool_msg.NamespaceReply: pool_msg.NamespaceReply(req_id=7, ok=False, error="quota below use"),
    pool_msg.Error: pool_msg.Error(req_id=8, message="undecodable request"),
}

ADMIN_RESULTS = [
    ExpertLoad(format="meshserve-expert-load/1", num_logical=4, moe_layers=[1], slice_seconds=10.0,
                   slice_start_times=[1.7e9], counts=[[[3, 0, 5, 1]]]),
    EplbStatus(enabled=True, phase="prefetching", num_reconfigurations=2, last_error="rank 1 failed",
                   last_started_at=1.7e9, last_finished_at=1.7e9 + 3, num_slices=6, slice_seconds=10.0,
                   interval_seconds=600.0, placement=PLACEMENT, round=2, rounds=3),
    StatsResult(STATS),
    KVSnapshot(seq=5, blocks={0: [(17, None, [1, 2, 3, 4]), (18, 17, [5, 6, 7, 8])]}),
    ContextCacheDeleted(id="ctxc-1", deleted=True),
    ContextCacheListing(caches={"ctxc-1": ContextCacheInfo(dp_rank=1, num_tokens=64, expires_in_s=12.5)}),
]


def _subclasses(base: type) -> set[type]:
    found = set()
    for cls in base.__subclasses__():
        found |= {cls} | _subclasses(cls)
    return found


MESSAGE_TYPES = sorted(_subclasses(Message) | _subclasses(pool_msg.PoolMessage), key=lambda c: c.__qualname__)


def _round_trip(item):
    """Through the codec the type travels with: the framed one for a message, msgpack for a nested struct."""
    if isinstance(item, pool_msg.PoolMessage):
        return pool_msg.decode(pool_msg.encode(item))
    if type(item).__name__ in _MESSAGE_TYPES:
        return codec.decode(codec.encode(item))
    return msgspec.msgpack.decode(msgspec.msgpack.encode(item), type=type(item))


def _fields_at_default(item: msgspec.Struct) -> list[str]:
    return [f.name for f in msgspec.structs.fields(item)
            if f.default is not msgspec.NODEFAULT and getattr(item, f.name) == f.default
            or f.default_factory is not msgspec.NODEFAULT and getattr(item, f.name) == f.default_factory()]


def test_every_message_type_has_a_sample():
    missing = [cls.__qualname__ for cls in MESSAGE_TYPES if cls not in SAMPLES]
    assert not missing, f"add a sample for {missing}"


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__qualname__)
def test_every_message_round_trips_with_every_field_set(cls):
    sample = SAMPLES.get(cls)
    if sample is None:
        pytest.fail(f"{cls.__qualname__} has no sample")
    assert type(sample) is cls
    assert not _fields_at_default(sample), "give these fields a value other than their default"
    decoded = _round_trip(sample)
    assert decoded == sample and type(decoded) is cls


def test_every_frame_type_is_registered_with_the_codec():
    """A message sent on its own must be decodable by name; nested ones travel inside those."""
    top_level = [c for c in _subclasses(Message) if c.__name__ in _MESSAGE_TYPES]
    assert {c.__name__ for c in top_level} == set(_MESSAGE_TYPES)
    assert set(pool_msg._TYPES.values()) == _subclasses(pool_msg.PoolMessage)


@pytest.mark.parametrize("result", ADMIN_RESULTS, ids=lambda r: type(r).__name__)
def test_every_admin_result_round_trips_inside_a_reply(result):
    reply = AdminReply(query_id=3, data=result)
    decoded = codec.decode(codec.encode(reply))
    assert decoded == reply and type(decoded.data) is type(result)
    assert "result" not in reply.to_json()  # the HTTP API shows the result as it always did


def test_admin_results_cover_every_operation():
    assert len(ADMIN_RESULTS) == len(typing.get_args(AdminData))
    assert {type(r) for r in ADMIN_RESULTS} == set(typing.get_args(AdminData))


def _annotations(cls: type) -> dict[str, str]:
    """The annotations as written (this module uses postponed evaluation): strings to grep."""
    out = {}
    for klass in reversed(cls.__mro__):
        out.update(getattr(klass, "__annotations__", {}))
    return {name: str(hint) for name, hint in out.items()}


# Any or object anywhere, or a container without item types anywhere (`list | None`, `dict[str, list]`)
UNTYPED_HINT = re.compile(r"\bAny\b|\bobject\b|\b(?:list|dict|tuple|set|frozenset)\b(?!\[)")


@pytest.mark.parametrize("hint", ["Any", "dict[str, Any]", "list", "dict", "list | None", "None | dict",
                                  "dict[str, list]", "list[tuple] | None", "object"])
def test_the_untyped_check_refuses_bare_containers_inside_unions(hint):
    assert UNTYPED_HINT.search(hint)


@pytest.mark.parametrize("hint", ["list[int] | None", "dict[str, SampleLogprobs]", "tuple[str, int] | None",
                                  "list[tuple[int, float]]", "AdminData | None"])
def test_the_untyped_check_accepts_typed_containers(hint):
    assert not UNTYPED_HINT.search(hint)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__qualname__)
def test_no_message_field_is_untyped(cls):
    untyped = {name: hint for name, hint in _annotations(cls).items() if UNTYPED_HINT.search(hint)}
    assert not untyped, f"{cls.__qualname__} has untyped fields: {untyped}"


def test_no_tab_joined_payloads_remain():
    pattern = re.compile(r"""["']\\t["']\.join|partition\(["']\\t["']\)|split\(["']\\t["']\)""")
    hits = [f"{path.relative_to(PACKAGE.parent)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, f"tab-joined payloads: {hits}"


def test_a_request_with_bad_sampling_params_is_answered_not_dropped():
    frame = codec.encode(AddRequest(req_id="bad", prompt_token_ids=[1], sampling_params={"seed": 2**63},
                                      arrival_time=0.0, reply_to="tcp://10.0.0.9:7000"))
    with pytest.raises(RefusedFrame) as refused:
        codec.decode(frame)
    assert refused.value.reply_to == "tcp://10.0.0.9:7000"
    [delta] = refused.value.answer.deltas
    assert (delta.req_id, delta.finish_reason, delta.error_type) == ("bad", "error", "SamplingParamsError")


def test_an_admin_request_with_an_unknown_op_is_answered():
    frame = codec.encode(AdminRequest(query_id=9, op="no.such.op"))
    with pytest.raises(RefusedFrame) as refused:
        codec.decode(frame)
    assert refused.value.answer.query_id == 9 and "unknown admin operation" in refused.value.answer.error


def test_string_enums_read_as_the_words_the_api_shows():
    assert FinishReason.STOP == "stop" and f"{FinishReason.LENGTH}" == "length"
    assert error_type_of(ValueError("x")) is None


def test_the_startup_timeline_splits_te_pre_load_into_its_parts():
    launched = 1.7e9 - 0.05
    cold = msgspec.structs.replace(TIMELINE, prewarmed=False)
    parts = cold.pre_load_parts(launched)
    assert list(parts) == ["interpreter", "master_imports", "ranks_start", "rank_setup"]
    assert parts["interpreter"] == pytest.approx(0.06) and parts["rank_setup"] == pytest.approx(0.05)
    assert sum(parts.values()) == pytest.approx(cold.load_start - launched)
    assert TIMELINE.pre_load_parts(launched) == {}  # pre-warmed: its process and ranks were there before
    assert msgspec.structs.replace(cold, rank_start=0.0).pre_load_parts(launched) == {}  # a part not reported
