"""Redundant expert slots, the logical -> slot mapping, the load recorder and live reconfiguration.

One world of 4 ranks loads the tiny DeepSeek-V3 and Qwen3-MoE checkpoints (two layers) under pure EP
and hybrid TP-EP with R redundant slots per EP rank and runs the same paged prefill/decode steps:
- with the default placement (recording the router's choices and the load counts);
- with a placement replicating the hottest experts (logits equal; rows per slot follow the rotation);
- while a reconfiguration to a third placement runs phase by phase between the steps.
The single-rank tests cover the pieces (slot map, counter, slot weights) and the phase rules.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from meshserve.layers.moe import FusedMoEWeights, fused_experts
from meshserve.models.factory import make_model
from meshserve.models.loader import load_model
from meshserve.moe.live_moves import check_every_expert_served, placement_rounds
from meshserve.moe.placement import EMPTY, ExpertPlacement, PlacementShape
from meshserve.moe.recorder import ExpertLoadCounter, add_counts
from meshserve.moe.slots import SlotMap, changed_slots
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import spawn_local_world
from tests.models.paged_harness import PagedHarness
from tests.models.test_parallel_models import Harness, write_packed_experts

TOL = 1e-4
WORLD_TIMEOUT_S = 120
PHASE_TIMEOUT_S = 30.0
TWO_LAYERS = {"num_hidden_layers": 2}  # a dense layer, then an MoE layer (16 experts, top-4)
NUM_EXPERTS = 16

# One row per step; column g: what attention DP group g runs, as (sequence id, new tokens); [] is idle.
SCHEDULE = [
    [[(0, 6), (1, 9)], [(2, 5)], [(3, 4)], []],
    [[(0, 1), (1, 1)], [], [(3, 1)], [(4, 7)]],
    [[(0, 1)], [(2, 1), (5, 6)], [], [(4, 1)]],
    [[], [(2, 1), (5, 1)], [(3, 1), (6, 3)], [(4, 2)]],
    [[(1, 1), (0, 1)], [(5, 2)], [(6, 1)], [(4, 1)]],
    [[(1, 1)], [(5, 1)], [(6, 1), (3, 1)], [(4, 1)]],
]
# (checkpoint, strategy, R); each rank of the world runs every case
CASES = [
    ("deepseek_v3", "attn=TP1+DP4 moe=TP1+EP4", 1),
    ("qwen3_moe", "attn=TP1+DP4 moe=TP1+EP4", 2),
    ("deepseek_v3", "attn=TP2+DP2 moe=TP2+EP2", 2),
    ("qwen3_moe", "attn=TP2+DP2 moe=TP2+EP2", 1),
    ("qwen3_moe", "attn=TP2+DP2 moe=TP1+EP4", 1),  # attention TP chunks the tokens: mapping comes first
]


def step_tokens(seq: int, step: int, count: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * seq + step)
    return torch.randint(0, 32000, (count,), generator=g).tolist()


def with_replicas(shape: PlacementShape, wanted: list[int]) -> list[int]:
    """The default slots plus a replica of each wanted expert in the first free redundant slot of a rank
    that does not hold its primary (skipped when there is none)."""
    slots = shape.default_slots()
    free = [r * shape.slots_per_rank + shape.primary_per_rank + j
            for r in range(shape.num_ranks) for j in range(shape.redundant_per_rank)]
    for expert in wanted:
        slot = next((s for s in free if shape.rank_of_slot(s) != expert // shape.primary_per_rank), None)
        if slot is not None:
            free.remove(slot)
            slots[slot] = expert
    return slots


def shuffled_experts(shape: PlacementShape, ranking: list[int]) -> list[int]:
    """Every expert on another rank than at start (the order reversed), the redundant slots holding the hottest."""
    experts = list(reversed(range(shape.num_logical)))
    slots = []
    for rank in range(shape.num_ranks):
        slots += experts[rank * shape.primary_per_rank:(rank + 1) * shape.primary_per_rank]
        slots += ranking[rank:rank + shape.redundant_per_rank]
    return slots


# ---------------------------------------------------------------- one rank of the world

class Probe:
    """Records each MoE block's router choices (logical ids per forward) and the rows each slot runs."""

    def __init__(self, model, num_slots: int) -> None:
        self.choices: list[list[torch.Tensor]] = []
        self.slot_rows: list[torch.Tensor] = []
        for position, block in enumerate(model.expert_balancer._blocks):
            self.choices.append([])
            self.slot_rows.append(torch.zeros(num_slots, dtype=torch.int64))
            self._watch_router(block, self.choices[position])
            block.experts.register_forward_hook(self._slot_counter(self.slot_rows[position]))

    @staticmethod
    def _slot_counter(rows: torch.Tensor):
        def hook(module, args, out) -> None:  # args: hidden, slot ids, weights
            rows.add_(torch.bincount(args[1].reshape(-1), minlength=rows.numel()))
        return hook

    @staticmethod
    def _watch_router(block, into: list) -> None:
        if hasattr(block, "route"):  # DeepSeek-V3: grouped top-k of the biased sigmoid scores
            route = block.route

            def recording_route(hidden):
                weights, ids = route(hidden)
                into.append(ids.clone())
                return weights, ids
            block.route = recording_route
        else:  # Qwen3-MoE: top-k of the softmax of the gate's logits
            def recording_gate(module, args, logits) -> None:
                into.append(torch.softmax(logits, dim=-1, dtype=torch.float32).topk(block.top_k, dim=-1)[1])
            block.gate.register_forward_hook(recording_gate)

    def reset(self) -> None:
        for choices, rows in zip(self.choices, self.slot_rows):
            choices.clear()
            rows.zero_()


def run_steps(model, dp_group: int, before_step=None) -> list[torch.Tensor | None]:
    harness = Harness(model)
    out = []
    for step, row in enumerate(SCHEDULE):
        if before_step is not None:
            before_step(step)
        seqs = [seq for seq, _ in row[dp_group]]
        logits = harness.step(seqs, [step_tokens(seq, step, n) for seq, n in row[dp_group]])
        out.append(torch.cat(logits) if logits else None)
    return out


def assert_logits_close(got, want, label: str) -> None:
    for step, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), (label, step)
        if a is not None:
            diff = (a - b).abs().max().item()
            assert diff <= TOL, f"{label} step {step}: max |logit diff| {diff}"


def wait_for(done, what: str) -> None:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while not done():
        assert time.monotonic() < deadline, f"{what} did not finish within {PHASE_TIMEOUT_S} s"
        time.sleep(0.01)


def expected_slot_rows(choices: list[torch.Tensor], replicas: list[list[int]], offset: int,
                       num_slots: int) -> torch.Tensor:
    """Rows per slot that the rotation rule gives: token i of a batch -> replica (i + offset) mod copies."""
    rows = torch.zeros(num_slots, dtype=torch.int64)
    for ids in choices:
        for i, experts in enumerate(ids.tolist()):
            for e in experts:
                rows[replicas[e][(i + offset) % len(replicas[e])]] += 1
    return rows


def world_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _check_case(checkpoint: str, strategy_text: str, redundant: int, model_dir: str, label: str) -> None:
    strategy = ParallelStrategy.parse(strategy_text)
    ctx = ParallelContext.build(strategy, redundant_experts_per_rank=redundant)
    model = load_model(model_dir, parallel=ctx)
    balancer = model.expert_balancer
    balancer.model_dir = model_dir
    shape = balancer.shape
    assert shape == PlacementShape(NUM_EXPERTS, strategy.moe_ep, redundant), label
    S = shape.slots_per_rank
    moe_tp, driver = strategy.moe_tp, ctx.attn_tp_rank == 0

    # parameter bytes: S slots of (gate, up, down) column blocks per MoE block, on every rank
    for module in model.modules():
        if isinstance(module, FusedMoEWeights):
            part = module.intermediate_size // moe_tp
            assert module.num_slots == S and module.first_slot == ctx.ep_rank * S, label
            held = sum(p.numel() * p.element_size() for p in module.parameters())
            assert held == S * 3 * part * module.hidden_size * 4, label

    probe = Probe(model, shape.num_slots)
    assert balancer.take_counts() == [[0] * NUM_EXPERTS] * len(balancer.moe_layers)  # loading routes nothing

    # 1. default placement: the recorder counts the router's choices, once per rank of an attention TP group
    default_logits = run_steps(model, ctx.dp_rank)
    counts = balancer.take_counts()
    assert counts == [torch.bincount(torch.cat(ch).reshape(-1), minlength=NUM_EXPERTS).tolist()
                      for ch in probe.choices], label
    assert balancer.take_counts() == [[0] * NUM_EXPERTS] * len(balancer.moe_layers), label
    group_counts = torch.tensor(counts) * driver  # each token once per attention TP group
    total = world_sum(group_counts)[0].tolist()
    ranking = sorted(range(NUM_EXPERTS), key=lambda e: (-total[e], e))

    # 2. the hottest experts replicated (the hottest twice): same logits, rows rotate over the replicas
    hot = ExpertPlacement(shape, {layer: with_replicas(shape, [ranking[0], ranking[0], *ranking[1:]])
                                  for layer in balancer.moe_layers})
    assert max(len(r) for r in hot.replicas(balancer.moe_layers[0])) >= 2, label
    balancer.reconfigure(hot)
    assert balancer.placement.layers == hot.layers and balancer.phase == "idle", label
    probe.reset()
    assert_logits_close(run_steps(model, ctx.dp_rank), default_logits, f"{label} hot placement")
    for position, layer in enumerate(balancer.moe_layers):
        want = expected_slot_rows(probe.choices[position], hot.replicas(layer), ctx.dp_rank, shape.num_slots)
        got = world_sum(probe.slot_rows[position]) // moe_tp
        assert torch.equal(got, world_sum(want * driver)), f"{label}: rows per slot {got} != {want}"
        assert got[hot.replicas(layer)[ranking[0]]].min() > 0, label  # every replica of the hottest works
    # the redundant slots hold this rank's TP slice of their experts, read from the checkpoint
    weights = {name: t for path in Path(model_dir).glob("*.safetensors") for name, t in load_file(path).items()}
    block = balancer._blocks[0]
    lo, hi = block.experts.column_range()
    prefix = f"model.layers.{balancer.moe_layers[0]}.mlp.experts"
    for slot in range(shape.primary_per_rank, S):
        expert = hot.layers[balancer.moe_layers[0]][ctx.ep_rank * S + slot]
        assert block.experts.slot_experts[slot] == expert, label
        if expert != EMPTY:
            assert torch.equal(block.experts.w2[slot], weights[f"{prefix}.{expert}.down_proj.weight"][:, lo:hi])
            assert torch.equal(block.experts.w13[slot, :hi - lo], weights[f"{prefix}.{expert}.gate_proj.weight"][lo:hi])

    # 3. to another placement, phase by phase between forward steps; logits stay the same throughout
    new = ExpertPlacement(shape, {layer: with_replicas(shape, ranking[1:shape.num_ranks])
                                  for layer in balancer.moe_layers})
    changing = {layer: changed_slots(hot.layers[layer], new.layers[layer]) for layer in balancer.moe_layers}
    assert all(changing.values()), label
    phases = []

    def before_step(step: int) -> None:
        if step == 1:
            balancer.start_prefetch(new)  # step 1 runs while the prefetch thread reads
        elif step == 2:
            wait_for(balancer.prefetch_done, "prefetch")
            balancer.disable_changing_slots()
            probe.reset()
        elif step == 3:
            balancer.start_load()  # step 3 runs while the load thread writes
        elif step == 4:
            wait_for(balancer.load_done, "load")
            # in the disabled phases no row reached a changing slot, on any rank
            for position, layer in enumerate(balancer.moe_layers):
                assert world_sum(probe.slot_rows[position])[changing[layer]].sum() == 0, label
            balancer.enable()
            probe.reset()
        phases.append(balancer.phase)

    assert_logits_close(run_steps(model, ctx.dp_rank, before_step), default_logits, f"{label} reconfiguration")
    assert phases == ["idle", "prefetch", "disabled", "loading", "idle", "idle"], (label, phases)
    assert balancer.placement.layers == new.layers, label
    for position, layer in enumerate(balancer.moe_layers):  # steps 4-5 rotate over the new placement
        want = expected_slot_rows(probe.choices[position], new.replicas(layer), ctx.dp_rank, shape.num_slots)
        assert torch.equal(world_sum(probe.slot_rows[position]) // moe_tp, world_sum(want * driver)), label

    # 4. a placement under which an expert would have no slot while the changing ones load is refused, and
    # nothing starts: two primaries trading places in one round
    moved = {layer: list(slots) for layer, slots in new.layers.items()}
    first_layer = balancer.moe_layers[0]
    moved[first_layer][0], moved[first_layer][1] = moved[first_layer][1], moved[first_layer][0]
    with pytest.raises(ValueError, match="would have no slot"):
        balancer.start_prefetch(ExpertPlacement(shape, moved))
    assert balancer.phase == "idle", label

    _check_live_move_of_every_expert(model, ctx, ranking, default_logits, label)

    if checkpoint == "deepseek_v3" and strategy.moe_tp == 1:
        _check_even_rotation(model, ctx, probe, label)


def _check_live_move_of_every_expert(model, ctx: ParallelContext, ranking: list[int], default_logits,
                                     label: str) -> None:
    """5. Every expert moved, primaries included, while serving: the move's rounds, one phase before each step."""
    balancer = model.expert_balancer
    shape, S = balancer.shape, balancer.shape.slots_per_rank
    target = ExpertPlacement(shape, {layer: shuffled_experts(shape, ranking) for layer in balancer.moe_layers})
    rounds = placement_rounds(balancer.placement, target)
    assert len(rounds) > 1, label
    actions = []
    for placement in rounds:
        actions += [lambda p=placement: balancer.start_prefetch(p),
                    lambda: (wait_for(balancer.prefetch_done, "prefetch"), balancer.disable_changing_slots()),
                    balancer.start_load,
                    lambda: (wait_for(balancer.load_done, "load"), balancer.enable())]

    def next_phase(step: int) -> None:
        if actions:
            actions.pop(0)()

    while actions:
        assert_logits_close(run_steps(model, ctx.dp_rank, next_phase), default_logits, f"{label} moving primaries")
    assert balancer.placement.layers == target.layers and balancer.phase == "idle", label
    assert_logits_close(run_steps(model, ctx.dp_rank), default_logits, f"{label} every expert moved")
    block = balancer._blocks[0]
    for slot in range(S):  # each slot is labelled with its new expert
        expert = target.layers[balancer.moe_layers[0]][ctx.ep_rank * S + slot]
        assert block.experts.slot_experts[slot] == expert, label


def _check_even_rotation(model, ctx: ParallelContext, probe: Probe, label: str) -> None:
    """Every token routed to one expert (a huge router bias): its replicas get equal rows."""
    balancer = model.expert_balancer
    shape, layer = balancer.shape, balancer.moe_layers[0]
    hottest = 5
    slots = with_replicas(shape, [hottest] * (shape.num_ranks - 1))
    placement = ExpertPlacement(shape, {layer: slots})
    balancer.reconfigure(placement, offline=True)  # from the moved experts of step 5: no forward in between
    replicas = placement.replicas(layer)[hottest]
    assert len(replicas) == shape.num_ranks, label  # one copy on every EP rank
    block = balancer._blocks[0]
    block.e_score_correction_bias[hottest] = 100.0
    probe.reset()
    tokens = 12  # each DP group: a multiple of every replica count up to 4
    harness = PagedHarness(model)
    harness.step([0], [step_tokens(9, ctx.dp_rank, tokens)])
    rows = world_sum(probe.slot_rows[0])[replicas]
    assert rows.tolist() == [tokens * ctx.dp_size // len(replicas)] * len(replicas), (label, rows)


def _world_worker(rank: int, world_size: int, checkpoints: dict) -> None:
    torch.set_num_threads(1)
    for checkpoint, strategy, redundant in CASES:
        _check_case(checkpoint, strategy, redundant, checkpoints[checkpoint], f"{checkpoint} {strategy} R={redundant}")


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("expert-slots")
    paths = {arch: make_model(arch, "tiny", root / arch, overrides=TWO_LAYERS) for arch in ("deepseek_v3", "qwen3_moe")}
    paths["qwen3_moe_packed"] = write_packed_experts(paths["qwen3_moe"], root / "qwen3_moe_packed")
    return {name: str(path) for name, path in paths.items()}


# ---------------------------------------------------------------- tests

def test_world_of_four_replicates_and_reconfigures_between_steps(checkpoints):
    spawn_local_world(_world_worker, 4, args=(checkpoints,), timeout_s=WORLD_TIMEOUT_S)


def test_slot_map_rotates_over_replicas_and_skips_disabled_slots(monkeypatch):
    shape = PlacementShape(8, 2, 2)  # slots: rank 0 [0..3 | 4 5], rank 1 [6..9 | 10 11]
    slots = shape.default_slots()
    slots[4], slots[10], slots[11] = 6, 6, 1  # expert 6: slots 8, 4, 10; expert 1: slots 1, 11
    table = SlotMap.from_slots(slots, 8)
    assert table.replicas[6] == [4, 8, 10] and table.replicas[1] == [1, 11] and table.period == 6
    ids = torch.tensor([[6, 1], [6, 0], [1, 6], [6, 1], [7, 6]])
    for offset in (0, 1, 3):
        want = [[table.replicas[e][(i + offset) % len(table.replicas[e])] for e in row]
                for i, row in enumerate(ids.tolist())]
        assert table.route(ids, offset).tolist() == want
    # a long batch (past the cached rotation rows) and the modulo path of layers with long periods agree
    many = torch.randint(0, 8, (300, 3), generator=torch.Generator().manual_seed(0))
    with monkeypatch.context() as patch:
        patch.setattr(SlotMap, "MAX_TABLE_ENTRIES", 1)
        modulo = SlotMap(table.replicas)
    assert modulo.period == 0
    assert torch.equal(modulo.route(many, 2), table.route(many, 2))
    # disabled slots carry nothing; unreplicated experts go to their only slot
    disabled = SlotMap.from_slots(slots, 8, disabled=[10, 11])
    assert disabled.replicas[6] == [4, 8] and disabled.replicas[1] == [1]
    assert set(disabled.route(many, 0).unique().tolist()).isdisjoint({10, 11})
    assert SlotMap.from_slots(shape.default_slots(), 8).route(ids).tolist() == [
        [8, 1], [8, 0], [1, 8], [8, 1], [9, 8]]
    with pytest.raises(ValueError, match="at least one slot"):
        SlotMap.from_slots(slots, 8, disabled=[1, 11])


def test_a_live_change_keeps_every_expert_an_unchanged_slot_and_changes_are_listed():
    shape = PlacementShape(8, 2, 1)
    old = shape.default_slots()  # [0 1 2 3 - | 4 5 6 7 -]
    new = list(old)
    new[4], new[9] = 7, 0
    check_every_expert_served(old, new, "layer 1")
    assert changed_slots(old, new) == [4, 9]
    new[0] = 5  # expert 0's only other copy (slot 9) is being written too
    with pytest.raises(ValueError, match="layer 1: expert 0 would have no slot"):
        check_every_expert_served(old, new, "layer 1")


def test_counter_adds_a_bincount_per_layer_and_take_resets():
    counter = ExpertLoadCounter(2, 6)
    ids = torch.tensor([[0, 5], [5, 2], [2, 5]])
    add_counts(counter.row(1), ids, counter.one)
    add_counts(counter.row(1), ids[:1], counter.one)
    add_counts(counter.row(0), ids[:0], counter.one)  # an idle step
    assert counter.take() == [[0] * 6, [2, 0, 2, 0, 0, 4]]
    assert counter.take() == [[0] * 6, [0] * 6]


def test_redundant_slots_run_like_their_primaries():
    gen = torch.Generator().manual_seed(0)
    hidden_size, inter, num = 16, 8, 4
    w13 = torch.randn(num, 2 * inter, hidden_size, generator=gen)
    w2 = torch.randn(num, hidden_size, inter, generator=gen)
    # EP rank 1 of 2 with 2 redundant slots: experts 2, 3 in slots 4, 5; slots 6, 7 redundant
    experts = FusedMoEWeights(num, hidden_size, inter, torch.float32, first_expert=2, num_local_experts=2,
                              tp_rank=1, tp_size=2, redundant_slots=2)
    assert experts.num_slots == 4 and experts.first_slot == 4 and experts.slot_experts == [2, 3, -1, -1]
    assert experts.w13.shape == (4, inter, hidden_size) and float(experts.w13[2:].abs().sum()) == 0
    for e in range(num):
        for proj, t in (("gate_proj", w13[e, :inter]), ("up_proj", w13[e, inter:]), ("down_proj", w2[e])):
            experts.load_expert(e, proj, t)
    experts.pack_weights()
    lo, hi = experts.column_range()
    shard13, shard2 = torch.cat([w13[0, lo:hi], w13[0, inter + lo:inter + hi]]), w2[0, :, lo:hi]
    experts.write_slot(3, 0, shard13, shard2)  # a replica of expert 0 (another rank's primary)
    assert experts.slot_experts == [2, 3, -1, 0]
    x = torch.randn(5, hidden_size, generator=gen)
    weights = torch.rand(5, 1, generator=gen)
    half13 = torch.cat([w13[:, lo:hi], w13[:, inter + lo:inter + hi]], dim=1)
    for slot, expert in ((7, 0), (4, 2), (5, 3)):
        want = fused_experts(x, torch.full((5, 1), expert), weights, half13, w2[:, :, lo:hi])
        got = experts(x, torch.full((5, 1), slot), weights)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not a local slot"):
        experts.write_slot(experts.num_slots, 0, shard13, shard2)
    with pytest.raises(ValueError, match="slot weights must be"):
        experts.write_slot(2, 0, shard13[:1], shard2)
    experts.clear_slot(3)
    assert experts.slot_experts == [2, 3, -1, -1]


def test_single_rank_phases_with_packed_experts(checkpoints):
    """One rank, packed checkpoint: the phase rules, a failed prefetch, and an abort while loading."""
    path = checkpoints["qwen3_moe_packed"]
    reference = load_model(path)
    assert reference.expert_balancer.shape.redundant_per_rank == 0
    assert all(b.runtime.slot_map is None for b in reference.expert_balancer._blocks)  # R = 0: no mapping
    model = load_model(path, parallel=ParallelContext(ParallelStrategy(), redundant_experts_per_rank=2))
    balancer = model.expert_balancer
    shape, layers = balancer.shape, balancer.moe_layers
    tokens = [[5, 6, 7, 8, 9], [40, 41, 42]]

    def logits(m):
        return torch.cat(PagedHarness(m).step([0, 1], tokens))

    want = logits(reference)
    assert balancer.take_counts()[0] == [0] * NUM_EXPERTS
    replicated = ExpertPlacement(shape, {layer: list(range(NUM_EXPERTS)) + [3, 3] for layer in layers})
    assert balancer.model_dir == path  # load_model tells the balancer where its checkpoint is
    balancer.model_dir = None
    with pytest.raises(RuntimeError, match="model_dir"):
        balancer.start_prefetch(replicated)
    with pytest.raises(RuntimeError, match="needs a reconfiguration in phase 'disabled'"):
        balancer.start_load()
    balancer.model_dir = path + "-missing"
    balancer.start_prefetch(replicated)
    with pytest.raises(RuntimeError, match="expert prefetch failed"):
        wait_for(balancer.prefetch_done, "prefetch")
    balancer.abort()
    assert balancer.phase == "idle" and balancer.placement.layers == ExpertPlacement.default(shape, layers).layers

    balancer.model_dir = path
    balancer.start_prefetch(replicated)
    with pytest.raises(RuntimeError, match="already in phase 'prefetch'"):
        balancer.start_prefetch(replicated)
    balancer.disable_changing_slots()
    balancer.start_load()
    balancer.abort()  # the slots being written become empty; routing stays on the primaries
    assert balancer.placement.layers[layers[0]][-2:] == [EMPTY, EMPTY]
    assert balancer._blocks[0].experts.slot_experts[-2:] == [EMPTY, EMPTY]
    torch.testing.assert_close(logits(model), want, atol=TOL, rtol=0)

    balancer.reconfigure(replicated)
    experts = balancer._blocks[0].experts
    assert torch.equal(experts.w13[16], experts.w13[3]) and torch.equal(experts.w2[17], experts.w2[3])
    torch.testing.assert_close(logits(model), want, atol=TOL, rtol=0)
    assert sum(balancer.take_counts()[0]) == 2 * 8 * model.model.layers[1].mlp.top_k
    with pytest.raises(ValueError, match="does not match the model's"):
        balancer.start_prefetch(ExpertPlacement.default(PlacementShape(NUM_EXPERTS, 1, 1), layers))
    with pytest.raises(ValueError, match="MoE layers are"):
        balancer.start_prefetch(ExpertPlacement(shape, {}))
