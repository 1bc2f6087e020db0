"""Attention-to-expert (A2E) and expert-to-attention (E2A) transfers for attention ranks and expert ranks on
different devices (xdeepserve §3.3, Fig. 8; attention-expert disaggregation, §5.2).

One process group holds both roles. An attention rank owns tokens (its DP group's); an expert rank owns a
contiguous slice of the routed experts and no tokens. Per MoE layer:

- A2E: each attention rank sends each token's hidden state once per destination (not once per routed expert:
  a token whose experts share a rank travels there once), with all of its top-k expert ids and weights;
- the expert rank computes, for each row, the weighted sum over its own experts among the k (`ExpertCompute`):
  one partial output per row;
- E2A: the partial outputs travel back, and the attention rank adds them up per token. What comes back is
  already weighted, so the attention side does no more than a sum.

Routing (`two_stage`):

- direct: rows go from each attention rank to each expert rank that owns one of their experts;
- two-stage (xdeepserve's trampoline forward): the expert ranks form nodes of `ranks_per_node`; a row goes
  once to one relay rank of each node that holds one of its experts (A2E, over the whole group), and the relay
  forwards it to the node's ranks that own them (A2E', over the node's group). On the way back each rank
  returns its partials to the relay (E2A'), which sums the node's partials of each row and sends one row back
  (E2A). An attention rank then talks to one rank per node, not to every expert rank, and a token crosses
  between nodes once per node instead of once per expert rank. The relay of a node for attention rank i is
  the node's rank i mod `ranks_per_node`, so the relays' work is spread over the node.

Every transfer is a variable-split `all_to_all_single` after an all-to-all of the counts, into buffers
allocated once for the worst case (as `EPDispatcher`): from one attention rank at most `max_tokens_per_rank`
rows reach each destination, since a token goes to a destination once. With `int8` the hidden states travel as
per-token INT8 codes and an fp32 scale, quantized once on the attention rank (CloudMatrix-Infer §4.2.1's early
quantization); partial outputs travel back in full precision.

Every rank of the group calls the same methods in the same order each layer: attention ranks `a2e` then
`e2a`; expert ranks `serve_layer`.

Under the benchmarks' emulated link latency (`MESHSERVE_EMULATED_LINK_LATENCY_MS`) an attention rank's rows leave
that long after `a2e` is called and the partial outputs reach it that long after they were sent: the expert
ranks do not wait meanwhile, so another DP domain can use them, as over a slow link.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshserve.moe.comm import as_bytes, dequantize_per_token_int8, from_bytes, quantize_per_token_int8
from meshserve.utils import envs

# (hidden [R, H], topk_ids [R, K] global, topk_weights [R, K]) -> the weighted sum over this rank's experts
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class A2ELayout:
    """Who is what in the A2E group: group ranks of the attention ranks and of the expert ranks, and the expert
    ranks per node (two-stage). Expert ranks are in expert order, in EP groups of `expert_tp` ranks that split
    each expert's intermediate dimension (MoE TP): expert rank j = g * t + r holds column block r of the experts
    [g * E/G, (g + 1) * E/G) of EP group g of G. A row goes to every rank of its expert's EP group; their partial
    outputs add up to the expert's, on the attention side with the others. "Experts" are the routed slots (with
    redundant slots, E counts the slots). `rank_of_slot` (MoE TP1 only) names the expert rank (an index into
    `expert_ranks`) of each slot instead, where the ranks hold different numbers of them: shared-expert ranks
    beside the routed ones (meshserve/moe/shared_ranks.py), whose slots every token's k counts too."""

    attention_ranks: tuple[int, ...]
    expert_ranks: tuple[int, ...]
    num_experts: int
    top_k: int
    ranks_per_node: int = 1
    expert_tp: int = 1
    rank_of_slot: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.attention_ranks or not self.expert_ranks:
            raise ValueError("an A2E group needs at least one attention rank and one expert rank")
        if set(self.attention_ranks) & set(self.expert_ranks):
            raise ValueError("a rank is either an attention rank or an expert rank")
        everyone = sorted(self.attention_ranks + self.expert_ranks)
        if everyone != list(range(len(everyone))):
            raise ValueError(f"the roles must cover group ranks 0..{len(everyone) - 1} once each")
        if self.expert_tp < 1 or len(self.expert_ranks) % self.expert_tp:
            raise ValueError(f"{len(self.expert_ranks)} expert ranks do not form EP groups of TP{self.expert_tp}")
        if self.rank_of_slot is not None:
            if self.expert_tp != 1:
                raise ValueError("a slot table (rank_of_slot) needs MoE TP1 on the expert ranks")
            if len(self.rank_of_slot) != self.num_experts or not all(
                    0 <= r < len(self.expert_ranks) for r in self.rank_of_slot):
                raise ValueError(f"rank_of_slot must name one of the {len(self.expert_ranks)} expert ranks for each "
                                 f"of the {self.num_experts} slots")
        elif self.num_experts % self.num_ep_groups:
            raise ValueError(f"{self.num_experts} experts do not split evenly over {self.num_ep_groups} EP groups "
                             "of expert ranks")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")
        if self.ranks_per_node < 1 or len(self.expert_ranks) % self.ranks_per_node:
            raise ValueError(f"{len(self.expert_ranks)} expert ranks do not form nodes of {self.ranks_per_node}")

    @property
    def world_size(self) -> int:
        return len(self.attention_ranks) + len(self.expert_ranks)

    @property
    def num_ep_groups(self) -> int:
        return len(self.expert_ranks) // self.expert_tp

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_ep_groups

    @property
    def destinations_per_token(self) -> int:
        """The most expert ranks one token's k experts live on."""
        return min(self.top_k * self.expert_tp, len(self.expert_ranks))

    def owner_indices(self, expert_ids: torch.Tensor, owners: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] expert ids -> [N, K * t] indices (into `expert_ranks`) of the ranks holding each one's columns
        (`owners`: `rank_of_slot` as a tensor, where the layout has one)."""
        if self.rank_of_slot is not None:
            if owners is None:
                owners = torch.tensor(self.rank_of_slot, dtype=torch.int64, device=expert_ids.device)
            return owners.index_select(0, expert_ids.reshape(-1).to(torch.int64)).reshape(expert_ids.shape)
        group = expert_ids.to(torch.int64) // self.experts_per_group
        if self.expert_tp == 1:
            return group
        columns = torch.arange(self.expert_tp, dtype=torch.int64, device=expert_ids.device)
        owners = group.unsqueeze(-1) * self.expert_tp + columns
        return owners.reshape(expert_ids.shape[0], expert_ids.shape[1] * self.expert_tp)

    @property
    def num_nodes(self) -> int:
        return len(self.expert_ranks) // self.ranks_per_node

    def node_members(self, node: int) -> tuple[int, ...]:
        """The group ranks of node `node`'s expert ranks."""
        return self.expert_ranks[node * self.ranks_per_node:(node + 1) * self.ranks_per_node]

    def relay(self, node: int, attention_index: int) -> int:
        """The rank of `node` that relays the rows of the `attention_index`-th attention rank."""
        return self.node_members(node)[attention_index % self.ranks_per_node]


@dataclass
class A2EHandle:
    """What an attention rank's `e2a` needs of its `a2e`: the transfers in flight."""

    token_of_row: torch.Tensor  # the token of each row sent, rows grouped by destination
    send_splits: list[int]  # rows sent to each rank of the group: as many come back from it
    num_tokens: int
    back: torch.Tensor  # where the partial outputs arrive, a row per row sent
    transfers: list  # the rows' send and the partial outputs' receive (async collectives), in issue order


class A2EComm:
    """One rank's side of A2E/E2A on `group` (every rank of `layout`), with buffers for `max_tokens_per_rank`
    tokens per attention rank. `node_groups`: with `two_stage`, the process group of each node's expert ranks
    (every rank creates all of them, in node order, as torch.distributed requires)."""

    def __init__(self, group, layout: A2ELayout, hidden: int, max_tokens_per_rank: int, dtype: torch.dtype,
                 two_stage: bool = False, node_groups: Sequence | None = None, int8: bool = False,
                 device: torch.device | str = "cpu", domain: int = 0) -> None:
        self.group, self.layout = group, layout
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != layout.world_size:
            raise ValueError(f"the group has {dist.get_world_size(group)} ranks, the layout {layout.world_size}")
        if two_stage and (node_groups is None or len(node_groups) != layout.num_nodes):
            raise ValueError(f"two-stage routing needs the process group of each of the {layout.num_nodes} nodes")
        if hidden < 1 or max_tokens_per_rank < 1:
            raise ValueError("hidden and max_tokens_per_rank must be positive")
        self.hidden, self.dtype, self.int8 = hidden, dtype, int8
        self.domain = domain  # the DP domain whose attention ranks the group holds (logs, timelines)
        self.max_tokens = max_tokens_per_rank
        self.two_stage = two_stage
        self.device = torch.device(device)
        self.is_attention = self.rank in layout.attention_ranks
        self.attention_index = layout.attention_ranks.index(self.rank) if self.is_attention else -1
        self.expert_index = layout.expert_ranks.index(self.rank) if not self.is_attention else -1
        self.node = self.expert_index // layout.ranks_per_node if not self.is_attention else -1
        self.node_group = node_groups[self.node] if two_stage and not self.is_attention else None
        k = layout.top_k
        element = torch.empty((), dtype=dtype).element_size()
        self.payload_bytes = hidden if int8 else hidden * element
        self.scale_bytes = 4 if int8 else 0
        self.row_bytes = self.payload_bytes + self.scale_bytes + 4 * k + 4 * k  # + int32 ids + fp32 weights
        # the most rows one rank holds at once: an attention rank sends a token to each destination once; an
        # expert rank (or a relay) gets at most one row per token of every attention rank
        destinations = min(layout.destinations_per_token, layout.num_nodes) if two_stage \
            else layout.destinations_per_token
        num_attention = len(layout.attention_ranks)
        rows = max_tokens_per_rank * (destinations if self.is_attention else num_attention)
        forward_rows = (max_tokens_per_rank * num_attention * min(layout.destinations_per_token, layout.ranks_per_node)
                        if two_stage else 0)
        # an attention rank has two micro-batches' rows and partial outputs in flight at once (`buffer_index`)
        sets = 2 if self.is_attention else 1
        self._send_sets = [torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=self.device)
                           for _ in range(sets)]
        self._partial_sets = [torch.empty(rows, hidden, dtype=dtype, device=self.device) for _ in range(sets)]
        self._send, self._partials = self._send_sets[0], self._partial_sets[0]
        self._recv = torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=self.device)
        self._forward = torch.empty(forward_rows, self.row_bytes, dtype=torch.uint8, device=self.device)
        self._forwarded = torch.empty(forward_rows, self.row_bytes, dtype=torch.uint8, device=self.device)
        self._relay_back = torch.empty(forward_rows, hidden, dtype=dtype, device=self.device)
        # (row count, tag) to and from every rank: the tag names the layer, so ranks out of step fail at once
        self._counts_send = torch.zeros(layout.world_size, 2, dtype=torch.int64, device=self.device)
        self._counts_recv = torch.zeros(layout.world_size, 2, dtype=torch.int64, device=self.device)
        self.link_latency_s = envs.emulated_link_latency_s()  # benchmarks only (see the module's docstring)
        self._owners = (torch.tensor(layout.rank_of_slot, dtype=torch.int64, device=self.device)
                        if layout.rank_of_slot is not None else None)

    def use_groups(self, group, node_groups: Sequence | None = None) -> None:
        """Talk over new process groups (the context rebuilt them after a transient error)."""
        self.group = group
        if self.two_stage and not self.is_attention:
            self.node_group = node_groups[self.node]

    def buffer_data_ptrs(self) -> list[int]:
        """data_ptr of every pre-allocated buffer (lets callers check nothing is re-allocated)."""
        return [t.data_ptr() for t in (*self._send_sets, self._recv, self._forward, self._forwarded,
                                       *self._partial_sets, self._relay_back)]

    # ------------------------------------------------------------------ attention ranks
    def a2e(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            tag: int = 0, buffer_index: int = 0) -> A2EHandle:
        """Send this attention rank's tokens to their experts' ranks (or their nodes' relays); `tag` names the layer
        (the expert ranks serve the same one). Returns once the row counts are known, with the rows on their way
        and their partial outputs' receive posted: the rank may compute meanwhile (the other micro-batch, which
        then uses the other `buffer_index`) until `e2a`."""
        self._check_attention_inputs(hidden, topk_ids, topk_weights)
        layout = self.layout
        owner = layout.owner_indices(topk_ids, self._owners)  # expert-rank index of each (token, k[, column block])
        target = owner // layout.ranks_per_node if self.two_stage else owner
        if self.two_stage:
            ranks = torch.tensor([layout.relay(node, self.attention_index) for node in range(layout.num_nodes)],
                                 dtype=torch.int64, device=self.device)
        else:
            ranks = torch.tensor(layout.expert_ranks, dtype=torch.int64, device=self.device)
        token_of_row, dest = _unique_destinations(target)  # each token once per destination
        dest_rank = ranks.index_select(0, dest)
        order = torch.argsort(dest_rank, stable=True)
        token_of_row, dest_rank = token_of_row.index_select(0, order), dest_rank.index_select(0, order)
        send = self._pack(self._send_sets[buffer_index], hidden, topk_ids, topk_weights, token_of_row)
        if self.link_latency_s:
            time.sleep(self.link_latency_s)
        send_splits, _ = self._exchange_counts(torch.bincount(dest_rank, minlength=layout.world_size), self.group,
                                               tag)
        nothing = [0] * layout.world_size
        rows = dist.all_to_all_single(self._recv[:0], send, nothing, send_splits, group=self.group, async_op=True)
        partials = self._partial_sets[buffer_index]
        back = partials[:token_of_row.numel()]
        # posted now: the expert ranks send the partial outputs before they take the next rows of this group
        returned = dist.all_to_all_single(back, partials[:0], send_splits, nothing, group=self.group, async_op=True)
        return A2EHandle(token_of_row, send_splits, hidden.shape[0], back, [rows, returned])

    def e2a(self, handle: A2EHandle) -> torch.Tensor:
        """The MoE output of this attention rank's tokens: the weighted partial outputs that came back, summed."""
        for transfer in handle.transfers:
            transfer.wait()
        out = torch.zeros(handle.num_tokens, self.hidden, dtype=self.dtype, device=self.device)
        out.index_add_(0, handle.token_of_row, handle.back)
        if self.link_latency_s:
            time.sleep(self.link_latency_s)
        return out

    # ------------------------------------------------------------------ expert ranks
    def serve_layer(self, compute: ExpertCompute, tag: int = 0) -> int:
        """One MoE layer on an expert rank: take the rows sent here, compute them, send the partials back. The
        number of rows this rank computed. `tag`: the layer the attention ranks must be sending."""
        if self.is_attention:
            raise RuntimeError(f"rank {self.rank} is an attention rank: it sends tokens, it serves no layer")
        layout = self.layout
        _, recv_splits = self._exchange_counts(torch.zeros(layout.world_size, dtype=torch.int64), self.group, tag)
        received = self._recv[:sum(recv_splits)]
        dist.all_to_all_single(received, self._send[:0], recv_splits, [0] * layout.world_size, group=self.group)
        if self.two_stage:
            partials = self._relay(received, compute, tag)
        else:
            partials = self._compute(received, compute)
        dist.all_to_all_single(self._partials[:0], partials, [0] * layout.world_size, recv_splits,
                               group=self.group)
        return received.shape[0]

    def _relay(self, received: torch.Tensor, compute: ExpertCompute, tag: int) -> torch.Tensor:
        """Two-stage: forward the rows this rank relays to the node's ranks that own their experts (A2E'),
        compute what came here, send the partials back to the relays (E2A'), and sum each relayed row's."""
        layout = self.layout
        members = torch.tensor(layout.node_members(self.node), dtype=torch.int64, device=self.device)
        ids = self._ids_of(received)
        local_owner = layout.owner_indices(ids, self._owners) - self.node * layout.ranks_per_node
        local_owner[(local_owner < 0) | (local_owner >= layout.ranks_per_node)] = -1  # experts of other nodes
        row_of_fwd, member = _unique_destinations(local_owner)  # each row once per owner in this node
        order = torch.argsort(member, stable=True)
        row_of_fwd, member = row_of_fwd.index_select(0, order), member.index_select(0, order)
        forward = self._forward[:row_of_fwd.numel()]
        torch.index_select(received, 0, row_of_fwd, out=forward)
        send_splits, recv_splits = self._exchange_counts(torch.bincount(member, minlength=members.numel()),
                                                         self.node_group, tag)
        forwarded = self._forwarded[:sum(recv_splits)]
        dist.all_to_all_single(forwarded, forward, recv_splits, send_splits, group=self.node_group)
        computed = self._compute(forwarded, compute)
        back = self._relay_back[:row_of_fwd.numel()]
        dist.all_to_all_single(back, computed, send_splits, recv_splits, group=self.node_group)
        partials = self._partials[:received.shape[0]].zero_()
        partials.index_add_(0, row_of_fwd, back)
        return partials

    def _compute(self, rows: torch.Tensor, compute: ExpertCompute) -> torch.Tensor:
        hidden, ids, weights = self._unpack(rows)
        # only this rank's experts count: the others' ids are out of its range (the compute skips them)
        out = compute(hidden, ids.to(torch.int64), weights)
        if out.shape != (rows.shape[0], self.hidden):
            raise ValueError(f"the expert compute returned {tuple(out.shape)}, not [{rows.shape[0]}, {self.hidden}]")
        return out.to(self.dtype).contiguous()

    # ------------------------------------------------------------------ rows
    def _pack(self, buffer: torch.Tensor, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              token_of_row: torch.Tensor) -> torch.Tensor:
        rows = buffer[:token_of_row.numel()]
        p, s, k = self.payload_bytes, self.scale_bytes, self.layout.top_k
        if self.int8:  # once per token, before the rows are replicated
            codes, scale = quantize_per_token_int8(hidden)
            rows[:, :p].copy_(as_bytes(codes.index_select(0, token_of_row)))
            rows[:, p:p + s].copy_(as_bytes(scale.index_select(0, token_of_row)))
        else:
            rows[:, :p].copy_(as_bytes(hidden.index_select(0, token_of_row)))
        rows[:, p + s:p + s + 4 * k].copy_(as_bytes(topk_ids.to(torch.int32).index_select(0, token_of_row)))
        rows[:, p + s + 4 * k:].copy_(as_bytes(topk_weights.to(torch.float32).index_select(0, token_of_row)))
        return rows

    def _ids_of(self, rows: torch.Tensor) -> torch.Tensor:
        p, s, k = self.payload_bytes, self.scale_bytes, self.layout.top_k
        return from_bytes(rows[:, p + s:p + s + 4 * k], torch.int32).reshape(-1, k)

    def _unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p, s, k = self.payload_bytes, self.scale_bytes, self.layout.top_k
        if self.int8:
            codes = from_bytes(rows[:, :p], torch.int8)
            scale = from_bytes(rows[:, p:p + s], torch.float32).reshape(-1)
            hidden = dequantize_per_token_int8(codes, scale, self.dtype)
        else:
            hidden = from_bytes(rows[:, :p], self.dtype)
        weights = from_bytes(rows[:, p + s + 4 * k:], torch.float32).reshape(-1, k)
        return hidden.reshape(-1, self.hidden), self._ids_of(rows), weights

    def _exchange_counts(self, send_counts: torch.Tensor, group, tag: int) -> tuple[list[int], list[int]]:
        """Rows to and from each rank of `group`; RuntimeError when a rank is at another layer (`tag`)."""
        size = send_counts.numel()
        sent, received = self._counts_send[:size], self._counts_recv[:size]
        sent[:, 0].copy_(send_counts)
        sent[:, 1].fill_(tag)
        dist.all_to_all_single(received, sent, group=group)
        tags = received[:, 1].tolist()
        if any(other != tag for other in tags):
            peer = next(i for i, other in enumerate(tags) if other != tag)
            raise RuntimeError(f"A2E out of step: group rank {peer} sent layer {tags[peer]} to rank {self.rank}, "
                               f"which is at layer {tag}")
        return sent[:, 0].tolist(), received[:, 0].tolist()

    def _check_attention_inputs(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                                topk_weights: torch.Tensor) -> None:
        if not self.is_attention:
            raise RuntimeError(f"rank {self.rank} is an expert rank: it serves layers, it sends no tokens")
        k = self.layout.top_k
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden or hidden.dtype != self.dtype:
            raise ValueError(f"hidden must be [T, {self.hidden}] {self.dtype}, got {tuple(hidden.shape)} "
                             f"{hidden.dtype}")
        if hidden.shape[0] > self.max_tokens:
            raise ValueError(f"{hidden.shape[0]} tokens exceed max_tokens_per_rank={self.max_tokens}")
        if topk_ids.shape != (hidden.shape[0], k) or topk_weights.shape != (hidden.shape[0], k):
            raise ValueError(f"topk_ids and topk_weights must be [{hidden.shape[0]}, {k}]")
        if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= self.layout.num_experts):
            raise ValueError(f"expert ids must be in [0, {self.layout.num_experts})")


def _unique_destinations(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For `target` [N, K] (a destination per row and k; -1: none), each (row, destination) pair once: the
    (row, destination) vectors, ordered by row, then destination."""
    num_rows, k = target.shape
    span = int(target.max()) + 1 if target.numel() else 1
    row = torch.arange(num_rows, device=target.device).repeat_interleave(k)
    flat = target.reshape(-1)
    keep = flat >= 0
    unique = torch.unique(row[keep] * span + flat[keep])  # sorted
    return unique // span, unique % span
