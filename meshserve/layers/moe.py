"""Routed-expert compute that is fast on CPU.

Tokens are grouped by expert (one stable sort of the flattened top-k ids) and
each active expert runs one matmul pair over its contiguous slice: no per-token
Python loop and no dense mask over all experts. On CPU the native kernel
(cpu_kernels.py) runs every expert of the layer in one parallel region.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels, int8, w8a8
from meshserve.layers.linear import NO_TENSOR, linear, pack_weight


def fused_experts(
    hidden_states: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int64 [T, K], global expert ids
    topk_weights: torch.Tensor,  # [T, K]
    w13: torch.Tensor,  # [E_local, 2 * I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E_local, H, I]
    first_expert: int = 0,  # global id of local expert 0 (expert parallelism keeps a slice)
    packed: tuple[list, list] | None = None,  # per-expert oneDNN weights of w13 and w2 (see linear.py)
    native: tuple[torch.Tensor, torch.Tensor] | None = None,  # w13 and w2 packed for the native CPU kernel
    bf16_native: tuple[torch.Tensor, torch.Tensor] | None = None,  # w13 and w2 packed per slot for the bf16 kernel
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    if native is not None and hidden_states.dtype == torch.float32 and cpu_kernels.enabled():
        return cpu_kernels.moe_forward(hidden_states.contiguous(), topk_ids, topk_weights.float(), first_expert,
                                       *native)
    out = torch.zeros_like(hidden_states)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1) - first_expert
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids.index_select(0, order)
    local = (sorted_ids >= 0) & (sorted_ids < num_local)
    if not bool(local.all()):
        order = order[local]
        sorted_ids = sorted_ids[local]
    if order.numel() == 0:
        return out
    counts = torch.bincount(sorted_ids, minlength=num_local)
    token_idx = order // top_k
    xs = hidden_states.index_select(0, token_idx)
    ys = _experts_per_matmul(xs, counts.tolist(), w13, w2, packed, bf16_native)
    weights = topk_weights.reshape(-1).index_select(0, order).to(ys.dtype)
    ys.mul_(weights.unsqueeze(1))
    out.index_add_(0, token_idx, ys)
    return out


def _experts_per_matmul(xs: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor,
                        packed: tuple[list, list] | None,
                        bf16_native: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One matmul pair per active expert over its rows of xs (grouped by expert): through the native bfloat16
    kernel where its packs are given, else oneDNN's packs, else torch."""
    ys = torch.empty_like(xs)
    intermediate = w2.shape[2]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        if bf16_native is not None:
            gate_up = cpu_kernels.bf16_linear(xs[start:end], bf16_native[0][expert])
            act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            ys[start:end] = cpu_kernels.bf16_linear(act, bf16_native[1][expert])
        elif packed is None:
            gate_up = torch.mm(xs[start:end], w13[expert].t())
            act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            torch.mm(act, w2[expert].t(), out=ys[start:end])
        else:
            gate_up = linear(xs[start:end], w13[expert], packed=packed[0][expert])
            act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            ys[start:end] = linear(act, w2[expert], packed=packed[1][expert])
        start = end
    return ys


class FusedMoEWeights(torch.nn.Module):
    """Stacked expert weights with a loader that accepts HF per-expert tensors.

    Sharded for parallel serving: a rank holds `num_local_experts` consecutive experts
    from `first_expert` (expert parallelism) and, of each, the intermediate block
    `tp_rank` of `tp_size` (MoE tensor parallelism). Gate and up keep the same column
    block and down the matching input columns, so silu(gate) * up stays local and the
    `tp_size` partial outputs sum to the full one. `load_expert` takes full HF tensors and
    copies the held slice.

    Expert load balancing adds `redundant_slots` physical slots after the primaries:
    local slot i < num_local_experts holds expert first_expert + i, the redundant slots
    hold replicas written by `write_slot` (empty, zero, until then). The forward takes
    global slot ids (local slot 0 is global slot `first_slot`); without redundant slots
    slot ids are the expert ids. Where the experts do not split evenly over the EP ranks
    (meshserve/moe/placement.py `engine_shape`), the caller passes `first_slot`: the ranks
    then hold different numbers of primaries but the same number of slots.

    `num_experts` is the number of primary experts held here (what loaders iterate over);
    `total_experts` the model's; `num_slots` the local slots; `intermediate_size` the full
    HF size and `local_intermediate_size` the held columns.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 first_expert: int = 0, num_local_experts: int | None = None, tp_rank: int = 0,
                 tp_size: int = 1, redundant_slots: int = 0, first_slot: int | None = None) -> None:
        super().__init__()
        if num_local_experts is None:
            num_local_experts = num_experts - first_expert
        # no expert at all: an attention rank of a disaggregated layout (its experts live on expert ranks)
        holds_none = num_local_experts == 0 and redundant_slots == 0 and first_slot is not None
        if not (0 <= first_expert and (1 <= num_local_experts or holds_none)
                and first_expert + num_local_experts <= num_experts):
            raise ValueError(f"experts [{first_expert}, {first_expert + num_local_experts}) are not a slice of "
                             f"{num_experts} experts")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside TP{tp_size}")
        if intermediate_size % tp_size:
            raise ValueError(f"intermediate size {intermediate_size} does not split evenly over TP{tp_size}")
        if redundant_slots < 0 or (redundant_slots and first_slot is None and first_expert % num_local_experts):
            raise ValueError(f"redundant slots need a non-negative count and an EP-aligned expert slice (or a "
                             f"first_slot), got {redundant_slots} after experts [{first_expert}, "
                             f"{first_expert + num_local_experts})")
        if first_slot is not None and first_slot < 0:
            raise ValueError(f"first_slot must be >= 0, got {first_slot}")
        self.total_experts = num_experts
        self.num_experts = num_local_experts
        self.num_local_experts = num_local_experts
        self.first_expert = first_expert
        self.redundant_slots = redundant_slots
        self.num_slots = num_local_experts + redundant_slots
        # slots are rank-major: EP rank r's slots start at r * num_slots
        self.first_slot = first_slot if first_slot is not None else first_expert // num_local_experts * self.num_slots
        # the logical expert each local slot holds (-1: empty)
        self.slot_experts = list(range(first_expert, first_expert + num_local_experts)) + [-1] * redundant_slots
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_intermediate_size = intermediate_size // tp_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        part = self.local_intermediate_size
        self.w13 = torch.nn.Parameter(
            torch.empty(self.num_slots, 2 * part, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = torch.nn.Parameter(
            torch.empty(self.num_slots, hidden_size, part, dtype=dtype), requires_grad=False)
        if redundant_slots:  # empty slots are never routed to; zeros keep them free of garbage
            self.w13.data[num_local_experts:].zero_()
            self.w2.data[num_local_experts:].zero_()
        self.float_dtype = dtype  # the serving dtype; the weights themselves turn INT8 under W8A8
        self.w13_scale: torch.Tensor | None = None  # W8A8: per-output-channel scales [slots, 2 * part]
        self.w2_scale: torch.Tensor | None = None  # [slots, H]
        self._int8_native: tuple | None = None  # W8A8 weights packed for the native INT8 kernel
        self._packed: tuple[list, list] | None = None  # oneDNN copies (torch path)
        self._native: tuple[torch.Tensor, torch.Tensor] | None = None  # native-kernel copies
        self._bf16_native: tuple[torch.Tensor, torch.Tensor] | None = None  # slots packed for the bf16 kernel
        self._pack_requested = False

    def owns_expert(self, expert_id: int) -> bool:
        """Whether expert_id is one of the primaries held here (what the checkpoint loader fills)."""
        return 0 <= expert_id - self.first_expert < self.num_local_experts

    def hf_shape(self, proj: str) -> tuple[int, int]:
        """Shape of one expert's full HF tensor for `gate_proj`, `up_proj` or `down_proj`."""
        if proj in ("gate_proj", "up_proj"):
            return self.intermediate_size, self.hidden_size
        if proj == "down_proj":
            return self.hidden_size, self.intermediate_size
        raise KeyError(f"unknown expert projection {proj!r}")

    def column_range(self) -> tuple[int, int]:
        """[lo, hi) of the intermediate columns held here (of gate/up rows and down columns)."""
        part = self.local_intermediate_size
        return self.tp_rank * part, (self.tp_rank + 1) * part

    def _columns(self) -> slice:
        return slice(*self.column_range())

    def load_expert(self, expert_id: int, proj: str, tensor: torch.Tensor) -> bool:
        """Copy this rank's slice of one full HF tensor (`gate_proj`, `up_proj` or `down_proj` of a global
        expert id) into its primary slot. Returns False when the expert is not held by this rank."""
        expected = self.hf_shape(proj)
        if not self.owns_expert(expert_id):
            return False
        if tuple(tensor.shape) != expected:
            raise ValueError(f"expert {expert_id} {proj} has shape {tuple(tensor.shape)}, expected {expected}")
        local, cols, part = expert_id - self.first_expert, self._columns(), self.local_intermediate_size
        if proj == "gate_proj":
            self.w13.data[local, :part].copy_(tensor[cols])
        elif proj == "up_proj":
            self.w13.data[local, part:].copy_(tensor[cols])
        else:
            self.w2.data[local].copy_(tensor[:, cols])
        return True

    def write_slot(self, slot: int, expert_id: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Fill local `slot` with `expert_id`'s held slice: w13 [2 * local I, H] (gate rows then up rows),
        w2 [H, local I]; repacks the slot. Safe while other slots serve forwards. Live reconfiguration
        writes only redundant slots (the balancer checks); a placement applied before serving may
        rewrite primary slots too."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not a local slot (this rank holds [0, {self.num_slots}))")
        if tuple(w13.shape) != tuple(self.w13.shape[1:]) or tuple(w2.shape) != tuple(self.w2.shape[1:]):
            raise ValueError(f"slot weights must be {tuple(self.w13.shape[1:])} and {tuple(self.w2.shape[1:])}, "
                             f"got {tuple(w13.shape)} and {tuple(w2.shape)}")
        if self.is_int8:  # checkpoint INT8 values keep their grid (see w8a8.recover_grid)
            w13, self.w13_scale[slot] = w8a8.recover_grid(w13)
            w2, self.w2_scale[slot] = w8a8.recover_grid(w2)
        self.w13.data[slot].copy_(w13)
        self.w2.data[slot].copy_(w2)
        if self._int8_native is not None:
            int8.repack_slot(self._int8_native, slot, self.w13[slot], self.w2[slot])
        if self._native is not None:
            self._native[0][slot].copy_(cpu_kernels.pack_weight(self.w13[slot]))
            self._native[1][slot].copy_(cpu_kernels.pack_weight(self.w2[slot]))
        if self._packed is not None:  # swap in the slot's new blocked copies (list items: atomic)
            self._packed[0][slot] = pack_weight(self.w13[slot])
            self._packed[1][slot] = pack_weight(self.w2[slot])
        if self._bf16_native is not None:
            self._bf16_native[0][slot].copy_(cpu_kernels.pack_weight_bf16(self.w13[slot]))
            self._bf16_native[1][slot].copy_(cpu_kernels.pack_weight_bf16(self.w2[slot]))
        self.slot_experts[slot] = expert_id

    def clear_slot(self, slot: int) -> None:
        """Mark a local slot empty (its weights stay; nothing routes to an empty slot)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not a local slot (this rank holds [0, {self.num_slots}))")
        self.slot_experts[slot] = -1

    @property
    def is_int8(self) -> bool:
        return self.w13.dtype == torch.int8

    def quantize_int8(self) -> int:
        """W8A8: every slot's weights to INT8 values with per-output-channel scales (`w8a8.convert_model`)."""
        q13, self.w13_scale = w8a8.recover_grid(self.w13.data)
        q2, self.w2_scale = w8a8.recover_grid(self.w2.data)
        self.w13.data, self.w2.data = q13, q2
        self._native = self._packed = self._bf16_native = None
        return 2

    def pack_weights(self) -> int:
        """Prepack the slots for the native CPU kernel, or else each slot's matrices for oneDNN (see
        linear.py); 0 where neither applies. With the native kernel the oneDNN copies are made only
        if the torch path is asked for (`cpu_kernels.disabled()`)."""
        self._pack_requested = True
        self._native = self._bf16_native = None
        if self.is_int8:
            packable = cpu_kernels.enabled() and int8.packable(self.w13) and int8.packable(self.w2)
            self._int8_native = int8.pack_moe(self.w13, self.w2) if packable else None
            return 2 if packable else 0
        if (cpu_kernels.packable(self.w13) and self.local_intermediate_size % cpu_kernels.BLOCK_COLUMNS == 0
                and cpu_kernels.packable(self.w2) and cpu_kernels.enabled()):
            self._native = (cpu_kernels.pack_weight(self.w13), cpu_kernels.pack_weight(self.w2))
            return 2
        if self.num_slots and cpu_kernels.bf16_packable(self.w13[0]) and cpu_kernels.bf16_packable(self.w2[0]):
            self._bf16_native = (torch.stack([cpu_kernels.pack_weight_bf16(w) for w in self.w13]),
                                 torch.stack([cpu_kernels.pack_weight_bf16(w) for w in self.w2]))
            return 2 * self.num_slots
        return 2 * self.num_slots if self._onednn_packs() is not None else 0

    def _onednn_packs(self) -> tuple[list, list] | None:
        if self._packed is None and self._pack_requested:
            w13 = [pack_weight(self.w13[e]) for e in range(self.num_slots)]
            if all(p is not None for p in w13):
                self._packed = (w13, [pack_weight(self.w2[e]) for e in range(self.num_slots)])
        return self._packed

    def native_tensors(self) -> list[torch.Tensor] | None:
        """The slots as the fused decode ops take them (csrc/decode_layer.cpp): float32 or bfloat16 w13 and w2 packed
        and four empty tensors, or INT8 w13 blocks, compensation and scales, then w2's; None where they are not
        packed."""
        if self._int8_native is not None:
            w13, w2 = self._int8_native
            return [w13.blocks, w13.compensation, self.w13_scale, w2.blocks, w2.compensation, self.w2_scale]
        if self._native is not None:
            return [*self._native, *[NO_TENSOR] * 4]
        if self._bf16_native is not None:
            return [*self._bf16_native, *[NO_TENSOR] * 4]
        return None

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Top-k weighted output over the held slots (a partial sum under MoE TP); ids are global slot ids."""
        if self.is_int8:
            packed = self._int8_native if hidden_states.device.type == "cpu" and cpu_kernels.enabled() else None
            out = int8.moe_forward(hidden_states.float(), topk_ids, topk_weights.float(), self.first_slot, self.w13,
                                   self.w13_scale, self.w2, self.w2_scale, packed=packed)
            return out.to(hidden_states.dtype)
        if self._native is not None and cpu_kernels.enabled():
            return fused_experts(hidden_states, topk_ids, topk_weights, self.w13, self.w2, self.first_slot,
                                 native=self._native)
        if self._bf16_native is not None and hidden_states.dtype == torch.bfloat16 and cpu_kernels.enabled():
            return fused_experts(hidden_states, topk_ids, topk_weights, self.w13, self.w2, self.first_slot,
                                 bf16_native=self._bf16_native)
        return fused_experts(hidden_states, topk_ids, topk_weights, self.w13, self.w2, self.first_slot,
                             self._onednn_packs())
