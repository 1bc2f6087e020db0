"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before W8A8 quantization.

For a group of linears that read the same input X (e.g. the q_a and kv_a projections after
`input_layernorm`), input channel j is divided by s_j and the weights' column j multiplied by it:
X W^T = (X / s)(W * s)^T, exact in float. s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (max over the tokens
and over all the group's weights) evens out the per-token activation ranges against the per-channel weight
ranges. The division is folded into whatever produced X: an RMSNorm weight, or the output rows of the
previous linear (up_proj before down_proj, the value rows of kv_b_proj before o_proj).

`search_alpha` picks alpha per group from a grid (and "no smoothing") by the W8A8 output error on the
calibration activations: sum over the group's linears of ||X W^T - Q_tok(X / s) Q_ch(W * s)^T||^2 /
||X W^T||^2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.quant.int8 import fake_quantize_activation, fake_quantize_weight

ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(11))
_EPS = 1e-5


@dataclass
class Consumer:
    """One linear reading the group's input: its current weight [out, in] and the rows of X it sees (a routed
    expert sees only the tokens routed to it; None: all)."""

    name: str
    weight: torch.Tensor
    rows: torch.Tensor | None = None


def smoothing_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    s = act_absmax.float().clamp(min=_EPS).pow(alpha) / weight_absmax.float().clamp(min=_EPS).pow(1 - alpha)
    return s.clamp(min=_EPS)


def weight_column_absmax(consumers: list[Consumer]) -> torch.Tensor:
    return torch.stack([c.weight.abs().amax(dim=0) for c in consumers]).amax(dim=0).float()


class _Group:
    """A group's calibration data prepared once for every candidate s: the float outputs and their energy."""

    def __init__(self, x: torch.Tensor, consumers: list[Consumer]) -> None:
        self.x = x.float()
        self.consumers = [c for c in consumers if c.rows is None or c.rows.numel() > 0]
        self.refs = []
        for c in self.consumers:
            rows_x = self.x if c.rows is None else self.x[c.rows]
            ref = rows_x @ c.weight.float().T
            self.refs.append((ref, ref.pow(2).sum().clamp(min=1e-30)))
        # every consumer's weight rows side by side: per-row quantization makes one call do them all
        self.weights = torch.cat([c.weight.float() for c in self.consumers]) if self.consumers else None
        self.splits = [c.weight.shape[0] for c in self.consumers]

    def error(self, s: torch.Tensor | None) -> float:
        if not self.consumers:
            return 0.0
        xq = fake_quantize_activation(self.x if s is None else self.x / s)  # per token: rows index after
        wq = fake_quantize_weight(self.weights if s is None else self.weights * s).split(self.splits)
        total = 0.0
        for c, w, (ref, energy) in zip(self.consumers, wq, self.refs):
            out = (xq if c.rows is None else xq[c.rows]) @ w.T
            total += float((ref - out).pow(2).sum() / energy)
        return total / len(self.consumers)


def search_alpha(x: torch.Tensor, consumers: list[Consumer], grid: tuple[float, ...] = ALPHA_GRID
                 ) -> tuple[float | None, torch.Tensor | None, dict]:
    """(best alpha or None for no smoothing, its scales [in] or None, {"errors": {alpha: error}}) for the
    calibration input `x` [tokens, in] of `consumers`."""
    group = _Group(x, consumers)
    act_absmax = group.x.abs().amax(dim=0)
    w_absmax = weight_column_absmax(consumers)
    errors: dict[str, float] = {"none": group.error(None)}
    best_alpha, best_s, best_err = None, None, errors["none"]
    for alpha in grid:
        s = smoothing_scales(act_absmax, w_absmax, alpha)
        err = group.error(s)
        errors[f"{alpha:.2f}"] = err
        if err < best_err:
            best_alpha, best_s, best_err = alpha, s, err
    return best_alpha, best_s, {"errors": errors}


def search_shared_alpha(members: list[tuple[torch.Tensor, Consumer, torch.Tensor]],
                        grid: tuple[float, ...] = ALPHA_GRID
                        ) -> tuple[float | None, list[torch.Tensor | None], dict]:
    """One alpha for many independent groups (a layer's routed experts' down projections): `members` are
    (search sample of x, consumer, max|x| per channel over all of that member's tokens). Returns (alpha or
    None, each member's scales or None, {"errors": ...}) minimizing the members' mean error."""
    groups = [_Group(x, [c]) for x, c, _ in members]
    w_absmax = [c.weight.abs().amax(dim=0).float() for _, c, _ in members]

    def scales(alpha: float) -> list[torch.Tensor]:
        return [smoothing_scales(a, w, alpha) for (_, _, a), w in zip(members, w_absmax)]

    def error(ss: list[torch.Tensor | None]) -> float:
        return sum(g.error(s) for g, s in zip(groups, ss)) / max(len(groups), 1)

    errors = {"none": error([None] * len(groups))}
    best_alpha, best_err = None, errors["none"]
    for alpha in grid:
        errors[f"{alpha:.2f}"] = err = error(scales(alpha))
        if err < best_err:
            best_alpha, best_err = alpha, err
    chosen = [None] * len(members) if best_alpha is None else scales(best_alpha)
    return best_alpha, chosen, {"errors": errors}
