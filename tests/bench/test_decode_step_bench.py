"""`meshserve bench decode-step` on the tiny preset: both paths timed and profiled, their logits compared,
the speedup their ratio, and one-line argument errors."""
from __future__ import annotations

import json
import math

import pytest

from meshserve.entrypoints.cli import main

pytestmark = pytest.mark.timeout(120)  # the first use in a fresh cache may also compile the kernels

BATCH, CONTEXT, STEPS, REPEATS = 4, 32, 2, 1


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_decode_step_bench_times_both_paths(tmp_path, capsys, monkeypatch):
    from meshserve.layers import cpu_kernels

    if not cpu_kernels.enabled():
        pytest.fail("the native CPU kernels did not build: the benchmark has nothing to compare")
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))  # the preset's model is written here
    out = tmp_path / "decode.json"
    assert main(["bench", "decode-step", "--preset", "tiny", "--batch", str(BATCH), "--context", str(CONTEXT),
                 "--steps", str(STEPS), "--repeats", str(REPEATS), "--json", str(out)]) == 0
    assert (tmp_path / "cache" / "models" / "deepseek_v3-tiny" / "config.json").is_file()
    result = json.loads(out.read_text())
    config = result["config"]
    assert (config["batch"], config["context"], config["steps"], config["repeats"]) == (BATCH, CONTEXT, STEPS, REPEATS)
    assert config["model_type"] == "deepseek_v3" and config["dtype"] == "float32"
    assert config["blocks_per_sequence"] == 3  # 34 tokens in 16-token blocks
    assert config["num_kv_blocks"] >= BATCH * config["blocks_per_sequence"]

    check = result["logit_check"]
    assert check["passed"] is True and check["steps"] == STEPS and len(check["per_step_max_abs_diff"]) == STEPS
    assert 0 <= check["max_abs_diff"] <= check["tolerance"] == 1e-3
    assert check["max_abs_diff"] == max(check["per_step_max_abs_diff"])
    assert _positive(check["max_abs_logit"])

    paths = result["paths"]
    assert set(paths) == {"native", "torch"}
    for path in paths.values():
        assert len(path["times_ms_per_step"]) == REPEATS and all(_positive(t) for t in path["times_ms_per_step"])
        assert _positive(path["ms_per_step"]) and _positive(path["tokens_per_s"])
        assert math.isclose(path["tokens_per_s"], BATCH / (path["ms_per_step"] / 1e3))
        profile = path["profile"]
        assert 1 <= len(profile["top_ops"]) <= 8 and _positive(profile["wall_ms"])
        top = [op["self_ms"] for op in profile["top_ops"]]
        assert top == sorted(top, reverse=True) and all(_positive(t) for t in top)
        assert math.isclose(profile["ops_self_ms"], sum(top) + profile["other_ops_self_ms"], rel_tol=1e-9)
    # the native step ran the kernels, the torch step none of them
    native_ops = paths["native"]["profile"]["native_ops"]
    assert native_ops and all(name.startswith("meshserve_cpu::") for name in native_ops)
    assert paths["torch"]["profile"]["native_ops"] == []
    assert _positive(result["speedup"])
    assert math.isclose(result["speedup"], paths["torch"]["ms_per_step"] / paths["native"]["ms_per_step"])
    assert out.with_suffix(".png").stat().st_size > 0

    printed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(("native ", "torch ")) and " ms/step" in line and "/1:" in line
               for line in printed) == 2 * REPEATS  # one progress line per measurement
    summary = [line for line in printed if line.startswith("native ") and "speedup" in line]
    assert len(summary) == 1 and f"speedup {result['speedup']:.2f}x" in summary[0]


def _one_line_error(capsys, needle: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshserve bench decode-step: error:") and needle in err[0], err


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "tiny", "--batch", "0"], "--batch"),
    (["--preset", "tiny", "--steps", "-1"], "--steps"),
    (["--preset", "tiny", "--repeats", "0"], "--repeats"),
    (["--preset", "tiny", "--block-size", "12"], "power of two"),
    (["--model", "no/such/model"], "does not exist"),
])
def test_decode_step_bench_bad_arguments(tmp_path, capsys, argv, needle):
    out = tmp_path / "decode.json"
    assert main(["bench", "decode-step", "--json", str(out), *argv]) == 2
    _one_line_error(capsys, needle)
    assert not out.exists() and not out.with_suffix(".png").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "huge"], "--preset"),
    (["--preset", "tiny", "--batch", "many"], "--batch"),
    ([], "--model"),  # neither a model nor a preset
])
def test_decode_step_bench_parse_errors_are_one_line(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "decode-step", "--json", str(tmp_path / "decode.json"), *argv])
    assert exc.value.code == 2
    _one_line_error(capsys, needle)


def test_decode_step_bench_fails_without_the_kernels(tmp_path, capsys, monkeypatch):
    from meshserve.layers import cpu_kernels

    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))  # were a model made, it would land here
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: False)
    out = tmp_path / "decode.json"
    assert main(["bench", "decode-step", "--preset", "tiny", "--json", str(out)]) == 1
    _one_line_error(capsys, "not available")
    assert not out.exists() and not (tmp_path / "cache").exists()  # it stopped before making the preset's model


def test_decode_step_bench_fails_when_the_paths_disagree(tmp_path, capsys, monkeypatch):
    from meshserve.bench import decode_step

    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(decode_step, "LOGIT_TOLERANCE", -1.0)  # no difference passes, not even none
    out = tmp_path / "decode.json"
    assert main(["bench", "decode-step", "--preset", "tiny", "--batch", "2", "--context", "16", "--steps", "1",
                 "--repeats", "1", "--json", str(out)]) == 1
    _one_line_error(capsys, "logits differ")
    assert not out.exists()


def test_decode_step_bench_refuses_a_context_past_the_model_length(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "decode.json"
    assert main(["bench", "decode-step", "--preset", "tiny", "--context", "4096", "--steps", "1",
                 "--json", str(out)]) == 1  # the tiny model holds 4096 positions
    _one_line_error(capsys, "max_position_embeddings 4096")
    assert not out.exists()
