"""One MoE layer's routed experts over a parallel strategy `attn=TPa+DPb moe=TPc+EPd`.

`MoERuntime(ctx, ...)(hidden, topk_ids, topk_weights, experts)` gives each rank the
routed-expert output of its own tokens, equal (up to float summation order) to the
single-rank `experts(hidden, topk_ids, topk_weights)` with full weights. Every rank
calls it once per MoE layer per step, with T = 0 tokens too (an idle DP group), so
every collective completes. The path, per step:

1. de-duplicate: the a ranks of an attention TP group hold the same T tokens, so each
   takes one contiguous `torch.tensor_split` chunk and every token is computed once;
2. pure EP (c = 1): `EPDispatcher` sends each (token, expert) row to the expert owner
   and back (optionally INT8 on the way out);
   MoE TP (c > 1): the c ranks of a MoE node exchange their token sets so each holds
   its column block of every node token (sizes first, then one all-to-all that moves
   only H/c columns per row plus the routing), `HybridMoEComm` dispatches, every rank
   runs its intermediate-column shard of the node's experts, and the combine sums the
   partials; each rank keeps its own rows. When a == c the attention TP group is the
   MoE node and its tokens are already replicated: steps 1 and 3 and the exchange are
   skipped;
3. the attention TP group all-gathers the chunks back, so all of its ranks hold the
   same output for all T tokens.

Physical expert slots (`ctx.redundant_experts_per_rank` = R > 0): each EP rank holds
S = E/EP + R slots, its primaries then R redundant slots for replicas of hot experts, and
the dispatchers route by global slot id (N * S "experts"). After gating the runtime adds
the logical ids to the layer's load counts (`load_counts`, when the model's
`ExpertBalancer` has attached its row) and maps them to slot ids through `slot_map`
(meshserve/moe/slots.py), on the whole batch of the attention TP group before step 1.
With R = 0 slot ids are the expert ids and no mapping runs. Where the experts do not split
evenly over the EP ranks (a shrunk layout, meshserve/moe/placement.py `engine_shape`), each
rank holds ceil(E/EP) + R slots, its share of the experts first, and the mapping always runs.

INT8 dispatch (`ctx.int8_dispatch`, off by default, pure EP only) quantizes each token
symmetrically per row before it leaves its rank: every input element moves by at most
max|x_t| / 254, and the layer output stays within 2% of its max |output| (max abs error
<= 0.02 * max |output|, checked in tests/parallel/test_moe_runtime.py). The combine
stays in full precision.

Attention-expert disaggregation (`disagg`, meshserve/moe/a2e.py): an attention rank holds no expert; it counts
and maps its tokens' ids as above, sends each token to the expert ranks of its slots (A2E, over its DP domain's
group, tagged with `layer`) and sums what comes back (E2A). An expert rank has no tokens: `serve` takes each
domain's rows in turn, runs them through its slots and sends the partial outputs back.

Shared-expert ranks (`shared=EPs`, meshserve/moe/shared_ranks.py): the routed slots cover the routed ranks
only; after the routed ids are counted and mapped each token gets the columns of its shared-expert blocks,
and a shared rank's weights (`make_weights`) hold those blocks instead of routed experts.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshserve.layers.moe import FusedMoEWeights
from meshserve.moe.a2e import A2EComm, A2EHandle, A2ELayout
from meshserve.moe.comm import CombineInFlight, DispatchInFlight, EPDispatcher, HybridMoEComm, group_device
from meshserve.moe.placement import PlacementShape, engine_shape
from meshserve.moe.recorder import add_counts
from meshserve.moe.shared_ranks import SharedExpertSlots
from meshserve.moe.slots import SlotMap
from meshserve.parallel.context import ParallelContext

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# INT8 dispatch keeps the layer output within this fraction of its max |output| (see module docstring).
INT8_DISPATCH_MAX_ERROR = 0.02


# Every MoE layer of a model runs one after another, so the layers of one context share one
# communicator per shape: one set of worst-case dispatch buffers instead of one per layer.
_SHARED_COMMS: dict[tuple, object] = {}


def _shared_comm(ctx: ParallelContext, key: tuple, make: Callable[[], object],
                 regroup: Callable[[object], None]) -> object:
    """The context's communicator for `key`, made once; `regroup(comm)` moves it to the context's new groups
    whenever they are rebuilt."""
    full_key = (id(ctx), *key)
    comm = _SHARED_COMMS.get(full_key)
    if comm is None:
        comm = _SHARED_COMMS[full_key] = make()
        weakref.finalize(ctx, _SHARED_COMMS.pop, full_key, None)  # ids are reused once ctx is gone
        ctx.on_rebuild(functools.partial(regroup, comm))
    return comm


def _a2e_comm(ctx: ParallelContext, index: int, num_slots: int, top_k: int, hidden_size: int,
              dtype: torch.dtype, shared: SharedExpertSlots | None) -> A2EComm:
    """The context's A2E communicator over its `index`-th A2E group (an expert rank has one per DP domain); `top_k`
    counts the shared experts' columns too where `shared` ranks hold them."""
    s = ctx.strategy
    per_domain = s.attention_ranks // s.domains
    num_expert_ranks = ctx.world_size - s.attention_ranks
    layout = A2ELayout(attention_ranks=tuple(range(per_domain)),
                       expert_ranks=tuple(range(per_domain, per_domain + num_expert_ranks)),
                       num_experts=num_slots, top_k=top_k, ranks_per_node=s.relay, expert_tp=s.moe_tp,
                       rank_of_slot=tuple(shared.rank_of_slot()) if shared else None)
    return _shared_comm(ctx, ("a2e", index, num_slots, top_k, hidden_size, dtype), lambda: A2EComm(
        ctx.a2e_groups[index], layout, hidden_size, ctx.max_tokens_per_step, dtype, two_stage=s.relay > 1,
        node_groups=ctx.a2e_node_groups, int8=ctx.int8_dispatch, device=group_device(ctx.a2e_groups[index]),
        domain=index if ctx.is_expert_rank else ctx.domain),
        lambda comm: comm.use_groups(ctx.a2e_groups[index], ctx.a2e_node_groups))


def engine_placement_shape(ctx: ParallelContext, num_experts: int) -> PlacementShape:
    """The routed-expert slots of the engine `ctx` is a rank of (the same on every rank; over its routed ranks)."""
    return engine_shape(num_experts, ctx.routed_ep_size, ctx.redundant_experts_per_rank)


def rank_expert_range(ctx: ParallelContext, num_experts: int) -> tuple[int, int]:
    """[first, first + count) of the experts this rank reads from the checkpoint into its first slots (none on a
    shared-expert rank)."""
    if ctx.is_shared_expert_rank or (ctx.is_disagg and not ctx.is_expert_rank):
        return 0, 0
    return engine_placement_shape(ctx, num_experts).initial_experts(ctx.ep_rank)


def chunk_sizes(num_tokens: int, parts: int) -> list[int]:
    """Row counts of `torch.tensor_split(x, parts)` for x with num_tokens rows."""
    base, extra = divmod(num_tokens, parts)
    return [base + (i < extra) for i in range(parts)]


def _to_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [N, bytes per row] uint8 (a view where t is contiguous)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], t.shape[1] * t.element_size())


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """A column range of a byte message -> [N, cols] of dtype (copied: the range need not be aligned)."""
    return torch.empty(b.shape, dtype=torch.uint8, device=b.device).copy_(b).view(dtype).reshape(b.shape[0], cols)


@dataclass
class MoEInFlight:
    """One micro-batch's MoE layer between its stages."""

    dispatch: DispatchInFlight | A2EHandle  # A2EHandle: attention-expert disaggregation
    topk_weights: torch.Tensor
    combine: CombineInFlight | None = None


class MoERuntime:
    """Runs the routed experts of one MoE layer for this rank of a parallel context."""

    def __init__(self, ctx: ParallelContext, num_experts: int, top_k: int, hidden_size: int,
                 dtype: torch.dtype, num_shared_experts: int = 0, layer: int = 0) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.ctx = ctx
        self.layer = layer  # the decoder layer: what A2E tags its rows with
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.placement_shape = engine_placement_shape(ctx, num_experts)
        shape = self.placement_shape
        slots_per_rank = shape.slots_per_rank
        # a shared-expert rank holds no routed experts; its routed rank index would be past the routed ranks
        self.first_expert, self.num_local_experts = shape.initial_experts(min(ctx.ep_rank, shape.num_ranks - 1))
        self.first_slot = ctx.ep_rank * slots_per_rank
        self.redundant_slots = slots_per_rank - self.num_local_experts  # this rank's slots beyond its share
        self.num_slots = shape.num_slots  # what the dispatchers route over
        self.holds_experts = not ctx.is_disagg or ctx.is_expert_rank
        if not self.holds_experts:  # an attention rank of a disaggregated layout
            self.first_expert = self.num_local_experts = self.first_slot = self.redundant_slots = 0
        # logical -> slot ids; None while slot ids are the expert ids (no redundant slots, an even split)
        self.slot_map: SlotMap | None = None
        if shape.redundant_per_rank or shape.uneven:
            self.slot_map = SlotMap.from_slots(shape.default_slots(), num_experts)
        # shared experts on their own EP ranks: their slots follow the routed ones
        self.shared_slots: SharedExpertSlots | None = None
        if ctx.shared_ep_size:
            self.shared_slots = SharedExpertSlots(self.num_slots, ctx.routed_ep_size, ctx.shared_ep_size,
                                                  num_shared_experts)
            self.num_slots = self.shared_slots.num_slots
            if ctx.is_shared_expert_rank:  # this rank's weights are the shared experts' column blocks
                self.first_expert, self.num_local_experts, self.redundant_slots = 0, num_shared_experts, 0
                self.first_slot = self.shared_slots.first_slot(ctx.ep_rank - ctx.routed_ep_size)
        # this layer's row of the model's expert-load counter (attached by its ExpertBalancer)
        self.load_counts: torch.Tensor | None = None
        self._one = torch.ones(1, dtype=torch.int64)
        self.rotation_offset = ctx.dp_rank
        # an attention rank of a disaggregated layout holds no column block either
        self.tp_rank, self.tp_size = (ctx.moe_tp_rank, ctx.moe_tp_size) if self.holds_experts else (0, 1)
        self.attn_tp_size = ctx.attn_tp_size
        self.single = ctx.world_size == 1
        # a == c: the attention TP group is the MoE node, whose tokens are then already replicated
        self.node_replicated = self.tp_size > 1 and self.attn_tp_size == self.tp_size
        self.deduplicate = self.attn_tp_size > 1 and not self.node_replicated
        self.ep_dispatcher: EPDispatcher | None = None
        self.hybrid: HybridMoEComm | None = None
        self.a2e_comms: list[A2EComm] = []  # disaggregated: one per DP domain this rank talks to
        if not self.single:
            self._connect(num_shared_experts)

    def _connect(self, num_shared_experts: int) -> None:
        """This layer's communicator (shared with the context's other layers of its shape)."""
        ctx, top_k, hidden_size, dtype = self.ctx, self.top_k, self.hidden_size, self.dtype
        shared, dispatched_k = self.shared_slots, top_k + (num_shared_experts if self.shared_slots else 0)
        if ctx.is_disagg:
            self.a2e_comms = [_a2e_comm(ctx, index, self.num_slots, dispatched_k, hidden_size, dtype, shared)
                              for index in range(len(ctx.a2e_groups))]
            return
        if ctx.moe_groups is None:
            raise ValueError(f"a context for {ctx.strategy} needs its process groups (ParallelContext.build)")
        shape = (self.num_slots, top_k, hidden_size, dtype)
        if self.tp_size == 1:
            per_rank = -(-ctx.max_tokens_per_step // self.attn_tp_size) if self.deduplicate \
                else ctx.max_tokens_per_step
            self.ep_dispatcher = _shared_comm(ctx, ("ep", *shape, shared), lambda: EPDispatcher(
                ctx.moe_groups.inter_node, self.num_slots, dispatched_k, hidden_size, per_rank, dtype,
                int8=ctx.int8_dispatch, rank_of_slot=shared.rank_of_slot() if shared else None),
                lambda comm: comm.use_group(ctx.moe_groups.inter_node))
        else:
            if ctx.int8_dispatch:
                raise ValueError(f"INT8 dispatch needs pure EP (moe=TP1+EPn); {ctx.strategy} has MoE TP")
            self.hybrid = _shared_comm(ctx, ("hybrid", *shape), lambda: HybridMoEComm(
                ctx.moe_groups, self.num_slots, top_k, hidden_size, fused=ctx.moe_comm == "fused"),
                lambda comm: comm.use_groups(ctx.moe_groups))

    def make_weights(self, intermediate_size: int) -> FusedMoEWeights:
        """Expert weights holding this rank's slots and intermediate-column block (a shared-expert rank: the
        shared experts' column blocks, as experts 0 .. n - 1)."""
        total = self.num_local_experts if self.ctx.is_shared_expert_rank else self.num_experts
        return FusedMoEWeights(total, self.hidden_size, intermediate_size, self.dtype,
                               first_expert=self.first_expert, num_local_experts=self.num_local_experts,
                               tp_rank=self.tp_rank, tp_size=self.tp_size, redundant_slots=self.redundant_slots,
                               first_slot=self.first_slot)

    def attach_load_counts(self, row: torch.Tensor) -> None:
        """Count this layer's routed tokens per logical expert into `row` ([E] int64) from now on."""
        self.load_counts = row
        self._one = torch.ones(1, dtype=torch.int64, device=row.device)

    # ------------------------------------------------------------------ forward

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 experts: FusedMoEWeights) -> torch.Tensor:
        self._check(hidden, topk_ids, topk_weights, experts)
        topk_ids, topk_weights = self._count_and_map(topk_ids, topk_weights)
        if self.single:
            return experts(hidden, topk_ids, topk_weights)
        if self.a2e_comms:  # the experts are on the expert ranks
            comm = self.a2e_comms[0]
            return comm.e2a(comm.a2e(hidden, topk_ids, topk_weights, tag=self.layer))
        num_tokens = hidden.shape[0]
        if self.deduplicate:
            rank = self.ctx.attn_tp_rank
            hidden, topk_ids, topk_weights = (torch.tensor_split(t, self.attn_tp_size)[rank]
                                              for t in (hidden, topk_ids, topk_weights))
        if self.ep_dispatcher is not None:
            out = self._expert_parallel(hidden, topk_ids, topk_weights, experts)
        else:
            out = self._hybrid(hidden, topk_ids, topk_weights, experts)
        if self.deduplicate:
            out = self._gather_chunks(out, num_tokens)
        return out

    def _count_and_map(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the logical ids to the load counts; the slot ids they go to and their weights (with the shared
        experts' columns where they have ranks of their own)."""
        if self.load_counts is not None:
            add_counts(self.load_counts, topk_ids, self._one)
        slot_map = self.slot_map
        slot_ids = topk_ids if slot_map is None else slot_map.route(topk_ids, self.rotation_offset)
        if self.shared_slots is None:
            return slot_ids, topk_weights
        return self.shared_slots.append_columns(slot_ids, topk_weights, self.rotation_offset)

    def serve(self, experts: FusedMoEWeights, microbatches: int = 1) -> int:
        """An expert rank's part of the layer: every DP domain's rows in turn (each domain's micro-batches in
        order), through its slots. The rows run."""
        if not self.ctx.is_expert_rank:
            raise RuntimeError(f"rank {self.ctx.rank} is not an expert rank of a disaggregated layout")
        return sum(self.serve_domain(domain, comm, experts)
                   for domain, comm in enumerate(self.a2e_comms) for _ in range(microbatches))

    def serve_domain(self, domain: int, comm: A2EComm, experts: FusedMoEWeights) -> int:
        """DP domain `domain`'s rows of this layer (a method of its own: the benchmarks' timeline records it)."""
        return comm.serve_layer(experts, tag=self.layer)

    # ------------------------------------------------------------------ forward in stages (two micro-batches)

    @property
    def runs_in_stages(self) -> bool:
        """Whether `start` / `compute` / `finish` serve this layout: pure EP over more than one rank, attention TP1
        (the decode layouts of the papers; the two-microbatch schedule runs on them)."""
        if self.a2e_comms:  # an attention rank of a disaggregated layout
            return not self.ctx.is_expert_rank
        return self.ep_dispatcher is not None and not self.deduplicate

    def start(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              experts: FusedMoEWeights, buffer_index: int) -> MoEInFlight:
        """Stage 1: count, map to slots and launch the dispatch; returns while the rows travel."""
        if not self.runs_in_stages:
            raise RuntimeError(f"the MoE layer runs in stages only under pure EP with attention TP1, not "
                               f"{self.ctx.strategy}")
        self._check(hidden, topk_ids, topk_weights, experts)
        slot_ids, topk_weights = self._count_and_map(topk_ids, topk_weights)
        if self.a2e_comms:
            return MoEInFlight(self.a2e_comms[0].a2e(hidden, slot_ids, topk_weights, tag=self.layer,
                                                     buffer_index=buffer_index), topk_weights)
        return MoEInFlight(self.ep_dispatcher.dispatch_start(hidden, slot_ids, buffer_index), topk_weights)

    def compute(self, pending: MoEInFlight, experts: FusedMoEWeights) -> None:
        """Stage 2: once the rows are here, run them through this rank's experts and launch the combine (nothing
        on an attention rank of a disaggregated layout: its experts are on the expert ranks)."""
        if self.a2e_comms:
            return
        rows, expert_ids, handle = self.ep_dispatcher.dispatch_finish(pending.dispatch)
        pending.combine = self.ep_dispatcher.combine_start(self._run_rows(experts, rows, expert_ids), handle,
                                                           pending.topk_weights)

    def finish(self, pending: MoEInFlight) -> torch.Tensor:
        """Stage 3: the weighted sum of each token's returned expert outputs."""
        if self.a2e_comms:
            return self.a2e_comms[0].e2a(pending.dispatch)
        return self.ep_dispatcher.combine_finish(pending.combine)

    def _check(self, hidden, topk_ids, topk_weights, experts: FusedMoEWeights) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [T, {self.hidden_size}], got {tuple(hidden.shape)}")
        expected = (hidden.shape[0], self.top_k)
        if tuple(topk_ids.shape) != expected or tuple(topk_weights.shape) != expected:
            raise ValueError(f"topk_ids and topk_weights must be {list(expected)}, got "
                             f"{list(topk_ids.shape)} and {list(topk_weights.shape)}")
        held = (experts.first_expert, experts.num_local_experts, experts.tp_rank, experts.tp_size,
                experts.redundant_slots, experts.first_slot)
        if held != (self.first_expert, self.num_local_experts, self.tp_rank, self.tp_size, self.redundant_slots,
                    self.first_slot):
            raise ValueError(f"expert weights hold experts [{held[0]}, {held[0] + held[1]}) TP {held[2]}/{held[3]} "
                             f"+{held[4]} redundant slots from slot {held[5]}; this rank needs [{self.first_expert}, "
                             f"{self.first_expert + self.num_local_experts}) TP {self.tp_rank}/{self.tp_size} "
                             f"+{self.redundant_slots} from slot {self.first_slot} (use make_weights)")

    @staticmethod
    def _run_rows(experts: FusedMoEWeights, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Unweighted output of each dispatched row (routing weights are applied at combine)."""
        ids = expert_ids.reshape(-1, 1)
        return experts(rows, ids, torch.ones(ids.shape, dtype=rows.dtype, device=rows.device))

    def _expert_parallel(self, hidden, topk_ids, topk_weights, experts) -> torch.Tensor:
        recv_hidden, recv_ids, handle = self.ep_dispatcher.dispatch(hidden, topk_ids)
        return self.ep_dispatcher.combine(self._run_rows(experts, recv_hidden, recv_ids), handle, topk_weights)

    def _hybrid(self, hidden, topk_ids, topk_weights, experts) -> torch.Tensor:
        if self.node_replicated:
            shard = self.hybrid.shard
            hidden_shard = hidden[:, self.tp_rank * shard:(self.tp_rank + 1) * shard].contiguous()
            own = slice(0, hidden.shape[0])
        else:
            hidden_shard, topk_ids, topk_weights, own = self._exchange_node_tokens(hidden, topk_ids, topk_weights)
        recv, recv_ids, handle = self.hybrid.dispatch(hidden_shard, topk_ids)
        node_out = self.hybrid.combine(self._run_rows(experts, recv, recv_ids), handle, topk_weights)
        return node_out[own]

    def _exchange_node_tokens(self, hidden, topk_ids, topk_weights):
        """The node's tokens in rank order on each of its ranks: this rank's column block of the hidden
        states and the full routing. Returns them and the slice of this rank's own rows."""
        group = self.ctx.moe_groups.intra_node
        c, shard, num_tokens = self.tp_size, self.hybrid.shard, hidden.shape[0]
        device = hidden.device
        counts = torch.empty(c, dtype=torch.int64, device=device)
        _all_gather_single(counts, torch.tensor([num_tokens], dtype=torch.int64, device=device), group=group)
        sizes = counts.tolist()
        offset = sum(sizes[:self.tp_rank])
        own = slice(offset, offset + num_tokens)
        total = sum(sizes)
        # One message row per (destination, token): [destination's column block | ids | weights].
        blocks = hidden.reshape(num_tokens, c, shard).transpose(0, 1).reshape(c * num_tokens, shard)
        routing = torch.cat([_to_bytes(topk_ids), _to_bytes(topk_weights)], dim=1).repeat(c, 1)
        send = torch.cat([_to_bytes(blocks), routing], dim=1)
        recv = send.new_empty(total, send.shape[1])
        if total:  # every rank of the node sees the same sizes, so all skip together
            dist.all_to_all_single(recv, send, sizes, [num_tokens] * c, group=group)
        hidden_bytes = shard * hidden.element_size()
        ids_bytes = self.top_k * topk_ids.element_size()
        node_hidden = _from_bytes(recv[:, :hidden_bytes], hidden.dtype, shard)
        node_ids = _from_bytes(recv[:, hidden_bytes:hidden_bytes + ids_bytes], topk_ids.dtype, self.top_k)
        node_weights = _from_bytes(recv[:, hidden_bytes + ids_bytes:], topk_weights.dtype, self.top_k)
        return node_hidden, node_ids, node_weights, own

    def _gather_chunks(self, out_chunk: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """All T rows on every rank of the attention TP group, from each rank's tensor_split chunk."""
        if num_tokens == 0:  # the group's ranks share T, so all skip together
            return out_chunk
        sizes = chunk_sizes(num_tokens, self.attn_tp_size)
        padded = out_chunk.new_zeros(sizes[0], out_chunk.shape[1])
        padded[:out_chunk.shape[0]] = out_chunk
        gathered = padded.new_empty(self.attn_tp_size * sizes[0], out_chunk.shape[1])
        _all_gather_single(gathered, padded, group=self.ctx.attn_tp_group)
        parts = gathered.view(self.attn_tp_size, sizes[0], -1)
        return torch.cat([parts[i, :n] for i, n in enumerate(sizes)])
