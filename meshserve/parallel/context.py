"""Where this rank sits in a parallel strategy, and the process groups it talks over.

For `attn=TPa+DPb moe=TPc+EPd` (world W = a*b = c*d), rank r is
- in attention DP group r // a, with attention TP rank r % a (its TP group: the a
  consecutive ranks of that DP group; they hold the same tokens);
- on MoE "node" r // c with MoE TP rank r % c: the c ranks of a node shard every
  expert's intermediate dimension and see the node's tokens; the d nodes split the
  experts (EP). The EP group of a rank holds the ranks with its MoE TP rank on every
  node. These are `Topology(num_nodes=d, ranks_per_node=c)` groups, so the hybrid
  TP-EP collectives of `moe_comm` run on them unchanged.
With `oproj=TPk` (attention TP1, so rank = DP rank) rank r also shares the attention
output projection with the k consecutive ranks [r - r % k, r - r % k + k): its o_proj
group, where it holds heads-shard r % k of o_proj's input columns.

`ParallelContext.single()` is the one-rank context: every group is None and every
collective helper is the identity, so model code calls them unconditionally.

A step's collectives run on these groups only, never on the WORLD group the ranks rendezvoused with, and each
of them fails after `collective_timeout_s` rather than waiting forever for a peer. After a transient error
(parallel/rollback.py) the ranks agree on a rollback through the world's store (`agree_on_rollback`) and
replace every group with a new one (`rebuild_groups`): what holds a group (the MoE dispatchers) registers to
follow (`on_rebuild`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.parallel.rollback import RollbackAgreement
from meshserve.parallel.step_board import StepBoard
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import Topology, TopologyGroups, build_groups

_DEFAULT_TIMEOUT_S = dist.default_pg_timeout.total_seconds()


def _rank_lists(strategy: ParallelStrategy, rank: int) -> dict[str, list[int]]:
    """The ranks of `rank`'s groups by kind (for tests and logs)."""
    if strategy.disagg:
        first, t = strategy.attention_ranks, strategy.moe_tp
        if rank < first:
            return dict(attn_tp_ranks=[rank], oproj_ranks=[rank], moe_tp_ranks=[rank], ep_ranks=[rank])
        index = rank - first
        return dict(attn_tp_ranks=[rank], oproj_ranks=[rank],
                    moe_tp_ranks=[first + index // t * t + r for r in range(t)],
                    ep_ranks=[first + g * t + index % t for g in range(strategy.moe_ep)])
    topo = Topology(num_nodes=strategy.moe_ep, ranks_per_node=strategy.moe_tp)
    a, k = strategy.attn_tp, strategy.oproj_tp
    return dict(attn_tp_ranks=list(range(rank // a * a, (rank // a + 1) * a)),
                oproj_ranks=list(range(rank // k * k, (rank // k + 1) * k)),
                moe_tp_ranks=topo.intra_node_ranks(topo.node_of(rank)),
                ep_ranks=topo.inter_node_ranks(topo.local_rank(rank)))


@dataclass
class ParallelContext:
    strategy: ParallelStrategy
    rank: int = 0
    # how the MoE collectives are scheduled when moe TP > 1: "fused" (MixServe Alg. 1-2) or "sync"
    moe_comm: str = "fused"
    # early INT8 quantization of EP dispatch (pure EP only; combine stays in full precision)
    int8_dispatch: bool = False
    # the most tokens one rank runs in a step (sizes the pre-allocated dispatch buffers)
    max_tokens_per_step: int = 2048
    # R: extra physical expert slots per EP rank for replicas of hot experts (expert load balancing);
    # each EP rank then holds E/EP primary slots + R redundant ones per MoE layer
    redundant_experts_per_rank: int = 0
    # a collective on this context's groups fails after this long (None: torch's default timeout)
    collective_timeout_s: float | None = None
    # self-contained DP groups: the ranks agree on every step over `step_board` (`agree_on_step`)
    agree_steps: bool = False
    board_host: str | None = None  # rank 0's address when ranks run on other hosts (a TCP board); None: one host
    board_host_id: str | None = None  # the host this rank counts itself on (None: its hostname and boot id)
    step_board: StepBoard | None = None
    attn_tp_group: dist.ProcessGroup | None = None
    oproj_group: dist.ProcessGroup | None = None  # None with oproj TP1
    moe_groups: TopologyGroups | None = None
    # attention-expert disaggregation (`disagg`): the A2E groups this rank talks over (an attention rank: its DP
    # domain's, holding the domain's attention ranks and every expert rank; an expert rank: every domain's, in
    # domain order) and, with two-stage routing, every node's group of expert ranks (meshserve/moe/a2e.py)
    a2e_groups: list = field(default_factory=list)
    a2e_node_groups: list = field(default_factory=list)
    # rank lists of this rank's groups (for tests and logs)
    attn_tp_ranks: list[int] = field(default_factory=lambda: [0])
    oproj_ranks: list[int] = field(default_factory=lambda: [0])
    moe_tp_ranks: list[int] = field(default_factory=lambda: [0])
    ep_ranks: list[int] = field(default_factory=lambda: [0])
    rollback: RollbackAgreement | None = None  # the ranks' rollback rounds (None: one rank)
    _boards_opened: int = field(default=0, init=False, repr=False)  # names each new board in the world's store
    _all_groups: list = field(default_factory=list, init=False, repr=False)  # the groups this rank is in
    _rebuild_listeners: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.moe_comm not in ("fused", "sync"):
            raise ValueError(f"moe_comm must be 'fused' or 'sync', got {self.moe_comm!r}")
        if not 0 <= self.rank < self.strategy.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.strategy.world_size}")
        if self.max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step must be >= 1, got {self.max_tokens_per_step}")
        if self.redundant_experts_per_rank < 0:
            raise ValueError(f"redundant_experts_per_rank must be >= 0, got {self.redundant_experts_per_rank}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def single(cls) -> ParallelContext:
        return cls(ParallelStrategy())

    @classmethod
    def build(cls, strategy: ParallelStrategy, moe_comm: str = "fused", int8_dispatch: bool = False,
              max_tokens_per_step: int = 2048, redundant_experts_per_rank: int = 0,
              collective_timeout_s: float | None = None, agree_steps: bool = False,
              board_host: str | None = None, board_host_id: str | None = None) -> ParallelContext:
        """Create every group on an initialised world; collective: every rank calls it in the same order."""
        settings = dict(moe_comm=moe_comm, int8_dispatch=int8_dispatch, max_tokens_per_step=max_tokens_per_step,
                        redundant_experts_per_rank=redundant_experts_per_rank,
                        collective_timeout_s=collective_timeout_s, agree_steps=agree_steps, board_host=board_host,
                        board_host_id=board_host_id)
        if not dist.is_initialized():
            if strategy.world_size == 1:
                return cls(strategy, **settings)
            raise RuntimeError(f"strategy {strategy} needs torch.distributed to be initialised")
        world = dist.get_world_size()
        if world != strategy.world_size:
            raise ValueError(f"strategy {strategy} spans {strategy.world_size} ranks but the world has {world}")
        rank = dist.get_rank()
        # a peer still in a collective fails it within one timeout; the second covers the compute before it
        wait_s = 2 * (collective_timeout_s or _DEFAULT_TIMEOUT_S)
        # the store the world rendezvoused on: its server lives in rank 0's process, apart from the groups
        store = dist.distributed_c10d._get_default_store()
        ctx = cls(strategy, rank=rank, **settings, **_rank_lists(strategy, rank),
                  rollback=RollbackAgreement(store, rank, world, wait_s))
        ctx._create_groups()
        return ctx

    def _create_groups(self) -> None:
        """This rank's groups, new; collective over the world (new_group must be called for every group on every
        rank, in one order). They meet under torch's default timeout; their collectives then get the bounded one."""
        if self.strategy.disagg:
            self._create_disagg_groups()
            return
        a = self.strategy.attn_tp
        attn_pgs = [dist.new_group(list(range(dp * a, (dp + 1) * a))) for dp in range(self.strategy.attn_dp)]
        self.moe_groups = build_groups(Topology(num_nodes=self.strategy.moe_ep, ranks_per_node=self.strategy.moe_tp))
        self.attn_tp_group = attn_pgs[self.rank // a]
        k = self.strategy.oproj_tp
        # none with oproj TP1: that layout creates exactly the groups it always did
        oproj_pgs = [dist.new_group(list(range(g * k, (g + 1) * k))) for g in range(self.world_size // k)] if k > 1 \
            else []
        self.oproj_group = oproj_pgs[self.rank // k] if oproj_pgs else None
        self._finish_groups([*attn_pgs, *oproj_pgs, *self.moe_groups.all_intra_node, *self.moe_groups.all_inter_node])

    def _create_disagg_groups(self) -> None:
        """The A2E groups of a disaggregated layout: one per DP domain (its attention ranks, then every expert
        rank) and, with two-stage routing, one per node of `relay` expert ranks."""
        s = self.strategy
        experts = list(range(s.attention_ranks, self.world_size))
        per_domain = s.attention_ranks // s.domains
        domain_pgs = [dist.new_group(list(range(d * per_domain, (d + 1) * per_domain)) + experts)
                      for d in range(s.domains)]
        node_pgs = [dist.new_group(experts[n:n + s.relay]) for n in range(0, len(experts), s.relay)] \
            if s.relay > 1 else []
        self.a2e_groups = domain_pgs if self.is_expert_rank else [domain_pgs[self.domain]]
        self.a2e_node_groups = node_pgs
        self._finish_groups([*domain_pgs, *node_pgs])

    def _finish_groups(self, groups: list) -> None:
        """Keep the groups this rank is in (to rebuild and destroy them), bound their collectives, open the board."""
        if self.agree_steps:
            self._open_step_board()
        self._all_groups = [group for group in groups
                            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER]
        if self.collective_timeout_s is not None:
            for group in self._all_groups:
                group.set_timeout(timedelta(seconds=self.collective_timeout_s))

    def _open_step_board(self) -> None:
        """A new board for the step agreement (the old one's connections may be broken after a transient error)."""
        if self.step_board is not None:
            self.step_board.close()
        self._boards_opened += 1
        self.step_board = StepBoard.open(self.rollback.store, self.rank, self.world_size, self._boards_opened,
                                         round_timeout_s=self.collective_timeout_s or _DEFAULT_TIMEOUT_S,
                                         meet_timeout_s=_DEFAULT_TIMEOUT_S, host=self.board_host,
                                         host_id=self.board_host_id)

    def agree_on_step(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (all of one length), in rank order: how self-contained DP groups agree on each step
        (worker/step_agreement.py). Collective over the world."""
        if self.step_board is None:
            return [list(row)]
        return self.step_board.exchange(row)

    # ------------------------------------------------------------------ rollback (xdeepserve §6.2)
    def agree_on_rollback(self, step_id: int) -> None:
        """Wait until every rank has failed `step_id` too (RollbackAbandoned when they failed different steps or
        one does not come); nothing to agree with for one rank."""
        if self.rollback is not None:
            self.rollback.agree(step_id)

    def rebuild_groups(self) -> None:
        """Replace every group with a new one (a transient error leaves the old communicators unusable); what
        registered with `on_rebuild` follows. Collective: every rank calls it after agreeing on the rollback."""
        if self.rollback is None:
            return
        old = self._all_groups
        self._create_groups()
        for listener in self._rebuild_listeners:
            listener()
        for group in old:
            dist.destroy_process_group(group)

    def on_rebuild(self, listener: Callable[[], None]) -> None:
        """Call `listener` after each `rebuild_groups` (it takes the new groups from this context)."""
        self._rebuild_listeners.append(listener)

    # ------------------------------------------------------------------ coordinates
    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_disagg(self) -> bool:
        """Attention and experts on different ranks (`disagg`)."""
        return self.strategy.disagg

    @property
    def is_expert_rank(self) -> bool:
        """A rank of a disaggregated layout holding experts only: no tokens, no KV cache, no DP group."""
        return self.strategy.disagg and self.rank >= self.strategy.attention_ranks

    @property
    def expert_index(self) -> int:
        """This expert rank's place among the expert ranks (EP group * MoE TP + column block)."""
        return self.rank - self.strategy.attention_ranks

    @property
    def domain(self) -> int:
        """The DP domain of this attention rank (disaggregated layouts; 0 otherwise)."""
        return self.dp_rank // (self.strategy.attn_dp // self.strategy.domains)

    @property
    def dp_rank(self) -> int:
        if self.is_expert_rank:
            return 0  # in no DP group; never asked for one's part of a step
        return self.rank // self.strategy.attn_tp

    @property
    def dp_size(self) -> int:
        return self.strategy.attn_dp

    @property
    def attn_tp_rank(self) -> int:
        return self.rank % self.strategy.attn_tp

    @property
    def attn_tp_size(self) -> int:
        return self.strategy.attn_tp

    @property
    def oproj_rank(self) -> int:
        """Which heads-shard of o_proj's input columns this rank holds."""
        return self.rank % self.strategy.oproj_tp

    @property
    def oproj_size(self) -> int:
        return self.strategy.oproj_tp

    @property
    def moe_tp_rank(self) -> int:
        if self.is_disagg:
            return self.expert_index % self.strategy.moe_tp if self.is_expert_rank else 0
        return self.rank % self.strategy.moe_tp

    @property
    def moe_tp_size(self) -> int:
        return self.strategy.moe_tp

    @property
    def ep_rank(self) -> int:
        if self.is_disagg:  # an attention rank holds no expert: 0 keeps index arithmetic in range
            return self.expert_index // self.strategy.moe_tp if self.is_expert_rank else 0
        return self.rank // self.strategy.moe_tp

    @property
    def ep_size(self) -> int:
        return self.strategy.moe_ep

    @property
    def shared_ep_size(self) -> int:
        """EP ranks hosting only the shared experts (`shared=EPs`; the last s EP ranks)."""
        return self.strategy.shared_ep

    @property
    def routed_ep_size(self) -> int:
        """EP ranks hosting the routed experts (the first EP - s)."""
        return self.strategy.routed_ep

    @property
    def is_shared_expert_rank(self) -> bool:
        if self.is_disagg and not self.is_expert_rank:
            return False
        return self.ep_rank >= self.routed_ep_size

    @property
    def is_driver(self) -> bool:
        """The rank that samples for its DP group and reports the group's results to the master."""
        return self.attn_tp_rank == 0 and not self.is_expert_rank

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[first, first + count) of the global experts this rank's EP slot holds."""
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split evenly over EP{self.ep_size}")
        count = num_experts // self.ep_size
        return self.ep_rank * count, count

    def slot_range(self, num_experts: int) -> tuple[int, int]:
        """[first, first + count) of the physical expert slots this rank's EP rank holds: its E/EP primary
        slots, then R redundant ones (slot ids are rank-major, see meshserve/moe/placement.py)."""
        _, primaries = self.expert_range(num_experts)
        count = primaries + self.redundant_experts_per_rank
        return self.ep_rank * count, count

    def shard_range(self, size: int, tp_size: int, tp_rank: int, what: str) -> tuple[int, int]:
        if size % tp_size:
            raise ValueError(f"{what} of {size} does not split evenly over TP{tp_size}")
        part = size // tp_size
        return tp_rank * part, part

    # ------------------------------------------------------------------ attention-TP collectives
    def attn_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results (row-parallel outputs) over the attention TP group, in place."""
        if self.attn_tp_size > 1:
            dist.all_reduce(x, group=self.attn_tp_group)
        return x

    def attn_all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate equal shards along the last dim over the attention TP group (vocab-parallel logits)."""
        if self.attn_tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.attn_tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.attn_tp_group)
        return torch.cat(parts, dim=-1)

    def attn_broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """The driver's tensor on every rank of the attention TP group, in place."""
        if self.attn_tp_size > 1:
            dist.broadcast(x, src=self.attn_tp_ranks[0], group=self.attn_tp_group)
        return x

    # ------------------------------------------------------------------ o_proj-group collectives
    def oproj_token_counts(self, num_tokens: int, device: torch.device) -> list[int]:
        """Every o_proj group member's token count, in rank order (exchanged on `device`, as NCCL needs)."""
        mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        counts = [torch.empty_like(mine) for _ in range(self.oproj_size)]
        dist.all_gather(counts, mine, group=self.oproj_group)
        return [int(count.item()) for count in counts]

    def oproj_all_to_all(self, out: torch.Tensor, rows: torch.Tensor, out_splits: list[int],
                         in_splits: list[int]) -> torch.Tensor:
        """Rows [sum(in_splits), ...] to the o_proj group members, in_splits[i] of them to member i; `out` receives
        out_splits[i] rows from member i."""
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=self.oproj_group)
        return out
