"""The bridge to Vidur (meshserve/sim/vidur.py): its tables written from the dense op model, found by the Hugging
Face loader Vidur calls (offline), its trace and command line from meshserve's settings, its results read back
as meshserve's metrics, and `meshserve simulate vidur`'s refusals in one line. Vidur itself runs in its own
environment (`make vidur`) from the benchmark command; the figures are in docs/simulate.md."""
from __future__ import annotations

import csv
import json
import lzma

import pytest
from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download

from meshserve.entrypoints.cli import main
from meshserve.sim.dense_op_model import DENSE_PRESETS, DenseDeployment, DenseOps, DenseShape
from meshserve.sim.hardware import HARDWARE_DIR, Hardware
from meshserve.sim.te import SimTESettings
from meshserve.sim.trace import TraceRequest
from meshserve.sim.vidur import (
    COMPUTE_OPS,
    VidurError,
    VidurRun,
    attention_rows,
    compute_rows,
    read_vidur_metrics,
    token_grid,
    vidur_arguments,
    write_profiles,
    write_trace,
)

OPS = DenseOps(DenseShape.from_config(DENSE_PRESETS["llama-3-8b"]), Hardware.load("h800"), DenseDeployment())
SETTINGS = SimTESettings(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024, num_kv_blocks=512)


def test_the_token_grid_holds_every_batch_vidur_times():
    grid = token_grid(1024)
    # Vidur times a batch at its token count rounded up to a multiple of 8
    assert set(range(1, 129)) <= set(grid) and set(range(8, 1025, 8)) <= set(grid)
    assert grid == sorted(set(grid)) and grid[-1] == 1024


def test_the_tables_hold_the_op_models_times_in_milliseconds():
    rows = compute_rows(OPS, 256)
    by_tokens = {row["num_tokens"]: row for row in rows}
    assert by_tokens[64]["time_stats.mlp_up_proj.median"] == pytest.approx(1e3 * OPS.mlp_up_proj(64))
    assert by_tokens[256]["time_stats.attn_pre_proj.median"] == pytest.approx(1e3 * OPS.attn_pre_proj(256))
    assert all(f"time_stats.{op}.median" in rows[0] for op in COMPUTE_OPS)
    attention = attention_rows(OPS, 1024, 8, 256, 16, 256)
    decode = {(r["batch_size"], r["kv_cache_size"]): r["time_stats.attn_decode.median"] for r in attention
              if r["prefill_chunk_size"] == 0}
    assert decode[(8, 1024)] == pytest.approx(1e3 * OPS.attn_decode(8, 1024))
    assert decode[(8, 1024)] > decode[(4, 1024)] > decode[(4, 256)]
    prefill = {(r["kv_cache_size"], r["prefill_chunk_size"]): r["time_stats.attn_prefill.median"] for r in attention
               if r["prefill_chunk_size"]}
    # every (KV multiple of the granularity, chunk multiple of 32) Vidur predicts at
    assert set(prefill) == {(kv, chunk) for kv in range(0, 1025, 256) for chunk in range(32, 257, 32)}


def test_the_hugging_face_loader_finds_the_tables_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    compute_id, network_id = write_profiles(OPS, SETTINGS, tmp_path)
    # what Vidur's predictor calls when it starts
    snapshot = snapshot_download(repo_id=compute_id, repo_type="dataset",
                                 cache_dir=str(tmp_path / "profiling_data" / "compute"))
    with lzma.open(f"{snapshot}/mlp.csv.xz", "rt") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(token_grid(SETTINGS.max_model_len))
    assert float(table[0]["time_stats.attn_pre_proj.median"]) == pytest.approx(1e3 * OPS.attn_pre_proj(1))
    assert (tmp_path / "profiling_data" / "network" / f"datasets--{network_id.replace('/', '--')}").is_dir()
    # other figures make other tables, and another id (Vidur caches its fitted forests by id)
    faster = DenseOps(OPS.shape, Hardware.from_dict(_faster_h800(), "test"), DenseDeployment())
    assert write_profiles(faster, SETTINGS, tmp_path)[0] != compute_id
    assert write_profiles(OPS, SETTINGS, tmp_path)[0] == compute_id


def _faster_h800() -> dict:
    data = json.loads((HARDWARE_DIR / "h800.json").read_text())
    data["ops"]["hbm_read_gbps"]["value"] *= 2
    return data


def test_the_command_line_carries_the_settings(tmp_path):
    arguments = vidur_arguments(OPS, SETTINGS, VidurRun(replicas=2, routing="load", seed=3),
                                trace_file=tmp_path / "t.csv", datasets=("a/b", "a/c"), cache_dir=tmp_path,
                                out_dir=tmp_path / "out")
    flags = dict(zip(arguments[:-1:2], arguments[1::2]))
    assert flags["--cluster_config_num_replicas"] == "2" and flags["--global_scheduler_config_type"] == "lor"
    assert flags["--seed"] == "3"
    assert flags["--replica_config_model_name"] == "meta-llama/Llama-3-8B"
    assert flags["--sarathi_scheduler_config_batch_size_cap"] == "8"
    assert flags["--sarathi_scheduler_config_chunk_size"] == "256"
    assert flags["--cache_config_num_blocks"] == "512"
    assert flags["--random_forrest_execution_time_predictor_config_model_profiling_dataset"] == "a/b"
    assert arguments[-1] == "--no-metrics_config_store_plots"


def test_vidur_results_read_back_as_meshserve_metrics(tmp_path):
    trace = [TraceRequest(0.0, 100, 11), TraceRequest(2.0, 50, 1)]
    write_trace(trace, tmp_path / "trace.csv")
    with open(tmp_path / "trace.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(float(r["Time"]), int(r["PromptTokenCount"])) for r in rows] == [(0.0, 100), (2.0, 50)]
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    # Vidur's columns (a subset): the second request ends 0.5 s after arriving at 2 s
    with open(run / "request_metrics.csv", "w") as f:
        f.write("Request Id,request_e2e_time,prefill_e2e_time,request_num_decode_tokens\n"
                "0,1.1,0.1,11\n1,0.5,0.5,1\n")
    with open(run / "plots" / "batch_execution_time.csv", "w") as f:
        f.write(",cdf,batch_execution_time\n0,0.0,0.004\n1,0.5,0.006\n2,1.0,0.009\n")
    metrics = read_vidur_metrics(run, trace)
    assert metrics["ttfts"] == [0.1, 0.5]
    assert metrics["tpots"] == [pytest.approx(0.1)]  # (1.1 - 0.1) / (11 - 1); a one-token request has none
    assert metrics["output_tokens_per_s"] == pytest.approx(12 / 2.5)
    assert metrics["median_step_ms"] == pytest.approx(6.0)
    with pytest.raises(VidurError, match="served 2 of the trace's 3"):
        read_vidur_metrics(run, [*trace, TraceRequest(3.0, 10, 10)])


@pytest.mark.parametrize("flags, message", [
    (["--vidur-python", "/nonexistent/python"], "make vidur"),
    (["--model-config", "deepseek-r1"], "not 'deepseek_v3'"),
    (["--parallel", "attn=DP2 moe=EP2"], "one replica at attn=TPk moe=TPk"),
    (["--input-len", "4000:4000"], "exceeds max_model_len 4096"),
    (["--kv-granularity", "0"], "a KV step of a token or more"),
    (["--replicas", "300"], "needs 300 devices"),
])
def test_simulate_vidur_refuses_bad_input_in_one_line(tmp_path, capsys, flags, message):
    python = tmp_path / "python"
    python.touch()
    code = main(["simulate", "vidur", "--vidur-python", str(python), "--requests", "4",
                 "--json", str(tmp_path / "v.json"), *flags])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "v.json").exists()
