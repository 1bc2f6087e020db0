import json

import pytest
import torch

from meshserve.bench.cli import main as bench_main
from meshserve.bench.hf_baseline import left_pad, load_hf_model, run_hf_baseline
from meshserve.bench.offline import compare_greedy, plot_offline, roofline_record
from meshserve.bench.workload import make_offline_workload


def test_compare_greedy_counts_requests_and_first_divergence():
    ours = [[1, 2, 3], [4, 5, 6], [7, 8], [9]]
    theirs = [[1, 2, 3], [4, 0, 6], [7, 8, 9], [0]]
    assert compare_greedy(ours, theirs) == {
        "compared_requests": 4, "mismatching_requests": 3, "first_divergence_positions": [1, 2, 0]}


def test_left_pad_aligns_prompts_to_the_right():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.fixture(scope="module")
def hf_tiny_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=128, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("hf_tiny")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _unpadded_greedy(model, prompt, n):
    """One request alone, no padding: what batching must not change."""
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_hf_baseline_batches_match_unpadded_requests_and_count_useful_tokens(hf_tiny_dir):
    workload = make_offline_workload(5, (2, 9), (1, 6), vocab_size=128, seed=4, exclude_token_ids={1, 2})
    model = load_hf_model(hf_tiny_dir)
    done = []
    result = run_hf_baseline(hf_tiny_dir, workload, batch_size=2, model=model, on_batch_done=done.append)
    assert done == [2, 2, 1]
    for request, tokens in zip(workload, result.outputs):
        assert tokens == _unpadded_greedy(model, request.prompt_token_ids, request.output_len)
    assert result.output_tokens == sum(r.output_len for r in workload)
    batches = [workload[0:2], workload[2:4], workload[4:5]]
    assert result.generated_tokens == sum(len(b) * max(r.output_len for r in b) for b in batches)
    assert result.output_tokens_per_s == pytest.approx(result.output_tokens / result.elapsed_s)


def test_hf_baseline_does_not_stop_at_eos(hf_tiny_dir):
    model = load_hf_model(hf_tiny_dir)
    workload = make_offline_workload(1, (3, 3), (6, 6), 128, seed=0)
    first = _unpadded_greedy(model, workload[0].prompt_token_ids, 1)[0]
    # the very first generated token is now EOS, in both places generate looks
    model.config.eos_token_id = first
    model.generation_config.eos_token_id = first
    result = run_hf_baseline(hf_tiny_dir, workload, model=model)
    assert len(result.outputs[0]) == 6 and result.outputs[0][0] == first


def _fake_result(with_baseline=True, with_roofline=True):
    result = {"meshserve": {"output_tokens_per_s": 120.0}, "baseline": None, "speedup": None, "roofline": None,
              "decode_roofline_fraction": None}
    if with_baseline:
        result.update(baseline={"output_tokens_per_s": 40.0}, speedup=3.0)
    if with_roofline:
        result.update(roofline={"batch": 4, "context_len": 16, "achieved_tokens_per_s": 50.0,
                                "bound_tokens_per_s": 200.0, "bound": {"limited_by": "memory"}},
                      decode_roofline_fraction=0.25)
    return result


@pytest.mark.parametrize("with_baseline, with_roofline", [(True, True), (False, False)])
def test_plot_offline_writes_png(tmp_path, with_baseline, with_roofline):
    path = plot_offline(_fake_result(with_baseline, with_roofline), tmp_path / "x" / "offline.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_roofline_record_uses_engine_dtype_width():
    from meshserve.models.factory import preset_config

    config = preset_config("qwen3_moe", "tiny")
    machine = {"memory_bandwidth_gbps": 10.0, "matmul_gflops": 50.0}
    fp32 = roofline_record(config, "float32", 4, 32, machine, 10.0, {})
    bf16 = roofline_record(config, "bfloat16", 4, 32, machine, 10.0, {})
    assert (fp32["bytes_per_param"], bf16["bytes_per_param"]) == (4, 2)
    assert fp32["step_cost"]["total_bytes"] == pytest.approx(2 * bf16["step_cost"]["total_bytes"])
    assert fp32["achieved_tokens_per_s"] == 10.0
    assert fp32["bound_tokens_per_s"] == pytest.approx(fp32["bound"]["tokens_per_s"])


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model", "--requests", "2", "--input-len", "2", "--output-len", "2"], "does not exist"),
    (["--preset", "huge", "--requests", "2", "--input-len", "2", "--output-len", "2"], "huge"),
    (["--preset", "tiny", "--requests", "2", "--input-len", "x:2", "--output-len", "2"], "--input-len"),
    (["--preset", "tiny", "--requests", "2", "--input-len", "2", "--output-len", "3:1"], "--output-len"),
    (["--preset", "tiny", "--requests", "-1", "--input-len", "2", "--output-len", "2"], "--requests"),
    (["--preset", "tiny", "--requests", "2", "--input-len", "2", "--output-len", "2", "--max-num-seqs", "4",
      "--roofline-batch", "8"], "max_num_seqs"),
])
def test_bench_offline_bad_input_is_one_line_and_nonzero(tmp_path, capsys, args, message):
    path = tmp_path / "r.json"
    rc = bench_main(["offline", *args, "--json", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and not path.exists()
    assert len(err.splitlines()) == 1 and message in err


def test_bench_commands_register_under_the_main_cli():
    from meshserve.bench.cli import offline_command, serve_command
    from meshserve.entrypoints.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "serve", "--url", "http://127.0.0.1:1", "--rate", "2", "--requests", "3",
                              "--input-len", "2:4", "--output-len", "5", "--json", "out.json"])
    assert args.func is serve_command and args.rate == 2.0 and args.concurrency is None
    args = parser.parse_args(["bench", "offline", "--preset", "tiny", "--requests", "3", "--input-len", "2",
                              "--output-len", "5", "--json", "out.json", "--max-num-seqs", "8"])
    assert args.func is offline_command and args.max_num_seqs == 8 and args.baseline == "hf"


@pytest.fixture(scope="module")
def micro_model_dir(tiny_model):
    overrides = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "moe_intermediate_size": 32,
                 "num_attention_heads": 2, "num_key_value_heads": 2}
    return tiny_model("deepseek_v3", overrides=overrides, name="micro")


def test_bench_offline_end_to_end_on_a_micro_model(micro_model_dir, tmp_path):
    path = tmp_path / "out" / "offline.json"
    rc = bench_main(["offline", "--model", str(micro_model_dir), "--requests", "3", "--input-len", "4:8",
                     "--output-len", "2:4", "--hf-batch-size", "2", "--max-num-seqs", "4", "--roofline-batch", "2",
                     "--roofline-decode-tokens", "3", "--roofline-repeats", "1", "--bandwidth-mib", "8",
                     "--matmul-size", "128", "--json", str(path), "--no-progress"])
    assert rc == 0
    result = json.loads(path.read_text())
    workload = make_offline_workload(3, (4, 8), (2, 4), 32000, seed=0)
    assert result["workload"]["output_tokens"] == sum(r.output_len for r in workload)
    assert result["meshserve"]["output_tokens"] == result["workload"]["output_tokens"]
    assert result["baseline"]["output_tokens"] == result["workload"]["output_tokens"]
    assert result["speedup"] == pytest.approx(
        result["meshserve"]["output_tokens_per_s"] / result["baseline"]["output_tokens_per_s"])
    assert result["greedy_check"]["compared_requests"] == 3
    roofline = result["roofline"]
    assert roofline["batch"] == 2 and roofline["context_len"] == 6
    assert result["decode_roofline_fraction"] == pytest.approx(
        roofline["achieved_tokens_per_s"] / roofline["bound_tokens_per_s"])
    assert result["machine"]["torch_version"] == torch.__version__
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
