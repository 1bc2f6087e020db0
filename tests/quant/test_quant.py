"""`meshserve quantize`: W8A8 INT8 checkpoints in the compressed-tensors format (RTN and SmoothQuant + GPTQ)
of a very small DeepSeek-V3 (the tiny preset shrunk to 2 layers, 8 experts, hidden 64) trained for a few
dozen steps on the corpus; their layout and W8A8 math, the quality evaluator, HF transformers (with the
compressed-tensors package) loading them, and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from meshserve.entrypoints.cli import main as cli_main
from meshserve.models import compressed_tensors as ct
from meshserve.quant import hf
from meshserve.quant.evaluate import quality
from meshserve.quant.gptq import hessian, quantize_gptq, search_clip
from meshserve.quant.int8 import quantize_weight
from meshserve.quant.pipeline import REPORT_FILE, quantize
from meshserve.quant.smoothquant import Consumer, search_alpha
from meshserve.train import trainer
from meshserve.train.corpus import heldout_batches, load_corpus, train_batches
from meshserve.utils.checkpoint_files import safetensors_files

MICRO = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
             q_lora_rank=32, kv_lora_rank=32, num_attention_heads=4, num_key_value_heads=4)
PROMPTS = [[0, 1204, 58, 977, 3021], [0, 44, 45, 46], [0, 9000, 13, 250, 251, 7, 8]]


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A non-random model: quantization quality means little on random weights."""
    settings = trainer.settings_for("deepseek_v3", "tiny", steps=30, seq_len=32, batch_size=8, lr=3e-3,
                                    eval_sequences=8, mtp_distill_steps=0, overrides=MICRO)
    return trainer.train(settings, tmp_path_factory.mktemp("train") / "micro", progress=False)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def quantized(source, corpus, tmp_path_factory) -> dict[str, Path]:
    """The tiny model quantized with RTN and with SmoothQuant + GPTQ (16 windows of 64 corpus tokens)."""
    calibration = next(train_batches(corpus, 16, 64, seed=1))
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for method in ("rtn", "smoothquant-gptq"):
        quantize(source, root / method, method, calibration, progress=False, min_expert_tokens=16)
        out[method] = root / method
    return out


# ---------------------------------------------------------------------------------------------
# the format


def test_quantization_config_is_the_compressed_tensors_w8a8_scheme_and_parses_back(source):
    config = json.loads((source / "config.json").read_text())
    q = ct.build_quantization_config(config)
    group = q["config_groups"]["group_0"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == ("compressed-tensors", "int-quantized",
                                                                           "compressed")
    assert group["targets"] == ["Linear"]
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == \
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    assert {k: group["input_activations"][k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == \
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    spec = ct.read_quantization_config(ct.quantized_config(config))
    mtp = config["num_hidden_layers"]
    for name, expected in [("lm_head", True), ("model.layers.0.self_attn.q_a_proj", True),
                           ("model.layers.0.self_attn.kv_a_proj_with_mqa", True),
                           ("model.layers.0.mlp.down_proj", True), ("model.layers.1.mlp.experts.7.up_proj", True),
                           ("model.layers.1.mlp.shared_experts.gate_proj", True),
                           ("model.layers.0.self_attn.kv_b_proj", False), ("model.layers.1.mlp.gate", False),
                           (f"model.layers.{mtp}.eh_proj", False), (f"model.layers.{mtp}.self_attn.o_proj", False)]:
        assert spec.is_quantized(name) is expected, name
        assert ct.is_quantized_module(config, name) is expected, name
    # the compressed-tensors package reads the same config the same way
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(q)
    assert parsed.config_groups["group_0"].weights.strategy == "channel" and parsed.ignore == q["ignore"]


def test_read_quantization_config_refuses_other_schemes():
    assert ct.read_quantization_config({"model_type": "deepseek_v3"}) is None
    assert ct.read_quantization_config({"quantization_config": {"quant_method": "fp8"}}) is None
    base = {"num_hidden_layers": 2}
    good = ct.build_quantization_config(base)
    for path, value, words in [(("weights", "symmetric"), False, "symmetric"),
                               (("weights", "strategy"), "group", "strategy"),
                               (("input_activations", "dynamic"), False, "dynamic"),
                               (("weights", "num_bits"), 4, "num_bits")]:
        bad = json.loads(json.dumps(good))
        bad["config_groups"]["group_0"][path[0]][path[1]] = value
        with pytest.raises(ValueError, match=words):
            ct.read_quantization_config({"quantization_config": bad})
    bad = json.loads(json.dumps(good)) | {"format": "pack-quantized"}
    with pytest.raises(ValueError, match="format"):
        ct.read_quantization_config({"quantization_config": bad})


# ---------------------------------------------------------------------------------------------
# the algorithms on synthetic data


def test_gptq_and_clipping_beat_rounding_on_correlated_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 128, generator=g) @ (0.3 * torch.randn(128, 128, generator=g)) \
        + 2 * torch.randn(128, generator=g)
    w = torch.randn(2, 64, 128, generator=g)
    w[:, :, 0] *= 8  # an outlier column, where clipping and error feedback pay
    h = torch.stack([hessian(x)] * 2)
    codes, scale, clip = quantize_gptq(w, h)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= 127 and scale.shape == (2, 64, 1)
    assert bool((clip <= 1).all()) and bool((clip < 1).any())
    for b in range(2):
        ref = x @ w[b].T
        rtn_codes, rtn_scale = quantize_weight(w[b])
        rtn_err = (x @ (rtn_codes.float() * rtn_scale).T - ref).pow(2).sum()
        gptq_err = (x @ (codes[b].float() * scale[b]).T - ref).pow(2).sum()
        assert gptq_err < 0.7 * rtn_err, (gptq_err, rtn_err)
    assert torch.equal(search_clip(w, h, (1.0,)), torch.ones(2, 64))


def test_smoothquant_search_moves_activation_outliers_into_the_weights():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=g)
    x[:, 3] *= 50  # an outlier channel: per-token int8 loses the others without smoothing
    consumers = [Consumer("a", torch.randn(32, 64, generator=g)), Consumer("b", torch.randn(16, 64, generator=g))]
    alpha, s, info = search_alpha(x, consumers)
    assert alpha is not None and 0 < alpha <= 1 and s.shape == (64,)
    assert info["errors"][f"{alpha:.2f}"] < info["errors"]["none"] / 2
    assert float(s[3]) > float(s.median()) * 3


# ---------------------------------------------------------------------------------------------
# the checkpoint


def test_checkpoint_layout_int8_weights_float_exceptions_and_copied_files(source, quantized):
    config = json.loads((source / "config.json").read_text())
    src = _tensors(source)
    for method, out in quantized.items():
        out_config = json.loads((out / "config.json").read_text())
        assert out_config["quantization_config"] == ct.build_quantization_config(config)
        assert {k: v for k, v in out_config.items() if k != "quantization_config"} == config
        tensors = _tensors(out)
        quantized_names = {n.removesuffix(".weight") for n in src
                           if n.endswith(".weight") and ct.is_quantized_module(config, n.removesuffix(".weight"))}
        assert set(tensors) == set(src) | {f"{m}.weight_scale" for m in quantized_names}
        assert "lm_head" in quantized_names and "model.layers.1.mlp.experts.7.down_proj" in quantized_names
        for module in quantized_names:
            weight, scale = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"]
            assert weight.dtype == torch.int8 and weight.shape == src[f"{module}.weight"].shape
            assert scale.dtype == torch.float32 and scale.shape == (weight.shape[0], 1)
            assert int(weight.abs().max()) <= 127 and bool((scale > 0).all())
        for name, tensor in src.items():
            if name.removesuffix(".weight") in quantized_names:
                continue
            assert tensors[name].dtype == tensor.dtype, name
            if name.startswith(f"model.layers.{config['num_hidden_layers']}.") or method == "rtn":
                assert torch.equal(tensors[name], tensor), name  # MTP layer (and everything under RTN) unchanged
        for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (out / side).read_bytes() == (source / side).read_bytes()
        report = json.loads((out / REPORT_FILE).read_text())
        assert report["method"] == method and report["quantized_linears"] == len(quantized_names)
    # RTN is plain absmax rounding of the original weights
    rtn = _tensors(quantized["rtn"])
    for module in ("model.layers.0.self_attn.q_a_proj", "model.layers.1.mlp.experts.3.gate_proj", "lm_head"):
        codes, scale = quantize_weight(src[f"{module}.weight"])
        assert torch.equal(rtn[f"{module}.weight"], codes) and torch.equal(rtn[f"{module}.weight_scale"], scale)
    # SmoothQuant rewrote norms and the router (columns), and kv_b_proj's value rows for o_proj
    sq = _tensors(quantized["smoothquant-gptq"])
    assert not torch.equal(sq["model.layers.1.post_attention_layernorm.weight"],
                           src["model.layers.1.post_attention_layernorm.weight"])


def test_smoothing_is_exact_where_weights_stay_float(source, quantized):
    """SmoothQuant divides post_attention_layernorm by s and multiplies every consumer's columns by s: the
    float router among them, so norm * router is what it was and the routing sees the same logits."""
    config = json.loads((source / "config.json").read_text())
    src, sq = _tensors(source), _tensors(quantized["smoothquant-gptq"])
    changed = 0
    for layer in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        norm = f"model.layers.{layer}.post_attention_layernorm.weight"
        router = f"model.layers.{layer}.mlp.gate.weight"
        changed += not torch.equal(sq[norm], src[norm])
        torch.testing.assert_close(sq[norm][None, :] * sq[router], src[norm][None, :] * src[router],
                                   rtol=1e-5, atol=1e-7)
        assert torch.equal(sq[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"],
                           src[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])
    assert changed > 0


def test_quality_smoothquant_gptq_beats_rtn(source, quantized, corpus):
    batches = heldout_batches(corpus, 8, 64, 8)
    results = {method: quality(source, out, batches) for method, out in quantized.items()}
    print(json.dumps(results, indent=1))
    rtn, best = results["rtn"], results["smoothquant-gptq"]
    assert rtn["reference_perplexity"] == best["reference_perplexity"]
    for r in results.values():
        assert 0.5 < r["top1_agreement"] <= 1 and r["kl"] > 0 and r["tokens"] == 8 * 64
    assert best["kl"] < rtn["kl"] and best["top1_agreement"] >= rtn["top1_agreement"]
    # texts work too (tokenized with the model's tokenizer)
    text = quality(source, quantized["rtn"], ["def f(x):\n    return x + 1\n" * 8], seq_len=32)
    assert text["tokens"] > 32


# ---------------------------------------------------------------------------------------------
# HF transformers + compressed-tensors


def _ct_activation_convention(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own simulation of a symmetric per-token int8 activation (scale absmax / 127.5,
    codes -128..127); the W8A8 kernels use absmax / 127 and -127..127."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.5
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.clamp(torch.round(xf / scale), -128, 127) * scale).to(x.dtype)


def test_transformers_loads_the_checkpoint_and_decodes_the_same_greedy_tokens(quantized, tiny_model, tmp_path,
                                                                             monkeypatch):
    pytest.importorskip("compressed_tensors")
    from meshserve.quant.transformers_compat import load_in_transformers

    out = quantized["smoothquant-gptq"]
    theirs = load_in_transformers(out).eval()
    layer = theirs.model.layers[0].self_attn.q_a_proj
    assert getattr(layer, "quantization_scheme", None) is not None  # compressed-tensors runs this Linear
    assert getattr(theirs.model.layers[0].self_attn.kv_b_proj, "quantization_scheme", None) is None  # ignored
    ours, _, _ = hf.load_model(out)
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            want = ours.generate(ids, max_new_tokens=8, do_sample=False)
            got = theirs.generate(ids, max_new_tokens=8, do_sample=False)
            assert got.tolist() == want.tolist(), prompt
    # The same math to float precision once compressed-tensors' own simulation is taken on our side: its
    # per-token activation scale (absmax / 127.5, codes -128..127; the W8A8 kernels use absmax / 127 and
    # -127..127), and no activation quantization inside the fused experts, which transformers runs on plain
    # dequantized weights.
    monkeypatch.setattr(hf, "fake_quantize_activation", _ct_activation_convention)
    for module in hf.experts_modules(ours).values():
        module.w8a8 = False
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1] + PROMPTS[2]])
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert float((a - b).abs().max()) < 1e-3 * float(a.abs().max()), float((a - b).abs().max())
    # and on the random tiny model (4 layers, 16 experts), whose greedy continuations vary
    random_out = tmp_path / "tiny-rtn"
    quantize(tiny_model(), random_out, "rtn", progress=False)
    theirs = load_in_transformers(random_out).eval()
    ours, _, _ = hf.load_model(random_out)
    for module in hf.experts_modules(ours).values():
        module.w8a8 = False
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            want = ours.generate(ids, max_new_tokens=8, do_sample=False)
            assert theirs.generate(ids, max_new_tokens=8, do_sample=False).tolist() == want.tolist(), prompt
            assert len(set(want[0, len(prompt):].tolist())) > 2


def test_transformers_alone_stops_at_int8_experts_dense_layers_load(quantized, tiny_model, tmp_path, monkeypatch):
    """Why `load_in_transformers` exists: transformers 5.23 merges per-expert checkpoint tensors into fused
    experts after dequantizing them, and that step has branches for FP8 pairs and packed ints only; the
    int-quantized W8A8 experts fall through and the load stops. A model without routed experts loads as is."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    with pytest.raises(RuntimeError, match="conversion"):
        AutoModelForCausalLM.from_pretrained(str(quantized["rtn"]), dtype=torch.float32)
    dense_source = tiny_model(overrides=MICRO | {"first_k_dense_replace": 2}, name="dense")
    quantize(dense_source, tmp_path / "dense", "rtn", progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense"), dtype=torch.float32).eval()
    monkeypatch.setattr(hf, "fake_quantize_activation", _ct_activation_convention)
    ours, _, _ = hf.load_model(tmp_path / "dense")
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            assert theirs.generate(ids, max_new_tokens=6, do_sample=False).tolist() == \
                ours.generate(ids, max_new_tokens=6, do_sample=False).tolist()
        ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert float((a - b).abs().max()) < 1e-3 * float(a.abs().max())


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_quantizes_from_a_text_file_and_rejects_bad_input(source, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text("import os\n\ndef main(argv):\n    return len(argv) + 1\n" * 40)
    out = tmp_path / "sq"
    assert cli_main(["quantize", "--model", str(source), "--out", str(out), "--method", "smoothquant",
                     "--calibration", str(text), "--samples", "4", "--seq-len", "32", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert '"method": "smoothquant"' in printed and str(out) in printed
    assert ct.read_quantization_config(json.loads((out / "config.json").read_text())) is not None

    for argv, words in [(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "does not exist"),
                        (["--model", str(source), "--out", str(out)], "not empty"),
                        (["--model", str(source), "--out", str(tmp_path / "y"), "--calibration",
                          str(tmp_path / "missing.txt")], "missing.txt"),
                        (["--model", str(out), "--out", str(tmp_path / "z"), "--method", "rtn"], "already quantized"),
                        (["--model", str(source), "--out", str(tmp_path / "w"), "--samples", "0"], "--samples")]:
        assert cli_main(["quantize", *argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_api_takes_a_token_stream_windows_or_texts_and_overwrites_only_checkpoints(source, corpus, tmp_path):
    from meshserve.quant import api

    stream = corpus.train[:20000]
    windows = api.calibration_tokens(source, stream, samples=4, seq_len=32, seed=3)
    assert windows.shape == (4, 32) and torch.equal(windows, api.calibration_tokens(source, stream, 4, 32, 3))
    assert torch.equal(api.calibration_tokens(source, windows), windows)
    texts = api.calibration_tokens(source, ["def f():\n    pass\n" * 50], samples=2, seq_len=16)
    assert texts.shape == (2, 16)
    out = tmp_path / "q"
    api.quantize(source, out, "smoothquant", stream, calibration_samples=4, seq_len=32, progress=False)
    with pytest.raises(FileExistsError):
        api.quantize(source, out, "rtn", progress=False)
    report = api.quantize(source, out, "rtn", overwrite=True, progress=False)
    assert report["method"] == "rtn" and json.loads((out / REPORT_FILE).read_text())["method"] == "rtn"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a model directory"):
        api.quantize(source, tmp_path / "other", "rtn", overwrite=True, progress=False)
    with pytest.raises(ValueError, match="calibration"):
        api.quantize(source, tmp_path / "none", "smoothquant-gptq", progress=False)
