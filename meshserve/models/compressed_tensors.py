"""INT8 W8A8 checkpoints in the compressed-tensors format (the one vLLM and llm-compressor use).

The contract, written by `meshserve quantize` and read by the loader through `read_quantization_config`:

config.json gains

    "quantization_config": {
      "quant_method": "compressed-tensors",
      "format": "int-quantized",
      "quantization_status": "compressed",
      "config_groups": {"group_0": {
          "targets": ["Linear"],
          "weights": {"num_bits": 8, "type": "int", "symmetric": true, "group_size": null,
                      "strategy": "channel", "dynamic": false},
          "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "group_size": null,
                                "strategy": "token", "dynamic": true},
          "output_activations": null, "format": null}},
      "ignore": [...],  # the Linear modules kept in float (below)
      "kv_cache_scheme": null, "global_compression_ratio": null}

and for each quantized linear `X` the checkpoint holds `X.weight` (int8, [out, in]) and `X.weight_scale`
(float32, [out, 1]); no zero point (symmetric). The float weight is `weight * weight_scale` (per output
channel); at run time each input row (token) is quantized to int8 with its own absmax / 127 scale, the
matmul accumulates in int32 and the output is `acc * x_scale * weight_scale`.

Quantized: every `*_proj` linear of the decoder layers (attention q/k/v/o or q_a/q_b/kv_a_proj_with_mqa/o,
dense MLP, shared experts, each routed expert `mlp.experts.E.{gate,up,down}_proj`) and `lm_head` (unless it
is tied to the embedding). Kept float and listed in `ignore` (compressed-tensors semantics: an entry
`re:PATTERN` ignores the modules whose name `re.match`es PATTERN, any other entry is an exact module name or
a class name):
- the router `mlp.gate` (its logits pick the experts; a flipped top-k choice costs more than its tiny matmul
  saves),
- `self_attn.kv_b_proj` (the engine absorbs it into the MLA attention math, where it is not a plain linear),
- the MTP layers `model.layers.{num_hidden_layers + i}.*` (copied unchanged; HF transformers has no module
  for them),
- and embeddings and norms, which are not Linear modules and so never targets.
Every other tensor is copied (norm weights that SmoothQuant rewrote are stored rewritten).

Nothing here imports torch until a checkpoint is written: the parser serves torch-free processes too.
"""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshserve.models.factory import DEFAULT_MAX_SHARD_BYTES, write_safetensors_shards

if TYPE_CHECKING:
    import torch

QUANT_METHOD = "compressed-tensors"
FORMAT = "int-quantized"
SCALE_SUFFIX = ".weight_scale"
QMAX = 127  # symmetric int8: [-127, 127]

WEIGHT_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "channel",
               "dynamic": False}
INPUT_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "token",
              "dynamic": True}

# files of a model directory that are not weights and travel unchanged
_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "draft_vocab.json")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _is_main_layer_linear(rest: str) -> bool:
    """`rest` is a module name inside a decoder layer: whether the writer quantizes it."""
    leaf = rest.rsplit(".", 1)[-1]
    return (leaf.endswith("_proj") and leaf != "kv_b_proj") or leaf == "kv_a_proj_with_mqa"


def is_quantized_module(config: Mapping, module: str) -> bool:
    """Whether `meshserve quantize` stores module `module` (a checkpoint module name, e.g.
    `model.layers.3.mlp.experts.7.up_proj`) as int8 for the model `config`."""
    if module == "lm_head":
        return not config.get("tie_word_embeddings", False)
    match = _LAYER.fullmatch(module)
    if match is None:
        return False
    layer, rest = int(match.group(1)), match.group(2)
    return layer < int(config["num_hidden_layers"]) and _is_main_layer_linear(rest)


def ignore_list(config: Mapping) -> list[str]:
    """The `ignore` entries for `config`: the Linear modules kept float (see the module docstring)."""
    ignore = [r"re:.*self_attn\.kv_b_proj$", r"re:.*mlp\.gate$"]
    layers = int(config["num_hidden_layers"])
    for i in range(int(config.get("num_nextn_predict_layers", 0) or 0)):
        ignore.append(rf"re:model\.layers\.{layers + i}\.")
    if config.get("tie_word_embeddings", False):
        ignore.append("lm_head")
    return ignore


def build_quantization_config(config: Mapping) -> dict:
    """The `quantization_config` entry of config.json for a W8A8 checkpoint of the model `config`."""
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(WEIGHT_ARGS),
                                      "input_activations": dict(INPUT_ARGS), "output_activations": None,
                                      "format": None}},
        "ignore": ignore_list(config),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def _matches(name: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name


@dataclass(frozen=True)
class W8A8Spec:
    """A parsed compressed-tensors W8A8 INT8 `quantization_config`."""

    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def is_ignored(self, module: str) -> bool:
        return any(_matches(module, entry) for entry in self.ignore)

    def is_quantized(self, module: str) -> bool:
        """Whether the Linear module `module` (e.g. `model.layers.0.self_attn.o_proj`, or a routed expert's
        `model.layers.1.mlp.experts.5.down_proj`) is stored as int8 `weight` + `weight_scale`. Class-name
        targets ("Linear") match every name; the caller asks only about its linear layers."""
        if self.is_ignored(module):
            return False
        regex_targets = [t for t in self.targets if t.startswith("re:")]
        class_targets = [t for t in self.targets if not t.startswith("re:")]
        if class_targets:
            return True
        return any(_matches(module, t) for t in regex_targets)


def _check_args(args: Mapping | None, where: str, strategy: str, dynamic: bool) -> None:
    if not isinstance(args, Mapping):
        raise ValueError(f"compressed-tensors {where} is missing: only W8A8 INT8 is supported")
    wanted = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic}
    for key, value in wanted.items():
        got = args.get(key, value if key == "dynamic" and not dynamic else None)
        if isinstance(value, str) and isinstance(got, str):
            got = got.lower()
        if got != value:
            raise ValueError(f"compressed-tensors {where}.{key} is {got!r}; supported: {value!r} "
                             f"(W8A8 INT8: per-channel symmetric weights, dynamic per-token activations)")
    if args.get("group_size") not in (None, -1):
        raise ValueError(f"compressed-tensors {where}.group_size {args.get('group_size')!r} is not supported")


def read_quantization_config(config: Mapping) -> W8A8Spec | None:
    """The W8A8 spec of an HF config dict; None when it has no compressed-tensors `quantization_config`
    (plain float, or another quant_method such as fp8 that other code reads). ValueError for a
    compressed-tensors scheme other than W8A8 INT8 (per-channel symmetric int8 weights, dynamic per-token
    symmetric int8 activations, one config group, format int-quantized, status compressed)."""
    quant = config.get("quantization_config")
    if not quant or str(quant.get("quant_method", "")).lower() != QUANT_METHOD:
        return None
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoints with {len(groups)} config groups are not supported "
                         "(supported: one W8A8 INT8 group)")
    (group,) = groups.values()
    fmt = group.get("format") or quant.get("format")
    if fmt != FORMAT:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: {FORMAT!r})")
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"compressed-tensors quantization_status {status!r} is not supported "
                         "(supported: 'compressed')")
    _check_args(group.get("weights"), "weights", "channel", False)
    _check_args(group.get("input_activations"), "input_activations", "token", True)
    if group.get("output_activations"):
        raise ValueError("compressed-tensors output_activations quantization is not supported")
    if quant.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme is not supported")
    targets = tuple(group.get("targets") or ())
    if not targets:
        raise ValueError("compressed-tensors config group has no targets")
    return W8A8Spec(targets=targets, ignore=tuple(quant.get("ignore") or ()))


def quantized_config(config: Mapping) -> dict:
    """`config` with the W8A8 `quantization_config` added."""
    out = dict(config)
    out["quantization_config"] = build_quantization_config(config)
    return out


def write_checkpoint(src_dir: str | Path, out_dir: str | Path, config: Mapping,
                     tensors: Iterable[tuple[str, torch.Tensor]],
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write a W8A8 checkpoint into the existing, empty `out_dir`: config.json (`config` plus the
    `quantization_config`), the side files of `src_dir` (tokenizer, generation config) and `tensors` (every
    tensor of the checkpoint, quantized ones as int8 `weight` + float32 `weight_scale` [out, 1]) in
    safetensors shards of at most `max_shard_bytes` with an index when there are several."""
    import torch  # the parser above stays importable without torch
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    on_disk: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name in on_disk:
            raise ValueError(f"tensor {name} written twice")
        on_disk[name] = tensor.detach().contiguous()
    for name, tensor in on_disk.items():
        if name.endswith(SCALE_SUFFIX):
            weight = on_disk.get(name[: -len(SCALE_SUFFIX)] + ".weight")
            if weight is None or weight.dtype != torch.int8:
                raise ValueError(f"{name} has no int8 weight beside it")
            if tensor.dtype != torch.float32 or tuple(tensor.shape) != (weight.shape[0], 1):
                raise ValueError(f"{name}: float32 [{weight.shape[0]}, 1] expected, got {tensor.dtype} "
                                 f"{list(tensor.shape)}")
        elif tensor.dtype == torch.int8 and name[: -len(".weight")] + SCALE_SUFFIX not in on_disk:
            raise ValueError(f"{name} is int8 without a weight_scale")
    (out_dir / "config.json").write_text(json.dumps(quantized_config(config), indent=2) + "\n")
    for side in _SIDE_FILES:
        if (src_dir / side).is_file():
            shutil.copyfile(src_dir / side, out_dir / side)
    write_safetensors_shards(out_dir, on_disk, max_shard_bytes)
