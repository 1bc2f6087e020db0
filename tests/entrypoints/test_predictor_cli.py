import json

import pytest

from meshserve.entrypoints.cli import build_parser, main
from meshserve.entrypoints.predictor import bucket_histogram, report_path_for, split_examples, train_main
from meshserve.router.length_predictor import LengthExample, LengthPredictor


@pytest.fixture(scope="module")
def micro_model_dir(tiny_model):
    overrides = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "moe_intermediate_size": 32,
                 "num_attention_heads": 2, "num_key_value_heads": 2}
    return tiny_model("deepseek_v3", overrides=overrides, name="micro")


def test_predictor_train_registers_under_the_main_cli():
    args = build_parser().parse_args(["predictor", "train", "--model", "m", "--out", "p.safetensors",
                                      "--num-prompts", "7", "--max-num-seqs", "4"])
    assert args.func is train_main and args.num_prompts == 7 and args.max_num_seqs == 4
    assert (args.held_out, args.bucket_tokens, args.temperature, args.seed) == (0.2, 128, 1.0, 0)


def test_split_is_deterministic_and_keeps_both_sides():
    examples = [LengthExample([i], 10, i % 10) for i in range(20)]
    train, held = split_examples(examples, 0.25, seed=3)
    assert (len(train), len(held)) == (15, 5)
    assert split_examples(examples, 0.25, seed=3) == (train, held)
    assert sorted(e.prompt_token_ids[0] for e in train + held) == list(range(20))
    assert [len(side) for side in split_examples(examples[:2], 0.01, seed=0)] == [1, 1]


def test_bucket_histogram_names_token_ranges():
    examples = [LengthExample([1], 300, n) for n in (1, 128, 129, 300)]
    assert bucket_histogram(examples, 128) == {"1-128": 2, "129-256": 1, "257-384": 1}


def test_predictor_train_end_to_end_on_a_micro_model(micro_model_dir, tmp_path, capsys):
    out = tmp_path / "out" / "predictor.safetensors"
    rc = main(["predictor", "train", "--model", str(micro_model_dir), "--out", str(out), "--num-prompts", "10",
               "--held-out", "0.3", "--bucket-tokens", "4", "--max-tokens-range", "2:14", "--prompt-len", "3:8",
               "--max-num-seqs", "8", "--epochs", "5", "--no-progress"])
    assert rc == 0
    predictor = LengthPredictor.load(out)
    assert predictor.bucket_tokens == 4
    report = json.loads(report_path_for(out).read_text())
    assert (report["n_train"], report["n_held_out"]) == (7, 3)
    held_out = report["held_out"]
    assert held_out["n"] == 3 and 0.0 <= held_out["accuracy"] <= 1.0
    assert set(held_out["baselines"]) == {"majority_bucket", "max_tokens_bucket"}
    assert sum(report["bucket_histogram"]["train"].values()) == 7
    assert sum(report["bucket_histogram"]["held_out"].values()) == 3
    # every request stopped at EOS or max_tokens, so the recorded lengths never exceed the range's top
    assert sum(report["generation"]["finish_reasons"].values()) == 10
    assert 10 <= report["generation"]["output_tokens"] <= 10 * 14
    assert "held-out accuracy" in capsys.readouterr().out
    assert predictor.predict_tokens([5, 6, 7], 3) <= 3


@pytest.mark.parametrize("args, message", [
    (["--held-out", "1.5"], "--held-out"),
    (["--num-prompts", "1"], "--num-prompts"),
    (["--max-tokens-range", "9:2"], "--max-tokens-range"),
    (["--prompt-len", "x"], "--prompt-len"),
    (["--bucket-tokens", "0"], "--bucket-tokens"),
    (["--temperature", "-1"], "--temperature"),
])
def test_bad_arguments_are_one_line_and_nonzero(micro_model_dir, tmp_path, capsys, args, message):
    out = tmp_path / "p.safetensors"
    rc = main(["predictor", "train", "--model", str(micro_model_dir), "--out", str(out), *args])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and not out.exists()
    assert len(err.splitlines()) == 1 and message in err


def test_unparsable_flag_is_one_line_and_nonzero(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["predictor", "train", "--model", "m", "--out", str(tmp_path / "p"), "--num-prompts", "many"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1 and "invalid int value" in err


def test_missing_model_is_one_line_and_nonzero(tmp_path, capsys):
    rc = main(["predictor", "train", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "p.safetensors")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "does not exist" in err
