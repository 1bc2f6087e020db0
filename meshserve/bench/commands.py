"""The `meshserve bench` subcommands: names and one-line help here, flags and code in each benchmark's module,
imported only when its command is parsed (so `meshserve --help` and every other command start without them)."""
from __future__ import annotations

import argparse

from meshserve.utils.lazy_parser import LazyArgumentParser

# name, help, "module:function adding its flags[:its entry point]" (the function sets `func` when no entry point)
BENCH_COMMANDS = (
    ("offline", "offline throughput vs HF transformers, and the decode roofline",
     "meshserve.bench.cli:add_offline_parser"),
    ("serve", "load an OpenAI-compatible server and report latency percentiles",
     "meshserve.bench.cli:add_serve_parser"),
    ("moe-comm", "MoE dispatch/combine: pure EP vs hybrid TP-EP sync/fused (4 local ranks, 2 nodes x 2)",
     "meshserve.bench.moe_comm:add_moe_comm_arguments:moe_comm_main"),
    ("parallel", "every parallel strategy of a world size against one rank, measured vs the analyzer's ranking",
     "meshserve.bench.parallel:add_parallel_arguments:parallel_main"),
    ("eplb", "expert load balancing: balancedness without and with redundant experts, planning time, and one MoE "
             "layer's step time on 4 ranks",
     "meshserve.bench.eplb:add_eplb_arguments:eplb_main"),
    ("cache", "caching cluster: pool bandwidth vs memory copy, model start-up time",
     "meshserve.bench.cache:add_cache_arguments:cache_main"),
    ("transfer", "KV block pulls between two processes per transfer backend (shm, tcp, dist) vs memcpy",
     "meshserve.bench.transfer:add_transfer_arguments:transfer_main"),
    ("decode-step", "one decode step, native CPU kernels vs the torch path: ms per step, speedup, where the time "
                    "goes",
     "meshserve.bench.decode_step:add_decode_step_arguments:decode_step_main"),
    ("microbatch", "a decode step as one batch vs two overlapped micro-batches (DP2+EP2) per emulated "
                   "dispatch/combine latency: step time, communication hidden, a timeline",
     "meshserve.bench.microbatch:add_microbatch_arguments"),
    ("pd", "colocated TEs vs a P/D pair on the same cores: TTFT, TPOT and JCT on a mixed workload",
     "meshserve.bench.pd:add_pd_arguments"),
    ("routing", "the job executor's routing policies on one deployment with shared prefixes: JCT, TTFT, TPOT, "
                "prefix-cache hit rate",
     "meshserve.bench.routing:add_routing_arguments"),
    ("spec", "MTP speculative decoding against plain decoding per batch size and k: decode tokens/s, TPOT, "
             "acceptance per draft position, and where drafting stops paying",
     "meshserve.bench.spec:add_spec_arguments"),
    ("scale", "the cluster manager's scale-up steps (cold, pre-warmed, DRAM preload, fork), TE-Load by weight "
              "source, fork fan-out, and an autoscaling run against fixed deployments",
     "meshserve.bench.scale:add_scale_arguments"),
    ("faults", "a steady load through injected faults (killed ranks, masters, TEs, a JE, a pool server; a stalled "
               "rank, a broken P/D link, a collective error): requests lost, tokens repeated or lost, time to "
               "detect and to recover, the throughput dip",
     "meshserve.bench.faults:add_faults_arguments"),
    ("quant", "INT8 W8A8 and the INT8 KV cache against float32 and bfloat16: weight bytes, decode and prefill "
              "tokens/s, roofline fraction, and quality per quantization method",
     "meshserve.bench.quant:add_quant_arguments"),
    ("jitter", "step-time tails with Python's automatic garbage collection, with collection on a schedule, and "
               "with that and pinned cores (p50, p90, p99, max; p99 against automatic collection)",
     "meshserve.bench.jitter:add_jitter_arguments"),
    ("control-plane", "the control plane's CPU per decode step at DP 1, 2, 4, 8: one master for every DP group "
                      "against self-contained DP groups, each ratio against DP 1",
     "meshserve.bench.control_plane:add_control_plane_arguments"),
    ("step-board", "what a round of the self-contained DP groups' step board costs rank 0 as the world grows: a "
                   "host per rank against ranks grouped by host",
     "meshserve.bench.step_board:add_step_board_arguments"),
    ("a2e", "A2E / E2A between attention ranks and expert ranks (attention-expert disaggregation): latency per "
            "direction against tokens per rank and expert ranks, direct and two-stage routing",
     "meshserve.bench.a2e:add_a2e_arguments"),
    ("disagg", "attention-expert disaggregation against colocated DP/EP on the same ranks: tokens/s and step time "
               "per DP domain count and emulated link latency, and a timeline of the domains taking turns",
     "meshserve.bench.disagg:add_disagg_arguments"),
    ("llama-cpp", "meshserve against llama.cpp (built from the llama-cpp-python sdist) on the same model and shapes: "
                   "decode and prefill tokens/s per batch size, float32 vs f32 and INT8 vs Q8_0",
     "meshserve.bench.llama_cpp:add_llama_cpp_arguments"),
    ("step-profile", "where a batch-1 decode step's time goes, end to end: the worker's and the master's parts per "
                      "step from py-spy samples, and the worker's flame graph",
     "meshserve.bench.step_profile:add_step_profile_arguments"),
    ("structured", "decoding under a JSON schema against free decoding at each batch size (tokens/s and their "
                   "ratio), and the first-token latency of a new schema, a cached one and a free request",
     "meshserve.bench.structured:add_structured_arguments"),
    ("tenants", "a noisy tenant at 10x its token budget beside a polite one: the polite tenant's TTFT alone and "
                "beside it, with per-tenant limits on",
     "meshserve.bench.tenants:add_tenants_arguments"),
)


def register_bench_commands(parser: argparse.ArgumentParser) -> None:
    """Add every benchmark of BENCH_COMMANDS to `parser` (the `bench` command) as its subcommands."""
    subparsers = parser.add_subparsers(dest="bench_command", required=True, parser_class=LazyArgumentParser)
    for name, text, flags_from in BENCH_COMMANDS:
        subparsers.add_parser(name, help=text, flags_from=flags_from)
