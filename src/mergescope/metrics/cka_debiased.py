"""Debiased linear CKA: CKA from the unbiased HSIC estimator (Song et al. 2012; Nguyen, Raghu & Kornblith 2021).

The plain estimator is biased upward when the width is large against the number of sentences (1012
sentences and up to 2048 dimensions in the real study); the unbiased one is not. Gram form, float64:
K = X Xᵀ and L = Y Yᵀ with their diagonals set to zero, then

    HSIC_u(K, L) = [tr(K L) + (1ᵀK1)(1ᵀL1) / ((n-1)(n-2)) - 2/(n-2) · 1ᵀ K L 1] / (n (n-3))

and CKA_u = HSIC_u(K, L) / sqrt(HSIC_u(K, K) · HSIC_u(L, L)). It can be slightly negative.
The CI is the same 50-block delete-a-group jackknife as ``cka`` (contiguous blocks in row order). The
leave-one-block-out estimators are not recomputed from submatrices: every term of HSIC_u is a sum over
rows and columns, so deleting block b subtracts its rows' and columns' share (``loo_hsic``: a few n x n
by n x g products for all g blocks at once, equal to the submatrix recomputation to rounding, tested).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mergescope.metrics._common import pair_f64
from mergescope.errors import MergescopeError
from mergescope.metrics.cka import Z95, block_indicator, block_slices, check_cka
from mergescope.registry import metrics


def unbiased_hsic(k: torch.Tensor, l_: torch.Tensor) -> torch.Tensor:
    """The unbiased HSIC estimator of two n x n kernel matrices (diagonals are ignored); n >= 4."""
    n = k.shape[-1]
    if n < 4:
        raise ValueError(f"the unbiased HSIC needs at least 4 sentences, got {n}")
    k = k - torch.diag_embed(torch.diagonal(k, dim1=-2, dim2=-1))
    l_ = l_ - torch.diag_embed(torch.diagonal(l_, dim1=-2, dim2=-1))
    trace = (k * l_).sum(dim=(-2, -1))  # tr(K L) for symmetric K, L
    ks, ls = k.sum(dim=(-2, -1)), l_.sum(dim=(-2, -1))
    cross = (k.sum(dim=-1) * l_.sum(dim=-1)).sum(dim=-1)  # 1ᵀ K L 1
    return (trace + ks * ls / ((n - 1) * (n - 2)) - 2.0 * cross / (n - 2)) / (n * (n - 3))


def _zero_diag(k: torch.Tensor) -> torch.Tensor:
    return k - torch.diag_embed(torch.diagonal(k, dim1=-2, dim2=-1))


def loo_hsic(k: torch.Tensor, l_: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """HSIC_u of K and L with each block's rows and columns deleted, for every block at once. ``members`` is the
    (n, g) 0/1 block-membership matrix. With K, L zero-diagonal, k = K1, l = L1, P = K E, Q = L E:
    tr(KL) loses 2 sum_{i in b} (K*L 1)_i minus the block's own sum; 1'K1 likewise; and 1'KL1 over the kept rows
    is sum_{i not in b} (k_i - P_ib)(l_i - Q_ib)."""
    k, l_ = _zero_diag(k), _zero_diag(l_)
    e = members.to(k.dtype)
    m = k.shape[-1] - e.sum(0)  # rows left per block
    h = k * l_
    within = lambda a: (e * (a @ e)).sum(0)  # noqa: E731  sum of a block's own entries, every block
    trace = h.sum() - 2.0 * (h.sum(1) @ e) + within(h)
    ks = k.sum() - 2.0 * (k.sum(1) @ e) + within(k)
    ls = l_.sum() - 2.0 * (l_.sum(1) @ e) + within(l_)
    rk, rl = k.sum(1, keepdim=True) - k @ e, l_.sum(1, keepdim=True) - l_ @ e
    cross = ((rk * rl) * (1.0 - e)).sum(0)
    return (trace + ks * ls / ((m - 1) * (m - 2)) - 2.0 * cross / (m - 2)) / (m * (m - 3))


def _cka_u(k: torch.Tensor, l_: torch.Tensor) -> torch.Tensor:
    return unbiased_hsic(k, l_) / torch.sqrt(unbiased_hsic(k, k) * unbiased_hsic(l_, l_))


def debiased_cka(X: Any, Y: Any, device: str = "auto") -> float:
    """Debiased linear CKA of two row-aligned feature matrices (float64)."""
    x, y = pair_f64(X, Y, device)
    return float(_cka_u(x @ x.T, y @ y.T))


def debiased_cka_jackknife(X: Any, Y: Any, n_blocks: int = 50, device: str = "auto") -> tuple[float, float, float]:
    """(estimate, ci_low, ci_high): full-sample debiased CKA, normal 95% delete-a-group jackknife CI."""
    x, y = pair_f64(X, Y, device)
    n = x.shape[0]
    if not 2 <= n_blocks <= n:
        raise ValueError(f"n_blocks must be in [2, n={n}], got {n_blocks}")
    k, l_ = x @ x.T, y @ y.T
    estimate = float(_cka_u(k, l_))
    members = block_indicator(n, block_slices(n, n_blocks), k)
    if int(members.sum(0).max()) > n - 4:
        raise ValueError(f"n_blocks={n_blocks} leaves fewer than 4 of {n} sentences in a jackknife replicate")
    loo_t = loo_hsic(k, l_, members) / torch.sqrt(loo_hsic(k, k, members) * loo_hsic(l_, l_, members))
    g = n_blocks
    se = float(torch.sqrt((g - 1) / g * (loo_t - loo_t.mean()).pow(2).sum()))
    return estimate, estimate - Z95 * se, estimate + Z95 * se


def debiased_cka_null(X: Any, Y: Any, perms: list[torch.Tensor], n_blocks: int = 50, device: str = "auto") -> list[float]:
    """Debiased CKA of X against Y's rows permuted by each of ``perms``, from the two Gram matrices built once: with
    L_p = L[p][:, p] (zero diagonal stays zero), 1'L_p 1 = 1'L 1, L_p 1 = (L 1)[p] and HSIC_u(L_p, L_p) = HSIC_u(L, L),
    so a permutation changes only tr(K L_p) and 1'K L_p 1: one gather each instead of a pass over the features. Equal
    to :func:`debiased_cka` on the permuted rows (tested)."""
    x, y = pair_f64(X, Y, device)
    k, l_ = _zero_diag(x @ x.T), _zero_diag(y @ y.T)
    den = torch.sqrt(unbiased_hsic(k, k) * unbiased_hsic(l_, l_))  # refuses fewer than 4 sentences
    n = k.shape[0]
    sums = k.sum() * l_.sum() / ((n - 1) * (n - 2))
    rows_k, rows_l = k.sum(1), l_.sum(1)
    out = []
    for p in perms:
        p = p.to(l_.device)
        hsic = ((k * l_[p][:, p]).sum() + sums - 2.0 * (rows_k @ rows_l[p]) / (n - 2)) / (n * (n - 3))
        out.append(float(hsic / den))
    return out


def check_cka_debiased(kwargs: Mapping[str, Any], context: Mapping[str, Any]) -> None:
    """n_blocks in [2, n], and every jackknife replicate keeps at least 4 sentences (the unbiased HSIC needs 4)."""
    check_cka(kwargs, context)
    n, n_blocks = context.get("n"), kwargs.get("n_blocks", 50)
    if n is None:
        return
    largest = max(s.stop - s.start for s in block_slices(n, int(n_blocks)))
    if largest > n - 4:
        raise MergescopeError(f"metric.n_blocks={n_blocks} leaves fewer than 4 of the {n} sentences in a jackknife "
                              "replicate (the unbiased HSIC needs 4); raise metric.n_blocks or use more sentences")


@metrics.register("cka_debiased", check=check_cka_debiased, order=6, higher_is_better=True, null=debiased_cka_null,
                  reference="https://arxiv.org/abs/2202.07757")
def cka_debiased_metric(X: Any, Y: Any, n_blocks: int = 50, device: str = "auto") -> dict[str, float]:
    est, lo, hi = debiased_cka_jackknife(X, Y, n_blocks=n_blocks, device=device)
    return {"cka_debiased": est, "cka_debiased_ci_low": lo, "cka_debiased_ci_high": hi}
