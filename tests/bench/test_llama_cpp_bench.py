"""`meshserve bench llama-cpp`: one-line argument errors, llama-batched-bench's output read, the converter's
pre-tokenizer fallback, the sources llama.cpp is built from, ratios paired by weight format, and a --quick run
on the tiny model where llama.cpp cannot be built (meshserve measured alone, the reason printed). Building
llama.cpp itself takes minutes: the benchmark's full run does it, the tests do not."""
from __future__ import annotations

import json
import sys
import tarfile

import pytest

from meshserve.bench import gguf_convert, llama_cpp_build
from meshserve.bench.llama_cpp import FUSED_PAIRS, LlamaCppSettings, _result, parse_batched_bench, table_lines
from meshserve.bench.llama_cpp_build import LlamaCppUnavailable
from meshserve.entrypoints.cli import main

# two lines of llama-batched-bench 0.3.36's JSONL as printed, among its log lines
BATCHED_BENCH_OUTPUT = """main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 256, "tg": 128, "pl": 1, "n_kv": 384, "t_pp": 0.280095, \
"speed_pp": 913.975586, "t_tg": 0.712579, "speed_tg": 179.629196, "t": 0.992674, "speed": 386.833954}
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 256, "tg": 128, "pl": 16, "n_kv": 6144, "t_pp": 5.1, \
"speed_pp": 803.1, "t_tg": 10.2, "speed_tg": 200.78, "t": 15.3, "speed": 401.5}
llama_perf_context_print:        load time =     120.11 ms
"""


@pytest.mark.parametrize(("flags", "message"), [(["--rounds", "0"], "--rounds must be at least 1"),
                                                (["--batch-sizes", "1,x"], "--batch-sizes must be integers"),
                                                (["--output-len", "2"], "--output-len must be at least 3"),
                                                (["--threads", "0"], "--threads must be at least 1"),
                                                (["--preset", "huge"], "--preset must be tiny or small"),
                                                (["--model", "/no/such/dir"], "is not a model directory")])
def test_bad_arguments_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "llama-cpp", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_batched_bench_output_is_read_per_batch_size():
    rates = parse_batched_bench(BATCHED_BENCH_OUTPUT)
    assert rates == {1: {"decode_tokens_per_s": 179.629196, "prefill_tokens_per_s": 913.975586},
                     16: {"decode_tokens_per_s": 200.78, "prefill_tokens_per_s": 803.1}}


def test_ratios_pair_each_meshserve_format_with_llama_cpp_of_the_same_bytes():
    settings = LlamaCppSettings(model_dir="m", preset="tiny", batch_sizes=(1, 16), prompt_len=256, output_len=128,
                                rounds=2, threads=2, llama_cpp_source=None, json_path="x.json")

    def rates(decode):
        return {b: {"decode_tokens_per_s": decode * b, "prefill_tokens_per_s": 500.0} for b in (1, 16)}

    rounds = [{"llama.cpp f32": rates(50), "llama.cpp Q8_0": rates(100), "meshserve fp32": rates(60),
               "meshserve INT8": rates(125)},
              {"llama.cpp f32": rates(50), "llama.cpp Q8_0": rates(100), "meshserve fp32": rates(40),
               "meshserve INT8": rates(75)}]
    result = _result(settings, "m", list(rounds[0]), rounds, None)
    # each ratio is taken within a round, then the median over rounds
    assert result["decode_ratio"]["meshserve fp32"] == {"1": pytest.approx(1.0), "16": pytest.approx(1.0)}
    assert result["decode_ratio"]["meshserve INT8"]["1"] == pytest.approx(1.0)
    assert set(result["decode_ratio"]) == {"meshserve fp32", "meshserve INT8"} and result["fused_over_per_op"] == {}
    assert result["medians"]["llama.cpp Q8_0"]["16"]["decode_tokens_per_s"] == 1600
    lines = table_lines(result)
    assert lines[2].startswith("| 1 (decode tok/s) | 50.0 | 100.0 | 50.0 (1.00x) | 100.0 (1.00x) |")


def test_the_per_op_sides_give_the_fused_layers_ratio():
    settings = LlamaCppSettings(model_dir="m", preset="tiny", batch_sizes=(1,), prompt_len=16, output_len=8,
                                rounds=1, threads=2, llama_cpp_source=None, json_path="x.json", per_op=True)
    rates = {name: {1: {"decode_tokens_per_s": rate, "prefill_tokens_per_s": 1.0}}
             for name, rate in (("meshserve fp32", 90.0), ("meshserve INT8", 240.0), ("meshserve fp32 per-op", 72.0),
                                ("meshserve INT8 per-op", 160.0))}
    result = _result(settings, "m", list(rates), [rates], "llama.cpp skipped: no cmake")
    assert set(result["fused_over_per_op"]) == set(FUSED_PAIRS)
    assert result["fused_over_per_op"]["meshserve INT8"]["1"] == pytest.approx(1.5)
    assert "meshserve fp32 fused / per-op decode: batch 1 1.25x" in table_lines(result)


def test_the_converter_names_an_unlisted_pre_tokenizer_as_the_house_one(tmp_path, monkeypatch):
    """A stand-in llama.cpp tree whose converter refuses every hash, as the real one refuses the house
    tokenizer's: the wrapper names it llama-bpe; a listed hash keeps its own name."""
    tree = tmp_path / "llama.cpp"
    (tree / "conversion").mkdir(parents=True)
    (tree / "conversion" / "__init__.py").write_text("")
    (tree / "conversion" / "base.py").write_text(
        "class TextModel:\n"
        "    def get_vocab_base_pre(self, tokenizer):\n"
        "        if tokenizer == 'listed':\n"
        "            return 'gpt-2'\n"
        "        raise NotImplementedError('BPE pre-tokenizer was not recognized')\n")
    (tree / "convert_hf_to_gguf.py").write_text(
        "import json, sys\n"
        "from conversion.base import TextModel\n"
        "out = sys.argv[sys.argv.index('--outfile') + 1]\n"
        "names = [TextModel().get_vocab_base_pre(t) for t in ('house', 'listed')]\n"
        "open(out, 'w').write(json.dumps({'names': names, 'model': sys.argv[1]}))\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delitem(sys.modules, "conversion", raising=False)
    monkeypatch.delitem(sys.modules, "conversion.base", raising=False)
    out = tmp_path / "out.json"
    gguf_convert.main([str(tree), "model-dir", "--outfile", str(out)])
    assert json.loads(out.read_text()) == {"names": ["llama-bpe", "gpt-2"], "model": "model-dir"}
    for name in ("conversion", "conversion.base"):  # the stand-in's modules leave with the test
        sys.modules.pop(name, None)


def test_llama_cpp_is_found_in_an_sdist_tarball_or_a_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    sdist = tmp_path / "llama_cpp_python-9.9.9"
    tree = sdist / "vendor" / "llama.cpp"
    tree.mkdir(parents=True)
    for name in ("CMakeLists.txt", "convert_hf_to_gguf.py"):
        (tree / name).write_text("")
    tarball = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(sdist, arcname=sdist.name)
    root = llama_cpp_build.cache_root()
    extracted = llama_cpp_build._source_tree(tarball, root, lambda message: None)
    assert extracted == root / "src" / sdist.name / "vendor" / "llama.cpp"
    assert (extracted / "CMakeLists.txt").is_file()
    assert llama_cpp_build._source_tree(tree, root, lambda message: None) == tree
    with pytest.raises(LlamaCppUnavailable, match="holds no llama.cpp source tree"):
        llama_cpp_build._source_tree(tmp_path / "cache", root, lambda message: None)


def test_no_cmake_is_one_line_saying_so(monkeypatch):
    monkeypatch.setattr(llama_cpp_build.shutil, "which", lambda name: None)
    with pytest.raises(LlamaCppUnavailable, match="cmake is not installed"):
        llama_cpp_build.prepare(None, lambda message: None)


@pytest.mark.timeout(600)
def test_a_quick_run_without_llama_cpp_measures_meshserve_alone(tiny_model, tmp_path, capsys):
    path = tmp_path / "llama-cpp.json"
    assert main(["bench", "llama-cpp", "--quick", "--model", str(tiny_model()), "--llama-cpp-source",
                 str(tmp_path), "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    assert "holds no llama.cpp source tree" in result["llama_cpp_skipped"]
    assert set(result["medians"]) == {"meshserve fp32", "meshserve INT8"} and result["decode_ratio"] == {}
    for per_batch in result["medians"].values():
        assert set(per_batch) == {"1", "2"}
        assert all(v["decode_tokens_per_s"] > 0 and v["prefill_tokens_per_s"] > 0 for v in per_batch.values())
    out = capsys.readouterr().out
    assert "| 1 (decode tok/s) |" in out and "llama.cpp skipped:" in out
