"""MoE token dispatch / combine over torch.distributed (gloo on CPU, NCCL on CUDA).

Two layouts:

- `EPDispatcher`: pure expert parallelism. Every rank owns a contiguous slice of
  the experts and its own tokens; each (token, expert) row travels to the rank
  holding the expert and its result travels back (CloudMatrix-Infer §4.2.1: counts
  exchanged first, buffers pre-allocated for the worst case, two buffer sets used
  alternately, optional early INT8 quantization of the dispatched rows).
- `HybridMoEComm`: MixServe's hybrid TP-EP. Inside a node the expert weights are
  sharded along the intermediate dimension (MoE TP) and the node's hidden states
  are replicated; across nodes the experts are split (EP). Dispatch and combine
  exist as a synchronous chain of collectives and as the fused pairwise schedule
  of MixServe Algorithms 1 and 2, where intra-node and inter-node transfers of
  different node blocks run concurrently.

Expert ids are global; slices are contiguous (`first_expert` = owner index * slice size). After the ranks
rebuild their process groups (a rolled-back step, meshserve/parallel/context.py) a communicator takes the new
ones with `use_group` / `use_groups`; its buffers stay.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshserve.layers.moe import fused_experts
from meshserve.parallel.topology import TopologyGroups
from meshserve.utils import envs

# Newer torch names first; the older ones are the same operations.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

INT8_MAX = 127.0
_DISPATCH_TAG = 11
_COMBINE_TAG = 12


# ---------------------------------------------------------------- expert compute helpers

def moe_layer_reference(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Single-rank MoE layer over all experts: the oracle for the distributed paths."""
    return fused_experts(hidden, topk_ids, topk_weights, w13, w2, first_expert=0)


def run_local_experts(recv_hidden: torch.Tensor, recv_expert_ids: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, first_expert: int) -> torch.Tensor:
    """Unweighted expert output of each dispatched row (routing weights are applied at combine)."""
    ids = recv_expert_ids.reshape(-1, 1)
    ones = torch.ones(ids.shape, dtype=recv_hidden.dtype, device=recv_hidden.device)
    return fused_experts(recv_hidden, ids, ones, w13, w2, first_expert)


def shard_expert_weights(w13: torch.Tensor, w2: torch.Tensor, first_expert: int, num_experts: int,
                         tp_rank: int = 0, tp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts [first, first + num) of full weights, sharded along the intermediate dim for MoE TP.

    w13 rows are gate then up; each TP rank keeps the same intermediate columns of both,
    so silu(gate) * up stays local and the partial w2 products sum to the full output.
    """
    intermediate = w2.shape[2]
    if intermediate % tp_size:
        raise ValueError(f"intermediate size {intermediate} not divisible by TP size {tp_size}")
    part = intermediate // tp_size
    lo, hi = tp_rank * part, (tp_rank + 1) * part
    experts = slice(first_expert, first_expert + num_experts)
    gate = w13[experts, lo:hi]
    up = w13[experts, intermediate + lo:intermediate + hi]
    return torch.cat([gate, up], dim=1).contiguous(), w2[experts, :, lo:hi].contiguous()


# ---------------------------------------------------------------- INT8 dispatch quantization

def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8: q = round(x / s), s = max|x| / 127 (fp32)."""
    scale = x.float().abs().amax(dim=1).clamp_min(1e-12) / INT8_MAX
    q = torch.round(x.float() / scale.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_per_token_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(1)).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] contiguous tensor -> [N, bytes per row] uint8 view."""
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.contiguous().view(dtype)


def group_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------- pure expert parallelism

@dataclass
class DispatchHandle:
    """What combine needs to send results back and reduce them per token."""

    order: torch.Tensor  # flat (token * top_k + k) index of each sent row, rows grouped by destination
    send_splits: list[int]  # rows sent to each peer
    recv_splits: list[int]  # rows received from each peer
    num_tokens: int
    buffer_index: int  # which of the two buffer sets this step used


class InFlight:
    """A launched collective. `wait()` returns once it is over and, where a link latency is emulated (a benchmark
    knob, `MESHSERVE_EMULATED_LINK_LATENCY_MS`), no sooner than that long after its launch: work done between the
    launch and the wait hides the latency as it would hide a slow link's."""

    __slots__ = ("work", "ready_at")

    def __init__(self, work, latency_s: float = 0.0) -> None:
        self.work = work
        self.ready_at = time.perf_counter() + latency_s if latency_s else 0.0

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.ready_at:
            left = self.ready_at - time.perf_counter()
            if left > 0:
                time.sleep(left)


@dataclass
class DispatchInFlight:
    transfer: InFlight
    received: torch.Tensor  # the rows' landing buffer
    handle: DispatchHandle


@dataclass
class CombineInFlight:
    transfer: InFlight
    returned: torch.Tensor
    sent: torch.Tensor
    handle: DispatchHandle
    topk_weights: torch.Tensor


@dataclass
class _EPBuffers:
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    send_msg: torch.Tensor  # uint8 [max_send_rows, msg_bytes]
    recv_msg: torch.Tensor  # uint8 [max_recv_rows, msg_bytes]
    combine_recv: torch.Tensor  # dtype [max_send_rows, hidden]

    def tensors(self) -> list[torch.Tensor]:
        return [self.send_counts, self.recv_counts, self.send_msg, self.recv_msg, self.combine_recv]


def check_combine_shapes(name: str, out: torch.Tensor, num_recv: int, hidden: int, topk_weights: torch.Tensor,
                         num_tokens: int, top_k: int) -> None:
    """Reject a combine whose expert outputs or routing weights do not match the dispatch."""
    if out.shape != (num_recv, hidden):
        raise ValueError(f"{name} must be [{num_recv}, {hidden}], got {tuple(out.shape)}")
    if topk_weights.shape != (num_tokens, top_k):
        raise ValueError(f"topk_weights must be [{num_tokens}, {top_k}], got {tuple(topk_weights.shape)}")


class EPDispatcher:
    """Dispatch (token, expert) rows to the expert owners and combine the results back.

    One dispatch message per row holds the hidden state (or its INT8 codes and fp32
    scale) and the int32 expert id, so one variable-split all-to-all carries the data
    after one all-to-all of the counts. Buffers hold the worst case (CloudMatrix Eq. 1-2:
    every token of every peer routed here), and steps alternate between two sets so a
    step's combine can follow the next step's dispatch (two micro-batches in flight).
    """

    def __init__(self, ep_group, num_experts: int, top_k: int, hidden: int, max_tokens_per_rank: int,
                 dtype: torch.dtype, int8: bool = False, device: torch.device | str | None = None,
                 rank_of_slot: list[int] | None = None) -> None:
        """`rank_of_slot`: the owner of each of the `num_experts` slots where they are not split evenly in
        contiguous slices (shared-expert ranks beside the routed ones, meshserve/moe/shared_ranks.py)."""
        self.group = ep_group
        self.world = dist.get_world_size(ep_group)
        self.rank = dist.get_rank(ep_group)
        if rank_of_slot is not None:
            if len(rank_of_slot) != num_experts or not all(0 <= r < self.world for r in rank_of_slot):
                raise ValueError(f"rank_of_slot must give one of {self.world} ranks for each of {num_experts} slots")
        elif num_experts % self.world:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.world} EP ranks")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if hidden < 1 or max_tokens_per_rank < 1:
            raise ValueError("hidden and max_tokens_per_rank must be positive")
        if not dtype.is_floating_point:
            raise ValueError(f"dispatch dtype must be floating point, got {dtype}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden = hidden
        self.max_tokens_per_rank = max_tokens_per_rank
        self.dtype = dtype
        self.int8 = int8
        self.device = torch.device(device) if device is not None else group_device(ep_group)
        self.experts_per_rank = num_experts // self.world
        self.first_expert = self.rank * self.experts_per_rank
        self.rank_of_slot: torch.Tensor | None = None
        if rank_of_slot is not None:
            self.rank_of_slot = torch.tensor(rank_of_slot, dtype=torch.int64, device=self.device)
            self.experts_per_rank = max(rank_of_slot.count(r) for r in range(self.world))  # the most on one rank
            self.first_expert = rank_of_slot.index(self.rank) if self.rank in rank_of_slot else 0
        # Eq. 2: the most rows one peer can send here; Eq. 1: that from every peer.
        self.max_rows_per_peer = max_tokens_per_rank * min(top_k, self.experts_per_rank)
        self.max_recv_rows = self.world * self.max_rows_per_peer
        self.max_send_rows = max_tokens_per_rank * top_k
        element = torch.empty((), dtype=dtype).element_size()
        self.payload_bytes = hidden if int8 else hidden * element
        self.scale_bytes = 4 if int8 else 0
        self.msg_bytes = self.payload_bytes + self.scale_bytes + 4  # + int32 expert id
        self._buffers = [self._allocate() for _ in range(2)]
        self._step = 0
        self.link_latency_s = envs.emulated_link_latency_s()

    def _allocate(self) -> _EPBuffers:
        def empty(*shape, dtype):
            return torch.empty(*shape, dtype=dtype, device=self.device)
        return _EPBuffers(
            send_counts=empty(self.world, dtype=torch.int64),
            recv_counts=empty(self.world, dtype=torch.int64),
            send_msg=empty(self.max_send_rows, self.msg_bytes, dtype=torch.uint8),
            recv_msg=empty(self.max_recv_rows, self.msg_bytes, dtype=torch.uint8),
            combine_recv=empty(self.max_send_rows, self.hidden, dtype=self.dtype),
        )

    def use_group(self, ep_group) -> None:
        """Run on `ep_group` from now on: the same ranks in the same order, on new communicators."""
        if dist.get_world_size(ep_group) != self.world or dist.get_rank(ep_group) != self.rank:
            raise ValueError(f"a new EP group must hold this rank ({self.rank} of {self.world}) as the old one did")
        self.group = ep_group

    def buffer_data_ptrs(self) -> list[list[int]]:
        """data_ptr of every pre-allocated buffer, per set (lets callers check nothing is re-allocated)."""
        return [[t.data_ptr() for t in buffers.tensors()] for buffers in self._buffers]

    def _check_inputs(self, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden:
            raise ValueError(f"hidden must be [T, {self.hidden}], got {tuple(hidden.shape)}")
        if hidden.dtype != self.dtype:
            raise ValueError(f"hidden dtype {hidden.dtype} != dispatcher dtype {self.dtype}")
        if hidden.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"{hidden.shape[0]} tokens exceed max_tokens_per_rank={self.max_tokens_per_rank}")
        if topk_ids.shape != (hidden.shape[0], self.top_k):
            raise ValueError(f"topk_ids must be [{hidden.shape[0]}, {self.top_k}], got {tuple(topk_ids.shape)}")
        if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= self.num_experts):
            raise ValueError(f"expert ids must be in [0, {self.num_experts})")

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send rows to expert owners; returns (recv_hidden [R, H], recv_expert_ids [R] global, handle)."""
        return self.dispatch_finish(self.dispatch_start(hidden, topk_ids))

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor) -> torch.Tensor:
        """Send expert results back (full precision) and reduce each token's top-k with its weights."""
        return self.combine_finish(self.combine_start(expert_out, handle, topk_weights))

    # Each exchange in two halves: `*_start` launches the rows' all-to-all and returns at once, `*_finish` waits
    # for it. Between the two another micro-batch computes (two-microbatch overlap, meshserve/models/microbatch.py);
    # gloo moves the rows on its own threads meanwhile, NCCL on its stream.

    def dispatch_start(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                       buffer_index: int | None = None) -> DispatchInFlight:
        """Exchange the counts, pack the rows and launch their all-to-all (`buffer_index`: the buffer set, by
        default alternating; two micro-batches in flight each use their own)."""
        self._check_inputs(hidden, topk_ids)
        index = self._step % 2 if buffer_index is None else buffer_index
        self._step += 1
        buffers = self._buffers[index]
        num_tokens = hidden.shape[0]
        flat_ids = topk_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        dest = flat_ids // self.experts_per_rank if self.rank_of_slot is None else self.rank_of_slot[flat_ids]
        order = torch.argsort(dest, stable=True)
        buffers.send_counts.copy_(torch.bincount(dest, minlength=self.world))
        dist.all_to_all_single(buffers.recv_counts, buffers.send_counts, group=self.group)
        send_splits = buffers.send_counts.tolist()
        recv_splits = buffers.recv_counts.tolist()
        num_send, num_recv = flat_ids.numel(), sum(recv_splits)

        token_of_row = order // self.top_k
        msg = buffers.send_msg[:num_send]
        if self.int8:  # early quantization: once per token, before the rows are replicated
            codes, scale = quantize_per_token_int8(hidden)
            msg[:, :self.payload_bytes].copy_(as_bytes(codes.index_select(0, token_of_row)))
            msg[:, self.payload_bytes:self.payload_bytes + 4].copy_(as_bytes(scale.index_select(0, token_of_row)))
        else:
            msg[:, :self.payload_bytes].copy_(as_bytes(hidden.index_select(0, token_of_row)))
        msg[:, -4:].copy_(as_bytes(flat_ids.index_select(0, order).to(torch.int32)))

        received = buffers.recv_msg[:num_recv]
        work = dist.all_to_all_single(received, msg, recv_splits, send_splits, group=self.group, async_op=True)
        handle = DispatchHandle(order, send_splits, recv_splits, num_tokens, index)
        return DispatchInFlight(InFlight(work, self.link_latency_s), received, handle)

    def dispatch_finish(self, started: DispatchInFlight) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        started.transfer.wait()
        received = started.received
        recv_ids = from_bytes(received[:, -4:], torch.int32).reshape(-1).to(torch.int64)
        if self.int8:
            codes = from_bytes(received[:, :self.payload_bytes], torch.int8)
            scale = from_bytes(received[:, self.payload_bytes:self.payload_bytes + 4], torch.float32).reshape(-1)
            recv_hidden = dequantize_per_token_int8(codes, scale, self.dtype)
        else:
            recv_hidden = from_bytes(received[:, :self.payload_bytes], self.dtype)
        return recv_hidden, recv_ids, started.handle

    def combine_start(self, expert_out: torch.Tensor, handle: DispatchHandle,
                      topk_weights: torch.Tensor) -> CombineInFlight:
        check_combine_shapes("expert_out", expert_out, sum(handle.recv_splits), self.hidden, topk_weights,
                             handle.num_tokens, self.top_k)
        buffers = self._buffers[handle.buffer_index]
        returned = buffers.combine_recv[:handle.order.numel()]
        sent = expert_out.to(self.dtype).contiguous()  # kept alive until the transfer is over
        work = dist.all_to_all_single(returned, sent, handle.send_splits, handle.recv_splits, group=self.group,
                                      async_op=True)
        return CombineInFlight(InFlight(work, self.link_latency_s), returned, sent, handle, topk_weights)

    def combine_finish(self, started: CombineInFlight) -> torch.Tensor:
        started.transfer.wait()
        handle = started.handle
        weights = started.topk_weights.reshape(-1).to(device=self.device, dtype=self.dtype).index_select(
            0, handle.order)
        out = torch.zeros(handle.num_tokens, self.hidden, dtype=self.dtype, device=self.device)
        out.index_add_(0, handle.order // self.top_k, started.returned * weights.unsqueeze(1))
        return out


# ---------------------------------------------------------------- hybrid TP (intra-node) x EP (inter-node)

@dataclass
class HybridHandle:
    token_of_row: torch.Tensor  # source token of each sent row, rows grouped by destination node
    order: torch.Tensor  # flat (token * top_k + k) index of each sent row
    send_splits: list[int]  # rows sent to each node
    recv_splits: list[int]  # rows received from each node
    num_tokens: int


def _offsets(splits: list[int]) -> list[int]:
    offsets = [0]
    for count in splits:
        offsets.append(offsets[-1] + count)
    return offsets


class HybridMoEComm:
    """MixServe hybrid TP-EP dispatch / combine.

    Contract per rank (node n, local rank l, m ranks per node, H hidden):
    - dispatch input: `hidden_shard` [T, H/m], this rank's column block l of its node's
      tokens, and `topk_ids` [T, K], identical on every rank of the node;
    - dispatch output: full rows [R, H] routed to this node's experts (the same on every
      rank of the node), their global expert ids, and a handle;
    - combine input: this rank's partial expert output [R, H] from intermediate-sharded
      weights (the node's partials sum to the true output);
    - combine output: the node's MoE output [T, H], replicated on every rank of the node.
    Synchronous: AG(intra) -> A2A(inter) and RS(intra) -> A2A(inter) -> AG(intra), each
    step waiting for the previous. Fused (Alg. 2 / Alg. 1): only H/m columns cross nodes,
    in pairwise rounds whose isend/irecv overlap the intra-node AG / RS of other blocks.
    """

    def __init__(self, groups: TopologyGroups, num_experts: int, top_k: int, hidden: int,
                 fused: bool = False) -> None:
        topology = groups.topology
        self.groups = groups
        self.topology = topology
        self.num_nodes = topology.num_nodes
        self.ranks_per_node = topology.ranks_per_node
        self.node = topology.node_of(groups.rank)
        self.local = topology.local_rank(groups.rank)
        if num_experts % self.num_nodes:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.num_nodes} nodes")
        if hidden % self.ranks_per_node:
            raise ValueError(f"hidden {hidden} not divisible by {self.ranks_per_node} ranks per node")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden = hidden
        self.shard = hidden // self.ranks_per_node
        self.experts_per_node = num_experts // self.num_nodes
        self.first_expert = self.node * self.experts_per_node
        self.fused = fused

    def use_groups(self, groups: TopologyGroups) -> None:
        """Run on `groups` from now on: the same topology and rank, on new communicators."""
        if groups.topology != self.topology or groups.rank != self.groups.rank:
            raise ValueError(f"new groups must have this rank's topology {self.topology} and rank {self.groups.rank}")
        self.groups = groups

    # ---- public entry points

    def dispatch(self, hidden_shard: torch.Tensor, topk_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, HybridHandle]:
        return (self.dispatch_fused if self.fused else self.dispatch_sync)(hidden_shard, topk_ids)

    def combine(self, partial_out: torch.Tensor, handle: HybridHandle, topk_weights: torch.Tensor) -> torch.Tensor:
        return (self.combine_fused if self.fused else self.combine_sync)(partial_out, handle, topk_weights)

    def dispatch_sync(self, hidden_shard, topk_ids):
        handle, recv_ids = self._route(hidden_shard, topk_ids)
        full = self._gather_columns(hidden_shard)
        rows = full.index_select(0, handle.token_of_row)
        recv = rows.new_empty(sum(handle.recv_splits), self.hidden)
        dist.all_to_all_single(recv, rows, handle.recv_splits, handle.send_splits, group=self.groups.inter_node)
        return recv, recv_ids, handle

    def combine_sync(self, partial_out, handle, topk_weights):
        self._check_combine(partial_out, handle, topk_weights)
        reduced = self._reduce_scatter_columns(partial_out)
        returned = reduced.new_empty(handle.order.numel(), self.shard)
        dist.all_to_all_single(returned, reduced, handle.send_splits, handle.recv_splits,
                               group=self.groups.inter_node)
        out_shard = partial_out.new_zeros(handle.num_tokens, self.shard)
        weights = self._row_weights(topk_weights, handle, partial_out.dtype)
        out_shard.index_add_(0, handle.token_of_row, returned * weights.unsqueeze(1))
        return self._gather_columns(out_shard)

    def dispatch_fused(self, hidden_shard, topk_ids):
        """Alg. 2: pairwise inter-node rounds of column shards, each block all-gathered in the node on arrival."""
        handle, recv_ids = self._route(hidden_shard, topk_ids)
        send_off, recv_off = _offsets(handle.send_splits), _offsets(handle.recv_splits)
        rows = hidden_shard.index_select(0, handle.token_of_row)  # [T*K, H/m]: only this column block leaves
        recv_shard = rows.new_empty(recv_off[-1], self.shard)
        arrivals, sends = self._pairwise(rows, send_off, recv_shard, recv_off, _DISPATCH_TAG, source_first=False)
        recv = rows.new_empty(recv_off[-1], self.hidden)
        gathers = []
        for src_node, arrival in arrivals:  # in round order: the AG of one block overlaps later rounds' transfers
            if arrival is not None:
                arrival.wait()
            block = recv_shard[recv_off[src_node]:recv_off[src_node + 1]]
            if block.shape[0] == 0:  # same on every rank of the node: routing is replicated there
                continue
            gathered = block.new_empty(self.ranks_per_node * block.shape[0], self.shard)
            work = _all_gather_single(gathered, block, group=self.groups.intra_node, async_op=True)
            gathers.append((src_node, gathered, work))
        for src_node, gathered, work in gathers:
            work.wait()
            lo, hi = recv_off[src_node], recv_off[src_node + 1]
            recv[lo:hi] = self._columns_to_rows(gathered, hi - lo)
        for work in sends:
            work.wait()
        return recv, recv_ids, handle

    def combine_fused(self, partial_out, handle, topk_weights):
        """Alg. 1: reduce-scatter each node block in the node, send it back pairwise as soon as it is reduced,
        weight and accumulate each returning block on arrival, then all-gather the columns."""
        self._check_combine(partial_out, handle, topk_weights)
        send_off, recv_off = _offsets(handle.send_splits), _offsets(handle.recv_splits)
        reductions = {}
        for src_node in self._round_order(source_first=True):  # all RS issued at once, same order on every rank
            lo, hi = recv_off[src_node], recv_off[src_node + 1]
            if hi == lo:
                continue
            out = partial_out.new_empty(hi - lo, self.shard)
            inp = self._rows_to_columns(partial_out[lo:hi])
            reductions[src_node] = (out, _reduce_scatter_single(out, inp, group=self.groups.intra_node,
                                                                async_op=True))
        returned = partial_out.new_empty(handle.order.numel(), self.shard)
        weights = self._row_weights(topk_weights, handle, partial_out.dtype)
        out_shard = partial_out.new_zeros(handle.num_tokens, self.shard)
        sends = []
        receives = []
        for i, (src_node, dst_node) in enumerate(zip(self._round_order(source_first=True),
                                                     self._round_order(source_first=False))):
            if src_node in reductions:
                reduced, work = reductions[src_node]
                work.wait()
                if i == 0:
                    returned[send_off[self.node]:send_off[self.node + 1]] = reduced
                else:
                    sends.append(dist.isend(reduced, dst=self._peer(src_node), group=self.groups.inter_node,
                                            tag=_COMBINE_TAG))
            # Our rows that dst_node's experts processed come back in this round.
            lo, hi = send_off[dst_node], send_off[dst_node + 1]
            if i > 0 and hi > lo:
                receives.append((dst_node, dist.irecv(returned[lo:hi], src=self._peer(dst_node),
                                                      group=self.groups.inter_node, tag=_COMBINE_TAG)))
            elif i == 0:
                receives.append((dst_node, None))
        for node, work in receives:  # top-k weighting of a block overlaps the later blocks' transfers
            if work is not None:
                work.wait()
            lo, hi = send_off[node], send_off[node + 1]
            if hi > lo:
                out_shard.index_add_(0, handle.token_of_row[lo:hi], returned[lo:hi] * weights[lo:hi].unsqueeze(1))
        for work in sends:
            work.wait()
        return self._gather_columns(out_shard)

    # ---- pieces

    def _route(self, hidden_shard: torch.Tensor, topk_ids: torch.Tensor) -> tuple[HybridHandle, torch.Tensor]:
        """Group rows by destination node and exchange the counts and expert ids (the metadata all-to-all)."""
        if hidden_shard.dim() != 2 or hidden_shard.shape[1] != self.shard:
            raise ValueError(f"hidden_shard must be [T, {self.shard}], got {tuple(hidden_shard.shape)}")
        if topk_ids.shape != (hidden_shard.shape[0], self.top_k):
            raise ValueError(f"topk_ids must be [{hidden_shard.shape[0]}, {self.top_k}], got {tuple(topk_ids.shape)}")
        if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= self.num_experts):
            raise ValueError(f"expert ids must be in [0, {self.num_experts})")
        device = hidden_shard.device
        flat_ids = topk_ids.reshape(-1).to(device=device, dtype=torch.int64)
        dest = flat_ids // self.experts_per_node
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.num_nodes)
        recv_counts = torch.empty_like(send_counts)
        inter = self.groups.inter_node
        dist.all_to_all_single(recv_counts, send_counts, group=inter)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        recv_ids = flat_ids.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv_ids, flat_ids.index_select(0, order), recv_splits, send_splits, group=inter)
        handle = HybridHandle(order // self.top_k, order, send_splits, recv_splits, hidden_shard.shape[0])
        return handle, recv_ids

    def _check_combine(self, partial_out, handle, topk_weights) -> None:
        check_combine_shapes("partial_out", partial_out, sum(handle.recv_splits), self.hidden, topk_weights,
                             handle.num_tokens, self.top_k)

    def _row_weights(self, topk_weights, handle, dtype) -> torch.Tensor:
        return topk_weights.reshape(-1).to(device=handle.order.device, dtype=dtype).index_select(0, handle.order)

    def _round_order(self, source_first: bool) -> list[int]:
        """Round i pairs this node with node - i (its rows' source) and node + i (its rows' destination)."""
        sign = -1 if source_first else 1
        return [(self.node + sign * i) % self.num_nodes for i in range(self.num_nodes)]

    def _peer(self, node: int) -> int:
        return self.topology.global_rank(node, self.local)

    def _pairwise(self, rows, send_off, recv_buf, recv_off, tag, source_first):
        """Issue all pairwise rounds of one exchange; returns [(source node, recv work or None)] and send works."""
        arrivals, sends = [], []
        destinations = self._round_order(source_first=source_first)
        sources = self._round_order(source_first=not source_first)
        for i, (dst_node, src_node) in enumerate(zip(destinations, sources)):
            if i == 0:  # the local block needs no transfer
                node = self.node
                recv_buf[recv_off[node]:recv_off[node + 1]] = rows[send_off[node]:send_off[node + 1]]
                arrivals.append((self.node, None))
                continue
            if send_off[dst_node + 1] > send_off[dst_node]:
                sends.append(dist.isend(rows[send_off[dst_node]:send_off[dst_node + 1]], dst=self._peer(dst_node),
                                        group=self.groups.inter_node, tag=tag))
            work = None
            if recv_off[src_node + 1] > recv_off[src_node]:
                work = dist.irecv(recv_buf[recv_off[src_node]:recv_off[src_node + 1]], src=self._peer(src_node),
                                  group=self.groups.inter_node, tag=tag)
            arrivals.append((src_node, work))
        return arrivals, sends

    def _columns_to_rows(self, gathered: torch.Tensor, num_rows: int) -> torch.Tensor:
        """[m * R, H/m] (rank-major column blocks) -> [R, H]."""
        return gathered.view(self.ranks_per_node, num_rows, self.shard).permute(1, 0, 2).reshape(num_rows, self.hidden)

    def _rows_to_columns(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [m * R, H/m] with column block j at rows j*R..(j+1)*R (reduce-scatter input)."""
        num_rows = rows.shape[0]
        return rows.reshape(num_rows, self.ranks_per_node, self.shard).permute(1, 0, 2).reshape(-1, self.shard)

    def _gather_columns(self, shard: torch.Tensor) -> torch.Tensor:
        gathered = shard.new_empty(self.ranks_per_node * shard.shape[0], self.shard)
        _all_gather_single(gathered, shard.contiguous(), group=self.groups.intra_node)
        return self._columns_to_rows(gathered, shard.shape[0])

    def _reduce_scatter_columns(self, partial: torch.Tensor) -> torch.Tensor:
        out = partial.new_empty(partial.shape[0], self.shard)
        _reduce_scatter_single(out, self._rows_to_columns(partial).contiguous(), group=self.groups.intra_node)
        return out
