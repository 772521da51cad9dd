"""Linear CKA (Kornblith et al. 2019, feature-space form) and its delete-a-group jackknife CI."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mergescope.errors import MergescopeError
from mergescope.metrics._common import as_f64, center, pair_f64
from mergescope.registry import metrics

Z95 = 1.959963984540054


def _cka_from_moments(gyx: torch.Tensor, gxx: torch.Tensor, gyy: torch.Tensor) -> torch.Tensor:
    """CKA from centred cross/auto covariance matrices (any leading batch dims)."""
    num = gyx.pow(2).sum(dim=(-2, -1))
    den = gxx.pow(2).sum(dim=(-2, -1)).sqrt() * gyy.pow(2).sum(dim=(-2, -1)).sqrt()
    return num / den


def linear_cka(X: Any, Y: Any, device: str = "auto") -> float:
    """Linear CKA, ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F), columns centred, float64."""
    x, y = pair_f64(X, Y, device)
    x, y = center(x), center(y)
    return float(_cka_from_moments(y.T @ x, x.T @ x, y.T @ y))


def linear_cka_matrix(La: Sequence[Any], Lb: Sequence[Any], device: str = "auto", max_bytes: int = 2**31) -> np.ndarray:
    """Linear CKA of every layer of one side against every layer of the other, an (LA, LB) array: each layer's centred
    Gram matrix K = Xc Xc^T scaled to unit Frobenius norm once, then CKA = <K_a, K_b>_F, one product per layer of side a
    against the stack of side b (n^2 per pair where the pairwise form costs n da db). Equal to :func:`linear_cka` per
    pair (tested); looped pair by pair when side b's Grams would take more than ``max_bytes``."""
    if len(La) == 0 or len(Lb) == 0:
        return np.zeros((len(La), len(Lb)))
    n = len(La[0])  # sentences: every layer of both sides has these rows (checked per layer below)
    if len(Lb) * n * n * 8 > max_bytes:
        return np.array([[linear_cka(a, b, device=device) for b in Lb] for a in La])

    def unit_gram(X: Any) -> torch.Tensor:
        x = center(as_f64(X, device))
        if x.shape[0] != n:
            raise MergescopeError(f"the layers have {x.shape[0]} and {n} rows; rows must be the same sentences")
        k = x @ x.T
        norm = torch.linalg.norm(k)
        return (k / norm).reshape(-1) if float(norm) > 0 else torch.full((n * n,), float("nan"), dtype=k.dtype, device=k.device)

    stack_b = torch.stack([unit_gram(Y) for Y in Lb])
    return torch.stack([stack_b @ unit_gram(X) for X in La]).cpu().numpy()


def linear_cka_gram(X: Any, Y: Any, device: str = "auto") -> float:
    """Linear CKA in its Gram (HSIC) form: HSIC(K,L)/sqrt(HSIC(K,K) HSIC(L,L)), K = XX^T, L = YY^T."""
    x, y = pair_f64(X, Y, device)
    n = x.shape[0]
    h = torch.eye(n, dtype=x.dtype, device=x.device) - 1.0 / n
    k = h @ (x @ x.T) @ h
    l_ = h @ (y @ y.T) @ h
    return float((k * l_).sum() / ((k * k).sum().sqrt() * (l_ * l_).sum().sqrt()))


def block_slices(n: int, n_blocks: int) -> list[slice]:
    """Contiguous row blocks in row order, sizes differing by at most one (as numpy.array_split)."""
    base, extra = divmod(n, n_blocks)
    out, start = [], 0
    for g in range(n_blocks):
        size = base + (1 if g < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def _block_views(a: torch.Tensor, blocks: list[slice]) -> list[torch.Tensor]:
    """Runs of equal-size contiguous blocks as (blocks in run, size, d) views of ``a``, in block order.

    ``block_slices`` gives at most two runs (sizes base+1, then base), so this copies nothing.
    """
    views, g = [], 0
    while g < len(blocks):
        size, h = blocks[g].stop - blocks[g].start, g
        while h < len(blocks) and blocks[h].stop - blocks[h].start == size:
            h += 1
        views.append(a[blocks[g].start : blocks[h - 1].stop].reshape(h - g, size, a.shape[1]))
        g = h
    return views


def _block_sums(a: torch.Tensor, blocks: list[slice]) -> torch.Tensor:
    """(G, d): column sums of each block's rows."""
    return torch.cat([v.sum(dim=1) for v in _block_views(a, blocks)])


def _downdated_sqnorms(
    a: torch.Tensor, b: torch.Tensor, gram: torch.Tensor, blocks: list[slice],
    sa: torch.Tensor, sb: torch.Tensor, m: torch.Tensor,
) -> torch.Tensor:
    """For every block g: ||gram - A_g^T B_g - sa_g sb_g^T / m_g||_F^2, without forming d x d per block.

    ``gram`` = A^T B over all rows; ``sa``/``sb`` (G, d) are the column sums of the rows that
    remain when block g is deleted; ``m`` (G,) is their count. Expanding the square keeps memory
    at one d x d matrix and the cost at one extra n x d x d product. The blocks are handled as
    batched (blocks, size, d) views, not a Python loop of small per-block kernels (which was most
    of the time on a busy CPU and would be launch-bound on a GPU).
    """
    t1 = gram.pow(2).sum()
    q = ((a @ gram) * b).sum(dim=1, keepdim=True)  # a_i^T gram b_i per row (one n x d x d product)
    t2 = _block_sums(q, blocks).squeeze(1)  # <gram, A_g^T B_g>
    t3, ubv, g0 = [], [], 0
    for av, bv in zip(_block_views(a, blocks), _block_views(b, blocks)):
        g1 = g0 + av.shape[0]
        t3.append(((av @ av.transpose(1, 2)) * (bv @ bv.transpose(1, 2))).sum(dim=(1, 2)))  # ||A_g^T B_g||^2
        ubv.append(((av @ sa[g0:g1, :, None]) * (bv @ sb[g0:g1, :, None])).sum(dim=(1, 2)))  # sa^T A_g^T B_g sb
        g0 = g1
    t3, ubv = torch.cat(t3), torch.cat(ubv)
    ugv = ((sa @ gram) * sb).sum(dim=1)
    uu, vv = sa.pow(2).sum(dim=1), sb.pow(2).sum(dim=1)
    return t1 - 2 * t2 + t3 - 2 * (ugv - ubv) / m + uu * vv / m.pow(2)


def block_indicator(n: int, blocks: list[slice], like: torch.Tensor) -> torch.Tensor:
    """(n, G): 1 where row i is in block g."""
    e = torch.zeros(n, len(blocks), dtype=like.dtype, device=like.device)
    for g, s in enumerate(blocks):
        e[s, g] = 1.0
    return e


def _gram_downdated(k: torch.Tensor, l_: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """For every block g, <H K_SS H, H L_SS H> over the rows S that remain when block g is deleted (H centres within
    S): sum_S K o L - (2/m) sum_{i in S} k_i l_i + (1/m^2) (1'K_SS 1)(1'L_SS 1), with k_i, l_i the row sums over S.
    Every term is a full-matrix quantity downdated by the block's rows, O(n^2 G) in all, no n x n matrix per block."""
    keep = 1.0 - e  # (n, G)
    m = keep.sum(0)
    pk = k * l_
    kb, lb = k @ e, l_ @ e  # (n, G): row i's sum over block g's columns
    sum_p = pk.sum() - 2 * (pk.sum(1) @ e) + ((pk @ e) * e).sum(0)  # sum over S x S of K o L
    ks, ls = k.sum(1, keepdim=True) - kb, l_.sum(1, keepdim=True) - lb  # row sums over S (every row i)
    cross = (ks * ls * keep).sum(0)  # sum over i in S of k_i l_i
    tk = k.sum() - 2 * (k.sum(1) @ e) + (kb * e).sum(0)  # 1' K_SS 1
    tl = l_.sum() - 2 * (l_.sum(1) @ e) + (lb * e).sum(0)
    return sum_p - 2 * cross / m + tk * tl / m.pow(2)


def gram_side(n: int, da: int, db: int) -> bool:
    """Whether the jackknife is cheaper on the n x n Gram matrices (n^2 (da + db) multiply-adds) than on the feature
    moments (about n (da db + da^2 + db^2), twice over for the downdates): the study's 1012 x 2048 / 1536 sides are."""
    return n * (da + db) < da * db + da * da + db * db


def _jackknife_gram(x: torch.Tensor, y: torch.Tensor, blocks: list[slice]) -> tuple[float, torch.Tensor]:
    """The estimate and the leave-one-block-out CKAs from K = Xc Xc^T and L = Yc Yc^T (x, y centred)."""
    k, l_ = x @ x.T, y @ y.T
    e = block_indicator(x.shape[0], blocks, x)
    estimate = float((k * l_).sum() / ((k * k).sum().sqrt() * (l_ * l_).sum().sqrt()))  # centred: H K H = K
    return estimate, _gram_downdated(k, l_, e) / (_gram_downdated(k, k, e).sqrt() * _gram_downdated(l_, l_, e).sqrt())


def cka_jackknife(X: Any, Y: Any, n_blocks: int = 50, device: str = "auto") -> tuple[float, float, float]:
    """(estimate, ci_low, ci_high): full-sample CKA with a normal 95% delete-a-group jackknife CI.

    Blocks are contiguous in row order. The leave-one-block-out CKAs are obtained by downdating
    the full-sample moment matrices (X^T X, Y^T X, Y^T Y and the column sums) instead of
    recomputing them, so the whole interval costs a small multiple of one CKA; where the rows are fewer than the
    features (:func:`gram_side`) from the n x n Gram matrices instead (:func:`_gram_downdated`), the same numbers.
    se = sqrt((G-1)/G * sum_g (cka_(g) - mean)^2); interval = estimate -/+ 1.96 se.
    """
    x, y = pair_f64(X, Y, device)
    n = x.shape[0]
    if not 2 <= n_blocks <= n:
        raise ValueError(f"n_blocks must be in [2, n={n}], got {n_blocks}")
    # Centring is invariant to a shift; shifting by the full mean first keeps the downdated
    # uncentred moments well conditioned and makes the full-sample sums zero.
    x, y = center(x), center(y)
    blocks = block_slices(n, n_blocks)
    g = n_blocks
    if gram_side(n, x.shape[1], y.shape[1]):  # n < d: the same numbers from the n x n Gram matrices, at less cost
        estimate, loo = _jackknife_gram(x, y, blocks)
        se = float(torch.sqrt((g - 1) / g * (loo - loo.mean()).pow(2).sum()))
        return estimate, estimate - Z95 * se, estimate + Z95 * se
    m = torch.tensor([n - (s.stop - s.start) for s in blocks], dtype=x.dtype, device=x.device)
    # Column sums of the remaining rows = 0 - block sums.
    rx, ry = -_block_sums(x, blocks), -_block_sums(y, blocks)
    gxx, gyy, gyx = x.T @ x, y.T @ y, y.T @ x
    estimate = float(_cka_from_moments(gyx, gxx, gyy))
    num = _downdated_sqnorms(y, x, gyx, blocks, ry, rx, m)
    nxx = _downdated_sqnorms(x, x, gxx, blocks, rx, rx, m)
    nyy = _downdated_sqnorms(y, y, gyy, blocks, ry, ry, m)
    loo = num / (nxx.sqrt() * nyy.sqrt())
    se = float(torch.sqrt((g - 1) / g * (loo - loo.mean()).pow(2).sum()))
    return estimate, estimate - Z95 * se, estimate + Z95 * se


def check_cka(kwargs: Mapping[str, Any], context: Mapping[str, Any]) -> None:
    n, n_blocks = context.get("n"), kwargs.get("n_blocks", 50)
    if n is not None and not 2 <= int(n_blocks) <= n:
        raise MergescopeError(f"metric.n_blocks={n_blocks} must be in [2, {n}]: the jackknife deletes blocks of the {n} "
                              "sentences; lower metric.n_blocks or use more sentences")


def cka_null(X: Any, Y: Any, perms: list[torch.Tensor], n_blocks: int = 50, device: str = "auto") -> list[float]:
    """Linear CKA of X against Y's rows permuted by each of ``perms``, from the centred Gram matrices: CKA(X, Y[p]) =
    <Kx, Ky[p][:, p]>_F / (|Kx|_F |Ky|_F) (centring commutes with a row permutation), one gather per permutation
    instead of a pass over the features. Equal to :func:`linear_cka` on the permuted rows (tested)."""
    x, y = pair_f64(X, Y, device)
    x, y = center(x), center(y)
    kx, ky = x @ x.T, y @ y.T
    den = float(torch.linalg.norm(kx) * torch.linalg.norm(ky))
    out = []
    for p in perms:
        p = p.to(ky.device)
        out.append(float((kx * ky[p][:, p]).sum()) / den)
    return out


@metrics.register("cka", check=check_cka, order=1, higher_is_better=True, headline="cka", null=cka_null,
                  reference="https://arxiv.org/abs/1905.00414")
def cka_metric(X: Any, Y: Any, n_blocks: int = 50, device: str = "auto") -> dict[str, float]:
    est, lo, hi = cka_jackknife(X, Y, n_blocks=n_blocks, device=device)
    return {"cka": est, "cka_ci_low": lo, "cka_ci_high": hi}
