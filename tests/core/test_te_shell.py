"""The TE shell's placement of requests on self-contained DP groups (core/te_shell.py): from the groups' load
reports plus the requests each report does not count yet, so a burst spreads evenly however the reports lag."""
from __future__ import annotations

import collections

from meshserve.config import EngineConfig
from meshserve.core.eplb_controller import EplbController
from meshserve.core.group_prefixes import GroupPrefixes
from meshserve.core.group_world import GroupWorld
from meshserve.core.te_shell import GroupView, TEShell
from meshserve.wire import codec
from meshserve.wire.client import (
    AbortRequests,
    AddRequest,
    AdminOp,
    AdminRequest,
    EngineReady,
    EngineStats,
    Tenancy,
)
from meshserve.wire.dp_group import HandOver
from meshserve.wire.heartbeat import EngineHeartbeat, EngineRole
from meshserve.wire.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvents, chain_block_hash
from meshserve.wire.sampling_params import SamplingParams

MAX_NUM_SEQS = 8


def _shell(num_groups: int) -> TEShell:
    """A shell holding only what placement reads (no processes, no sockets)."""
    shell = TEShell.__new__(TEShell)
    shell.config = EngineConfig.from_kwargs("m", max_num_seqs=MAX_NUM_SEQS)
    shell.engine_ready = EngineReady(num_kv_blocks=512, block_size=16, kv_bytes_per_token=1, max_model_len=4096,
                                     vocab_size=32000)
    shell.groups = []
    for index in range(num_groups):
        group = GroupView(index, proc=None, inbox=None, kv_events=None)
        group.ready = EngineReady(num_kv_blocks=128, block_size=16, kv_bytes_per_token=1, max_model_len=4096,
                                  vocab_size=32000)
        shell.groups.append(group)
    shell.world = GroupWorld(shell.config, shell.groups, lambda config: config)
    shell.prefixes = GroupPrefixes(block_size=16)
    shell._recent_aborts = collections.deque(maxlen=16)
    return shell


def _request(i: int) -> AddRequest:
    return AddRequest(req_id=f"r{i}", prompt_token_ids=[5, 6, 7, 8], arrival_time=0.0,
                      sampling_params=SamplingParams(max_tokens=64))


def _report(running: int, received: int) -> EngineHeartbeat:
    return EngineHeartbeat(name="te", role=EngineRole.COLOCATED, group="g", input_addr="", kv_events_addr="",
                           model="m", max_model_len=4096, block_size=16, attn_tp=1, attn_dp=4,
                           stats=EngineStats(num_running=running, num_kv_blocks=128, requests_received=received))


def _placements(shell: TEShell, requests: range) -> collections.Counter:
    return collections.Counter(shell._place(_request(i)).index for i in requests)


def test_a_burst_spreads_evenly_over_the_groups():
    shell = _shell(4)
    assert _placements(shell, range(32)) == {0: 8, 1: 8, 2: 8, 3: 8}


def test_a_report_counts_only_the_requests_its_group_had_received():
    shell = _shell(2)
    _placements(shell, range(8))  # 4 each
    group = shell.groups[0]
    group.on_report(_report(running=3, received=3))  # made before the 4th request reached the group
    assert len(group.unreported) == 1 and group.load(MAX_NUM_SEQS).num_requests == 4
    group.on_report(_report(running=4, received=4))
    assert not group.unreported and group.load(MAX_NUM_SEQS).num_requests == 4


class _Link:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, item, reply_to: str = "") -> None:
        self.sent.append((item, reply_to))


class _Inbox:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.frames.append(data)


def test_the_shell_answers_expert_balancing_and_every_group_gets_the_other_commands():
    shell = _shell(2)
    shell.link = _Link()
    shell.dead_error = None
    shell.eplb = EplbController(None, [], world_size=2, slice_s=1.0)  # a model without MoE layers
    for group in shell.groups:
        group.inbox = _Inbox()
    shell._on_admin(AdminRequest(query_id=1, op=AdminOp.EPLB_STATUS, reply_to="tcp://fe:1"))
    shell._on_admin(AdminRequest(query_id=2, op=AdminOp.EPLB_REBALANCE, reply_to="tcp://fe:1"))
    (status, to), (refused, _) = shell.link.sent
    assert status.ok and not status.data.enabled and to == "tcp://fe:1"
    assert not refused.ok and refused.error  # the controller's own refusal, passed on
    assert all(not group.inbox.frames for group in shell.groups)
    shell._on_admin(AdminRequest(query_id=3, op=AdminOp.DRAIN, reply_to="tcp://fe:1"))
    assert all(len(group.inbox.frames) == 1 for group in shell.groups) and len(shell.link.sent) == 2


def test_a_report_after_finishes_frees_the_group_for_the_next_burst():
    shell = _shell(2)
    _placements(shell, range(16))  # both groups full
    shell.groups[0].on_report(_report(running=0, received=8))  # its 8 finished; group 1 has not reported yet
    shell.groups[1].on_report(_report(running=8, received=8))
    # the next burst fills the free group to its batch limit before the other gets any
    assert _placements(shell, range(16, 24)) == {0: 8}


def test_requests_handed_over_by_a_retired_group_go_to_the_groups_left():
    shell = _shell(3)
    for group in shell.groups:
        group.inbox = _Inbox()
    shell.world.served = [shell.groups[0], shell.groups[2]]  # group 1 retired after its rank was lost
    moved = [AddRequest(req_id=f"r{i}", prompt_token_ids=[5, 6, 7, 8], arrival_time=0.0, output_token_ids=[9, i],
                        sampling_params=SamplingParams(max_tokens=64)) for i in range(4)]
    shell._on_report(HandOver(requests=moved))
    assert not shell.groups[1].inbox.frames
    received = [codec.decode(frame) for g in (shell.groups[0], shell.groups[2]) for frame in g.inbox.frames]
    assert sorted(r.req_id for r in received) == ["r0", "r1", "r2", "r3"]
    assert all(r.output_token_ids == [9, int(r.req_id[1:])] for r in received)  # they go on from these tokens
    assert len(shell.groups[0].inbox.frames) == len(shell.groups[2].inbox.frames) == 2


def test_a_request_aborted_while_it_was_handed_over_is_not_placed_again():
    shell = _shell(2)
    for group in shell.groups:
        group.inbox = _Inbox()
    shell._on_client(AbortRequests(req_ids=["gone"]))  # reaches the groups before the handover reaches the shell
    assert all(len(group.inbox.frames) == 1 for group in shell.groups)
    moved = [AddRequest(req_id=req_id, prompt_token_ids=[5, 6], arrival_time=0.0, output_token_ids=[9],
                        sampling_params=SamplingParams(max_tokens=8)) for req_id in ("gone", "kept")]
    shell._on_report(HandOver(requests=moved))
    placed = [codec.decode(frame) for g in shell.groups for frame in g.inbox.frames[1:]]
    assert [r.req_id for r in placed] == ["kept"]


def _stored(seq: int, tokens: list[int], cache_salt: str = "") -> KVCacheEvents:
    """A group's event: it cached the full blocks of `tokens` (16 a block)."""
    hashes, parent = [], None
    for start in range(0, len(tokens) - 15, 16):
        parent = chain_block_hash(parent, tokens[start:start + 16], cache_salt)
        hashes.append(parent)
    return KVCacheEvents(seq=seq, timestamp=0.0, dp_rank=0, engine="te", events=[
        BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:len(hashes) * 16], block_size=16)])


def test_a_request_goes_to_the_group_caching_its_prefix():
    shell = _shell(3)
    prefix = list(range(100, 164))  # 4 blocks
    shell.prefixes.apply(2, _stored(1, prefix))
    shell.prefixes.apply(1, _stored(1, prefix[:16]))
    follow_up = AddRequest(req_id="r", prompt_token_ids=[*prefix, 7, 8], arrival_time=0.0,
                           sampling_params=SamplingParams(max_tokens=8))
    assert shell.prefixes.hits(follow_up.prompt_token_ids, "", [0, 1, 2]) == [0, 16, 64]
    assert shell._place(follow_up).index == 2
    # another tenant's namespace holds nothing of it: placed by load alone (the least loaded, group 0)
    other = AddRequest(req_id="s", prompt_token_ids=[*prefix, 7, 8], arrival_time=0.0,
                       sampling_params=SamplingParams(max_tokens=8), tenancy=Tenancy(tenant="t", cache_salt="x"))
    assert shell.prefixes.hits(other.prompt_token_ids, "x", [0, 1, 2]) == [0, 0, 0]
    assert shell._place(other).index == 0


def test_prefix_events_removed_cleared_and_missed():
    prefixes = GroupPrefixes(block_size=16)
    tokens = list(range(48))
    prefixes.apply("g", _stored(1, tokens))
    assert prefixes.hits([*tokens, 1], "", ["g"]) == [48]
    assert prefixes.hits(tokens, "", ["g"]) == [32]  # the last token is always computed
    first = chain_block_hash(None, tokens[:16])
    second = chain_block_hash(first, tokens[16:32])
    prefixes.apply("g", KVCacheEvents(seq=2, timestamp=0.0, dp_rank=0, engine="te",
                                      events=[BlockRemoved(block_hashes=[second])]))
    assert prefixes.hits([*tokens, 1], "", ["g"]) == [16]  # a chain ends at its first missing block
    prefixes.apply("g", KVCacheEvents(seq=3, timestamp=0.0, dp_rank=0, engine="te", events=[AllBlocksCleared()]))
    assert prefixes.hits([*tokens, 1], "", ["g"]) == [0]
    prefixes.apply("g", _stored(4, tokens))
    prefixes.apply("g", _stored(9, tokens[:16]))  # batches 5-8 were missed: only what came since is known
    assert prefixes.hits([*tokens, 1], "", ["g"]) == [16]


class _Publisher:
    """What the shell publishes for job executors: (group, events) per batch, numbered."""

    def __init__(self) -> None:
        self.seq, self.sent = 0, []

    def publish(self, group: int, events: list) -> None:
        self.seq += 1
        self.sent.append((group, events))

    def publish_cleared(self, num_groups: int, first_group: int = 0) -> None:
        for group in range(first_group, first_group + num_groups):
            self.publish(group, [AllBlocksCleared()])


def test_the_shell_speaks_for_its_groups_prefix_caches_to_job_executors():
    shell = _shell(2)
    shell.link, shell.dead_error, shell.kv_events = _Link(), None, _Publisher()
    tokens = list(range(100, 132))
    shell._on_group_events(shell.groups[1], _stored(1, tokens))
    shell._on_admin(AdminRequest(query_id=5, op=AdminOp.KV_SNAPSHOT, reply_to="tcp://je:1"))
    (reply, to), = shell.link.sent
    first = chain_block_hash(None, tokens[:16])
    assert to == "tcp://je:1" and reply.ok and reply.data.seq == 1
    assert reply.data.blocks == {0: [], 1: [(first, None, []), (chain_block_hash(first, tokens[16:32]), first, [])]}
    assert shell.kv_events.sent == [(1, _stored(1, tokens).events)]  # the group's batch, the shell's number
    # a gap in a group's numbers: job executors are told to forget the group before its next batch
    shell._on_group_events(shell.groups[1], _stored(5, tokens[:16]))
    assert [events[0].__class__.__name__ for _, events in shell.kv_events.sent[1:]] == ["AllBlocksCleared",
                                                                                        "BlockStored"]
    assert shell.prefixes.hits([*tokens, 1], "", [1]) == [16]
