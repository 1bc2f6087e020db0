"""Build a model from a HF-style directory: config.json plus safetensors (one file or an index of shards).

Weights stream shard by shard into the model's `load_weights`, one tensor at a time, so peak memory is
the model plus one tensor. `name_filter` is asked about each tensor name before the tensor is read,
which lets a tensor/expert-parallel rank read only the tensors it keeps; of a tensor split over ranks
only this rank's piece is read (safetensors slices).

`read_weights` replaces the checkpoint files as the source: called as `read_weights(wanted, shard_of)`,
it yields (name, tensor or this rank's piece). The worker passes the memory pool's model cache this
way (`meshserve.worker.model_cache.iter_pool_tensors`), so the model code never imports the pool.

FP8 block-quantized checkpoints (`meshserve.layers.fp8`) are dequantized to the serving dtype as they
stream: their FP8 weights and scales are read whole (a block scale spans rows of several ranks' pieces),
dequantized, and then cut to this rank's piece.

INT8 W8A8 (`quantization="int8"`, or a compressed-tensors W8A8 checkpoint, `meshserve.models.
compressed_tensors`): every weight that runs in INT8 (`meshserve.layers.w8a8`) is read whole, as its
INT8 values times their per-channel scales, or for a float or FP8 weight rounded to the INT8 grid of its
rows, then cut to this rank's piece; after loading, `w8a8.convert_model` turns those weights into INT8
values plus scales.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from meshserve.layers import fp8, w8a8
from meshserve.layers.linear import pack_linears
from meshserve.layers.tensor_parallel import Shard
from meshserve.models import compressed_tensors
from meshserve.models.base import CausalLM, RoutedExperts
from meshserve.models.expert_rank import ExpertRankModel
from meshserve.models.registry import model_class
from meshserve.parallel.context import ParallelContext
from meshserve.utils.checkpoint_files import safetensors_files

# a source of checkpoint tensors: (wanted(name) -> bool, shard_of(name) -> Shard | None) -> (name, tensor)...
WeightsReader = Callable[[Callable[[str], bool], Callable[[str], "Shard | None"]], Iterable[tuple[str, torch.Tensor]]]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, hf_config: dict | None = None) -> torch.dtype:
    """A torch dtype from a name ("float32", "bf16", ...) or "auto" (the checkpoint's own dtype, else float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        declared = (hf_config or {}).get("dtype") or (hf_config or {}).get("torch_dtype")
        return resolve_dtype(declared) if declared else torch.float32
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of: auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


def load_hf_config(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    if "model_type" not in config:
        raise ValueError(f"{path} has no 'model_type'")
    return config


def iter_safetensors(model_dir: str | Path, name_filter: Callable[[str], bool] | None = None,
                     shard_of: Callable[[str], Shard | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every stored tensor whose name passes `name_filter` (checked before reading).

    Where `shard_of(name)` names a piece, only that piece is read and yielded.
    """
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name_filter is not None and not name_filter(name):
                    continue
                shard = shard_of(name) if shard_of is not None else None
                yield name, (f.get_tensor(name) if shard is None else shard.read(f.get_slice(name), name))


def shard_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Full checkpoint tensors cut down to what `model`'s rank keeps, as `load_model` reads them."""
    for name, tensor in weights:
        if model.wants_weight(name):
            shard = model.weight_shard(name)
            yield name, (tensor if shard is None else shard.take(tensor, name))


def _dequantized(model: CausalLM, read: WeightsReader, wanted: Callable[[str], bool], block: tuple[int, int],
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's tensors as `model` loads them: FP8 weights dequantized, then cut to this rank."""
    def wanted_or_its_scale(name: str) -> bool:
        return wanted(fp8.weight_name_of_scale(name) if fp8.is_scale_name(name) else name)

    def shard_of(name: str) -> Shard | None:
        whole = fp8.is_scale_name(name) or fp8.is_quantized_name(name)
        return None if whole else model.weight_shard(name)

    for name, tensor in fp8.dequantize_weights(read(wanted_or_its_scale, shard_of), block, dtype):
        shard = model.weight_shard(name) if fp8.is_quantized_name(name) else None
        yield name, (tensor if shard is None else shard.take(tensor, name))


def _dequantized_int8(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                      ) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, was INT8) of a compressed-tensors checkpoint: every int8 weight times its scale
    (paired in whichever order they come); other tensors pass through."""
    suffix = compressed_tensors.SCALE_SUFFIX
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(suffix):
            weight_name = name[: -len(suffix)] + ".weight"
            if weight_name in weights_waiting:
                yield weight_name, _times_scale(weights_waiting.pop(weight_name), tensor, dtype), True
            else:
                scales_waiting[weight_name] = tensor
        elif tensor.dtype == torch.int8:
            if name in scales_waiting:
                yield name, _times_scale(tensor, scales_waiting.pop(name), dtype), True
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor, False
    if weights_waiting or scales_waiting:
        lonely = sorted(weights_waiting) + sorted(name[: -len(".weight")] + suffix for name in scales_waiting)
        raise ValueError(f"compressed-tensors checkpoint: {lonely[0]} has no partner ({len(lonely)} such tensor(s))")


def _times_scale(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if scale.numel() != weight.shape[0]:
        raise ValueError(f"an int8 weight of {weight.shape[0]} rows has {scale.numel()} scales")
    return (weight.float() * scale.float().reshape(-1, 1)).to(dtype)


def _int8_ready(model: CausalLM, read: WeightsReader, wanted: Callable[[str], bool], config: dict,
                dtype: torch.dtype, keep_float: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors for a W8A8 model: the weights that run in INT8 read whole, on their rows'
    INT8 grid (stored INT8 values times scales, or float / FP8 values rounded), then cut to this rank."""
    block = fp8.fp8_block_size(config)

    def weight_of(name: str) -> str:
        if name.endswith(compressed_tensors.SCALE_SUFFIX):
            return name[: -len(compressed_tensors.SCALE_SUFFIX)] + ".weight"
        return fp8.weight_name_of_scale(name) if block is not None and fp8.is_scale_name(name) else name

    def whole(name: str) -> bool:
        weight = weight_of(name)
        return weight != name or w8a8.is_quantizable_name(weight) or (block is not None and fp8.is_quantized_name(name))

    def shard_of(name: str) -> Shard | None:
        return None if whole(name) else model.weight_shard(name)

    stream = read(lambda name: wanted(weight_of(name)), shard_of)
    if block is not None:
        stream = fp8.dequantize_weights(stream, block, dtype)
    for name, tensor, was_int8 in _dequantized_int8(stream, dtype):
        if not was_int8 and w8a8.is_quantizable_name(name) and not keep_float(name):
            tensor = w8a8.round_to_grid(tensor)
        shard = model.weight_shard(name) if whole(name) else None
        yield name, (tensor if shard is None else shard.take(tensor, name))


def load_model(model_dir: str | Path, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
               name_filter: Callable[[str], bool] | None = None, parallel: ParallelContext | None = None,
               read_weights: WeightsReader | None = None, quantization: str | None = None) -> CausalLM:
    """Build the registered model for config.json's `model_type` and fill every parameter from the checkpoint.

    With `parallel`, the model is this rank's part of the strategy and only that part is read.
    With `read_weights`, the tensors come from it instead of the checkpoint files.
    With `quantization="int8"`, or for a compressed-tensors W8A8 checkpoint, the linear layers run INT8 W8A8.
    """
    config = load_hf_config(model_dir)
    w8a8_spec = compressed_tensors.read_quantization_config(config)
    if quantization not in (None, "int8"):
        raise ValueError(f"unknown quantization {quantization!r}; supported: int8")
    int8_mode = quantization == "int8" or w8a8_spec is not None
    # a checkpoint that another tool wrote may keep its LM head float; so does the engine then
    keep_lm_head_float = w8a8_spec is not None and w8a8_spec.is_ignored("lm_head")
    torch_dtype = resolve_dtype(dtype, config)
    model = new_model(model_dir, torch_dtype, device, parallel, config)

    def wanted(name: str) -> bool:
        return model.wants_weight(name) and (name_filter is None or name_filter(name))

    read = read_weights or (lambda want, shard_of: iter_safetensors(model_dir, want, shard_of))
    block = fp8.fp8_block_size(config)
    if int8_mode:
        weights = _int8_ready(model, read, wanted, config, torch_dtype,
                              keep_float=lambda name: keep_lm_head_float and name == "lm_head.weight")
    elif block is None:
        weights = read(wanted, model.weight_shard)
    else:
        weights = _dequantized(model, read, wanted, block, torch_dtype)
    loaded = model.load_weights(weights)
    # an empty parameter needs nothing (an attention rank's experts in a disaggregated layout)
    missing = [name for name, param in model.named_parameters() if name not in loaded and param.numel()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {str(model_dir)!r} did not provide {len(missing)} parameter(s): {shown}")
    post_process = getattr(model, "process_weights_after_loading", None)
    if callable(post_process):
        post_process()
    if int8_mode:
        w8a8.convert_model(model, keep_lm_head_float=keep_lm_head_float)
    return finish_model(model, model_dir)


def new_model(model_dir: str | Path, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
              parallel: ParallelContext | None = None, config: dict | None = None) -> CausalLM:
    """The registered model for config.json's `model_type`, its parameters allocated but not filled."""
    config = config if config is not None else load_hf_config(model_dir)
    cls = model_class(config["model_type"])
    with torch.device(device):  # allocate parameters where they will live
        if parallel is not None and parallel.is_expert_rank:  # a disaggregated layout's expert rank: experts only
            return ExpertRankModel(config, resolve_dtype(dtype, config), parallel, routed_experts(cls, config))
        return cls(config, dtype=resolve_dtype(dtype, config), parallel=parallel)


def routed_experts(cls: type, config: dict) -> RoutedExperts:
    """The routed experts of a model of class `cls`; ValueError for a model without any."""
    routed = getattr(cls, "routed_experts_of", None)
    shape = routed(config) if routed is not None else None
    if shape is None or not shape.layers or shape.num_experts < 1:
        raise ValueError(f"{config.get('model_type')!r} models have no routed experts to put on expert ranks "
                         "(a disaggregated layout serves MoE models)")
    return shape


def finish_model(model: CausalLM, model_dir: str | Path) -> CausalLM:
    """The last step of a load, once the weights are final (read and post-processed here, or forked from a
    running TE: `meshserve.worker.weight_fork`): prepacking, and where expert replicas are read from."""
    pack_linears(model)  # prepack the weights for the CPU matmul library
    balancer = getattr(model, "expert_balancer", None)
    if balancer is not None:  # live expert reconfiguration reads replicas from the same checkpoint
        balancer.model_dir = str(model_dir)
    return model.eval()
