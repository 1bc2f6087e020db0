"""How much a simulated result moves when every step takes a little longer or shorter (`simulate run --sensitivity`).

A profile fitted on a host is right to within the host's drift between the calibration and the run, and a
deployment near its capacity turns a few percent of step time into queues. The same trace is served again with
every step `1 - fraction` and `1 + fraction` times as long (the step timer wrapped, nothing else changed), and each
figure's elasticity is reported: its change, in percent, per percent of step time. Far below the capacity it is
about 1 for TPOT; near it, several, and a single run's prediction is only as good as the profile times that.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

FIGURES = ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s")


class ScaledSteps:
    """A step timer whose steps take `factor` times as long; every other figure as the timer it wraps."""

    def __init__(self, timer, factor: float) -> None:
        self._timer, self.factor = timer, factor

    def step_seconds(self, groups: Sequence) -> float:
        return self.factor * self._timer.step_seconds(groups)

    def with_expert_imbalance(self, imbalance: float) -> ScaledSteps:
        return ScaledSteps(self._timer.with_expert_imbalance(imbalance), self.factor)

    def __getattr__(self, name: str):
        return getattr(self._timer, name)


def figures_of(result: dict) -> dict[str, float | None]:
    """The figures a sensitivity compares, from a simulation's result."""
    ttft, tpot = result.get("ttft_s") or {}, result.get("tpot_s") or {}
    return {"output_tokens_per_s": result["output_tokens_per_s"], "ttft_p50_s": ttft.get("p50"),
            "tpot_p50_s": tpot.get("p50")}


def sensitivity(serve: Callable[[float], dict], base: dict, fraction: float) -> dict:
    """`serve(factor)`: the same simulation with steps `factor` times as long. The figures at 1 - fraction, 1 and
    1 + fraction, and each one's elasticity (relative change per relative change of the step time, across the two)."""
    if not 0 < fraction < 1:
        raise ValueError(f"the step fraction must be between 0 and 1, got {fraction:g}")
    runs = {"shorter": figures_of(serve(1 - fraction)), "as fitted": figures_of(base),
            "longer": figures_of(serve(1 + fraction))}
    elasticity = {}
    for name in FIGURES:
        low, mid, high = (runs[key][name] for key in ("shorter", "as fitted", "longer"))
        elasticity[name] = None if None in (low, mid, high) or not mid else (high - low) / mid / (2 * fraction)
    return {"step_fraction": fraction, "figures": runs, "elasticity": elasticity}


def sensitivity_lines(result: dict) -> list[str]:
    fraction, runs, elasticity = result["step_fraction"], result["figures"], result["elasticity"]

    def span(name: str, scale: float, unit: str) -> str:
        low, mid, high = (runs[key][name] for key in ("shorter", "as fitted", "longer"))
        if None in (low, mid, high):
            return "-"
        return (f"{scale * low:.1f} / {scale * mid:.1f} / {scale * high:.1f}{' ' + unit if unit else ''} "
                f"(elasticity {elasticity[name]:.2f})")
    return [f"steps {100 * fraction:g}% shorter / as fitted / {100 * fraction:g}% longer: "
            f"tok/s {span('output_tokens_per_s', 1.0, '')}",
            f"  TTFT p50 {span('ttft_p50_s', 1e3, 'ms')}; TPOT p50 {span('tpot_p50_s', 1e3, 'ms')}"]
