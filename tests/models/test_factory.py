"""Random HF-format checkpoints: layout against transformers, determinism, sharding, numerics, tokenizer."""
from __future__ import annotations

import argparse
import json
import logging
import re
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from meshserve.models import factory
from meshserve.models import tokenizer_assets as tok
from meshserve.models.factory import (
    ARCHITECTURES,
    PRESET_NAMES,
    checkpoint_tensor_shapes,
    count_parameters,
    ensure_default_model,
    make_model,
    preset_config,
)

TWO_LAYERS = {"num_hidden_layers": 2}
PROMPT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "The quick brown fox jumps over the lazy dog, and then it sleeps."
)


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = f.get_tensor(name)
    return tensors


def hf_saved_shapes(config: dict, tmp_path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names/shapes that transformers itself writes for `config` (its own init, its own save)."""
    config_dir = tmp_path / "hf-config"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    model.save_pretrained(tmp_path / "hf-saved")
    return {name: tuple(t.shape) for name, t in read_checkpoint(tmp_path / "hf-saved").items()}


@pytest.fixture(scope="module")
def two_layer_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(arch, "tiny", root / arch, overrides=TWO_LAYERS) for arch in ARCHITECTURES}


# --- layout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch, overrides", [
    ("deepseek_v3", TWO_LAYERS),
    ("deepseek_v3", {**TWO_LAYERS, "q_lora_rank": None, "attention_bias": True}),
    ("qwen3_moe", {**TWO_LAYERS, "mlp_only_layers": [1]}),
    ("qwen3", {**TWO_LAYERS, "tie_word_embeddings": True}),
])
def test_tensor_layout_matches_what_transformers_saves(arch, overrides, tmp_path):
    config = preset_config(arch, "tiny", overrides)
    assert checkpoint_tensor_shapes(config, include_mtp=False) == hf_saved_shapes(config, tmp_path)


def test_deepseek_layout_has_per_expert_and_mtp_tensors():
    config = preset_config("deepseek_v3", "tiny")
    shapes = checkpoint_tensor_shapes(config)
    hidden, vocab, experts = config["hidden_size"], config["vocab_size"], config["n_routed_experts"]
    mtp = f"model.layers.{config['num_hidden_layers']}"
    assert shapes[f"{mtp}.eh_proj.weight"] == (hidden, 2 * hidden)
    assert shapes[f"{mtp}.embed_tokens.weight"] == shapes[f"{mtp}.shared_head.head.weight"] == (vocab, hidden)
    for name in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
        assert shapes[f"{mtp}.{name}.weight"] == (hidden,)
    assert f"{mtp}.mlp.gate.e_score_correction_bias" in shapes
    assert "model.layers.0.mlp.experts.0.up_proj.weight" not in shapes  # first_k_dense_replace = 1
    expert_names = {n for n in shapes if re.fullmatch(r"model\.layers\.1\.mlp\.experts\.\d+\.gate_proj\.weight", n)}
    assert len(expert_names) == experts
    assert not any(f"model.layers.{config['num_hidden_layers'] + 1}." in n for n in shapes)


def test_deepseek_small_parameter_count_matches_transformers():
    config = preset_config("deepseek_v3", "small")
    counted = count_parameters(config)
    assert 150e6 <= counted <= 250e6
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert counted == sum(t.numel() for t in model.state_dict().values())  # incl. e_score_correction_bias
    assert count_parameters(config, include_mtp=True) > counted


# --- writing --------------------------------------------------------------------------------


def test_same_arguments_give_byte_identical_files(tmp_path):
    first = make_model("deepseek_v3", "tiny", tmp_path / "a", seed=7, overrides=TWO_LAYERS)
    second = make_model("deepseek_v3", "tiny", tmp_path / "b", seed=7, overrides=TWO_LAYERS)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert "model.safetensors" in names
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other_seed = make_model("deepseek_v3", "tiny", tmp_path / "c", seed=8, overrides=TWO_LAYERS)
    assert (other_seed / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_small_shard_limit_writes_index_and_shards_with_the_same_tensors(tmp_path, two_layer_models):
    max_shard_bytes = 8 * 2**20
    sharded = make_model("qwen3", "tiny", tmp_path / "sharded", overrides=TWO_LAYERS, max_shard_bytes=max_shard_bytes)
    shard_files = sorted(sharded.glob("*.safetensors"))
    assert len(shard_files) >= 3
    assert not (sharded / "model.safetensors").exists()
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shard_files):05d}\.safetensors", p.name) for p in shard_files)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    expected_names = set(checkpoint_tensor_shapes(preset_config("qwen3", "tiny", TWO_LAYERS)))
    assert set(index["weight_map"]) == expected_names
    for path in shard_files:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
        assert keys == {n for n, file in index["weight_map"].items() if file == path.name}
        assert len(keys) == 1 or path.stat().st_size <= max_shard_bytes + 2**16  # header slack
    tensors = read_checkpoint(sharded)  # asserts every name is stored once
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    unsharded = read_checkpoint(two_layer_models["qwen3"])
    assert tensors.keys() == unsharded.keys()
    assert all(torch.equal(tensors[n], unsharded[n]) for n in tensors)


def test_overrides_change_the_weights_and_dtype(tmp_path):
    model_dir = make_model("deepseek_v3", "tiny", tmp_path / "m",
                           overrides={"num_hidden_layers": 1, "q_lora_rank": None, "torch_dtype": "bfloat16"})
    config = json.loads((model_dir / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["q_lora_rank"] is None and config["num_hidden_layers"] == 1
    tensors = read_checkpoint(model_dir)
    assert set(tensors) == set(checkpoint_tensor_shapes(config))
    assert "model.layers.0.self_attn.q_proj.weight" in tensors
    assert "model.layers.1.eh_proj.weight" in tensors  # MTP follows the new layer count
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32  # HF keeps it fp32


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(factory, "_write_weights", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        make_model("qwen3", "tiny", tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_a_non_empty_directory(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        make_model("qwen3", "tiny", tmp_path / "m")
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["notes.txt"]


def test_bad_names_and_keys_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="deepseek_v3, qwen3_moe, qwen3"):
        make_model("llama", "tiny", tmp_path / "m")
    with pytest.raises(ValueError, match="tiny, small"):
        make_model("qwen3", "huge", tmp_path / "m")
    with pytest.raises(ValueError, match="num_hidden_layer"):
        preset_config("qwen3", "tiny", {"num_hidden_layer": 2})
    with pytest.raises(ValueError, match="n_group"):
        preset_config("deepseek_v3", "tiny", {"n_group": 3})
    with pytest.raises(ValueError, match="torch_dtype"):
        preset_config("qwen3", "tiny", {"torch_dtype": "int8"})
    assert not (tmp_path / "m").exists()


def test_cli_writes_model_or_prints_one_error_line(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    factory.add_make_model_arguments(parser)
    args = parser.parse_args(["--arch", "qwen3", "--preset", "tiny", "--out", str(tmp_path / "m"),
                              "--seed", "3", "--dtype", "bfloat16"])
    assert factory.make_model_main(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["torch_dtype"] == "bfloat16"

    bad = parser.parse_args(["--arch", "gpt2", "--out", str(tmp_path / "n")])
    assert factory.make_model_main(bad) != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "gpt2" in err and "deepseek_v3" in err


# --- HF loads it, and the random model is numerically pleasant -------------------------------


def _preferred_expert_lead(arch: str, router_logits: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per token: top-1 score minus the median expert's score, and the lead that counts as clear."""
    if arch == "deepseek_v3":  # sigmoid scores in (0, 1)
        scores = router_logits.sigmoid()
        clear_lead = 0.2
    else:  # softmax probabilities: the top expert should take several times a uniform share
        scores = router_logits.softmax(-1)
        clear_lead = 4.0 / scores.shape[-1]
    return scores.max(-1).values - scores.median(-1).values, clear_lead


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transformers_loads_checkpoint_and_numerics_are_pleasant(arch, two_layer_models):
    model_dir = two_layer_models[arch]
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    num_layers = model.config.num_hidden_layers
    assert all(key.startswith(f"model.layers.{num_layers}.") for key in info["unexpected_keys"])  # only MTP
    assert bool(info["unexpected_keys"]) == (arch == "deepseek_v3")
    stored = read_checkpoint(model_dir)
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])

    router_logits: list[torch.Tensor] = []
    hooks = [module.register_forward_hook(lambda _m, _i, out: router_logits.append(out[0]))
             for name, module in model.named_modules() if name.endswith("mlp.gate")]
    input_ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True)
    for hook in hooks:
        hook.remove()

    for hidden in out.hidden_states:  # embeddings, every layer, final norm
        rms = hidden.pow(2).mean(-1).sqrt()
        assert 0.5 < rms.min() and rms.max() < 4.0
    logits = out.logits[0]
    assert 2.0 < logits.std() < 4.0
    top2 = logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    assert margins.median() > 0.5 and margins.min() > 1e-3

    assert len(router_logits) == (0 if arch == "qwen3" else 1)
    for layer_router_logits in router_logits:
        lead, clear_lead = _preferred_expert_lead(arch, layer_router_logits)
        assert (lead > clear_lead).float().mean() > 0.9
        # Different tokens choose different experts.
        chosen = layer_router_logits.topk(model.config.num_experts_per_tok, dim=-1).indices
        assert chosen.unique().numel() >= layer_router_logits.shape[-1] // 2

    for name, tensor in stored.items():
        if name.endswith("norm.weight"):
            assert abs(tensor.mean() - 1) < 0.1 and 0.03 < tensor.std() < 0.3, name
        if name.endswith("e_score_correction_bias"):
            assert 0 < tensor.abs().max() < 0.1, name


# --- tokenizer and chat template ---------------------------------------------------------------


def test_committed_tokenizer_round_trips_text(two_layer_models):
    assert tok.TOKENIZER_FILE.stat().st_size < 3 * 2**20
    tokenizer = AutoTokenizer.from_pretrained(two_layer_models["qwen3"])
    assert len(tokenizer) == tok.VOCAB_SIZE
    assert [tokenizer.convert_tokens_to_ids(t) for t in tok.SPECIAL_TOKENS] == list(range(len(tok.SPECIAL_TOKENS)))
    assert tokenizer.eos_token == tok.EOS_TOKEN and tokenizer.pad_token == tok.PAD_TOKEN
    for text in [PROMPT, "naïve café — ünïcödé", "数学 と ひらがな 🚀🧪", "tabs\tand\r\nnewlines\n\n  x", ""]:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(ids[1:]) == text
    with_specials = f"{tok.USER_TOKEN}\nhi{tok.END_OF_TURN_TOKEN}"
    ids = tokenizer(with_specials, add_special_tokens=False).input_ids
    ids_by_token = tok.special_token_ids()
    assert ids[0] == ids_by_token[tok.USER_TOKEN] and ids[-1] == ids_by_token[tok.END_OF_TURN_TOKEN]
    assert tokenizer.decode(ids) == with_specials
    assert len(tokenizer("def __init__(self):\n        return None").input_ids) < 16  # BPE learned code


def test_chat_template_renders_turns_with_role_tokens(two_layer_models):
    tokenizer = AutoTokenizer.from_pretrained(two_layer_models["deepseek_v3"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Count "}, {"type": "text", "text": "to 3."}]},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turns = "".join(f"<|{role}|>\n{text}{tok.END_OF_TURN_TOKEN}" for role, text in
                    [("system", "Be brief."), ("user", "Hi there"), ("assistant", "Hello!"), ("user", "Count to 3.")])
    assert rendered == tok.BOS_TOKEN + turns + tok.ASSISTANT_TOKEN + "\n"
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without_prompt == tok.BOS_TOKEN + turns

    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, return_dict=False)
    special = tok.special_token_ids()
    assert ids[0] == special[tok.BOS_TOKEN] and ids.count(special[tok.BOS_TOKEN]) == 1
    assert ids.count(special[tok.END_OF_TURN_TOKEN]) == 2
    assert ids[-2:] == [special[tok.ASSISTANT_TOKEN], tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\n"))[0]]
    with pytest.raises(Exception, match="critic"):
        tokenizer.apply_chat_template([{"role": "critic", "content": "x"}], tokenize=False)
    tool_result = tokenizer.apply_chat_template([{"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                                                tokenize=False)
    assert tool_result == tok.BOS_TOKEN + "<|user|>\n<tool_result>sunny</tool_result>" + tok.END_OF_TURN_TOKEN

    generation = json.loads((two_layer_models["deepseek_v3"] / "generation_config.json").read_text())
    config = json.loads((two_layer_models["deepseek_v3"] / "config.json").read_text())
    assert config["eos_token_id"] == special[tok.EOS_TOKEN]
    assert generation["eos_token_id"] == [special[tok.EOS_TOKEN], special[tok.END_OF_TURN_TOKEN]]
    tokenizer_config = json.loads((two_layer_models["deepseek_v3"] / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]


def test_tokenizer_training_is_reproducible(tmp_path, monkeypatch):
    corpus = tok.stdlib_corpus_files()
    assert len(corpus) > 100 and corpus == sorted(corpus, key=lambda p: p.as_posix())
    # A slice of the corpus and a small vocab keep this fast; the pipeline is the one that built the asset.
    monkeypatch.setattr(tok, "stdlib_corpus_files", lambda: corpus[:40])
    first = tok.train_tokenizer(tmp_path / "a" / "tokenizer.json", vocab_size=2000)
    second = tok.train_tokenizer(tmp_path / "b" / "tokenizer.json", vocab_size=2000)
    assert first.read_bytes() == second.read_bytes()
    from tokenizers import Tokenizer

    trained = Tokenizer.from_file(str(first))
    assert trained.get_vocab_size() == 2000
    assert all(trained.token_to_id(t) == i for t, i in tok.special_token_ids().items())
    assert trained.decode(trained.encode(PROMPT).ids) == PROMPT


# --- default model cache -----------------------------------------------------------------------


def test_ensure_default_model_writes_once_and_reuses(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    assert factory.default_cache_dir() == tmp_path / "cache"
    calls = []
    real_make_model = factory.make_model
    monkeypatch.setattr(factory, "make_model", lambda *a, **k: calls.append(a) or real_make_model(*a, **k))

    crashed_writer_leftover = tmp_path / "cache" / "models" / ".qwen3-tiny.partial-0123456789ab"
    crashed_writer_leftover.mkdir(parents=True)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model("qwen3", "tiny")))
               for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="meshserve.models.factory"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        again = ensure_default_model("qwen3", "tiny")
    expected = tmp_path / "cache" / "models" / "qwen3-tiny"
    assert results == [expected, expected] and again == expected
    assert len(calls) == 1
    assert "reusing" in caplog.text
    assert sorted(p.name for p in expected.parent.iterdir() if not p.name.endswith(".lock")) == ["qwen3-tiny"]
    assert AutoConfig.from_pretrained(expected).model_type == "qwen3"


def test_default_cache_dir_falls_back_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("MESHSERVE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert factory.default_cache_dir() == tmp_path / ".cache" / "meshserve"


def test_presets_cover_every_arch_and_size():
    assert set(factory.PRESETS) == set(ARCHITECTURES)
    for arch in ARCHITECTURES:
        assert set(factory.PRESETS[arch]) == set(PRESET_NAMES)
        tiny, small = (count_parameters(preset_config(arch, p)) for p in PRESET_NAMES)
        assert tiny < small


def test_a_cached_default_model_takes_the_current_chat_template(tmp_path):
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{{ messages }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok.follow_chat_template(tmp_path)
    updated = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert updated == {**config, "chat_template": tok.chat_template()}
