"""PD heatmap: where PD-disaggregated TEs beat PD-colocated ones (deepserve §5.3, Fig. 6).

Rows are prefill-length bins (tokens), columns are bins of the decode/prefill
length ratio. For each request rate (RPS) a cell holds
JCT_colocated / JCT_disaggregated - 1: positive means disaggregated wins.
The PD-aware policy sums the grids over all RPS (the sign is stable across
rates) and reads the cell of a request's prefill length and predicted decode
length: positive -> disaggregated TEs, negative -> colocated TEs.
"""
from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshserve.utils import report

FORMAT = "meshserve-pd-heatmap"
VERSION = 1

Grid = list[list[float | None]]


def measure_cell(jct_colocated: Sequence[float], jct_disaggregated: Sequence[float]) -> float:
    """One cell: mean colocated JCT over mean disaggregated JCT, minus one."""
    if not jct_colocated or not jct_disaggregated:
        raise ValueError("a heatmap cell needs at least one JCT from each setup")
    colocated = sum(jct_colocated) / len(jct_colocated)
    disaggregated = sum(jct_disaggregated) / len(jct_disaggregated)
    if not (math.isfinite(colocated) and math.isfinite(disaggregated)) or disaggregated <= 0 or colocated < 0:
        raise ValueError(f"JCTs must be finite and positive, got means {colocated} (colocated) and "
                         f"{disaggregated} (disaggregated)")
    return colocated / disaggregated - 1.0


class PDHeatmap:
    """Grids of JCT advantage of disaggregation, one per RPS, over (prefill length, decode/prefill ratio) bins.

    Read-only once built: the combined grid is summed at construction.
    """

    def __init__(self, prefill_edges: Sequence[float], ratio_edges: Sequence[float],
                 grids: Mapping[float, Sequence[Sequence[float | None]]]):
        self.prefill_edges = _edges(prefill_edges, "prefill_edges")
        self.ratio_edges = _edges(ratio_edges, "ratio_edges")
        if not grids:
            raise ValueError("a PD heatmap needs at least one RPS grid")
        rows, cols = len(self.prefill_edges) - 1, len(self.ratio_edges) - 1
        self.grids: dict[float, Grid] = {}
        for rps, grid in sorted(grids.items(), key=lambda item: float(item[0])):
            rps = _number(rps, "RPS")
            if rps <= 0:
                raise ValueError(f"RPS must be positive, got {rps}")
            if rps in self.grids:
                raise ValueError(f"RPS {rps:g} appears twice")
            self.grids[rps] = _grid(grid, rows, cols, f"grid at RPS {rps:g}")
        self._combined = self._sum_over_rps()  # summed once: routing reads it for every request

    @property
    def shape(self) -> tuple[int, int]:
        """(prefill bins, ratio bins)."""
        return len(self.prefill_edges) - 1, len(self.ratio_edges) - 1

    def combined(self) -> list[list[float]]:
        """Element-wise sum over RPS; cells without data at some RPS add nothing, cells without any are 0.0."""
        return [list(row) for row in self._combined]

    def _sum_over_rps(self) -> list[list[float]]:
        rows, cols = self.shape
        return [[sum((v for grid in self.grids.values() if (v := grid[r][c]) is not None), 0.0) for c in range(cols)]
                for r in range(rows)]

    def has_data(self) -> list[list[bool]]:
        """Which cells were measured at one RPS or more."""
        rows, cols = self.shape
        return [[any(grid[r][c] is not None for grid in self.grids.values()) for c in range(cols)]
                for r in range(rows)]

    def cell(self, prefill_tokens: int, decode_tokens: int) -> tuple[int, int]:
        """(row, column) of a request; values beyond the outer edges fall in the outer bins."""
        if prefill_tokens < 0 or decode_tokens < 0:
            raise ValueError(f"token counts must be non-negative, got prefill {prefill_tokens}, "
                             f"decode {decode_tokens}")
        # an empty prompt has an unbounded ratio: the last column
        ratio = decode_tokens / prefill_tokens if prefill_tokens > 0 else math.inf
        return _bin(self.prefill_edges, prefill_tokens), _bin(self.ratio_edges, ratio)

    def value(self, prefill_tokens: int, decode_tokens: int) -> float:
        """The combined advantage of disaggregation for a request (positive: route to disaggregated TEs)."""
        row, col = self.cell(prefill_tokens, decode_tokens)
        return self._combined[row][col]

    # ---- files ----------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "prefill_edges": list(self.prefill_edges),
                "ratio_edges": list(self.ratio_edges),
                "grids": [{"rps": rps, "values": [list(row) for row in grid]} for rps, grid in self.grids.items()]}

    @classmethod
    def from_dict(cls, data: dict) -> PDHeatmap:
        if not isinstance(data, dict):
            raise ValueError(f"a PD heatmap must be a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"not a PD heatmap (format {data.get('format')!r}, expected {FORMAT!r})")
        if data.get("version") != VERSION:
            raise ValueError(f"PD heatmap version {data.get('version')!r} is not supported (expected {VERSION})")
        missing = [key for key in ("prefill_edges", "ratio_edges", "grids") if key not in data]
        if missing:
            raise ValueError(f"PD heatmap lacks {', '.join(missing)}")
        entries = data["grids"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) and {"rps", "values"} <= e.keys()
                                                    for e in entries):
            raise ValueError("PD heatmap grids must be a list of {\"rps\": ..., \"values\": [[...]]}")
        grids: dict[float, Grid] = {}
        for entry in entries:
            rps = _number(entry["rps"], "RPS")
            if rps in grids:
                raise ValueError(f"RPS {rps:g} appears twice")
            grids[rps] = entry["values"]
        return cls(data["prefill_edges"], data["ratio_edges"], grids)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> PDHeatmap:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"PD heatmap file {str(path)!r} does not exist")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a JSON file: {exc}") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    # ---- figure ---------------------------------------------------------------------------------------------

    def plot(self, path_png: str | Path) -> Path:
        """One panel per RPS plus the combined one; red favours disaggregated, blue colocated, gray is unmeasured."""
        # only when drawing: the router loads a heatmap at start-up and never needs matplotlib for that
        import matplotlib
        from matplotlib.colors import Normalize

        panels = [(f"RPS {rps:g}", grid) for rps, grid in self.grids.items()]
        data = self.has_data()
        combined = self.combined()
        panels.append(("combined (sum over RPS)",
                       [[v if data[r][c] else None for c, v in enumerate(row)] for r, row in enumerate(combined)]))
        rows, cols = self.shape
        # unmeasured cells gray: they must not look like a measured tie
        colormap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="lightgray")
        fig, axes = report.new_figure(ncols=len(panels), width_per_panel=max(4.0, 0.9 * cols + 1.5),
                                      height=max(3.5, 0.5 * rows + 1.5))
        for ax, (title, grid) in zip(axes[0], panels):
            known = [abs(v) for row in grid for v in row if v is not None]
            limit = max(known, default=0.0) or 1.0  # symmetric limits centre the diverging map at 0
            matrix = [[math.nan if v is None else v for v in row] for row in grid]
            image = ax.imshow(matrix, cmap=colormap, norm=Normalize(-limit, limit), origin="lower", aspect="auto")
            for r in range(rows):
                for c in range(cols):
                    v = grid[r][c]
                    ax.text(c, r, "-" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if v is not None and abs(v) > 0.6 * limit else "black")
            ax.set_xticks(range(cols), _bin_labels(self.ratio_edges), rotation=45, fontsize=7)
            ax.set_yticks(range(rows), _bin_labels(self.prefill_edges), fontsize=7)
            ax.set_xlabel("decode / prefill length")
            ax.set_ylabel("prefill length (tokens)")
            ax.set_title(title)
            fig.colorbar(image, ax=ax, label="JCT colocated / disaggregated - 1")
        return report.save_figure(fig, path_png)


def _bin(edges: list[float], x: float) -> int:
    return min(max(bisect.bisect_right(edges, x) - 1, 0), len(edges) - 2)


def _bin_labels(edges: list[float]) -> list[str]:
    return [f"{a:g}-{b:g}" for a, b in zip(edges, edges[1:])]


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value}")
    return value


def _edges(edges: Sequence[float], name: str) -> list[float]:
    if isinstance(edges, (str, bytes)) or not isinstance(edges, Sequence):
        raise ValueError(f"{name} must be a list of numbers, got {edges!r}")
    values = [_number(e, name) for e in edges]
    if len(values) < 2:
        raise ValueError(f"{name} needs at least two edges (one bin), got {values}")
    if values[0] < 0 or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-negative and strictly increasing, got {values}")
    return values


def _grid(grid, rows: int, cols: int, what: str) -> Grid:
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or len(grid) != rows:
        raise ValueError(f"{what} must have {rows} rows (one per prefill bin)")
    out: Grid = []
    for r, row in enumerate(grid):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != cols:
            raise ValueError(f"{what}: row {r} must have {cols} values (one per ratio bin)")
        out.append([None if v is None else _number(v, f"{what} cell ({r}, {c})") for c, v in enumerate(row)])
    return out
