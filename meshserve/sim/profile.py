"""How long one engine step takes on some hardware: the simulator's model of time (a data file per profile).

A step of a TE runs every DP group's part at once (lockstep), so it takes as long as its slowest group, less
`per_idle_group_ms` for each group with nothing to do in it (on a host whose cores the groups' ranks share, an idle
group's core takes the host's other work off the busy ones: `calibrate` fits it from prompts alone and side by side,
one per group). A group's part costs

    base_ms + per_decode_row_ms * decode rows + per_prefill_token_ms * prefill tokens
            + per_context_kilotoken_ms * (tokens the decode rows attend to) / 1000
            + per_prefill_megapair_ms * (prefill (token, attended token) pairs) / 10^6

(a prompt's attention grows with its square: a chunk of n tokens after c computed ones attends to
n * (c + n / 2) pairs).

`base_ms` is what a step costs whatever it holds: the weights read once per step, the MoE collectives, the
control plane. `delivery_ms` is the trip of a request and its tokens between the client and the steps (the
request to the master, each token back through the output path): it delays every token a client sees, so it
adds to the time to the first token and not to the time between tokens. A profile is fitted to one model and
layout (`fit`, from steps measured on the real engine: `meshserve simulate calibrate`), and names where its
numbers come from (`source`) and the DP groups of the TE it was fitted on (`dp`: its terms are per group, and
simulated for another number of groups they would time steps that never ran).

TEs on devices of their own step independently. TEs sharing one host's CPU cores do not: a profile calibrated on a
deployment of several TEs on one host says how much longer a TE's step takes while another TE steps beside it
(`stretch_beside_tes`, `meshserve simulate calibrate --shared-tes`), and what a starting TE and a starting pre-warmed
process count as, in stepping TEs (`starting_te_weight`, `prewarm_weight`: `calibrate --scale-up`); the simulator
applies them to every step that starts while other TEs step or start (`shared_cores_factor`). A prompt's step may
stretch otherwise: on a P/D deployment sharing one host, a prefill TE's prompt beside a decoding TE took 1.6-1.9x
as long to its first token (its delivery through the frontend and the job executor as much as its step), a decode
step beside a prefilling TE 1.3x; `prompt_stretch_beside_tes` (`calibrate --pd`) is the prompts' table, applied to
a step holding prompt tokens and to its outputs' delivery.

A host may also run slower for a while after it idled (cores clocked down or lent elsewhere, caches cold):
`wake_after_idle` says how much longer a TE's first step after `idle_s` seconds without work takes (points of
(idle_s, extra_ms), on straight lines from (0, 0), the last one's beyond them; `calibrate` measures it with lone
prompts after different idle times). Without it, `delivery_ms` holds whatever waking cost the prompts it was fitted
from paid, at every load.

A request costs the host work besides its steps: the frontend takes it in and streams it out, the job executor
routes it, the master admits it. On a host whose cores the TE's ranks use, that work takes cores from the steps
under way: `per_request_ms` is how much longer a TE's steps take, together, for each request that joins work
already running (`calibrate` measures it from a decoding batch's steps while lone requests keep arriving). A
request that finds its TE idle pays its host work as latency, which `delivery_ms` holds. The work is not the same
at every rate: processes that idled between requests take longer over the next (measured on 2 cores beside a
DP2+EP2 TE's decoding batch: 11 ms a request at 5 a second, 5 ms at 40), and `per_request_after_gap` holds it by
the gap since the request before (points, on straight lines between them, the nearest one's beyond them;
`calibrate` measures two rates).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TERMS = ("base_ms", "per_decode_row_ms", "per_prefill_token_ms", "per_context_kilotoken_ms", "per_prefill_megapair_ms",
         "delivery_ms")
SCALE_UP_WEIGHTS = ("starting_te_weight", "prewarm_weight")  # optional, with stretch_beside_tes
OPTIONAL_TERMS = ("per_request_ms", "per_idle_group_ms", *SCALE_UP_WEIGHTS)
STRETCH_TABLES = ("stretch_beside_tes", "prompt_stretch_beside_tes")  # optional


class ProfileError(ValueError):
    """A profile that cannot time a step (one line for the user)."""


@dataclass(frozen=True)
class GroupWork:
    """One DP group's part of a step."""

    decode_rows: int = 0  # requests adding their next token (one row each)
    prefill_tokens: int = 0
    context_tokens: int = 0  # the tokens the decode rows attend to
    prefill_pairs: float = 0.0  # the prefill tokens' (token, attended token) pairs
    draft_rows: int = 0  # drafts the decode rows verify (speculative decoding: one more row each)
    sampling_prompts: int = 0  # prompts whose last chunk this is: each samples its first token

    @property
    def rows(self) -> int:
        """Tokens through the step's GEMMs."""
        return self.decode_rows + self.draft_rows + self.prefill_tokens

    @property
    def sampled_rows(self) -> int:
        """Rows through the LM head: the engine computes logits only for the rows it samples (every decode and
        draft row, a prompt's last row), not for a prompt's other tokens."""
        return self.decode_rows + self.draft_rows + self.sampling_prompts

    @property
    def rows_per_decode_request(self) -> float:
        return 1.0 + self.draft_rows / self.decode_rows if self.decode_rows else 1.0

    @classmethod
    def prompt(cls, tokens: int) -> GroupWork:
        """A lone prompt's prefill in one step."""
        return cls(prefill_tokens=tokens, prefill_pairs=tokens * tokens / 2, sampling_prompts=1)


@dataclass(frozen=True)
class StepProfile:
    name: str
    source: str  # where the numbers come from
    base_ms: float
    per_decode_row_ms: float
    per_prefill_token_ms: float
    per_context_kilotoken_ms: float = 0.0
    per_prefill_megapair_ms: float = 0.0
    delivery_ms: float = 0.0
    # optional, on a host whose cores TEs share: a step's time beside 1, 2, ... other busy TEs over its time alone
    # (empty: each TE has devices of its own)
    stretch_beside_tes: tuple[float, ...] = ()
    # optional, the same for a step that holds prompt tokens, its outputs' delivery included: a prompt's time to
    # its first token beside busy TEs over alone (P/D on a shared host; empty: stretch_beside_tes, delivery as is)
    prompt_stretch_beside_tes: tuple[float, ...] = ()
    starting_te_weight: float = 1.0  # a TE starting (its load, KV cache, warm-up), in stepping TEs
    prewarm_weight: float = 1.0  # a pre-warmed process starting (imports, native kernels), in stepping TEs
    # optional: (idle_s, extra_ms) points, how much longer the first step after idling that long takes
    wake_after_idle: tuple[tuple[float, float], ...] = ()
    # optional: the steps' time, together, that each request joining running work takes from them (host work)
    per_request_ms: float = 0.0
    # optional: (gap_s, ms) points, the same for a request that comes gap_s after the request before it
    per_request_after_gap: tuple[tuple[float, float], ...] = ()
    # optional: how much shorter a step is for each DP group that has nothing to do in it
    per_idle_group_ms: float = 0.0
    dp: int = 1  # the DP groups of the TE the profile was fitted on

    def __post_init__(self) -> None:
        for term in (*TERMS, *OPTIONAL_TERMS):
            value = getattr(self, term)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ProfileError(f"profile {self.name!r}: {term} must be a number >= 0, got {value!r}")
        for table in STRETCH_TABLES:
            stretch = getattr(self, table)
            if not isinstance(stretch, (list, tuple)) or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 1 for x in stretch):
                raise ProfileError(f"profile {self.name!r}: {table} must be a list of numbers >= 1, got {stretch!r}")
            object.__setattr__(self, table, tuple(float(x) for x in stretch))
        for table, what in (("wake_after_idle", "idle_s, extra_ms"), ("per_request_after_gap", "gap_s, ms")):
            points = getattr(self, table)
            if not isinstance(points, (list, tuple)) or any(
                    not isinstance(point, (list, tuple)) or len(point) != 2
                    or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0 for x in point)
                    for point in points) or [p[0] for p in points] != sorted({p[0] for p in points}):
                raise ProfileError(f"profile {self.name!r}: {table} must be a list of [{what}] pairs of numbers >= 0, "
                                   f"{what.split(',')[0]} rising, got {points!r}")
            object.__setattr__(self, table, tuple((float(x), float(ms)) for x, ms in points))
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ProfileError(f"profile {self.name!r}: dp must be a whole number >= 1, got {self.dp!r}")

    def group_seconds(self, work: GroupWork) -> float:
        return 1e-3 * (self.base_ms + self.per_decode_row_ms * (work.decode_rows + work.draft_rows)
                       + self.per_prefill_token_ms * work.prefill_tokens
                       + self.per_context_kilotoken_ms * work.context_tokens / 1000
                       + self.per_prefill_megapair_ms * work.prefill_pairs / 1e6)

    def step_seconds(self, groups: Sequence[GroupWork]) -> float:
        """A lockstep step: its slowest DP group's part, less `per_idle_group_ms` for each group with nothing to
        do (at most all but one)."""
        idle = min(sum(not work.rows for work in groups), len(groups) - 1)
        return max(0.0, max(self.group_seconds(work) for work in groups) - 1e-3 * self.per_idle_group_ms * idle)

    def shared_cores_factor(self, other_tes: float, prompt: bool = False) -> float:
        """How much longer a step takes while `other_tes` other TEs are busy on this profile's host: the measured
        stretch, on straight lines between the counts measured and along the last one beyond them. 1 alone, and for
        a profile without a shared host (TEs with devices of their own). `prompt`: a step that holds prompt tokens
        (`prompt_stretch_beside_tes` where the profile has it)."""
        stretch = (1.0, *(self.prompt_stretch_beside_tes if prompt and self.prompt_stretch_beside_tes
                          else self.stretch_beside_tes))
        if other_tes <= 0 or len(stretch) == 1:
            return 1.0
        below = min(int(other_tes), len(stretch) - 2)
        return stretch[below] + (other_tes - below) * (stretch[below + 1] - stretch[below])

    def wake_seconds(self, idle_s: float) -> float:
        """How much longer a TE's first step after `idle_s` seconds without work takes (0 without `wake_after_idle`):
        on straight lines from (0, 0) through the measured points, the last point's beyond them."""
        points = self.wake_after_idle
        return 1e-3 * _on_lines(points if points and points[0][0] == 0.0 else ((0.0, 0.0), *points), idle_s)

    def request_host_seconds(self, gap_s: float) -> float:
        """The host work of a request that comes `gap_s` after the request before it: on straight lines between the
        `per_request_after_gap` points, the nearest point's beyond them (`per_request_ms` without them)."""
        if not self.per_request_after_gap:
            return 1e-3 * self.per_request_ms
        return 1e-3 * _on_lines(self.per_request_after_gap, gap_s)

    def kv_pull_seconds(self, tokens: int) -> float:
        """A P/D pull of `tokens` tokens' KV: not calibrated on this machine (it lands by the next step)."""
        return 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> StepProfile:
        missing = [key for key in ("name", "source", *TERMS) if key not in data]
        if missing:
            raise ProfileError(f"{where} lacks {', '.join(missing)}")
        unknown = sorted(set(data) - {"name", "source", *TERMS, *STRETCH_TABLES, *OPTIONAL_TERMS,
                                      "wake_after_idle", "per_request_after_gap", "dp"})
        if unknown:
            raise ProfileError(f"{where} has unknown field(s) {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> StepProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ProfileError(f"cannot read profile {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ProfileError(f"profile {path} is not a JSON object")
        return cls.from_dict(data, where=f"profile {path}")


def _on_lines(points: Sequence[tuple[float, float]], x: float) -> float:
    """The value at `x` on straight lines between `points` ((x, y), x rising), the nearest point's beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (low_x, low_y), (high_x, high_y) in zip(points, points[1:]):
        if x <= high_x:
            return low_y + (x - low_x) / (high_x - low_x) * (high_y - low_y)
    return points[-1][1]


def fit(name: str, source: str, steps: Sequence[tuple], first_tokens: Sequence[tuple] = ()) -> StepProfile:
    """The profile that fits best, in relative least squares (a 3 ms decode step counts as much as a 200 ms
    prefill), every term kept at zero or more: `steps`, (one group's work, the seconds its step took[, the DP groups
    with nothing to do in it]), and `first_tokens`, (a prompt's prefill, the seconds from its arrival to its first
    token: the step and the delivery[, idle groups]). Idle groups fit `per_idle_group_ms`, where any step had one."""
    samples = [_sample(point, 0.0) for point in steps] + [_sample(point, 1.0) for point in first_tokens]
    if len(samples) < len(TERMS):
        raise ProfileError(f"fitting {len(TERMS)} terms needs at least as many measurements, got {len(samples)}")
    if any(not seconds > 0 for _, seconds, _, _ in samples):
        raise ProfileError("every measurement must have taken a positive time")
    # each equation divided by its measured time: the residuals are relative errors
    rows = [[x / (1e3 * seconds) for x in (1.0, w.decode_rows, w.prefill_tokens, w.context_tokens / 1000,
                                           w.prefill_pairs / 1e6, first, -idle)]
            for w, seconds, idle, first in samples]
    target = [1.0] * len(samples)
    fitted = (*TERMS, "per_idle_group_ms")
    active = [i for i in range(len(fitted)) if i < len(TERMS) or any(row[i] for row in rows)]
    while True:  # drop a term the data gives a negative weight (a cost is never negative), and fit again
        coefficients = _least_squares([[row[i] for i in active] for row in rows], target)
        worst = min(range(len(active)), key=lambda i: coefficients[i])
        if coefficients[worst] >= 0 or len(active) == 1:
            break
        del active[worst]
    values = dict.fromkeys(fitted, 0.0)
    for index, value in zip(active, coefficients):
        values[fitted[index]] = max(0.0, value)
    return StepProfile(name=name, source=source, **values)


def _sample(point: tuple, first: float) -> tuple[GroupWork, float, int, float]:
    """(work, seconds, idle groups, 1 for a first token's delivery else 0) of a measured point."""
    work, seconds, *idle = point
    return work, seconds, idle[0] if idle else 0, first


def _least_squares(rows: list[list[float]], target: list[float]) -> list[float]:
    """The x minimising |A x - b| (the normal equations, solved by Gaussian elimination with a small ridge)."""
    n = len(rows[0])
    normal = [[sum(r[i] * r[j] for r in rows) + (1e-9 if i == j else 0.0) for j in range(n)] for i in range(n)]
    rhs = [sum(r[i] * t for r, t in zip(rows, target)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(normal[r][col]))
        normal[col], normal[pivot], rhs[col], rhs[pivot] = normal[pivot], normal[col], rhs[pivot], rhs[col]
        for r in range(col + 1, n):
            factor = normal[r][col] / normal[col][col]
            normal[r] = [a - factor * b for a, b in zip(normal[r], normal[col])]
            rhs[r] -= factor * rhs[col]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (rhs[r] - sum(normal[r][c] * x[c] for c in range(r + 1, n))) / normal[r][r]
    return x
