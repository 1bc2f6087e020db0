"""Recorded expert load: tokens routed to each logical expert of each MoE layer, per time slice.

File format (JSON, `meshserve eplb record` writes it, `meshserve eplb plan --load` reads it):

```json
{"format": "meshserve-expert-load/1",
 "num_logical": 16,                 # logical (routed) experts per MoE layer
 "moe_layers": [1, 2, 3],           # decoder-layer indices of the MoE layers
 "slice_seconds": 10.0,             # length of one time slice
 "slice_start_times": [t0, t1],     # unix time each slice began
 "counts": [[[...], ...], ...]}     # counts[slice][i][expert]: tokens of layer moe_layers[i]
```
Counts are summed over every DP group of the TE (each token counted once per chosen
expert, so a slice's layer row sums to tokens x top-k).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "meshserve-expert-load/1"


@dataclass
class ExpertLoadRecord:
    num_logical: int
    moe_layers: list[int]
    slice_seconds: float
    counts: list[list[list[int]]] = field(default_factory=list)  # [slice][layer position][expert]
    slice_start_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_logical < 1:
            raise ValueError(f"num_logical must be positive, got {self.num_logical}")
        if self.slice_seconds <= 0:
            raise ValueError(f"slice_seconds must be positive, got {self.slice_seconds}")
        for s, per_layer in enumerate(self.counts):
            if len(per_layer) != len(self.moe_layers):
                raise ValueError(f"slice {s}: {len(per_layer)} layers, expected {len(self.moe_layers)}")
            for row in per_layer:
                if len(row) != self.num_logical or any(c < 0 for c in row):
                    raise ValueError(f"slice {s}: each layer needs {self.num_logical} non-negative counts")
        if self.slice_start_times and len(self.slice_start_times) != len(self.counts):
            raise ValueError("slice_start_times must have one entry per slice")

    @property
    def num_slices(self) -> int:
        return len(self.counts)

    def layer_counts(self, layer: int) -> list[list[int]]:
        """counts[slice][expert] of one MoE layer (by decoder-layer index)."""
        i = self.moe_layers.index(layer)
        return [per_layer[i] for per_layer in self.counts]

    def to_dict(self) -> dict:
        return {"format": FORMAT, "num_logical": self.num_logical, "moe_layers": list(self.moe_layers),
                "slice_seconds": self.slice_seconds, "slice_start_times": list(self.slice_start_times),
                "counts": self.counts}

    @classmethod
    def from_dict(cls, data: dict) -> ExpertLoadRecord:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not an expert load record (format {FORMAT})")
        try:
            return cls(num_logical=int(data["num_logical"]), moe_layers=[int(x) for x in data["moe_layers"]],
                       slice_seconds=float(data["slice_seconds"]),
                       counts=[[[int(c) for c in row] for row in per_layer] for per_layer in data["counts"]],
                       slice_start_times=[float(t) for t in data.get("slice_start_times", [])])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad expert load record: {exc}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> ExpertLoadRecord:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        return cls.from_dict(data)
