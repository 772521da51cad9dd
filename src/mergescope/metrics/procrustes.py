"""Orthogonal-Procrustes alignability (rectangular widths native)."""

from __future__ import annotations

from typing import Any

import torch

from mergescope.metrics._common import center, pair_f64
from mergescope.registry import metrics


def _unit(x: torch.Tensor) -> torch.Tensor:
    x = center(x)
    norm = torch.linalg.matrix_norm(x)
    if norm == 0:
        raise ValueError("a side is constant across sentences (zero variance); alignability is undefined")
    return x / norm


def procrustes_alignability(X: Any, Y: Any, device: str = "auto") -> float:
    """Nuclear norm of Yhat^T Xhat, each side column-centred and scaled to unit Frobenius norm.

    Equals max over semi-orthogonal R (dB x dA) of <R, Yhat^T Xhat> = 1 - ||Xhat R^T... ||^2 / 2 at
    the optimum, so it is 1 exactly when one side is an orthogonal (or semi-orthogonal) image of
    the other, and lies in [0, 1].
    """
    x, y = pair_f64(X, Y, device)
    return float(torch.linalg.svdvals(_unit(y).T @ _unit(x)).sum())


def procrustes_null(X: Any, Y: Any, perms: list, device: str = "auto") -> list[float]:
    """:func:`procrustes_alignability` of X against Y's rows permuted by each of ``perms`` (centring and scaling are
    permutation-equivariant: done once)."""
    x, y = pair_f64(X, Y, device)
    ux, uy = _unit(x), _unit(y)
    return [float(torch.linalg.svdvals(uy[p.to(uy.device)].T @ ux).sum()) for p in perms]


@metrics.register("procrustes", order=2, higher_is_better=True, null=procrustes_null, reference="https://arxiv.org/abs/2108.01661")
def procrustes_metric(X: Any, Y: Any, device: str = "auto") -> dict[str, float]:
    return {"procrustes": procrustes_alignability(X, Y, device=device)}
