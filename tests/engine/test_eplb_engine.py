"""Expert load balancing through the whole engine on 4 ranks (pure EP, one redundant slot per rank).

Greedy outputs must be identical with rebalancing off, with a rebalanced placement, and while a live
reconfiguration (every expert planned, primaries moved in rounds) runs in the middle of generation; no
request may fail or stall meanwhile (the longest gap between tokens is reported against the steady state's).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
import torch

from meshserve.config import EngineConfig
from meshserve.engine.async_client import AsyncEngineClient
from meshserve.models.factory import make_model
from meshserve.moe.placement import ExpertPlacement
from meshserve.wire.sampling_params import SamplingParams

OUTPUT_LEN = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
# a stall is a gap far beyond any step time of this tiny model, even on a loaded 2-core machine
STALL_LIMIT_S = 20.0


def _prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 31900, (int(length),), generator=g).tolist()
            for length in torch.randint(4, 60, (n,), generator=g)]


async def _generate(client: AsyncEngineClient, prompts, tag: str, during=None):
    """Every prompt at once; returns (token ids per prompt, longest gap between tokens of any request).

    `during(client)` runs once the first tokens have arrived, while the rest are being generated."""
    first_token = asyncio.Event()
    gaps: list[float] = []

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        last = None
        async for out in client.generate(None, prompt, GREEDY, f"{tag}-{i}"):
            now = time.monotonic()
            if out.outputs[0].token_ids_delta:
                if last is not None:
                    gaps.append(now - last)
                last = now
                first_token.set()
            tokens = out.outputs[0].token_ids
            if out.finished:
                assert out.outputs[0].finish_reason == "length"
        return tokens

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    if during is not None:
        await first_token.wait()
        await during(client)
    results = await asyncio.gather(*tasks)
    return results, max(gaps)


async def wait_until_idle(client: AsyncEngineClient, timeout_s: float = 60.0) -> dict:
    """The EPLB status once no reconfiguration runs (AssertionError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = await client.admin("eplb.status")
        assert reply.ok, reply.error
        if reply.data.phase == "idle":
            return reply.to_json()
        await asyncio.sleep(0.05)
    raise AssertionError("the reconfiguration did not finish")


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_outputs_are_identical_off_on_and_during_live_reconfiguration(arch, tmp_path):
    model_dir = make_model(arch, "tiny", tmp_path / "model", seed=5)
    config = EngineConfig.from_kwargs(str(model_dir), parallel="attn=TP1+DP4 moe=TP1+EP4", eplb_redundant_experts=1,
                          eplb_slice_s=0.5, max_num_batched_tokens=64, block_size=8, max_num_seqs=8,
                          num_kv_blocks=128)
    prompts = _prompts()

    async def scenario():
        client = AsyncEngineClient(config, log_level=logging.WARNING)
        try:
            off, steady_gap = await _generate(client, prompts, "off")
            load = await client.admin("eplb.load")
            assert load.ok, load.error
            slices = load.data.counts
            layer_totals = [sum(sum(per_layer[i]) for per_layer in slices) for i in range(len(load.data.moe_layers))]
            # every computed token (prompt + outputs but the last) is routed to top-k experts in every MoE layer
            assert len(set(layer_totals)) == 1 and layer_totals[0] > 0

            started = {}

            async def rebalance(c):
                started["at"] = time.time()
                reply = await c.admin("eplb.rebalance")  # planned from the recorded load
                assert reply.ok, reply.error

            live, live_gap = await _generate(client, prompts, "live", during=rebalance)
            # a move of primaries takes rounds: generate again while it runs, every output checked against `off`
            for again in range(1, 11):
                if (await client.admin("eplb.status")).data.phase == "idle":
                    break
                more, gap = await _generate(client, prompts, f"live-{again}")
                assert more == off, f"outputs changed in generation {again} during the reconfiguration"
                live_gap = max(live_gap, gap)
            finished_at = time.time()
            status = await wait_until_idle(client)
            assert status["num_reconfigurations"] == 1 and status["last_error"] is None
            assert started["at"] <= status["last_started_at"]
            assert status["last_finished_at"] <= finished_at, "the reconfiguration finished after generation"
            placement = ExpertPlacement.from_dict(status["placement"])
            assert any(len(r) > 1 for layer in placement.layers for r in placement.replicas(layer))
            # the plan places every expert (eplb_live_mode full): primaries moved too, in rounds
            shape = placement.shape
            default = ExpertPlacement.default(shape, list(placement.layers))
            assert any(slots[slot] != default.layers[layer][slot] for layer, slots in placement.layers.items()
                       for slot in range(len(slots)) if slot % shape.slots_per_rank < shape.primary_per_rank)

            on, on_gap = await _generate(client, prompts, "on")
            # a rank lost now: the ranks restart with the rebalanced placement, not the configured one
            inject = await client.admin("fault.inject", {"fault": {"kind": "kill", "rank": 2, "after_steps": 3}})
            assert inject.ok, inject.error
            restarted, _ = await _generate(client, prompts, "restarted")
            assert restarted == off
            kept = await client.admin("eplb.status")
            assert ExpertPlacement.from_dict(kept.to_json()["placement"]).layers == placement.layers
            assert (await client.admin("stats")).data.stats.num_recoveries == 1
            print(f"\n{arch}: longest gap between tokens: steady {steady_gap:.3f} s, during reconfiguration "
                  f"{live_gap:.3f} s, rebalanced {on_gap:.3f} s")
            assert live_gap < STALL_LIMIT_S
            return off, live, on, load.data.moe_layers
        finally:
            client.shutdown()

    off, live, on, moe_layers = asyncio.run(scenario())
    assert live == off
    assert on == off

    # a placement planned with primaries moved too (mode "full") is applied before serving starts
    placement = _full_placement(config.eplb_config.eplb_redundant_experts, moe_layers)
    placement_file = tmp_path / "placement.json"
    placement_file.write_text(json.dumps(placement.to_dict()))

    async def from_file():
        client = AsyncEngineClient(config.replace(eplb_placement=str(placement_file)),
                                   log_level=logging.WARNING)
        try:
            status = (await client.admin("eplb.status")).to_json()
            assert ExpertPlacement.from_dict(status["placement"]).layers == placement.layers
            return (await _generate(client, prompts, "planned"))[0]
        finally:
            client.shutdown()

    assert asyncio.run(from_file()) == off


def _full_placement(redundant: int, moe_layers: list[int]) -> ExpertPlacement:
    """Every rank's experts shuffled across ranks, the hottest-looking few replicated (16 experts, EP4)."""
    from meshserve.moe.placement import PlacementShape

    shape = PlacementShape(16, 4, redundant)
    order = [15, 3, 8, 0, 12, 5, 1, 10, 7, 14, 2, 9, 4, 11, 6, 13]
    layers = {}
    for layer in moe_layers:
        slots = []
        for rank in range(4):
            slots += order[rank * 4:(rank + 1) * 4] + [order[(rank * 4 + 5) % 16]] * redundant
        layers[layer] = slots
    return ExpertPlacement(shape, layers)
