"""Mutual k-nearest-neighbour alignment (Huh et al. 2024, platonic representations)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mergescope.errors import MergescopeError
from mergescope.metrics._common import pair_f64
from mergescope.registry import metrics


def _knn_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    z = torch.nn.functional.normalize(x, dim=1)
    sim = z @ z.T
    sim.fill_diagonal_(float("-inf"))
    idx = sim.topk(k, dim=1).indices
    mask = torch.zeros_like(sim, dtype=torch.bool)
    mask.scatter_(1, idx, True)
    return mask


def mutual_knn(X: Any, Y: Any, k: int = 10, device: str = "auto") -> float:
    """Mean over sentences of |kNN_X(i) & kNN_Y(i)| / k, cosine neighbours, self excluded."""
    x, y = pair_f64(X, Y, device)
    if not 1 <= k < x.shape[0]:
        raise ValueError(f"k must be in [1, n-1={x.shape[0] - 1}], got {k}")
    both = _knn_mask(x, k) & _knn_mask(y, k)
    return float(both.sum(dim=1).double().mean() / k)


def check_knn(kwargs: Mapping[str, Any], context: Mapping[str, Any]) -> None:
    n, k = context.get("n"), kwargs.get("k", 10)
    if n is not None and not 1 <= int(k) < n:
        raise MergescopeError(f"metric.k={k} must be in [1, {n - 1}]: neighbours among {n} sentences exclude the sentence "
                              "itself; lower metric.k or use more sentences")


def mutual_knn_null(X: Any, Y: Any, perms: list[torch.Tensor], k: int = 10, device: str = "auto") -> list[float]:
    """:func:`mutual_knn` of X against Y's rows permuted by each of ``perms``: Y[p]'s neighbour mask is Y's with rows
    and columns gathered by p, so the masks are built once (equal to recomputing, tested)."""
    x, y = pair_f64(X, Y, device)
    mx, my = _knn_mask(x, k), _knn_mask(y, k)
    out = []
    for p in perms:
        p = p.to(my.device)
        out.append(float((mx & my[p][:, p]).sum(dim=1).double().mean() / k))
    return out


@metrics.register("mutual_knn", check=check_knn, order=5, higher_is_better=True, null=mutual_knn_null,
                  reference="https://arxiv.org/abs/2405.07987")
def mutual_knn_metric(X: Any, Y: Any, k: int = 10, device: str = "auto") -> dict[str, float]:
    return {"mutual_knn": mutual_knn(X, Y, k=k, device=device), "mutual_knn_chance": k / (len(X) - 1)}


def _hsic_u(k: torch.Tensor, l_: torch.Tensor) -> torch.Tensor:
    """The unbiased HSIC estimator (Song et al. 2012) of two n x n matrices that need not be symmetric (a kNN mask
    keeps row i's neighbours, not column i's): tr(K L) = sum(K * L^T), 1^T K L 1 = (K^T 1) . (L 1); diagonals ignored."""
    n = k.shape[0]
    k = k - torch.diag(torch.diagonal(k))
    l_ = l_ - torch.diag(torch.diagonal(l_))
    trace = (k * l_.T).sum()
    cross = k.sum(0) @ l_.sum(1)
    return (trace + k.sum() * l_.sum() / ((n - 1) * (n - 2)) - 2.0 * cross / (n - 2)) / (n * (n - 3))


def _cknna_sides(X: Any, Y: Any, k: int, device: str) -> tuple[torch.Tensor, ...]:
    """(M_K, M_L, M_K*K, M_L*L, the denominator): each side's neighbour mask, its cosine kernel on its own neighbours
    and sqrt(HSIC_u(M_K*K, M_K*K) HSIC_u(M_L*L, M_L*L))."""
    x, y = pair_f64(X, Y, device)
    n = x.shape[0]
    if n < 4:
        raise ValueError(f"CKNNA needs at least 4 sentences, got {n}")
    if not 1 <= k < n:
        raise ValueError(f"k must be in [1, n-1={n - 1}], got {k}")
    zx, zy = torch.nn.functional.normalize(x, dim=1), torch.nn.functional.normalize(y, dim=1)
    mx, my = _knn_mask(x, k).double(), _knn_mask(y, k).double()
    x_side, y_side = mx * (zx @ zx.T), my * (zy @ zy.T)
    return mx, my, x_side, y_side, torch.sqrt(_hsic_u(x_side, x_side) * _hsic_u(y_side, y_side))


def cknna(X: Any, Y: Any, k: int = 10, device: str = "auto") -> float:
    """Centered kernel nearest-neighbour alignment (Huh et al. 2024): the unbiased CKA of the linear kernels of the
    L2-normalised rows (cosine), restricted to the entries (i, j) where j is among i's k nearest neighbours in BOTH
    spaces (self excluded): HSIC_u(M*K, M*L) / sqrt(HSIC_u(M_K*K, M_K*K) HSIC_u(M_L*L, M_L*L)), each self-term with its
    own space's neighbours (M = M_K*M_L; the masks are 0/1, so M*K = (M_K*K)*M_L exactly). With k = n - 1 every
    off-diagonal entry is kept and it is the debiased CKA of the normalised rows (tested)."""
    mx, my, x_side, y_side, den = _cknna_sides(X, Y, k, device)
    return float(_hsic_u(x_side * my, mx * y_side) / den) if float(den) > 0 else float("nan")


def cknna_null(X: Any, Y: Any, perms: list[torch.Tensor], k: int = 10, device: str = "auto") -> list[float]:
    """:func:`cknna` of X against Y's rows permuted by each of ``perms``: Y[p]'s kernel and neighbour mask are Y's with
    rows and columns gathered by p and its self-term is unchanged (HSIC_u is invariant under one permutation of both
    rows and columns), so the kernels, masks and denominator are built once and each permutation costs one gather and
    one HSIC_u (equal to recomputing, tested)."""
    mx, my, x_side, y_side, den = _cknna_sides(X, Y, k, device)
    if not float(den) > 0:
        return [float("nan")] * len(perms)
    out = []
    for p in perms:
        p = p.to(my.device)
        out.append(float(_hsic_u(x_side * my[p][:, p], mx * y_side[p][:, p]) / den))
    return out


@metrics.register("cknna", check=check_knn, order=5.5, higher_is_better=True, null=cknna_null,
                  reference="https://arxiv.org/abs/2405.07987")
def cknna_metric(X: Any, Y: Any, k: int = 10, device: str = "auto") -> dict[str, float]:
    return {"cknna": cknna(X, Y, k=k, device=device)}
