"""FP8 block-quantized checkpoints, as DeepSeek-V3/R1 and Kimi-K2 are published.

The format (`quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`): the linear weights of the decoder layers are stored as float8_e4m3fn,
each with a float32 `<name>_scale_inv` of one scale per 128 x 128 block (ceil-divided at the edges);
weight = fp8 * scale_inv over its block. Embeddings, the LM head, norms, the router and its bias stay in
the checkpoint's dtype.

meshserve dequantizes at load (to the serving dtype, then cuts each rank's shard as for any checkpoint),
so every kernel, parallel layout and the pool's model cache serve an FP8 checkpoint unchanged; the win is
the checkpoint's size on disk and over the wire, not the compute. `write_fp8_checkpoint` makes one from
any checkpoint (`meshserve make-model --fp8`), the way the published ones were made.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
DEFAULT_BLOCK = (128, 128)
# names of the tensors stored in FP8: the decoder layers' (and MTP layers') linear projections and experts
_QUANTIZED_SUFFIXES = ("_proj.weight",)


def fp8_block_size(hf_config: dict) -> tuple[int, int] | None:
    """The checkpoint's FP8 weight block (rows, cols); None when it is not FP8-quantized (a compressed-tensors
    W8A8 checkpoint is `meshserve.models.compressed_tensors`'). ValueError for a quantization the loader does
    not read."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return None
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                         "(supported: fp8, compressed-tensors W8A8 INT8)")
    fmt = str(quant.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"FP8 format {fmt!r} is not supported (supported: e4m3)")
    if str(quant.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise ValueError("FP8 checkpoints with static activation scales are not supported "
                         "(supported: activation_scheme dynamic)")
    block = quant.get("weight_block_size")
    if block is None:
        raise ValueError("FP8 checkpoints without weight_block_size (per-tensor scales) are not supported")
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"weight_block_size must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def weight_name_of_scale(name: str) -> str:
    return name[:-len(SCALE_SUFFIX)]


def is_quantized_name(name: str) -> bool:
    """Whether `write_fp8_checkpoint` stores this tensor in FP8."""
    return name.endswith(_QUANTIZED_SUFFIXES)


def _expand(scale_inv: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    full = scale_inv.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:rows, :cols]


def dequantize_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An FP8 weight times its per-block scales, in `dtype`."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block weights are 2-D, got shape {tuple(weight.shape)}")
    expected = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv of shape {tuple(scale_inv.shape)} does not cover a {tuple(weight.shape)} "
                         f"weight in {block[0]}x{block[1]} blocks (expected {expected})")
    return (weight.to(torch.float32) * _expand(scale_inv.to(torch.float32), weight.shape, block)).to(dtype)


def quantize_block(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv): each block scaled so its largest magnitude maps to the FP8 maximum."""
    rows, cols = weight.shape
    w = weight.to(torch.float32)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = w
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (w / _expand(scale_inv, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def dequantize_weights(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                       dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every FP8 weight dequantized (paired with its scale, in whichever order
    they come); other tensors pass through. ValueError for a weight or scale without its partner."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if is_scale_name(name):
            weight_name = weight_name_of_scale(name)
            if weight_name in weights_waiting:
                yield weight_name, dequantize_block(weights_waiting.pop(weight_name), tensor, block, dtype)
            else:
                scales_waiting[weight_name] = tensor
        elif tensor.dtype == FP8_DTYPE:
            if name in scales_waiting:
                yield name, dequantize_block(tensor, scales_waiting.pop(name), block, dtype)
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        lonely = sorted(weights_waiting) + sorted(name + SCALE_SUFFIX for name in scales_waiting)
        raise ValueError(f"FP8 checkpoint: {lonely[0]} has no partner "
                         f"({'weight' if lonely[0].endswith(SCALE_SUFFIX) else SCALE_SUFFIX}) "
                         f"({len(lonely)} such tensor(s))")


def write_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, block: tuple[int, int] = DEFAULT_BLOCK) -> Path:
    """Copy the checkpoint in `src_dir` to `out_dir` with its linear projections in FP8 block format.

    Files other than the weights are copied; each safetensors file keeps its tensors (the FP8 ones gain
    their scales next to them) and the index, if any, is rewritten.
    """
    from safetensors import safe_open
    from safetensors.torch import save

    src, out = Path(src_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy2(path, out / path.name)
    weight_map: dict[str, str] = {}
    total = 0
    for path in sorted(src.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if is_quantized_name(name) and tensor.dim() == 2:
                    tensor, scale_inv = quantize_block(tensor, block)
                    tensors[name + SCALE_SUFFIX] = scale_inv
                tensors[name] = tensor
        for name, tensor in tensors.items():
            weight_map[name] = path.name
            total += tensor.numel() * tensor.element_size()
        (out / path.name).write_bytes(save(tensors, metadata={"format": "pt"}))
    if (src / "model.safetensors.index.json").exists():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
