"""Where this rank sits in a parallel strategy, and the process groups it talks over.

For `attn=TPa+DPb moe=TPc+EPd` (world W = a*b = c*d), rank r is
- in attention DP group r // a, with attention TP rank r % a (its TP group: the a
  consecutive ranks of that DP group; they hold the same tokens);
- on MoE "node" r // c with MoE TP rank r % c: the c ranks of a node shard every
  expert's intermediate dimension and see the node's tokens; the d nodes split the
  experts (EP). The EP group of a rank holds the ranks with its MoE TP rank on every
  node. These are `Topology(num_nodes=d, ranks_per_node=c)` groups, so the hybrid
  TP-EP collectives of `moe_comm` run on them unchanged.

`ParallelContext.single()` is the one-rank context: every group is None and every
collective helper is the identity, so model code calls them unconditionally.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import Topology, TopologyGroups, build_groups


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
    attn_tp_group: dist.ProcessGroup | None = None
    moe_groups: TopologyGroups | None = None
    world_group: dist.ProcessGroup | None = None
    # rank lists of this rank's groups (for tests and logs)
    attn_tp_ranks: list[int] = field(default_factory=lambda: [0])
    moe_tp_ranks: list[int] = field(default_factory=lambda: [0])
    ep_ranks: list[int] = field(default_factory=lambda: [0])

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
              max_tokens_per_step: int = 2048, redundant_experts_per_rank: int = 0) -> ParallelContext:
        """Create every group on an initialised world; collective: every rank calls it in the same order."""
        if not dist.is_initialized():
            if strategy.world_size == 1:
                return cls(strategy, moe_comm=moe_comm, int8_dispatch=int8_dispatch,
                           max_tokens_per_step=max_tokens_per_step,
                           redundant_experts_per_rank=redundant_experts_per_rank)
            raise RuntimeError(f"strategy {strategy} needs torch.distributed to be initialised")
        world = dist.get_world_size()
        if world != strategy.world_size:
            raise ValueError(f"strategy {strategy} spans {strategy.world_size} ranks but the world has {world}")
        rank = dist.get_rank()
        a = strategy.attn_tp
        attn_groups = [list(range(dp * a, (dp + 1) * a)) for dp in range(strategy.attn_dp)]
        # new_group is collective over the world: every rank creates every group, in one order
        attn_pgs = [dist.new_group(ranks) for ranks in attn_groups]
        moe_groups = build_groups(Topology(num_nodes=strategy.moe_ep, ranks_per_node=strategy.moe_tp))
        topo = moe_groups.topology
        ctx = cls(strategy, rank=rank, moe_comm=moe_comm, int8_dispatch=int8_dispatch,
                  max_tokens_per_step=max_tokens_per_step, redundant_experts_per_rank=redundant_experts_per_rank,
                  attn_tp_group=attn_pgs[rank // a], moe_groups=moe_groups, world_group=dist.group.WORLD,
                  attn_tp_ranks=attn_groups[rank // a],
                  moe_tp_ranks=topo.intra_node_ranks(topo.node_of(rank)),
                  ep_ranks=topo.inter_node_ranks(topo.local_rank(rank)))
        return ctx

    # ------------------------------------------------------------------ coordinates
    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def dp_rank(self) -> int:
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
    def moe_tp_rank(self) -> int:
        return self.rank % self.strategy.moe_tp

    @property
    def moe_tp_size(self) -> int:
        return self.strategy.moe_tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.strategy.moe_tp

    @property
    def ep_size(self) -> int:
        return self.strategy.moe_ep

    @property
    def is_driver(self) -> bool:
        """The rank that samples for its DP group and reports the group's results to the master."""
        return self.attn_tp_rank == 0

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
