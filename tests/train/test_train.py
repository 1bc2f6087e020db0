"""`meshserve train`: a very small DeepSeek-V3 (2 layers, 8 experts, hidden 64) trained for a few dozen steps
on the standard-library corpus, its checkpoint in meshserve and HF transformers, determinism, the cache and
the CLI's error path."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from meshserve.entrypoints.cli import main as cli_main
from meshserve.models.factory import checkpoint_tensor_shapes
from meshserve.models.loader import load_model
from meshserve.train import cache, corpus, trainer
from meshserve.train.mtp import load_main_and_mtp, mtp_reference_logits
from meshserve.utils.checkpoint_files import safetensors_files
from tests.models.paged_harness import PagedHarness

MICRO = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
             q_lora_rank=32, kv_lora_rank=32, num_attention_heads=4, num_key_value_heads=4)
TOL = 1e-3


def micro_settings(**given) -> trainer.TrainSettings:
    chosen = dict(steps=30, seq_len=32, batch_size=8, lr=3e-3, eval_sequences=8, overrides=MICRO) | given
    return trainer.settings_for("deepseek_v3", "tiny", **chosen)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    out = trainer.train(micro_settings(), tmp_path_factory.mktemp("train") / "micro", progress=False)
    return out, json.loads((out / trainer.REPORT_FILE).read_text())


def test_training_lowers_the_heldout_loss(trained):
    _, report = trained
    factory, before, after = report["factory_init"], report["untrained"], report["trained"]
    print(json.dumps(trainer.summary(report), indent=1))
    assert report["steps"] == 30 and report["tokens_seen"] == 30 * 8 * 32 and report["threads"] == 1
    # the factory's random model is confidently wrong (~30 nats); training starts near uniform (~log 32000)
    assert factory["loss"] > 20 and abs(before["loss"] - math.log(32000)) < 0.5, (factory, before)
    assert after["loss"] < before["loss"] - 1.5, (before, after)
    assert after["perplexity"] < before["perplexity"] / 4
    assert after["mtp_loss"] < before["mtp_loss"] - 1.5, (before, after)
    assert 0.0 <= after["mtp_top1"] <= 1.0 and 0.0 <= after["mtp_agrees_with_main"] <= 1.0
    assert len(report["history"]) == 30 and "heldout" in report["history"][6]


def test_mtp_distillation_learns_the_main_models_predictions_and_leaves_it_alone(trained):
    """Stage 2 (`mtp_distill_steps`): the MTP layer alone moves towards the main model's distribution of t+2."""
    out, _ = trained
    settings = micro_settings(mtp_distill_steps=25, mtp_distill_lr=3e-3)
    models = trainer._load_models(out, "deepseek_v3")
    main_before = {name: p.detach().clone() for name, p in models.main.named_parameters()}
    mtp_before = {name: p.detach().clone() for name, p in models.mtp.named_parameters()}
    report = trainer.distill_mtp(models, corpus.load_corpus(), settings, progress=False)
    print(report["before"], report["after"])
    kl = [entry["kl"] for entry in report["history"]]
    assert len(kl) == 25 and sum(kl[-5:]) < sum(kl[:5]) * 0.8, kl
    # (the micro model agrees everywhere already: a constant guess; the KL above is what moves)
    assert report["after"]["mtp_agrees_with_main"] >= report["before"]["mtp_agrees_with_main"]
    for name, p in models.main.named_parameters():
        assert torch.equal(p, main_before[name]) and p.requires_grad, name
    assert any(not torch.equal(p, mtp_before[name]) for name, p in models.mtp.named_parameters())


def test_checkpoint_has_the_factory_layout_with_trained_mtp_tensors(trained):
    out, _ = trained
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    shapes = {}
    tensors = {}
    for path in safetensors_files(out):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
                shapes[name] = tuple(tensors[name].shape)
    expected = checkpoint_tensor_shapes(config)
    mtp = f"model.layers.{config['num_hidden_layers']}"
    # the MTP layer's own embedding is left out (the main one is meant); everything else as the factory names it
    assert shapes == {name: shape for name, shape in expected.items() if name != f"{mtp}.embed_tokens.weight"}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "mlp.gate.weight",
                 "mlp.experts.7.down_proj.weight", "self_attn.kv_b_proj.weight"):
        assert f"{mtp}.{name}" in tensors
    # trained with the output head shared, written as its own tensor
    assert torch.equal(tensors[f"{mtp}.shared_head.head.weight"], tensors["lm_head.weight"])


def test_checkpoint_loads_in_meshserve_and_hf_with_equal_logits(trained):
    out, _ = trained
    prompt = corpus.heldout_prompts(1, 24, seed=3)[0]
    model = load_model(out)
    harness = PagedHarness(model)
    tokens, logits = list(prompt), [harness.step([0], [prompt])[0]]
    for _ in range(6):  # greedy decode through the paged cache
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(harness.step([0], [[tokens[-1]]])[0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.inference_mode():
        reference = hf(torch.tensor([tokens])).logits[0]
    diff = (torch.cat(logits) - reference).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff}"


def test_mtp_reference_logits_predict_token_after_next(trained):
    out, _ = trained
    main, mtp = load_main_and_mtp(out)
    ids = corpus.heldout_prompts(1, 32, seed=4)[0]
    logits = mtp_reference_logits((main, mtp), ids)
    assert logits.shape == (31, main.config.vocab_size)
    # causal: row t depends on tokens up to t + 1 only
    assert torch.allclose(mtp_reference_logits((main, mtp), ids[:10]), logits[:9], atol=1e-4)
    assert torch.equal(mtp_reference_logits(out, ids), logits)


QWEN3_MICRO = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3_moe", QWEN3_MICRO | dict(moe_intermediate_size=32, num_experts=8)),
    ("qwen3", QWEN3_MICRO),
])
def test_other_architectures_train_into_loadable_checkpoints(arch, overrides, tmp_path):
    settings = trainer.settings_for(arch, "tiny", steps=3, seq_len=32, batch_size=4, eval_sequences=2,
                                    overrides=overrides)
    out = trainer.train(settings, tmp_path / arch, progress=False)
    report = json.loads((out / trainer.REPORT_FILE).read_text())
    assert "mtp_loss" not in report["trained"] and report["trained"]["loss"] < report["untrained"]["loss"]
    model = load_model(out)  # every parameter present, by the factory's names
    assert model.kv_cache_layout().num_layers == 2


def _train_two_steps(tmp_path: Path, seed: int) -> dict[str, torch.Tensor]:
    settings = micro_settings(steps=2, batch_size=4, eval_sequences=1, seed=seed)
    models = trainer.build_models(settings, tmp_path / f"run-{seed}-{len(list(tmp_path.iterdir()))}")
    trainer.run_training(models, corpus.load_corpus(), settings, progress=False)
    return models.checkpoint_tensors()


def test_same_seed_gives_identical_weights(tmp_path):
    first, second = _train_two_steps(tmp_path, 0), _train_two_steps(tmp_path, 0)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    other = _train_two_steps(tmp_path, 1)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])


def test_split_is_by_file_and_prompts_are_held_out():
    data = corpus.load_corpus()
    assert 0.02 < data.heldout_files / (data.heldout_files + data.train_files) < 0.08
    prompts = corpus.heldout_prompts(4, 16, seed=0)
    assert prompts == corpus.heldout_prompts(4, 16, seed=0) != corpus.heldout_prompts(4, 16, seed=1)
    heldout = data.heldout.tolist()
    for prompt in prompts:
        assert len(prompt) == 16
        assert any(heldout[i:i + 16] == prompt for i in range(len(heldout) - 15))


def test_ensure_trained_model_trains_once_then_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path))
    calls = []

    def fake_train(settings, out_dir, progress=True):
        calls.append((settings.arch, settings.preset))
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        report = {"settings": dataclasses.asdict(settings)}
        (out_dir / trainer.REPORT_FILE).write_text(json.dumps(report))
        return out_dir

    monkeypatch.setattr(cache, "train", fake_train)
    stale = tmp_path / "models" / ".qwen3-tiny-trained.partial-dead"
    stale.mkdir(parents=True)
    path = cache.ensure_trained_model("qwen3", "tiny")
    assert path == tmp_path / "models" / "qwen3-tiny-trained"
    assert cache.ensure_trained_model("qwen3", "tiny") == path
    assert calls == [("qwen3", "tiny")] and not stale.exists()
    # the preset's defaults changed since: the cached model is trained again
    monkeypatch.setitem(trainer.PRESET_DEFAULTS, "tiny", {**trainer.PRESET_DEFAULTS["tiny"], "steps": 7})
    assert cache.ensure_trained_model("qwen3", "tiny") == path
    assert calls == [("qwen3", "tiny")] * 2
    assert json.loads((path / trainer.REPORT_FILE).read_text())["settings"]["steps"] == 7


@pytest.mark.parametrize("argv,message", [
    (["train", "--arch", "llama", "--out", "x"], "unknown arch 'llama'"),
    (["train", "--cached", "--steps", "5"], "--cached trains with the preset's defaults"),
    (["train", "--steps", "0", "--out", "x"], "steps must be at least 1"),
    (["train", "--override", "nonsense_key=1", "--out", "x"], "unknown deepseek_v3 config key"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("meshserve train: error:") and message in err, err
    assert not (tmp_path / "x").exists()
