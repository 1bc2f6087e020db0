"""Which model an engine serves, and on what."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from meshserve.config.base import ConfigStruct


class ModelConfig(ConfigStruct, frozen=True):
    model: Annotated[str, Meta(description="HF-format model directory")]
    served_model_name: Annotated[str, Meta(
        description="the model's name in the API (default: the model directory's name)")] | None = None
    dtype: Annotated[Literal["float32", "bfloat16", "float16", "auto"], Meta(
        description="weight and activation dtype (auto: the checkpoint's)")] = "float32"
    quantization: Annotated[Literal["int8"], Meta(
        description="run the linear layers in INT8 W8A8 (int8: float and FP8 checkpoints are rounded per "
                    "output channel at load; unset: as the checkpoint is, INT8 for a compressed-tensors W8A8 "
                    "checkpoint)")] | None = None
    device: Annotated[str, Meta(description="torch device the ranks run on (cpu, cuda)")] = "cpu"
    seed: Annotated[int, Meta(description="the engine's random seed")] = 0
    serve_weights: Annotated[bool, Meta(
        description="run a weight server on every rank, so new TEs of the same model and layout can fork their "
                    "weights from this one while it serves (the cluster manager turns it on)")] = False
    fork_from: Annotated[str, Meta(
        description="load the weights from a running TE of the same model and layout instead of the "
                    "checkpoint: its ranks' weight servers, comma-separated, one per rank (the cluster "
                    "manager sets it)")] | None = None
