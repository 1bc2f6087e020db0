"""The papers' decode results, simulated from op-level figures: CloudMatrix-Infer Table 5's three TPOT SLO rows and
xDeepServe §7's DP288/EP288 point and 768-die disaggregated deployment.

Each point is a decode TE of P/D (its requests arrive with their prompts' KV on a prefill TE, as in the papers'
decode measurements) serving a fixed batch per die of fixed-length requests, all admitted at once, with MTP drafting
one token per step at the paper's acceptance. The hardware profile holds kernel and link figures only; the papers'
TPOT and tokens/s are what the simulation is compared with, never an input.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.parallel.cluster_file import MODEL_PRESETS
from meshserve.parallel.strategy import parse_strategy
from meshserve.sim.hardware import Hardware
from meshserve.sim.op_model import Deployment, OpStepModel, deployment_of
from meshserve.sim.run import simulate
from meshserve.sim.te import SimTE, SimTESettings
from meshserve.sim.trace import TraceRequest

MODEL = "deepseek-r1"
BLOCK_SIZE = 16



def _deployment(layout: str, redundant: int, microbatches: int) -> Deployment:
    return deployment_of(parse_strategy(layout), 256, redundant=redundant, microbatches=microbatches)


# CloudMatrix-Infer §5.1: one decode TE of 320 dies, DP320 attention, EP320 (256 routed experts and 32 redundant on
# 288 dies, a shared-expert copy on each of 32), INT8, two-microbatch decode (§4.2.3)
_CM_EP320 = _deployment("attn=DP320 moe=EP320 shared=EP32", redundant=32, microbatches=2)
# xDeepServe §7: DP288/EP288 colocated; 256 dies hold a routed and a redundant expert, 32 a shared expert
_X_DP288 = _deployment("attn=DP288 moe=EP288 shared=EP32", redundant=256, microbatches=1)
# xDeepServe §5.2/§7: 480 attention dies in 3 DP domains of 160, EP288 on 288 dies of their own
_X_DISAGG = _deployment("attn=DP480 moe=EP256 shared=EP32 disagg domains=3", redundant=256, microbatches=2)


@dataclass(frozen=True)
class SeedPoint:
    name: str
    source: str
    deployment: Deployment
    batch_per_die: int
    prompt_len: int
    output_len: int
    mtp_acceptance: float
    paper_tpot_ms: float
    paper_tokens_per_s_per_die: float  # output tokens/s over every die of the deployment
    hardware: str = "ascend910c-cm384"


SEED_POINTS = (
    SeedPoint("cm-tpot50", "CloudMatrix-Infer Table 5, TPOT SLO 50 ms", _CM_EP320, 96, 4096, 256, 0.7, 49.4, 1943),
    SeedPoint("cm-tpot30", "CloudMatrix-Infer Table 5, TPOT SLO 30 ms", _CM_EP320, 24, 4096, 256, 0.7, 24.6, 974),
    SeedPoint("cm-tpot15", "CloudMatrix-Infer Table 5, TPOT SLO 15 ms", _CM_EP320, 8, 4096, 256, 0.7, 14.9, 538),
    SeedPoint("xds-dp288", "xDeepServe section 7, DP288/EP288 colocated (Figure 20)", _X_DP288, 60, 2048, 2048, 0.9,
              50.0, 1200),
    # "2400 tokens/s per chip" (two dies), TPOT 93 ms / 1.9 = 49 ms
    SeedPoint("xds-disagg768", "xDeepServe section 7, 768 dies, attention-expert disaggregated", _X_DISAGG, 96,
              2048, 2048, 0.9, 49.0, 1200),
)


def run_point(point: SeedPoint, groups: int = 16, seed: int = 0, progress: bool = False) -> dict:
    """Simulate `point` with `groups` of its DP groups (each stands for dp / groups of them: the load is the same on
    every group); the simulated TPOT and tokens/s per die beside the paper's."""
    deployment = point.deployment
    groups = min(groups, deployment.dp)
    model = OpStepModel(MODEL_PRESETS[MODEL], Hardware.load(point.hardware), deployment)
    length = point.prompt_len + point.output_len
    blocks = -(-length // BLOCK_SIZE) + 1
    settings = SimTESettings(dp=groups, max_num_seqs=point.batch_per_die, max_num_batched_tokens=8192,
                             max_model_len=length + 8, num_kv_blocks=blocks * point.batch_per_die + 16,
                             block_size=BLOCK_SIZE, num_draft_tokens=1, mtp_acceptance=point.mtp_acceptance,
                             kv_transfer="consumer", prefix_caching=False)
    trace = [TraceRequest(0.0, point.prompt_len, point.output_len) for _ in range(groups * point.batch_per_die)]
    metrics = simulate(trace, SimTE(settings, model, seed=seed), progress=progress)
    tpot_ms = 1e3 * metrics["tpot_s"]["p50"]
    per_die = metrics["output_tokens_per_s"] * (deployment.dp / groups) / deployment.devices
    return {
        "name": point.name, "source": point.source, "hardware": point.hardware,
        "devices": deployment.devices, "batch_per_die": point.batch_per_die,
        "paper_tpot_ms": point.paper_tpot_ms, "tpot_ms": tpot_ms,
        "tpot_error": tpot_ms / point.paper_tpot_ms - 1,
        "paper_tokens_per_s_per_die": point.paper_tokens_per_s_per_die, "tokens_per_s_per_die": per_die,
        "throughput_error": per_die / point.paper_tokens_per_s_per_die - 1,
        "mean_step_ms": metrics["mean_step_ms"], "step_breakdown_ms": metrics.get("step_breakdown_ms", {}),
        "simulated_groups": groups, "wall_s": metrics["wall_s"],
    }


def hardware_sources(name: str) -> dict[str, str]:
    return dict(Hardware.load(name).sources)
