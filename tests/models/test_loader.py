"""The safetensors loader: single and sharded checkpoints, config handling, name filtering, clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from meshserve.layers.metadata import AttentionMetadata
from meshserve.models import loader
from meshserve.models.loader import iter_safetensors, load_hf_config, load_model, resolve_dtype
from meshserve.models.qwen3_moe import Qwen3MoeForCausalLM
from meshserve.models.registry import UnsupportedModelError
from meshserve.utils.checkpoint_files import INDEX_FILE
from tests.models.qwen3_checkpoints import hf_logits, make_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random Qwen3-MoE weights saved as one file and as several shards."""
    single = tmp_path_factory.mktemp("single")
    reference = make_checkpoint(single, moe=True, seed=5, mlp_only_layers=[0])
    sharded = tmp_path_factory.mktemp("sharded")
    reference.save_pretrained(sharded, max_shard_size="40KB")
    return single, sharded, reference


def shard_files(path):
    return sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))


@torch.inference_mode()
def prefill_logits(model, tokens):
    meta = AttentionMetadata.build([len(tokens)], [0], [list(range(4))], block_size=8)
    caches = model.kv_cache_layout().allocate(num_blocks=4, block_size=8)
    return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)), meta, caches))


def test_sharded_checkpoint_loads_like_single_file(checkpoints):
    single, sharded, reference = checkpoints
    assert not (single / INDEX_FILE).exists()
    assert len(shard_files(sharded)) >= 3
    a, b = load_model(single), load_model(sharded)
    assert not a.training and not b.training
    names = [name for name, _ in iter_safetensors(sharded)]
    assert len(names) == len(set(names)) and set(names) == {name for name, _ in iter_safetensors(single)}
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    tokens = [5, 17, 250, 499, 3, 42]
    assert (prefill_logits(b, tokens) - hf_logits(reference, tokens)).abs().max().item() <= 1e-3


def test_missing_shard_is_named(checkpoints, tmp_path):
    _, sharded, _ = checkpoints
    for f in sharded.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    gone = shard_files(tmp_path)[1]
    (tmp_path / gone).unlink()
    with pytest.raises(FileNotFoundError, match=gone):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match=gone):
        next(iter_safetensors(tmp_path))


def test_missing_weights_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        next(iter_safetensors(tmp_path))


def test_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_config(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    config = tmp_path / "config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(tmp_path)
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_hf_config(tmp_path)
    config.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type"):
        load_hf_config(tmp_path)
    config.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    assert load_hf_config(tmp_path) == {"model_type": "qwen3", "hidden_size": 8}


def test_unknown_model_type(checkpoints, tmp_path):
    single, _, _ = checkpoints
    config = json.loads((single / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "not_a_model"}))
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'not_a_model'.*qwen3_moe"):
        load_model(tmp_path)


loader_safe_open = loader.safe_open


class RecordingSafeOpen:
    """Wraps safetensors.safe_open and records which tensors were actually read."""

    read: list[str] = []

    def __init__(self, *args, **kwargs):
        self._inner = loader_safe_open(*args, **kwargs)

    def __enter__(self):
        self._file = self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def keys(self):
        return self._file.keys()

    def get_tensor(self, name):
        RecordingSafeOpen.read.append(name)
        return self._file.get_tensor(name)


def test_name_filter_is_asked_before_any_tensor_is_read(checkpoints, monkeypatch):
    _, sharded, _ = checkpoints
    monkeypatch.setattr(loader, "safe_open", RecordingSafeOpen)
    RecordingSafeOpen.read = []
    asked = []

    def only_layer_1(name):
        asked.append(name)
        return ".layers.1." in name

    kept = dict(iter_safetensors(sharded, name_filter=only_layer_1))
    assert RecordingSafeOpen.read == list(kept)  # rejected tensors were never read
    all_names = {name for name, _ in iter_safetensors(sharded)}
    assert set(asked) == all_names
    assert kept and set(kept) == {n for n in all_names if ".layers.1." in n}


def test_every_parameter_must_be_provided(checkpoints):
    single, _, _ = checkpoints
    with pytest.raises(ValueError, match=r"did not provide 1 parameter\(s\): model.norm.weight"):
        load_model(single, name_filter=lambda name: name != "model.norm.weight")
    # dropping one expert's tensor leaves that layer's stacked expert weights incomplete
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.w2"):
        load_model(single, name_filter=lambda name: "layers.1.mlp.experts.3.down_proj" not in name)


def test_post_loading_hook_runs_after_weights(checkpoints, monkeypatch):
    single, _, reference = checkpoints
    seen = {}

    class WithHook(Qwen3MoeForCausalLM):
        def process_weights_after_loading(self):
            seen["norm"] = self.model.norm.weight.detach().clone()

    monkeypatch.setattr(loader, "model_class", lambda model_type: WithHook)
    load_model(single)
    assert torch.equal(seen["norm"], reference.model.norm.weight.detach())


def test_dtypes(checkpoints):
    single, _, reference = checkpoints
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype(torch.bfloat16) is torch.bfloat16
    assert resolve_dtype("auto", {"dtype": "bfloat16"}) is torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float16"}) is torch.float16
    assert resolve_dtype("auto", {}) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8")

    model = load_model(single, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.kv_cache_layout().dtype == torch.bfloat16
    tokens = [7, 8, 9, 10]
    logits = prefill_logits(model, tokens)
    assert logits.dtype == torch.float32
    # bf16 is coarse, but it must still be the same function
    expected = hf_logits(reference, tokens)
    assert (logits - expected).abs().max().item() < 0.1 * expected.abs().max().item()
    assert load_model(single, dtype="auto").lm_head.weight.dtype == torch.float32  # config says float32
