"""How an engine's ranks are laid out: the parallel strategy, collectives, and where the ranks run."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from meshserve.config.base import ConfigError, ConfigStruct
from meshserve.parallel.strategy import ParallelStrategy, StrategyError, parse_strategy

DEFAULT_ENGINE_PORT = 29600  # where a master with remote ranks listens for them (`meshserve worker`)

Port = Annotated[int, Meta(ge=1, le=65535)]


class ParallelConfig(ConfigStruct, frozen=True):
    parallel: Annotated[str, Meta(
        description="parallel strategy, one worker per rank (MixServe grammar, e.g. 'attn=TP1+DP2 moe=TP1+EP2'; "
                    "'attn=TP1+DP2 oproj=TP2 moe=TP1+EP2' shares MLA's o_proj over 2 ranks)")
    ] = "attn=TP1+DP1 moe=TP1+EP1"
    moe_comm: Annotated[Literal["fused", "sync"], Meta(
        description="hybrid TP-EP collectives: fused (MixServe Alg. 1-2, overlapped) or sync")] = "fused"
    int8_dispatch: Annotated[bool, Meta(
        description="INT8 expert-parallel dispatch (per-token scale); combine stays full precision")] = False
    microbatches: Annotated[int, Meta(
        ge=1, le=2, description="2: run each step as two micro-batches, one computing while the other's MoE "
                                "dispatch or combine is in flight (pure EP with attention TP1, "
                                "attn=TP1+DPn moe=TP1+EPn with n > 1, also with oproj=TPk, or a disaggregated "
                                "layout's DP domains; DeepSeek-V3 models)")] = 1
    microbatch_min_tokens: Annotated[int, Meta(
        ge=2, description="with microbatches 2: split a step only when its largest DP group has this many tokens "
                          "(a smaller step gains less than the split costs)")] = 16
    dp_groups: Annotated[Literal["lockstep", "self-contained"], Meta(
        description="how a TE runs its DP groups: lockstep (one master schedules every group and sends one step to "
                    "all ranks) or self-contained (xdeepserve §4.2: each group a master process of its own with its "
                    "scheduler, KV cache and output path; its ranks agree with the other groups' on each step; the "
                    "TE's own process only places requests on groups and watches them)")] = "lockstep"
    dist_backend: Annotated[Literal["gloo", "nccl"], Meta(
        description="torch.distributed backend (default: gloo on CPU, nccl on CUDA)")] | None = None
    num_threads: Annotated[int, Meta(
        ge=1, description="torch threads per worker (default: the cores divided among the ranks)")] | None = None
    # jitter (xdeepserve §4.4): a pause on one rank stalls every rank at the step's collectives
    gc_collect_every_steps: Annotated[int, Meta(
        ge=0, description="the ranks and the master turn Python's automatic garbage collection off after start-up "
                          "and collect every this many steps instead, all ranks after the same step (0: automatic "
                          "collection, as Python does it)")] = 200
    pin_cores: Annotated[bool, Meta(
        description="pin each rank to cores of its own: its slice of the cores the process may use, as many as "
                    "its torch threads (ranks beyond the cores wrap around)")] = False
    local_ranks: Annotated[int, Meta(
        ge=1, description="ranks the master starts on this host; the others join with `meshserve worker "
                          "--engine tcp://MASTER_ADDR:ENGINE_PORT --rank R` (default: all)")] | None = None
    master_addr: Annotated[str, Meta(
        description="this host's address as the other hosts reach it (MASTER_ADDR)")] = "127.0.0.1"
    engine_port: Annotated[Port, Meta(
        description="with remote ranks: the port they connect to the master on")] = DEFAULT_ENGINE_PORT
    master_port: Annotated[Port, Meta(
        description="torch.distributed rendezvous port on this host (MASTER_PORT; default: a free one)")
    ] | None = None
    startup_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds the engine waits for its workers to start")] = 300.0
    # fault tolerance (xdeepserve §6)
    hang_timeout_s: Annotated[float, Meta(
        gt=0, description="a rank that answers no health ping for this long (stuck in a kernel or a collective) "
                          "is declared hung and the ranks are recovered; must exceed the longest step")] = 30.0
    collective_timeout_s: Annotated[float, Meta(
        gt=0, description="a step's collective (attention TP, MoE dispatch and combine) fails after waiting this "
                          "long for a peer instead of hanging; the ranks then roll the step back and run it again "
                          "on new process groups, or give up when they cannot agree (a dead rank). Keep it below "
                          "hang_timeout_s: a rank waiting longer is taken for hung and the ranks are restarted")
    ] = 10.0
    on_rank_failure: Annotated[Literal["restart", "shrink", "fail"], Meta(
        description="when a rank dies or hangs: restart the ranks and continue every request from its tokens so "
                    "far; shrink: go on at once on the ranks left (fewer DP groups and EP ranks, every expert "
                    "kept, DP=EP layouts) and grow back later; fail: fail the requests (the old way)")] = "restart"
    regrow_after_s: Annotated[float, Meta(
        gt=0, description="shrink: seconds on the ranks left before growing back to the full layout")] = 30.0
    max_recoveries: Annotated[int, Meta(
        ge=0, description="recoveries allowed within 10 minutes; one more fails the engine instead")] = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        world = self.world_size  # parses `parallel`, raising ConfigError on a bad strategy
        strategy = self.strategy
        if strategy.disagg:
            self._check_disagg(strategy)
        if self.microbatches == 2 and not strategy.disagg and not (
                strategy.attn_tp == 1 and strategy.moe_tp == 1 and strategy.moe_ep > 1):
            raise ConfigError(f"microbatches 2 overlaps the expert-parallel dispatch and combine: it needs "
                              f"attn=TP1+DPn moe=TP1+EPn with n > 1, not {strategy}")
        if self.dp_groups == "self-contained" and self.on_rank_failure == "shrink" and self.spans_hosts:
            raise ConfigError("on_rank_failure shrink renumbers the ranks left, which ranks on other hosts cannot "
                              "follow with self-contained DP groups: use restart, or start every rank here "
                              "(drop local_ranks)")
        if self.local_ranks is not None and self.local_ranks > world:
            raise ConfigError(f"local_ranks must be between 1 and the world size {world} (rank 0 runs beside the "
                              f"master), got {self.local_ranks}")

    def _check_disagg(self, strategy: ParallelStrategy) -> None:
        """What a disaggregated layout does not serve, refused in one line naming the setting."""
        if strategy.shared_ep and strategy.moe_tp > 1:
            raise ConfigError(f"shared=EP{strategy.shared_ep * strategy.moe_tp} needs moe=TP1 on the expert ranks "
                              f"(pure EP), not moe=TP{strategy.moe_tp}")
        if self.dp_groups == "self-contained":
            raise ConfigError("dp_groups self-contained: a disaggregated layout runs its attention ranks in "
                              "lockstep (the expert ranks serve every forward)")
        if self.on_rank_failure == "shrink":
            raise ConfigError("on_rank_failure shrink removes DP groups and EP ranks together (DP=EP layouts); a "
                              "disaggregated layout restarts its ranks (restart)")

    @property
    def strategy(self) -> ParallelStrategy:
        try:
            return parse_strategy(self.parallel)
        except StrategyError as exc:
            raise ConfigError(f"bad parallel strategy {self.parallel!r}: {exc}") from None

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def num_local_ranks(self) -> int:
        """Ranks the master starts on its own host; the rest join with `meshserve worker`."""
        return self.world_size if self.local_ranks is None else self.local_ranks

    @property
    def spans_hosts(self) -> bool:
        """Some ranks join from other hosts (everything between the ranks then goes over TCP)."""
        return self.num_local_ranks < self.world_size
