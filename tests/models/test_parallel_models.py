"""Tensor/data/expert-parallel models on real gloo worlds against the single-rank model.

Each world loads the `tiny` DeepSeek-V3 and Qwen3-MoE checkpoints (two layers) under several
strategies and runs the same prefill/decode steps through the paged KV cache as the single-rank
model, with DP groups that sit idle (0 tokens) in some steps. Every rank saves its logits and
parameter shapes; the tests compare them here with the single-rank model.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from meshserve.layers.metadata import AttentionMetadata
from meshserve.layers.tensor_parallel import Shard
from meshserve.models.factory import make_model
from meshserve.models.loader import iter_safetensors, load_hf_config, load_model, shard_weights
from meshserve.models.qwen3 import Qwen3ForCausalLM
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.strategy import ParallelStrategy
from meshserve.parallel.topology import spawn_local_world
from tests.models.paged_harness import PagedHarness

TOL = 1e-3
WORLD_TIMEOUT_S = 150
TWO_LAYERS = {"num_hidden_layers": 2}  # a dense first layer, then an MoE layer (plus DeepSeek's MTP layer)
ARCHS = ("deepseek_v3", "qwen3_moe")
# checkpoint name -> (arch, preset overrides): the tiny presets, and variants with attention biases, tied
# embeddings and (DeepSeek) no q-LoRA, where q_proj shares a fused matmul with the replicated latent projection
CHECKPOINTS = {
    "deepseek_v3": ("deepseek_v3", TWO_LAYERS),
    "qwen3_moe": ("qwen3_moe", TWO_LAYERS),
    "deepseek_v3_variant": ("deepseek_v3", {**TWO_LAYERS, "q_lora_rank": None, "attention_bias": True,
                                            "tie_word_embeddings": True}),
    "qwen3_moe_variant": ("qwen3_moe", {**TWO_LAYERS, "attention_bias": True, "tie_word_embeddings": True}),
}

# One row per step; column g holds what attention DP group g runs: (sequence id, new tokens).
# [] is an idle step for that group. Sequences are prefilled, decoded, continued in chunks.
SCHEDULE = [
    [[(0, 7), (1, 12)], [(2, 5)], [(5, 4)], []],
    [[(0, 1), (1, 1)], [], [(5, 1)], [(6, 8)]],
    [[(0, 1), (3, 6)], [(2, 1), (4, 9)], [], [(6, 1)]],
    [[], [(2, 1), (4, 1)], [(5, 1), (7, 3)], [(6, 2)]],
    [[(1, 1), (3, 3), (0, 1)], [(4, 3)], [(7, 1)], []],
]

# (checkpoint, strategy) cases per world size; each world runs all of its cases
WORLD2_CASES = [
    ("deepseek_v3", "attn=TP2+DP1 moe=TP2+EP1"),
    ("deepseek_v3", "attn=TP2+DP1 moe=TP1+EP2"),
    ("deepseek_v3", "attn=TP1+DP2 moe=TP1+EP2"),
    ("qwen3_moe", "attn=TP2+DP1 moe=TP2+EP1"),
    ("qwen3_moe", "attn=TP2+DP1 moe=TP1+EP2"),
    ("deepseek_v3_variant", "attn=TP2+DP1 moe=TP2+EP1"),
    ("qwen3_moe_variant", "attn=TP2+DP1 moe=TP1+EP2"),
]
WORLD4_CASES = [
    ("deepseek_v3", "attn=TP2+DP2 moe=TP2+EP2"),
    ("deepseek_v3", "attn=TP4+DP1 moe=TP1+EP4"),
    ("qwen3_moe", "attn=TP2+DP2 moe=TP2+EP2"),
    ("qwen3_moe", "attn=TP1+DP4 moe=TP4+EP1"),
]
PACKED_CASE = ("qwen3_moe", "attn=TP2+DP1 moe=TP1+EP2")  # also loads the packed-experts checkpoint

# parameters split over the attention TP group (everything else but routed experts is replicated)
ATTN_TP_SHARDED = re.compile(
    r"(q_b_proj|kv_b_proj|o_proj|qkv_proj|embed_tokens|lm_head|shared_head\.head|gate_up_proj|down_proj)\.weight$")
ROUTED_EXPERTS = re.compile(r"\.experts\.(w13|w2)$")
NUM_EXPERTS = 16  # of both tiny presets


def step_tokens(seq: int, step: int, count: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * seq + step)
    return torch.randint(0, 32000, (count,), generator=g).tolist()


def group_steps(dp_group: int) -> list[list[tuple[int, list[int]]]]:
    """What one DP group runs in each step, with its tokens."""
    return [[(seq, step_tokens(seq, i, n)) for seq, n in row[dp_group]] for i, row in enumerate(SCHEDULE)]


class Harness(PagedHarness):
    """PagedHarness that also runs an idle step (no sequences) the way the runner does."""

    def step(self, seq_ids, new_tokens):
        if seq_ids:
            return super().step(seq_ids, new_tokens)
        empty = torch.empty(0, dtype=torch.int64)
        with torch.inference_mode():
            hidden = self.model(empty, empty, AttentionMetadata.empty(), self.kv_caches)
        assert hidden.shape[0] == 0
        return []


def run_group(model, dp_group: int) -> list[torch.Tensor | None]:
    """Logits of each step ([new tokens, vocab], sequences in the step's order); None for an idle step."""
    harness = Harness(model)
    out = []
    for step in group_steps(dp_group):
        logits = harness.step([seq for seq, _ in step], [tokens for _, tokens in step])
        out.append(torch.cat(logits) if logits else None)
    return out


def write_packed_experts(src: Path, dst: Path) -> Path:
    """The same Qwen3-MoE weights with each layer's experts packed: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(path))
    expert = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    per_block: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    packed = {}
    for name, tensor in tensors.items():
        match = expert.fullmatch(name)
        if match:
            per_block.setdefault(match[1], {})[(int(match[2]), match[3])] = tensor
        else:
            packed[name] = tensor
    for block, parts in per_block.items():
        num = 1 + max(e for e, _ in parts)
        packed[f"{block}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(num)])
        packed[f"{block}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(num)])
    save_file(packed, str(dst / "model.safetensors"))
    return dst


# ---------------------------------------------------------------- worker (one rank of a world)

def _world_worker(rank: int, world_size: int, cases: list, models: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    for index, (checkpoint, strategy_text) in enumerate(cases):
        ctx = ParallelContext.build(ParallelStrategy.parse(strategy_text))
        model = load_model(models[checkpoint], parallel=ctx)
        result = {
            "params": {name: p.numel() for name, p in model.named_parameters()},
            "expert_bytes": sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                                if ROUTED_EXPERTS.search(name)),
            "kv_entry": model.kv_cache_layout().entry_shape,
            "wanted": {name for name in checkpoint_names(models[checkpoint]) if model.wants_weight(name)},
            "logits": run_group(model, ctx.dp_rank),
        }
        if (checkpoint, strategy_text) == PACKED_CASE:
            params = dict(model.named_parameters())
            # packed experts, read as slices, give the same weights as per-expert tensors
            packed = load_model(models["qwen3_moe_packed"], parallel=ctx)
            result["packed_equal"] = all(torch.equal(p, params[n]) for n, p in packed.named_parameters())
            # full tensors cut by shard_weights give the same weights as the loader's slice reads
            fresh = type(model)(load_hf_config(models[checkpoint]), parallel=ctx)
            fresh.load_weights(shard_weights(fresh, iter_safetensors(models[checkpoint])))
            result["shard_weights_equal"] = all(torch.equal(p, params[n]) for n, p in fresh.named_parameters())
        torch.save(result, Path(out_dir) / f"case{index}-rank{rank}.pt")


def checkpoint_names(model_dir: str) -> list[str]:
    names = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names.extend(f.keys())
    return names


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel-models")
    paths = {name: make_model(arch, "tiny", root / name, overrides=overrides)
             for name, (arch, overrides) in CHECKPOINTS.items()}
    paths["qwen3_moe_packed"] = write_packed_experts(paths["qwen3_moe"], root / "qwen3_moe_packed")
    return {name: str(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def single(checkpoints):
    """Per checkpoint: the single-rank model, and each DP group's logits per step."""
    out = {}
    for name in CHECKPOINTS:
        model = load_model(checkpoints[name])
        out[name] = (model, [run_group(model, g) for g in range(len(SCHEDULE[0]))])
    return out


def run_world(world_size: int, cases: list, checkpoints: dict, tmp_path: Path) -> list[list[dict]]:
    spawn_local_world(_world_worker, world_size, args=(cases, checkpoints, str(tmp_path)), timeout_s=WORLD_TIMEOUT_S)
    return [[torch.load(tmp_path / f"case{i}-rank{r}.pt") for r in range(world_size)] for i in range(len(cases))]


def check_case(checkpoint: str, strategy_text: str, results: list[dict], single, checkpoints) -> None:
    strategy = ParallelStrategy.parse(strategy_text)
    model, reference = single[checkpoint]
    full_params = {name: p.numel() for name, p in model.named_parameters()}
    full_expert_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                            if ROUTED_EXPERTS.search(name))
    label = f"{checkpoint} {strategy_text}"
    for rank, result in enumerate(results):
        dp_group = rank // strategy.attn_tp
        # logits: the full vocabulary on every rank of a group, equal to the single-rank model's
        for step, (got, want) in enumerate(zip(result["logits"], reference[dp_group])):
            assert (got is None) == (want is None), f"{label} rank {rank} step {step}"
            if want is not None:
                assert got.shape == want.shape, f"{label} rank {rank} step {step}"
                diff = (got - want).abs().max().item()
                assert diff <= TOL, f"{label} rank {rank} step {step}: max |logit diff| {diff}"
        # parameters: 1/attn_TP of each split one, 1/(EP*TP) of the routed experts, the rest whole
        assert result["params"].keys() == full_params.keys(), label
        for name, numel in result["params"].items() if checkpoint in ARCHS else ():
            if ROUTED_EXPERTS.search(name):
                parts = strategy.moe_ep * strategy.moe_tp
            elif ATTN_TP_SHARDED.search(name):
                parts = strategy.attn_tp
            else:
                parts = 1
            assert numel * parts == full_params[name], f"{label} rank {rank}: {name} {numel} of {full_params[name]}"
        assert result["expert_bytes"] * strategy.moe_ep * strategy.moe_tp == full_expert_bytes
        # reading: every tensor but the routed experts of other EP ranks
        first, count = ParallelContext(strategy, rank=rank).expert_range(NUM_EXPERTS)
        for name in checkpoint_names(checkpoints[checkpoint]):
            match = re.search(r"\.experts\.(\d+)\.", name)
            assert (name in result["wanted"]) == (match is None or first <= int(match[1]) < first + count), name
    if checkpoint.startswith("qwen3_moe"):
        kv_heads = model.dims.num_kv_heads // strategy.attn_tp
        assert all(r["kv_entry"] == (2, kv_heads, model.dims.head_dim) for r in results)
    assert sum(r["expert_bytes"] for r in results) == full_expert_bytes


# ---------------------------------------------------------------- tests


def test_world_of_two_matches_single_rank(checkpoints, single, tmp_path):
    results = run_world(2, WORLD2_CASES, checkpoints, tmp_path)
    for (checkpoint, strategy), case_results in zip(WORLD2_CASES, results):
        check_case(checkpoint, strategy, case_results, single, checkpoints)
    packed = results[WORLD2_CASES.index(PACKED_CASE)]
    assert all(r["packed_equal"] and r["shard_weights_equal"] for r in packed)


def test_world_of_four_matches_single_rank(checkpoints, single, tmp_path):
    results = run_world(4, WORLD4_CASES, checkpoints, tmp_path)
    for (checkpoint, strategy), case_results in zip(WORLD4_CASES, results):
        check_case(checkpoint, strategy, case_results, single, checkpoints)


def test_shard_weights_cuts_full_tensors_like_the_loader_reads_them(checkpoints):
    path = checkpoints["qwen3_moe_packed"]
    split_rows, split_experts = Shard(0, 1, 2), Shard(0, 0, 4)
    full = dict(iter_safetensors(path))
    read = dict(iter_safetensors(path, shard_of=lambda name: split_experts if "experts" in name else split_rows))
    assert read.keys() == full.keys()
    for name, tensor in read.items():
        shard = split_experts if "experts" in name else split_rows
        assert torch.equal(tensor, shard.take(full[name], name)), name
    experts = "model.layers.1.mlp.experts.down_proj"
    assert read[experts].shape[0] * 4 == full[experts].shape[0]
    with pytest.raises(ValueError, match="does not split evenly into 3 parts"):
        Shard(1, 0, 3).take(full["model.norm.weight"].view(1, -1), "model.norm.weight")
    # single rank: shard_weights passes everything through unchanged
    model = load_model(path)
    assert all(t is full[n] for n, t in shard_weights(model, full.items()))


def test_empty_metadata_and_idle_forward_on_one_rank(single):
    meta = AttentionMetadata.empty()
    assert meta.num_seqs == 0 and meta.slot_mapping.numel() == 0 and meta.num_decodes == 0
    for arch in ARCHS:
        model, _ = single[arch]
        harness = Harness(model)
        assert harness.step([], []) == []


def test_indivisible_heads_are_refused():
    config = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    ctx = ParallelContext(ParallelStrategy(attn_tp=4, attn_dp=1, moe_tp=4, moe_ep=1), rank=1)
    with pytest.raises(ValueError, match="num_key_value_heads of 2 does not split evenly over TP4"):
        Qwen3ForCausalLM(config, parallel=ctx)
