"""Read single experts' weights, this rank's intermediate columns only, from an HF safetensors checkpoint.

Experts are stored per expert (`{prefix}.{e}.gate_proj.weight`, `up_proj`, `down_proj`, as
transformers writes them) or packed per layer (`{prefix}.gate_up_proj` [E, 2I, H] with gate
rows then up rows, `{prefix}.down_proj` [E, H, I]). Only the requested slices are read, except of FP8 block-quantized
weights (`meshserve.layers.fp8`), which are read whole with their scales and dequantized first, and
of an engine serving INT8 W8A8 (`meshserve.layers.w8a8`): its experts are read whole, as the loader read
them, on the INT8 grid of their full rows (a compressed-tensors checkpoint's INT8 values times their
scales, or float values rounded).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from meshserve.layers import fp8, w8a8

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


class ExpertCheckpoint:
    """Reads [gate; up] rows and down columns [lo, hi) of one expert of one layer."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = tensor_files(model_dir)
        config = Path(model_dir) / "config.json"
        self.fp8_block = fp8.fp8_block_size(json.loads(config.read_text())) if config.is_file() else None
        self._open: dict[Path, object] = {}

    def __enter__(self) -> ExpertCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def _slice(self, name: str):
        path = self.files.get(name)
        if path is None:
            raise KeyError(name)
        handle = self._open.get(path)
        if handle is None:
            handle = self._open[path] = safe_open(str(path), framework="pt").__enter__()
        return handle.get_slice(name)

    def _weight(self, name: str, int8_grid: bool):
        """A per-expert weight to slice: the stored slice handle, or the dequantized tensor of an FP8 or INT8
        one; with `int8_grid`, the whole tensor on its rows' INT8 grid."""
        scale = name + fp8.SCALE_SUFFIX
        int8_scale = name.removesuffix(".weight") + ".weight_scale"
        if int8_scale in self.files:
            return self._slice(name)[:].float() * self._slice(int8_scale)[:].float().reshape(-1, 1)
        if self.fp8_block is not None and scale in self.files:
            weight = fp8.dequantize_block(self._slice(name)[:], self._slice(scale)[:], self.fp8_block)
        elif int8_grid:
            weight = self._slice(name)[:]
        else:
            return self._slice(name)
        return w8a8.round_to_grid(weight) if int8_grid else weight

    def read(self, prefix: str, expert: int, columns: tuple[int, int], intermediate: int,
             dtype: torch.dtype, int8_grid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2 * (hi - lo), H], w2 [H, hi - lo]) of expert `expert` under `prefix` (`...mlp.experts`);
        `int8_grid` for an engine serving INT8 W8A8 (see the module docstring)."""
        lo, hi = columns
        if f"{prefix}.{expert}.gate_proj.weight" in self.files:
            gate = self._weight(f"{prefix}.{expert}.gate_proj.weight", int8_grid)[lo:hi]
            up = self._weight(f"{prefix}.{expert}.up_proj.weight", int8_grid)[lo:hi]
            down = self._weight(f"{prefix}.{expert}.down_proj.weight", int8_grid)[:, lo:hi]
        elif f"{prefix}.gate_up_proj" in self.files:
            gate_up = self._slice(f"{prefix}.gate_up_proj")[expert:expert + 1]
            down = self._slice(f"{prefix}.down_proj")[expert:expert + 1]
            if int8_grid:
                gate_up, down = w8a8.round_to_grid(gate_up), w8a8.round_to_grid(down)
            gate, up = gate_up[0, lo:hi], gate_up[0, intermediate + lo:intermediate + hi]
            down = down[0, :, lo:hi]
        else:
            raise KeyError(f"checkpoint {str(self.model_dir)!r} has no weights of expert {expert} under {prefix!r}")
        return torch.cat([gate, up]).to(dtype), down.to(dtype).contiguous()
