"""SVCCA (Raghu et al. 2017): SVD-reduce each side, then mean canonical correlation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mergescope.errors import MergescopeError
from mergescope.metrics._common import center, pair_f64
from mergescope.registry import metrics


def _svd_reduce(x: torch.Tensor, var_explained: float, max_dims: int) -> torch.Tensor:
    """Centred data projected on the fewest top singular directions that keep ``var_explained``."""
    x = center(x)
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    var = s.pow(2)
    frac = torch.cumsum(var, 0) / var.sum()
    # smallest k with frac[k-1] >= var_explained (tolerance for round-off at exactly 1.0)
    k = int(torch.searchsorted(frac, torch.tensor(var_explained - 1e-12, dtype=frac.dtype, device=frac.device))) + 1
    k = max(1, min(k, max_dims, int((s > s[0] * 1e-10).sum())))
    return u[:, :k] * s[:k]


def canonical_correlations(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Canonical correlations of the column spaces of centred a and b (singular values of Qa^T Qb)."""
    qa, _ = torch.linalg.qr(center(a))
    qb, _ = torch.linalg.qr(center(b))
    return torch.linalg.svdvals(qa.T @ qb).clamp(max=1.0)


def svcca(X: Any, Y: Any, var_explained: float = 0.99, max_dims: int = 64, device: str = "auto") -> float:
    """Mean canonical correlation between the SVD-reduced sides (99% variance, at most 64 dims)."""
    if not 0 < var_explained <= 1:
        raise ValueError(f"var_explained must be in (0, 1], got {var_explained}")
    x, y = pair_f64(X, Y, device)
    xr = _svd_reduce(x, var_explained, max_dims)
    yr = _svd_reduce(y, var_explained, max_dims)
    if max(xr.shape[1], yr.shape[1]) >= x.shape[0] - 1:
        raise ValueError(
            f"SVCCA needs more sentences ({x.shape[0]}) than kept dimensions "
            f"({xr.shape[1]}, {yr.shape[1]}); lower svcca max_dims"
        )
    return float(canonical_correlations(xr, yr).mean())


def svcca_null(X: Any, Y: Any, perms: list, var_explained: float = 0.99, max_dims: int = 64,
               device: str = "auto") -> list[float]:
    """:func:`svcca` of X against Y's rows permuted by each of ``perms``: the SVD reduction and the orthonormal bases
    are permutation-equivariant (the reduction of Y[p] is Y's reduction with its rows permuted), so both are computed
    once and each permutation costs one (kx x ky) product and its singular values (equal to recomputing, tested)."""
    x, y = pair_f64(X, Y, device)
    qa, _ = torch.linalg.qr(center(_svd_reduce(x, var_explained, max_dims)))
    qb, _ = torch.linalg.qr(center(_svd_reduce(y, var_explained, max_dims)))
    return [float(torch.linalg.svdvals(qa.T @ qb[p.to(qb.device)]).clamp(max=1.0).mean()) for p in perms]


def check_svcca(kwargs: Mapping[str, Any], context: Mapping[str, Any]) -> None:
    var_explained, max_dims = kwargs.get("var_explained", 0.99), kwargs.get("max_dims", 64)
    if not 0 < float(var_explained) <= 1:
        raise MergescopeError(f"metric.var_explained={var_explained} must be in (0, 1]")
    if int(max_dims) < 1:
        raise MergescopeError(f"metric.max_dims={max_dims} must be at least 1")


@metrics.register("svcca", check=check_svcca, order=3, higher_is_better=True, null=svcca_null,
                  reference="https://arxiv.org/abs/1706.05806")
def svcca_metric(
    X: Any, Y: Any, var_explained: float = 0.99, max_dims: int = 64, device: str = "auto"
) -> dict[str, float]:
    return {"svcca": svcca(X, Y, var_explained=var_explained, max_dims=max_dims, device=device)}
