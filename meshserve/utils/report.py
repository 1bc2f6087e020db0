"""Shared output helpers for benchmarks: JSON files, percentile summaries, PNG figures."""
from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_PERCENTILES = (50, 90, 99)


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write `data` as indented JSON, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def publish(json_path: str | Path, result: dict[str, Any], plot: Callable[[dict, Path], Path],
            lines: Iterable[str]) -> None:
    """A benchmark's ending: the JSON, its PNG beside it (`plot(result, png path)`), the summary lines printed."""
    written = write_json(json_path, result)
    png = plot(result, png_path_for(written))
    for line in lines:
        print(line)
    print(f"wrote {written} and {png}")


def png_path_for(json_path: str | Path) -> Path:
    """The figure that sits next to a result JSON: same name, .png suffix."""
    return Path(json_path).with_suffix(".png")


def percentile(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    weight = position - lower
    return ordered[lower] + (ordered[upper] - ordered[lower]) * weight


def summarize(values: Iterable[float],
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | int | None]:
    """count, mean, min, max and the given percentiles (keys like "p50"); None fields for an empty sample."""
    sample = [float(v) for v in values]
    summary: dict[str, float | int | None] = {"count": len(sample)}
    if not sample:
        summary.update({"mean": None, "min": None, "max": None})
        summary.update({_pkey(q): None for q in percentiles})
        return summary
    summary.update({"mean": sum(sample) / len(sample), "min": min(sample), "max": max(sample)})
    summary.update({_pkey(q): percentile(sample, q) for q in percentiles})
    return summary


def _pkey(q: float) -> str:
    return f"p{q:g}"


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch  # here, not at the top: importing report (the router's heatmap does) must not load torch

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        # start-up: psutil only when machine info is asked for
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gb"] = round(psutil.virtual_memory().total / 1e9, 1)
    except Exception:  # psutil is optional for this record
        pass
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def new_figure(ncols: int = 1, nrows: int = 1, width_per_panel: float = 5.5, height: float = 4.0):
    """A matplotlib figure drawn off-screen (Agg), so benchmarks run without a display."""
    import matplotlib  # only when drawing: matplotlib costs start-up time in every process that imports report

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes its backend on import

    fig, axes = plt.subplots(nrows, ncols, figsize=(width_per_panel * ncols, height * nrows), squeeze=False)
    return fig, axes


def save_figure(fig, path: str | Path) -> Path:
    """Save a figure as PNG (creating parent directories) and release it."""
    # start-up: matplotlib only when drawing
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path


def plot_cdf(ax, values: Sequence[float], label: str, xlabel: str, ylabel: str = "fraction of requests") -> None:
    """Empirical CDF of a sample on `ax`; an empty sample leaves a note instead of a line."""
    if not values:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    else:
        ordered = sorted(values)
        n = len(ordered)
        ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label)
        ax.legend(loc="lower right")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
