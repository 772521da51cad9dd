"""Retrieval P@1 through a ridge map fitted on a seeded split, cosine retrieval on the held-out half."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mergescope.errors import MergescopeError
from mergescope.metrics._common import pair_f64
from mergescope.registry import metrics


def split_indices(n: int, train_frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if not 0 < train_frac < 1:
        raise ValueError(f"train_frac must be in (0, 1), got {train_frac}")
    perm = np.random.default_rng(seed).permutation(n)
    n_train = int(round(train_frac * n))
    if n_train < 2 or n - n_train < 2:
        raise ValueError(f"{n} sentences are too few for a {train_frac} split")
    return np.sort(perm[:n_train]), np.sort(perm[n_train:])


def ridge_fit(xs: torch.Tensor, ys: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ridge map with intercept: returns (W, x_mean, y_mean) with y ~ (x - x_mean) W + y_mean.

    The penalty is ``ridge`` times the mean eigenvalue of the centred Gram (scale invariant).
    Solved in the primal (d x d) or dual (n x n) form, whichever is smaller.
    """
    if not ridge >= 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    mx, my = xs.mean(0, keepdim=True), ys.mean(0, keepdim=True)
    xc, yc = xs - mx, ys - my
    n, d = xc.shape
    lam = ridge * xc.pow(2).sum() / d
    if d <= n:
        a = xc.T @ xc + lam * torch.eye(d, dtype=xc.dtype, device=xc.device)
        w = torch.linalg.solve(a, xc.T @ yc)
    else:
        a = xc @ xc.T + lam * torch.eye(n, dtype=xc.dtype, device=xc.device)
        w = xc.T @ torch.linalg.solve(a, yc)
    return w, mx, my


def _p1(pred: torch.Tensor, target: torch.Tensor) -> float:
    p = torch.nn.functional.normalize(pred, dim=1)
    t = torch.nn.functional.normalize(target, dim=1)
    hits = (p @ t.T).argmax(dim=1) == torch.arange(p.shape[0], device=p.device)
    return float(hits.double().mean())


def retrieval_scores(
    X: Any, Y: Any, train_frac: float = 0.5, ridge: float = 1e-2, seed: int = 0, device: str = "auto"
) -> dict[str, float]:
    """P@1 both ways (X->Y and Y->X), their mean, and the chance rate 1/n_test."""
    x, y = pair_f64(X, Y, device)
    tr, te = split_indices(x.shape[0], train_frac, seed)
    tr_t, te_t = torch.as_tensor(tr, device=x.device), torch.as_tensor(te, device=x.device)
    out = {}
    for name, a, b in (("ab", x, y), ("ba", y, x)):
        w, ma, mb = ridge_fit(a[tr_t], b[tr_t], ridge)
        pred = (a[te_t] - ma) @ w
        out[name] = _p1(pred, b[te_t] - mb)
    return {
        "retrieval_p1": (out["ab"] + out["ba"]) / 2,
        "retrieval_p1_ab": out["ab"],
        "retrieval_p1_ba": out["ba"],
        "retrieval_chance": 1.0 / len(te),
    }


def retrieval_p1(
    X: Any, Y: Any, train_frac: float = 0.5, ridge: float = 1e-2, seed: int = 0, device: str = "auto"
) -> float:
    """Mean of the two directions' held-out P@1."""
    return retrieval_scores(X, Y, train_frac=train_frac, ridge=ridge, seed=seed, device=device)["retrieval_p1"]


def check_retrieval(kwargs: Mapping[str, Any], context: Mapping[str, Any]) -> None:
    n, train_frac, ridge = context.get("n"), kwargs.get("train_frac", 0.5), kwargs.get("ridge", 1e-2)
    if not (isinstance(ridge, (int, float)) and not isinstance(ridge, bool) and 0 <= ridge < float("inf")):
        raise MergescopeError(f"metric.ridge={ridge} must be a finite number >= 0 (the ridge penalty, relative to the mean "
                              "eigenvalue); use e.g. metric.ridge=0.01")
    if not 0 < float(train_frac) < 1:
        raise MergescopeError(f"metric.train_frac={train_frac} must be in (0, 1)")
    if n is None:
        return
    n_train = int(round(float(train_frac) * n))
    if n_train < 2 or n - n_train < 2:
        raise MergescopeError(f"{n} sentences are too few for a metric.train_frac={train_frac} split (each half needs 2)")


@metrics.register("retrieval", check=check_retrieval, order=4, higher_is_better=True, headline="retrieval_p1",
                  reference="https://arxiv.org/abs/2405.07987")
def retrieval_metric(
    X: Any, Y: Any, train_frac: float = 0.5, ridge: float = 1e-2, seed: int = 0, device: str = "auto"
) -> dict[str, float]:
    return retrieval_scores(X, Y, train_frac=train_frac, ridge=ridge, seed=seed, device=device)
